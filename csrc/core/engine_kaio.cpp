// kernel_aio engine: Linux native AIO through the kernel ABI (io_setup,
// io_submit, io_getevents via syscall) -- the interface libaio wraps -- so no
// libaio is needed to build or run. One AIO context per worker, queue_depth
// I/Os of block_size bytes in flight across the worker's slices; the queue
// and completion rules are QueuedEngine's (queued_engine.h), this file holds
// the system calls only.
#include <errno.h>
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "error.h"
#include "queued_engine.h"

namespace aio {

namespace {

std::atomic<int> g_setup_fault{0};

// io_setup, or the test hook's refusal: a test that exhausted the real
// system-wide limit (fs.aio-max-nr) made every other process's io_setup
// fail meanwhile (CI: a test run beside it failed with EAGAIN).
long sys_io_setup(unsigned nr, aio_context_t* ctx) {
  const int fault = g_setup_fault.load();
  if (fault == 0) return syscall(SYS_io_setup, nr, ctx);
  errno = fault;
  return -1;
}
long sys_io_destroy(aio_context_t ctx) { return syscall(SYS_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, struct iocb** cbs) {
  return syscall(SYS_io_submit, ctx, n, cbs);
}
long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event* ev) {
  return syscall(SYS_io_getevents, ctx, min_nr, nr, ev, nullptr);
}

std::string read_proc(const char* path) {
  FILE* f = std::fopen(path, "r");
  if (!f) return "?";
  char buf[64] = {0};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::string s(buf, n);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

class KaioEngine final : public QueuedEngine {
 public:
  explicit KaioEngine(const EngineContext& ctx)
      : QueuedEngine(ctx, ctx.settings.queue_depth, UINT64_MAX) {
    if (sys_io_setup(depth_, &ctx_) != 0) {
      const int e = errno;
      std::string detail;
      if (e == EAGAIN)
        detail = "the system-wide AIO limit is exhausted: fs.aio-nr=" +
                 read_proc("/proc/sys/fs/aio-nr") +
                 " of fs.aio-max-nr=" + read_proc("/proc/sys/fs/aio-max-nr") +
                 "; raise it (sysctl -w fs.aio-max-nr=1048576) or lower queue_depth x "
                 "thread_count x number of handles";
      else if (e == ENOSYS)
        detail = "this kernel was built without native AIO (CONFIG_AIO=n)";
      else if (e == EPERM)
        detail = "native AIO is blocked here (seccomp or container policy)";
      throw Error(e, "io_setup(queue_depth=" + std::to_string(depth_) + ")", "", 0, 0, detail);
    }
    cbs_.resize(depth_);
    events_.resize(depth_);
    to_kernel_.reserve(depth_);
    owner_pid_ = getpid();
  }

  ~KaioEngine() override {
    // A context inherited through fork() belongs to the parent.
    if (ctx_ && getpid() == owner_pid_) sys_io_destroy(ctx_);
  }

  const char* name() const override { return "kernel_aio"; }

 private:
  // Buffered pieces (edges, fallback files): AIO on a buffered descriptor
  // blocks in io_submit anyway, so they take the plain loop.
  bool queues(const Slice& s) const override { return s.direct; }

  void prepare(const Slot& sl) {
    struct iocb& cb = cbs_[index(sl)];
    std::memset(&cb, 0, sizeof(cb));
    cb.aio_data = index(sl);
    cb.aio_lio_opcode = sl.job->s->op == Op::Read ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
    cb.aio_fildes = static_cast<uint32_t>(sl.job->fd);
    cb.aio_buf = reinterpret_cast<uint64_t>(sl.io_buf());
    cb.aio_nbytes = sl.io_len();
    cb.aio_offset = sl.io_off();
  }

  // Submits the pending I/Os. EINTR/EAGAIN are retried (after reaping when
  // something is in flight); any other refusal fails the refused chunks.
  void submit() override {
    to_kernel_.clear();
    for (const Slot* sl : pending_) {
      prepare(*sl);
      to_kernel_.push_back(&cbs_[index(*sl)]);
    }
    size_t submitted = 0;
    while (submitted < to_kernel_.size()) {
      const long n = s_.single_submit ? 1 : static_cast<long>(to_kernel_.size() - submitted);
      const long r = sys_io_submit(ctx_, n, to_kernel_.data() + submitted);
      c_.submit_calls.fetch_add(1, std::memory_order_relaxed);
      if (r > 0) {
        submitted += static_cast<size_t>(r);
        inflight_ += static_cast<unsigned>(r);
        c_.note_inflight(inflight_);
        submit_spins_ = 0;
        continue;
      }
      const int e = r == 0 ? EAGAIN : errno;
      if ((e == EAGAIN || e == EINTR) && spin_submit()) {
        if (inflight_ > 0) break;  // reap first, then try again
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      // The kernel refused the I/O outright.
      for (size_t i = submitted; i < to_kernel_.size(); ++i)
        refuse(slots_[to_kernel_[i]->aio_data], e, "io_submit");
      submitted = to_kernel_.size();
    }
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<long>(submitted));
  }

  // Waits for completions (one with overlap_events, else all in flight).
  void wait(unsigned want) override {
    // At most depth_ events fit events_ (and no more can be in flight).
    const long nr =
        static_cast<long>(f_.trickle() ? want : std::min(depth_, std::max(want, kReapBatch)));
    const long got = sys_io_getevents(ctx_, want, nr, events_.data());
    c_.getevents_calls.fetch_add(1, std::memory_order_relaxed);
    if (got < 0) {
      if (errno == EINTR) return;
      lose_all(errno);
      return;
    }
    for (long i = 0; i < got; ++i)
      complete(slots_[events_[i].data], static_cast<long>(events_[i].res));
  }

  // io_getevents failed (it cannot with a valid context): io_destroy waits
  // for everything in flight, so no I/O is aimed at a buffer when the chunks
  // fail; a fresh context serves what comes next.
  void lose_all(int e) {
    sys_io_destroy(ctx_);
    ctx_ = 0;
    if (sys_io_setup(depth_, &ctx_) != 0) ctx_ = 0;
    std::vector<bool> queued(depth_, false);
    for (const Slot* sl : pending_) queued[index(*sl)] = true;
    for (Slot& sl : slots_)
      if (sl.job && !queued[index(sl)]) lose(sl, e, "io_getevents failed");
  }

  aio_context_t ctx_ = 0;
  pid_t owner_pid_ = 0;
  std::vector<struct iocb> cbs_;
  std::vector<struct iocb*> to_kernel_;
  std::vector<struct io_event> events_;
};

const bool registered = register_engine(
    "kernel_aio", [](const EngineContext& ctx) { return std::make_unique<KaioEngine>(ctx); });

}  // namespace

void set_kaio_setup_fault(int err) { g_setup_fault.store(err); }

}  // namespace aio
