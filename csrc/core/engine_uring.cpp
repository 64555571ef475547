// io_uring engine: Linux io_uring through the kernel ABI (io_uring_setup,
// io_uring_enter, io_uring_register via syscall, mmap'ed rings), so neither
// liburing nor new kernel headers are needed to build. One ring per worker,
// queue_depth I/Os of block_size bytes in flight, as for kernel_aio, with the
// same completion rules: every CQE's res is checked against the length asked,
// short transfers resumed, EINTR/EAGAIN resubmitted, anything else raised
// after the ring has drained, so a buffer is never released with I/O still
// aimed at it. Unlike kernel AIO, io_uring is asynchronous for buffered
// descriptors too, so unaligned edges and files without O_DIRECT go through
// the ring instead of blocking the worker in pread/pwrite.
#include <errno.h>
#include <sys/mman.h>
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
#include "uring_abi.h"

namespace aio {

namespace {

// The kernel's limit on ring entries (IORING_MAX_ENTRIES); larger queue
// depths are clamped to it (IORING_SETUP_CLAMP).
constexpr unsigned kMaxEntries = 32768;
// The SQE length field is 32 bits; Linux moves at most 2 GiB - 4 KiB per call.
constexpr uint64_t kMaxChunk = 1ull << 30;

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}
int sys_enter(int fd, unsigned submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(
      syscall(__NR_io_uring_enter, fd, submit, min_complete, flags, nullptr, 0));
}
int sys_register(int fd, unsigned op, void* arg, unsigned nr) {
  return static_cast<int>(syscall(__NR_io_uring_register, fd, op, arg, nr));
}

// Ring indices are shared with the kernel: our stores to the SQ tail and CQ
// head must publish what precedes them (release), and our loads of the
// kernel's SQ head and CQ tail must see what it wrote before them (acquire).
unsigned load_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

std::string read_sysctl(const char* path) {
  FILE* f = std::fopen(path, "r");
  if (!f) return "";
  char buf[32] = {0};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::string s(buf, n);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// Why io_uring_setup failed, in words a user can act on.
std::string setup_failure_detail(int e) {
  if (e == ENOSYS)
    return "this kernel has no io_uring (built without CONFIG_IO_URING, or older than 5.1)";
  if (e == EPERM) {
    const std::string v = read_sysctl("/proc/sys/kernel/io_uring_disabled");
    if (v == "2") return "io_uring is disabled here (sysctl kernel.io_uring_disabled=2)";
    if (v == "1")
      return "io_uring is restricted here (sysctl kernel.io_uring_disabled=1) to "
             "kernel.io_uring_group, which this process is not in";
    return "io_uring is blocked here (seccomp or container policy; Docker's default "
           "profile blocks it)";
  }
  if (e == ENOMEM)
    return "the ring memory could not be allocated (before Linux 5.12 it counts against "
           "RLIMIT_MEMLOCK)";
  if (e == EMFILE || e == ENFILE) return "no file descriptor left for the ring";
  return "";
}

// One io_uring instance: the descriptor, the mapped SQ and CQ rings and the
// SQE array. Used by one worker thread at a time; the SQ array maps ring
// slot i to SQE i once and for all, so an SQE is written in place.
class Ring {
 public:
  explicit Ring(unsigned entries) {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    p.flags = IORING_SETUP_CLAMP;
    fd_ = sys_setup(entries, &p);
    if (fd_ < 0) {
      const int e = errno;
      throw Error(e, "io_uring_setup(queue_depth=" + std::to_string(entries) + ")", "", 0, 0,
                  setup_failure_detail(e));
    }
    try {
      map(p);
      require_ops();
    } catch (...) {
      unmap();
      ::close(fd_);
      throw;
    }
  }
  ~Ring() {
    unmap();
    if (fd_ >= 0) ::close(fd_);
  }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  unsigned entries() const { return sq_entries_; }

  // The next free SQE (zeroed); the caller fills it, then publish() makes it
  // visible to the kernel. The caller keeps at most entries() unconsumed.
  io_uring_sqe* next_sqe() {
    io_uring_sqe* sqe = &sqes_[sq_tail_ & sq_mask_];
    ++sq_tail_;
    std::memset(sqe, 0, sizeof(*sqe));
    return sqe;
  }
  void publish() { store_release(sq_ktail_, sq_tail_); }
  // SQEs published but not yet taken by the kernel.
  unsigned unconsumed() const { return sq_tail_ - load_acquire(sq_khead_); }
  // The user_data of each unconsumed SQE, which are then withdrawn (safe: no
  // io_uring_enter runs meanwhile, and nothing else submits on this ring).
  std::vector<uint64_t> withdraw() {
    std::vector<uint64_t> out;
    const unsigned head = load_acquire(sq_khead_);
    for (unsigned i = head; i != sq_tail_; ++i) out.push_back(sqes_[i & sq_mask_].user_data);
    sq_tail_ = head;
    publish();
    return out;
  }
  // Returns the syscall's result, or -errno.
  int enter(unsigned submit, unsigned min_complete, unsigned flags) {
    const int r = sys_enter(fd_, submit, min_complete, flags);
    return r < 0 ? -errno : r;
  }
  unsigned cq_ready() const { return load_acquire(cq_ktail_) - *cq_khead_; }
  // The i-th ready CQE; consume(n) hands n of them back to the kernel.
  io_uring_cqe cqe(unsigned i) const { return cqes_[(*cq_khead_ + i) & cq_mask_]; }
  void consume(unsigned n) { store_release(cq_khead_, *cq_khead_ + n); }

 private:
  void map(const io_uring_params& p) {
    sq_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    // Since 5.4 both rings live in one mapping.
    if (p.features & IORING_FEAT_SINGLE_MMAP) sq_len_ = cq_len_ = std::max(sq_len_, cq_len_);
    sq_ptr_ = mmap_or_throw(sq_len_, IORING_OFF_SQ_RING);
    cq_ptr_ = (p.features & IORING_FEAT_SINGLE_MMAP) ? sq_ptr_
                                                     : mmap_or_throw(cq_len_, IORING_OFF_CQ_RING);
    sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(mmap_or_throw(sqes_len_, IORING_OFF_SQES));
    char* sq = static_cast<char*>(sq_ptr_);
    char* cq = static_cast<char*>(cq_ptr_);
    sq_khead_ = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
    sq_ktail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    cq_khead_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_ktail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    sq_entries_ = p.sq_entries;
    unsigned* array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    for (unsigned i = 0; i < p.sq_entries; ++i) array[i] = i;
    sq_tail_ = *sq_ktail_;
  }

  void* mmap_or_throw(size_t len, unsigned long long off) {
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_,
                     static_cast<off_t>(off));
    if (p == MAP_FAILED) throw Error(errno, "mmap io_uring ring", "", 0, 0);
    return p;
  }

  void unmap() {
    if (sqes_) ::munmap(sqes_, sqes_len_);
    if (cq_ptr_ && cq_ptr_ != sq_ptr_) ::munmap(cq_ptr_, cq_len_);
    if (sq_ptr_) ::munmap(sq_ptr_, sq_len_);
    sqes_ = nullptr;
    sq_ptr_ = cq_ptr_ = nullptr;
  }

  // IORING_OP_READ/WRITE (Linux 5.6) are what the engine submits; the probe
  // itself is 5.6 too, so an older kernel fails here with a clear reason.
  void require_ops() {
    const size_t n = 256;
    std::vector<char> mem(sizeof(io_uring_probe) + n * sizeof(io_uring_probe_op), 0);
    auto* probe = reinterpret_cast<io_uring_probe*>(mem.data());
    const int r = sys_register(fd_, IORING_REGISTER_PROBE, probe, n);
    auto supported = [&](unsigned op) {
      return op <= probe->last_op && op < probe->ops_len &&
             (probe->ops[op].flags & IO_URING_OP_SUPPORTED);
    };
    if (r < 0 || !supported(IORING_OP_READ) || !supported(IORING_OP_WRITE))
      throw Error(r < 0 ? errno : EOPNOTSUPP, "io_uring probe", "", 0, 0,
                  "this kernel's io_uring lacks IORING_OP_READ/WRITE (Linux 5.6 or newer is "
                  "needed)");
  }

  int fd_ = -1;
  void* sq_ptr_ = nullptr;
  void* cq_ptr_ = nullptr;
  size_t sq_len_ = 0, cq_len_ = 0, sqes_len_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  io_uring_cqe* cqes_ = nullptr;
  unsigned* sq_khead_ = nullptr;
  unsigned* sq_ktail_ = nullptr;
  unsigned* cq_khead_ = nullptr;
  unsigned* cq_ktail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0, sq_entries_ = 0;
  unsigned sq_tail_ = 0;  // our tail, published by publish()
};

class UringEngine final : public Engine {
 public:
  explicit UringEngine(const EngineContext& ctx)
      : s_(ctx.settings),
        c_(ctx.counters),
        f_(ctx.faults),
        ring_(std::min(ctx.settings.queue_depth, kMaxEntries)),
        depth_(std::min(ctx.settings.queue_depth, ring_.entries())) {
    slots_.resize(depth_);
  }

