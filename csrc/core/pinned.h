// Page-aligned host memory locked in RAM (mlock), so the kernel can DMA into
// it without faulting and it never goes to swap. Locking costs about 1 s per
// GiB here, so pools are made once and leased out, never reallocated per I/O.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace aio {

// Bytes a PinnedBuffer of `nbytes` maps (and locks, when locked): whole
// pages, and from 2 MiB on whole huge pages where that adds at most an eighth
// (io_uring then gives each I/O on it large physically contiguous segments).
size_t mapped_size(size_t nbytes);

class PinnedBuffer {
 public:
  // Throws aio::Error with the RLIMIT_MEMLOCK limit and the size asked if the
  // memory cannot be locked. lock=false gives aligned, unlocked memory.
  // Locked memory is also a fixed buffer for io_uring rings (make_fixed).
  // A forked child sees the memory zero-filled (MADV_WIPEONFORK): nothing of
  // it is copied or shared at fork.
  PinnedBuffer(size_t nbytes, bool lock = true);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return size_; }
  bool locked() const { return locked_; }
  // io_uring rings register the memory as a fixed buffer (FixedBuffers) until
  // it goes. That pins its pages, so it is for memory that is pinned anyway:
  // locked here, or pinned by other means (cudaHostRegister).
  void make_fixed();

  // Total bytes locked by all live PinnedBuffers in this process.
  static uint64_t total_locked_bytes();
  // Test hook: make the next mlock calls fail with this errno (0 = off).
  static void set_lock_fault(int err);

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
  bool locked_ = false;
  uint64_t fixed_token_ = 0;  // FixedBuffers token, 0 when not fixed
};

// A fixed pool of `count` equal slots carved from one locked allocation.
// acquire() blocks (GIL released by the caller) until a slot is free.
class PinnedPool {
 public:
  PinnedPool(size_t count, size_t slot_bytes, bool lock = true);
  size_t count() const { return count_; }
  size_t slot_bytes() const { return slot_bytes_; }
  void* slot(size_t i) const;
  // Returns a free slot index, or -1 on timeout (timeout_ms < 0: forever).
  long acquire(long timeout_ms);
  void release(size_t i);
  size_t available() const;
  size_t total_bytes() const { return buf_->size(); }
  void make_fixed() { buf_->make_fixed(); }

 private:
  size_t count_;
  size_t slot_bytes_;
  std::unique_ptr<PinnedBuffer> buf_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<size_t> free_;
  std::vector<bool> leased_;
};

}  // namespace aio
