// io_uring engine: Linux io_uring through the kernel ABI (io_uring_setup,
// io_uring_enter, io_uring_register via syscall, mmap'ed rings), so neither
// liburing nor new kernel headers are needed to build. One ring per worker,
// queue_depth I/Os of block_size bytes in flight across the worker's slices,
// as for kernel_aio: the queue and the completion rules are QueuedEngine's
// (queued_engine.h); this file holds the ring and its system calls. Unlike
// kernel AIO, io_uring is asynchronous for buffered
// descriptors too, so unaligned edges and files without O_DIRECT go through
// the ring instead of blocking the worker in pread/pwrite.
#include <errno.h>
#include <sys/mman.h>
#include <sys/uio.h>
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
#include "fixed_buffers.h"
#include "pid.h"
#include "queued_engine.h"
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
std::atomic<int> g_setup_fault{0};

// io_uring_setup, or the test hook's refusal (as seccomp or
// kernel.io_uring_disabled would refuse it).
int setup_or_fault(unsigned entries, io_uring_params* p) {
  const int fault = g_setup_fault.load();
  if (fault == 0) return sys_setup(entries, p);
  errno = fault;
  return -1;
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
    // COOP_TASKRUN (5.19): completions are posted when this thread next
    // enters the kernel, not by interrupting it; it enters to wait anyway.
    p.flags = IORING_SETUP_CLAMP | IORING_SETUP_COOP_TASKRUN;
    fd_ = setup_or_fault(entries, &p);
    if (fd_ < 0 && errno == EINVAL) {
      std::memset(&p, 0, sizeof(p));
      p.flags = IORING_SETUP_CLAMP;
      fd_ = sys_setup(entries, &p);
    }
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
    // A child forked meanwhile holds the ring open, and with it every
    // registration: drop them first so the pages are not pinned for as long
    // as it lives (only in the process that made the ring: the child's own
    // copy of this object must not touch the parent's table).
    if (fixed_ && owner_ == current_pid()) sys_register(fd_, IORING_UNREGISTER_BUFFERS, nullptr, 0);
    unmap();
    if (fd_ >= 0) ::close(fd_);
  }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  unsigned entries() const { return sq_entries_; }

  // An empty table of FixedBuffers::kSlots fixed buffers (5.19); false where
  // the kernel cannot (the ring then uses plain READ/WRITE only).
  bool reserve_fixed() {
    aio_uring_rsrc_register r;
    std::memset(&r, 0, sizeof(r));
    r.nr = FixedBuffers::kSlots;
    r.flags = IORING_RSRC_REGISTER_SPARSE;
    fixed_ = sys_register(fd_, IORING_REGISTER_BUFFERS2, &r, sizeof(r)) >= 0;
    return fixed_;
  }
  bool fixed() const { return fixed_; }
  // Puts [base, base + len) in `slot` (len 0: empties it); 0 or errno.
  // EINTR/EAGAIN are retried (bounded): an emptying that failed would keep
  // the old pages pinned until the ring closes.
  int update_fixed(unsigned slot, void* base, size_t len) {
    iovec iov{base, len};
    aio_uring_rsrc_update2 u;
    std::memset(&u, 0, sizeof(u));
    u.offset = slot;
    u.data = reinterpret_cast<uint64_t>(&iov);
    u.nr = 1;
    for (int tries = 0;; ++tries) {
      if (sys_register(fd_, IORING_REGISTER_BUFFERS_UPDATE, &u, sizeof(u)) >= 0) return 0;
      if ((errno != EINTR && errno != EAGAIN) || tries >= kMaxRetries) return errno;
    }
  }

  // Replaces this ring's fixed-buffer table with a copy of the ring `src_fd`'s
  // (6.13): the same registrations, neither pinned nor charged again; 0 or
  // errno (the table is then unchanged).
  int clone_fixed(int src_fd) {
    aio_uring_clone_buffers c;
    std::memset(&c, 0, sizeof(c));
    c.src_fd = static_cast<uint32_t>(src_fd);
    c.flags = kAioCloneDstReplace;  // nr 0: the whole table
    for (int tries = 0;; ++tries) {
      if (sys_register(fd_, kAioRegisterCloneBuffers, &c, 1) >= 0) return 0;
      if ((errno != EINTR && errno != EAGAIN) || tries >= kMaxRetries) return errno;
    }
  }
  int fd() const { return fd_; }

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
  bool fixed_ = false;    // holds a fixed-buffer table
  const pid_t owner_ = current_pid();
};

// Pinned buffers (FixedBuffers) are registered on every ring, so chunks in
// them go out as READ_FIXED/WRITE_FIXED; other memory as plain READ/WRITE.
class UringEngine final : public QueuedEngine, public FixedBuffers::Holder {
 public:
  explicit UringEngine(const EngineContext& ctx)
      : UringEngine(ctx, std::make_unique<Ring>(std::min(ctx.settings.queue_depth, kMaxEntries))) {}
  ~UringEngine() override {
    if (ring_->fixed()) FixedBuffers::detach(this);
  }

  const char* name() const override { return "io_uring"; }

