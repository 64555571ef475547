#include "pinned.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <sstream>

#include "alignment.h"
#include "error.h"
#include "fixed_buffers.h"

namespace aio {

static std::atomic<uint64_t> g_locked{0};
static constexpr long kForeverMs = 1000L * 3600 * 24 * 365 * 30;
static std::atomic<int> g_lock_fault{0};

void PinnedBuffer::set_lock_fault(int err) { g_lock_fault.store(err); }
uint64_t PinnedBuffer::total_locked_bytes() { return g_locked.load(); }

static std::string memlock_limit_text() {
  struct rlimit rl;
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return "unknown";
  if (rl.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(static_cast<unsigned long long>(rl.rlim_cur)) + " bytes";
}

// Rounds n up to a multiple of the page size; throws instead of wrapping.
static size_t page_round(size_t n, const char* what) {
  const size_t ps = page_size();
  size_t padded;
  if (__builtin_add_overflow(n, ps - 1, &padded))
    throw Error(EOVERFLOW, what, "", 0, n, "size too large: rounding it up to a page overflows");
  return padded / ps * ps;
}

// Buffers from this size on start on a huge-page boundary and ask for
// transparent huge pages: the kernel then hands each I/O physically
// contiguous memory (one 2 MiB extent instead of 512 scattered pages), which
// measured 1.2-1.6x faster direct reads and a fifth of the CPU per GB on the
// dev box's virtio disk, for every engine (docs/performance.md).
static constexpr size_t kHugePage = size_t{2} << 20;

#ifndef MADV_WIPEONFORK
#define MADV_WIPEONFORK 18  // Linux 4.14; older C libraries lack the name
#endif

// A forked child gets this memory as an empty mapping (zero-filled pages on
// first touch), neither a copy nor shared pages. Pinned pages cannot be
// shared copy-on-write (a device may be writing into them), so fork() copies
// every page an io_uring ring holds registered into the child at once (a
// 32 MiB pool: 33 MiB of private dirty pages per DataLoader worker and 40 ms
// of fork) and splits the parent's huge pages to do it; and on any engine,
// the parent's next I/O into a page still shared with a child copies it.
// The child has no use for the bytes: it cannot use the parent's handles.
// Advice only: before Linux 4.14 the child gets copy-on-write pages.
static void* wipe_on_fork(void* p, size_t len) {
  if (p != MAP_FAILED) madvise(p, len, MADV_WIPEONFORK);
  return p;
}

size_t mapped_size(size_t nbytes) {
  const size_t pages = page_round(nbytes, "pinned alloc");
  if (pages < kHugePage) return pages;
  // io_uring maps a registered buffer as huge pages only when every page of it
  // is part of one: a tail of small pages makes each I/O on it a list of 4 KiB
  // segments, which the block layer cuts further (a 4 MB read from a 15.3 MiB
  // pool went to the virtio disk as 6 requests, not 1; 13 % slower swapper
  // steps). Whole huge pages where that costs at most an eighth more memory.
  size_t whole;
  if (__builtin_add_overflow(pages, kHugePage - 1, &whole)) return pages;
  whole = whole / kHugePage * kHugePage;
  return whole - pages <= pages / 8 ? whole : pages;
}

// Maps `len` bytes (whole pages) starting on a kHugePage boundary when len is
// at least that, trimming the slack of a larger mapping; MAP_FAILED on error.
static void* map_aligned(size_t len) {
  const int prot = PROT_READ | PROT_WRITE, flags = MAP_PRIVATE | MAP_ANONYMOUS;
  size_t padded;
  if (len < kHugePage || __builtin_add_overflow(len, kHugePage, &padded))
    return wipe_on_fork(mmap(nullptr, len, prot, flags, -1, 0), len);
  char* raw = static_cast<char*>(mmap(nullptr, padded, prot, flags, -1, 0));
  if (raw == MAP_FAILED) return MAP_FAILED;
  const uintptr_t a = reinterpret_cast<uintptr_t>(raw);
  char* p = raw + ((kHugePage - a % kHugePage) % kHugePage);
  if (p > raw) munmap(raw, static_cast<size_t>(p - raw));
  if (p + len < raw + padded) munmap(p + len, static_cast<size_t>(raw + padded - (p + len)));
  // Advice only: where THP is off ("never") the memory is plain pages.
  madvise(p, len, MADV_HUGEPAGE);
  return wipe_on_fork(p, len);
}

PinnedBuffer::PinnedBuffer(size_t nbytes, bool lock) {
  if (nbytes == 0) throw Error(EINVAL, "pinned alloc", "", 0, 0, "size must be positive");
  mapped_ = mapped_size(nbytes);
  void* p = map_aligned(mapped_);
  if (p == MAP_FAILED) throw Error(errno, "mmap", "", 0, nbytes, "allocating pinned memory");
  ptr_ = p;
  size_ = nbytes;
  if (lock) {
    int err = g_lock_fault.load();
    if (err == 0 && mlock(ptr_, mapped_) != 0) err = errno;
    if (err != 0) {
      munmap(ptr_, mapped_);
      ptr_ = nullptr;
      std::ostringstream os;
      os << "could not lock " << nbytes << " bytes of pinned memory; RLIMIT_MEMLOCK is "
         << memlock_limit_text() << " and " << g_locked.load()
         << " bytes are already locked by aio. Raise the limit (ulimit -l, or "
            "LimitMEMLOCK= for services / --ulimit memlock=-1 for containers), or use "
            "fewer/smaller buffers";
      throw Error(err, "mlock", "", 0, nbytes, os.str());
    }
    locked_ = true;
    g_locked.fetch_add(mapped_);
  }
  if (lock) make_fixed();
}

void PinnedBuffer::make_fixed() {
  if (!fixed_token_) fixed_token_ = FixedBuffers::add(ptr_, mapped_);
}

PinnedBuffer::~PinnedBuffer() {
  if (!ptr_) return;
  // Out of every ring before the pages go (a ring's registration pins them).
  if (fixed_token_) FixedBuffers::remove(fixed_token_);
  if (locked_) {
    munlock(ptr_, mapped_);
    g_locked.fetch_sub(mapped_);
  }
  munmap(ptr_, mapped_);
}

PinnedPool::PinnedPool(size_t count, size_t slot_bytes, bool lock) : count_(count), slot_bytes_(0) {
  if (count == 0 || slot_bytes == 0)
    throw Error(EINVAL, "pinned pool", "", 0, 0, "count and slot size must be positive");
  // Each slot starts on a page boundary so every slot is direct-I/O aligned.
  slot_bytes_ = page_round(slot_bytes, "pinned pool");
  size_t total;
  if (__builtin_mul_overflow(slot_bytes_, count, &total))
    throw Error(EOVERFLOW, "pinned pool", "", 0, 0,
                "count x slot size overflows: " + std::to_string(count) + " x " +
                    std::to_string(slot_bytes_) + " bytes");
  buf_ = std::make_unique<PinnedBuffer>(total, lock);
  leased_.assign(count, false);
  for (size_t i = count; i-- > 0;) free_.push_back(i);
}

void* PinnedPool::slot(size_t i) const {
  if (i >= count_) throw Error(EINVAL, "pinned pool", "", 0, 0, "slot index out of range");
  return static_cast<char*>(buf_->data()) + i * slot_bytes_;
}

long PinnedPool::acquire(long timeout_ms) {
  std::unique_lock<std::mutex> lk(mu_);
  auto ready = [&] { return !free_.empty(); };
  // Beyond ~30 years wait_for's deadline arithmetic overflows and returns at
  // once; such a timeout means "no timeout".
  if (timeout_ms < 0 || timeout_ms > kForeverMs) {
    cv_.wait(lk, ready);
  } else if (!cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), ready)) {
    return -1;
  }
  size_t i = free_.back();
  free_.pop_back();
  leased_[i] = true;
  return static_cast<long>(i);
}

void PinnedPool::release(size_t i) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (i >= count_ || !leased_[i])
      throw Error(EINVAL, "pinned pool release", "", 0, 0, "slot is not leased");
    leased_[i] = false;
    free_.push_back(i);
  }
  cv_.notify_one();
}

size_t PinnedPool::available() const {
  std::lock_guard<std::mutex> g(mu_);
  return free_.size();
}

}  // namespace aio
