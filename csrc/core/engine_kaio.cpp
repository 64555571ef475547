// kernel_aio engine: Linux native AIO through the kernel ABI (io_setup,
// io_submit, io_getevents via syscall) -- the interface libaio wraps -- so no
// libaio is needed to build or run. One AIO context per worker, queue_depth
// I/Os of block_size bytes in flight. Every completion is checked against
// the requested length (as fio's libaio engine does): short transfers are
// resumed, EINTR/EAGAIN resubmitted, anything else raised after the queue is
// drained, so a buffer is never released with I/O still aimed at it.
#include <errno.h>
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "engine.h"
#include "error.h"
#include "pinned.h"

namespace aio {

namespace {

long sys_io_setup(unsigned nr, aio_context_t* ctx) { return syscall(SYS_io_setup, nr, ctx); }
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

class KaioEngine final : public Engine {
 public:
  explicit KaioEngine(const EngineContext& ctx)
      : s_(ctx.settings), c_(ctx.counters), f_(ctx.faults), depth_(ctx.settings.queue_depth) {
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
    slots_.resize(depth_);
    events_.resize(depth_);
    owner_pid_ = getpid();
  }

  ~KaioEngine() override {
    // A context inherited through fork() belongs to the parent.
    if (ctx_ && getpid() == owner_pid_) sys_io_destroy(ctx_);
  }

  const char* name() const override { return "kernel_aio"; }

  void transfer(const Slice& s) override {
    if (!s.direct) {
      // Buffered pieces (edges, fallback files): AIO on a buffered descriptor
      // blocks in io_submit anyway, so use the plain loop in block_size chunks.
      for (uint64_t pos = 0; pos < s.len; pos += s_.block_size) {
        const uint64_t n = std::min<uint64_t>(s_.block_size, s.len - pos);
        sync_transfer(*s.file, s.op, false, s.buf + pos, n, s.off + static_cast<int64_t>(pos), c_,
                      f_);
      }
      return;
    }
    run_direct(s);
  }

 private:
  struct Slot {
    struct iocb cb;
    char* user = nullptr;   // caller memory for this chunk
    char* stage = nullptr;  // aligned staging memory, or null
    uint64_t len = 0;
    int64_t off = 0;
    uint64_t done = 0;
    int spins = 0;
  };

  void ensure_stage(uint64_t chunk) {
    if (stage_ && stage_chunk_ >= chunk) return;
    stage_ = std::make_unique<PinnedBuffer>(chunk * depth_, false);
    stage_chunk_ = chunk;
  }

  void prepare(Slot& sl, const Slice& s) {
    std::memset(&sl.cb, 0, sizeof(sl.cb));
    char* base = sl.stage ? sl.stage : sl.user;
    sl.cb.aio_data = reinterpret_cast<uint64_t>(&sl);
    sl.cb.aio_lio_opcode = s.op == Op::Read ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
    sl.cb.aio_fildes = static_cast<uint32_t>(s.file->direct_fd());
    sl.cb.aio_buf = reinterpret_cast<uint64_t>(base + sl.done);
    sl.cb.aio_nbytes = sl.len - sl.done;
    sl.cb.aio_offset = sl.off + static_cast<int64_t>(sl.done);
  }

  // The state of one direct slice in progress.
  struct Run {
    const Slice& s;
    size_t align;    // the file's direct-I/O granularity
    uint64_t chunk;  // bytes per I/O (a multiple of align)
    std::vector<Slot*> free_slots;
    std::vector<struct iocb*> to_submit;
    std::optional<Error> error;
    uint64_t next = 0;  // first byte of the slice not yet handed to a slot
    unsigned inflight = 0;
    int submit_spins = 0;

    // Keep the failure lowest in the file: chunks below it all completed, so
    // the request's error can say which bytes are known to be transferred.
    void fail(Error e) {
      if (!error || e.offset() < error->offset()) error.emplace(std::move(e));
    }
  };