  // FixedBuffers::Holder: called under FixedBuffers' lock, from any thread
  // (io_uring_register is safe beside this worker's io_uring_enter).
  int register_slot(unsigned slot, void* base, size_t len) override {
    return ring_->update_fixed(slot, base, len);
  }
  void clear_slot(unsigned slot) override { ring_->update_fixed(slot, nullptr, 0); }
  int clone_from(FixedBuffers::Holder& src) override {
    auto* from = dynamic_cast<UringEngine*>(&src);
    return from ? ring_->clone_fixed(from->ring_->fd()) : EINVAL;
  }
  void refused(int err) override {
    c_.fixed_refused.fetch_add(1, std::memory_order_relaxed);
    c_.fixed_refused_errno.store(err, std::memory_order_relaxed);
  }

 private:
  UringEngine(const EngineContext& ctx, std::unique_ptr<Ring> ring)
      : QueuedEngine(ctx, std::min(ctx.settings.queue_depth, ring->entries()), kMaxChunk),
        ring_(std::move(ring)) {
    if (ring_->reserve_fixed()) FixedBuffers::attach(this);
  }

  // Buffered descriptors are asynchronous through the ring too.
  bool queues(const Slice&) const override { return true; }

  // Writes the pending slots' SQEs into the ring. With single_submit each is
  // submitted by its own io_uring_enter right away; otherwise they go to the
  // kernel with the next wait, one system call for both.
  void submit() override {
    for (Slot* sl : pending_) {
      prepare(*sl);
      ++inflight_;
      if (s_.single_submit) enter(0);
    }
    c_.note_inflight(inflight_);
    pending_.clear();
  }

  void prepare(const Slot& sl) {
    const bool read = sl.job->s->op == Op::Read;
    const int slot = ring_->fixed() ? FixedBuffers::find(this, sl.io_buf(), sl.io_len()) : -1;
    io_uring_sqe* sqe = ring_->next_sqe();
    if (slot >= 0) {
      sqe->opcode = read ? IORING_OP_READ_FIXED : IORING_OP_WRITE_FIXED;
      sqe->buf_index = static_cast<uint16_t>(slot);
      c_.fixed_ios.fetch_add(1, std::memory_order_relaxed);
    } else {
      sqe->opcode = read ? IORING_OP_READ : IORING_OP_WRITE;
    }
    sqe->fd = sl.job->fd;
    sqe->addr = reinterpret_cast<uint64_t>(sl.io_buf());
    sqe->len = static_cast<uint32_t>(sl.io_len());
    sqe->off = static_cast<uint64_t>(sl.io_off());
    sqe->user_data = index(sl);
    ring_->publish();
  }

  // One io_uring_enter: submits whatever the ring holds and, with wait > 0,
  // waits until that many completions are ready. EINTR/EAGAIN/EBUSY are
  // retried (bounded); any other refusal fails the SQEs not taken.
  void enter(unsigned wait) {
    while (true) {
      const unsigned pending = ring_->unconsumed();
      // Completions already in the ring are taken without a system call.
      const bool must_wait = wait > 0 && ring_->cq_ready() < wait;
      if (pending == 0 && !must_wait) return;
      const int r =
          ring_->enter(pending, must_wait ? wait : 0, must_wait ? IORING_ENTER_GETEVENTS : 0);
      if (pending) c_.submit_calls.fetch_add(1, std::memory_order_relaxed);
      if (must_wait) c_.getevents_calls.fetch_add(1, std::memory_order_relaxed);
      if (r >= 0 && ring_->unconsumed() == 0) {
        submit_spins_ = 0;
        return;
      }
      const int e = r < 0 ? -r : EAGAIN;  // fewer taken than offered: try again
      if ((e == EINTR || e == EAGAIN || e == EBUSY) && spin_submit()) {
        if (e != EINTR) std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      for (uint64_t idx : ring_->withdraw()) {
        --inflight_;
        refuse(slots_[idx], e, "io_uring_enter");
      }
      if (r < 0 && must_wait) drain_without_enter();
      return;
    }
  }

  // io_uring_enter cannot wait (it cannot fail so on a valid ring): poll the
  // completion ring until everything in flight is back, so no I/O is aimed at
  // the caller's buffer when the error is raised. Sleeping returns to user
  // space, where the kernel posts pending completions.
  void drain_without_enter() {
    while (inflight_ > 0) {
      if (ring_->cq_ready() == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
      const unsigned n = ring_->cq_ready();
      for (unsigned i = 0; i < n; ++i) {
        const io_uring_cqe cqe = ring_->cqe(0);
        ring_->consume(1);
        lose(slots_[cqe.user_data], EIO, "io_uring_enter failed while I/O was in flight");
      }
    }
  }

  // Submits what is queued and handles completions: at most kReapBatch (or
  // `want`) per call, the rest stay in the ring for the next. Under the
  // trickle fault no more than `want` are taken per wait, even when more are
  // ready (as a slow drive would hand them out).
  void wait(unsigned want) override {
    enter(want);
    unsigned n = ring_->cq_ready();
    n = std::min(n, f_.trickle() ? want : std::max(want, kReapBatch));
    for (unsigned i = 0; i < n; ++i) {
      // Copy and hand the entry back first: complete() may block (buffered
      // remainder) and the kernel can reuse the entry meanwhile.
      const io_uring_cqe cqe = ring_->cqe(0);
      ring_->consume(1);
      complete(slots_[cqe.user_data], cqe.res);
    }
  }

  std::unique_ptr<Ring> ring_;
};

}  // namespace

void set_uring_setup_fault(int err) { g_setup_fault.store(err); }

namespace {

const bool registered = register_engine(
    "io_uring", [](const EngineContext& ctx) { return std::make_unique<UringEngine>(ctx); });

}  // namespace

}  // namespace aio