  const char* name() const override { return "io_uring"; }

  void transfer(const Slice& s) override { run_slice(s); }

 private:
  struct Slot {
    char* user = nullptr;   // caller memory for this chunk
    char* stage = nullptr;  // aligned staging memory, or null
    uint64_t len = 0;
    int64_t off = 0;
    uint64_t done = 0;
    int spins = 0;
  };

  // The state of one slice in progress.
  struct Run {
    const Slice& s;
    int fd;          // O_DIRECT descriptor for direct slices, else the buffered one
    size_t align;    // direct-I/O granularity (1 for buffered slices)
    uint64_t chunk;  // bytes per I/O (a multiple of align)
    std::vector<Slot*> free_slots;
    std::vector<Slot*> to_submit;
    std::optional<Error> error;
    uint64_t next = 0;  // first byte of the slice not yet handed to a slot
    unsigned inflight = 0;
    int submit_spins = 0;

    // Keep the failure lowest in the file (see engine_kaio.cpp).
    void fail(Error e) {
      if (!error || e.offset() < error->offset()) error.emplace(std::move(e));
    }
  };

  void ensure_stage(uint64_t chunk) {
    if (stage_ && stage_chunk_ >= chunk) return;
    stage_ = std::make_unique<PinnedBuffer>(chunk * depth_, false);
    stage_chunk_ = chunk;
  }