  void run_direct(const Slice& s) {
    const size_t align = s.file->alignment().offset;
    Run run{s, align, std::max<uint64_t>(align, s_.block_size / align * align), {}, {}, {}};
    if (s.bounce) ensure_stage(run.chunk);
    for (unsigned i = 0; i < depth_; ++i) {
      slots_[i].stage = s.bounce ? static_cast<char*>(stage_->data()) + i * run.chunk : nullptr;
      run.free_slots.push_back(&slots_[i]);
    }
    run.to_submit.reserve(depth_);
    while (true) {
      // With overlap_events the queue is topped up as completions arrive;
      // without it a new batch starts only once the last one drained.
      if (!run.error && (s_.overlap_events || run.inflight == 0)) fill(run);
      submit(run);
      if (run.inflight == 0) {
        if (!run.to_submit.empty()) continue;
        if (run.error || run.next >= s.len) break;
        continue;
      }
      reap(run);
    }
    if (run.error) throw *run.error;
  }

  // Hands the next chunks of the slice to free slots, queued for submission.
  void fill(Run& run) {
    const Slice& s = run.s;
    while (!run.free_slots.empty() && run.next < s.len) {
      Slot* sl = run.free_slots.back();
      run.free_slots.pop_back();
      sl->user = s.buf + run.next;
      sl->len = std::min<uint64_t>(run.chunk, s.len - run.next);
      sl->off = s.off + static_cast<int64_t>(run.next);
      sl->done = 0;
      sl->spins = 0;
      if (sl->stage && s.op == Op::Write) {
        std::memcpy(sl->stage, sl->user, sl->len);
        c_.bounce_bytes.fetch_add(sl->len, std::memory_order_relaxed);
      }
      prepare(*sl, s);
      run.to_submit.push_back(&sl->cb);
      run.next += sl->len;
    }
  }

