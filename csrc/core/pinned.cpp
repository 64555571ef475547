#include "pinned.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <sstream>

#include "alignment.h"
#include "error.h"

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

PinnedBuffer::PinnedBuffer(size_t nbytes, bool lock) {
  if (nbytes == 0) throw Error(EINVAL, "pinned alloc", "", 0, 0, "size must be positive");
  mapped_ = page_round(nbytes, "pinned alloc");
  void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
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
}

PinnedBuffer::~PinnedBuffer() {
  if (!ptr_) return;
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