  void run_slice(const Slice& s) {
    // Opening the buffered descriptor may throw: nothing is in flight yet.
    const int fd = s.direct ? s.file->direct_fd() : s.file->buffered_fd();
    const size_t align = s.direct ? s.file->alignment().offset : 1;
    const uint64_t chunk = std::max<uint64_t>(
        align, std::min<uint64_t>(s_.block_size, kMaxChunk / align * align) / align * align);
    Run run{s, fd, align, chunk, {}, {}, {}};
    const bool bounce = s.direct && s.bounce;
    if (bounce) ensure_stage(chunk);
    for (unsigned i = 0; i < depth_; ++i) {
      slots_[i].stage = bounce ? static_cast<char*>(stage_->data()) + i * chunk : nullptr;
      run.free_slots.push_back(&slots_[i]);
    }
    run.to_submit.reserve(depth_);
    while (true) {
      // With overlap_events the queue is topped up as completions arrive;
      // without it a new batch starts only once the last one drained.
      if (!run.error && (s_.overlap_events || run.inflight == 0)) fill(run);
      queue(run);
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
      run.to_submit.push_back(sl);
      run.next += sl->len;
    }
  }

  // Writes the queued slots' SQEs into the ring. With single_submit each is
  // submitted by its own io_uring_enter right away; otherwise they go to the
  // kernel with the next wait (reap), one system call for both.
  void queue(Run& run) {
    for (Slot* sl : run.to_submit) {
      prepare(*sl, run);
      ++run.inflight;
      if (s_.single_submit) enter(run, 0);
    }
    c_.note_inflight(run.inflight);
    run.to_submit.clear();
  }

  void prepare(Slot& sl, const Run& run) {
    io_uring_sqe* sqe = ring_.next_sqe();
    char* base = sl.stage ? sl.stage : sl.user;
    sqe->opcode = run.s.op == Op::Read ? IORING_OP_READ : IORING_OP_WRITE;
    sqe->fd = run.fd;
    sqe->addr = reinterpret_cast<uint64_t>(base + sl.done);
    sqe->len = static_cast<uint32_t>(sl.len - sl.done);
    sqe->off = static_cast<uint64_t>(sl.off + static_cast<int64_t>(sl.done));
    sqe->user_data = static_cast<uint64_t>(&sl - slots_.data());
    ring_.publish();
  }