  // Submits the queued I/Os. EINTR/EAGAIN are retried (after reaping when
  // something is in flight); any other refusal fails the refused chunks.
  void submit(Run& run) {
    size_t submitted = 0;
    while (submitted < run.to_submit.size()) {
      const long n = s_.single_submit ? 1 : static_cast<long>(run.to_submit.size() - submitted);
      const long r = sys_io_submit(ctx_, n, run.to_submit.data() + submitted);
      c_.submit_calls.fetch_add(1, std::memory_order_relaxed);
      if (r > 0) {
        submitted += static_cast<size_t>(r);
        run.inflight += static_cast<unsigned>(r);
        c_.note_inflight(run.inflight);
        run.submit_spins = 0;
        continue;
      }
      const int e = r == 0 ? EAGAIN : errno;
      if ((e == EAGAIN || e == EINTR) && run.submit_spins < kMaxRetries) {
        ++run.submit_spins;
        c_.retries.fetch_add(1, std::memory_order_relaxed);
        if (run.inflight > 0) break;  // reap first, then try again
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      // The kernel refused the I/O outright: record, put the slots back.
      for (size_t i = submitted; i < run.to_submit.size(); ++i) {
        Slot* sl = reinterpret_cast<Slot*>(run.to_submit[i]->aio_data);
        run.fail(Error(e, std::string("io_submit ") + op_name(run.s.op), run.s.file->path(),
                       sl->off + static_cast<int64_t>(sl->done), sl->len - sl->done));
        run.free_slots.push_back(sl);
      }
      submitted = run.to_submit.size();
    }
    run.to_submit.erase(run.to_submit.begin(),
                        run.to_submit.begin() + static_cast<long>(submitted));
  }

  // Waits for completions (one with overlap_events, else all in flight).
  void reap(Run& run) {
    const long min_nr = s_.overlap_events ? 1 : static_cast<long>(run.inflight);
    const long nr = f_.trickle() ? min_nr : static_cast<long>(depth_);
    const long got = sys_io_getevents(ctx_, min_nr, nr, events_.data());
    c_.getevents_calls.fetch_add(1, std::memory_order_relaxed);
    if (got < 0) {
      if (errno == EINTR) return;
      // Cannot happen with a valid context; make sure nothing is still in
      // flight (io_destroy waits for it) before reporting.
      const int e = errno;
      sys_io_destroy(ctx_);
      ctx_ = 0;
      if (sys_io_setup(depth_, &ctx_) != 0) ctx_ = 0;
      throw Error(e, "io_getevents", run.s.file->path(), run.s.off, run.s.len);
    }
    for (long i = 0; i < got; ++i) {
      --run.inflight;
      complete(*reinterpret_cast<Slot*>(events_[i].data), static_cast<long>(events_[i].res), run);
    }
  }

  // One completion: done, resubmitted (EINTR/EAGAIN, aligned short
  // transfer), finished through the buffered descriptor, or failed.
  void complete(Slot& sl, long res, Run& run) {
    const Slice& s = run.s;
    const uint64_t want = sl.len - sl.done;
    FaultAction fa = f_.on_io(s.op);
    if (fa.kind == FaultKind::Error) res = -fa.errno_value;
    if (fa.kind == FaultKind::Short && res > 1) res = (res / 2) | 1;

    if (res < 0) {
      const int e = static_cast<int>(-res);
      if ((e == EINTR || e == EAGAIN) && sl.spins < kMaxRetries) {
        ++sl.spins;
        c_.retries.fetch_add(1, std::memory_order_relaxed);
        prepare(sl, s);
        run.to_submit.push_back(&sl.cb);
        return;
      }
      run.fail(
          Error(e, op_name(s.op), s.file->path(), sl.off + static_cast<int64_t>(sl.done), want));
      run.free_slots.push_back(&sl);
      return;
    }
    const uint64_t got = static_cast<uint64_t>(res);
    if (s.op == Op::Read && sl.stage) {
      std::memcpy(sl.user + sl.done, sl.stage + sl.done, got);
      c_.bounce_bytes.fetch_add(got, std::memory_order_relaxed);
    }
    sl.done += got;
    if (got >= want) {
      c_.ios.fetch_add(1, std::memory_order_relaxed);
      run.free_slots.push_back(&sl);
      return;
    }
    resume_short(sl, got, run);
  }

  // A short transfer of `got` bytes (possibly none).
  void resume_short(Slot& sl, uint64_t got, Run& run) {
    const Slice& s = run.s;
    c_.short_resumed.fetch_add(1, std::memory_order_relaxed);
    if (got > 0 && sl.done % run.align == 0) {
      // Still aligned: resubmit the rest as direct I/O.
      sl.spins = 0;
      prepare(sl, s);
      run.to_submit.push_back(&sl.cb);
      return;
    }
    // Unaligned remainder (or no progress): finish it through the buffered
    // descriptor, which also turns end-of-file into a proper error.
    try {
      sync_transfer(*s.file, s.op, false, sl.user + sl.done, sl.len - sl.done,
                    sl.off + static_cast<int64_t>(sl.done), c_, f_);
      c_.ios.fetch_add(1, std::memory_order_relaxed);
    } catch (Error& e) {
      run.fail(std::move(e));
    }
    run.free_slots.push_back(&sl);
  }

  const Settings& s_;
  Counters& c_;
  FaultInjector& f_;
  unsigned depth_;
  aio_context_t ctx_ = 0;
  pid_t owner_pid_ = 0;
  std::vector<Slot> slots_;
  std::vector<struct io_event> events_;
  std::unique_ptr<PinnedBuffer> stage_;
  uint64_t stage_chunk_ = 0;
};

const bool registered = register_engine(
    "kernel_aio", [](const EngineContext& ctx) { return std::make_unique<KaioEngine>(ctx); });

}  // namespace

}  // namespace aio