  // One io_uring_enter: submits whatever the ring holds and, with wait > 0,
  // waits until that many completions are ready. EINTR/EAGAIN/EBUSY are
  // retried (bounded); any other refusal fails the SQEs not taken.
  void enter(Run& run, unsigned wait) {
    while (true) {
      const unsigned pending = ring_.unconsumed();
      // Completions already in the ring are taken without a system call.
      const bool must_wait = wait > 0 && ring_.cq_ready() < wait;
      if (pending == 0 && !must_wait) return;
      const int r =
          ring_.enter(pending, must_wait ? wait : 0, must_wait ? IORING_ENTER_GETEVENTS : 0);
      if (pending) c_.submit_calls.fetch_add(1, std::memory_order_relaxed);
      if (must_wait) c_.getevents_calls.fetch_add(1, std::memory_order_relaxed);
      if (r >= 0 && ring_.unconsumed() == 0) return;
      const int e = r < 0 ? -r : EAGAIN;  // fewer taken than offered: try again
      if ((e == EINTR || e == EAGAIN || e == EBUSY) && run.submit_spins < kMaxRetries) {
        ++run.submit_spins;
        c_.retries.fetch_add(1, std::memory_order_relaxed);
        if (e != EINTR) std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      refuse(run, e);
      if (r < 0 && must_wait) drain_without_enter(run);
      return;
    }
  }

  // The kernel refused SQEs outright: take them back and fail their chunks.
  void refuse(Run& run, int e) {
    for (uint64_t idx : ring_.withdraw()) {
      Slot& sl = slots_[idx];
      --run.inflight;
      run.fail(Error(e, std::string("io_uring_enter ") + op_name(run.s.op), run.s.file->path(),
                     sl.off + static_cast<int64_t>(sl.done), sl.len - sl.done));
      run.free_slots.push_back(&sl);
    }
  }

  // io_uring_enter cannot wait (it cannot fail so on a valid ring): poll the
  // completion ring until everything in flight is back, so no I/O is aimed at
  // the caller's buffer when the error is raised. Sleeping returns to user
  // space, where the kernel posts pending completions.
  void drain_without_enter(Run& run) {
    while (run.inflight > 0) {
      if (ring_.cq_ready() == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
      const unsigned n = ring_.cq_ready();
      for (unsigned i = 0; i < n; ++i) {
        const io_uring_cqe cqe = ring_.cqe(i);
        --run.inflight;
        run.fail(Error(EIO, op_name(run.s.op), run.s.file->path(), slots_[cqe.user_data].off,
                       slots_[cqe.user_data].len, "io_uring_enter failed while I/O was in flight"));
      }
      ring_.consume(n);
    }
  }

  // Submits what is queued and handles completions: one with overlap_events,
  // else all in flight. Under the trickle fault no more than that are taken
  // per wait, even when more are ready (as a slow drive would hand them out).
  void reap(Run& run) {
    const unsigned want = s_.overlap_events ? 1 : run.inflight;
    enter(run, want);
    unsigned n = ring_.cq_ready();
    if (f_.trickle()) n = std::min(n, want);
    for (unsigned i = 0; i < n; ++i) {
      // Copy and hand the entry back first: complete() may block (buffered
      // remainder) and the kernel can reuse the entry meanwhile.
      const io_uring_cqe cqe = ring_.cqe(0);
      ring_.consume(1);
      --run.inflight;
      complete(slots_[cqe.user_data], cqe.res, run);
    }
  }

  // One completion: done, resubmitted (EINTR/EAGAIN, short transfer that can
  // go on through the ring), finished through the buffered loop, or failed.
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
        run.to_submit.push_back(&sl);
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
    if (!s.direct) c_.buffered_bytes.fetch_add(got, std::memory_order_relaxed);
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
      // Progress, and still aligned for this descriptor: the rest goes on
      // through the ring.
      sl.spins = 0;
      run.to_submit.push_back(&sl);
      return;
    }
    // An unaligned direct remainder, or no progress at all: finish it with the
    // buffered loop, which also turns end-of-file into a proper error.
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
  Ring ring_;
  unsigned depth_;
  std::vector<Slot> slots_;
  std::unique_ptr<PinnedBuffer> stage_;
  uint64_t stage_chunk_ = 0;
};

const bool registered = register_engine(
    "io_uring", [](const EngineContext& ctx) { return std::make_unique<UringEngine>(ctx); });

}  // namespace

}  // namespace aio
