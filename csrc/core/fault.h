// Test hook: makes the Nth matching I/O of a handle fail in a chosen way, so
// tests can prove that every failure mode surfaces and nothing is lost. It is
// checked by every engine at the point where the kernel's answer is read, so
// the real recovery code (resume, retry, raise) runs, not a test double.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>

namespace aio {

enum class Op { Read, Write };

enum class FaultKind {
  None,
  Error,       // the I/O completes with -errno_value
  Short,       // the I/O completes with fewer bytes than asked (half, unaligned)
  OpenDirect,  // opening with O_DIRECT fails with errno_value (e.g. EINVAL)
  // statx reports dio_offset_align=0 (no direct I/O for this file), as ext4
  // with data=journal does.
  NoDirectStatx,
  // Every wait for completions hands back no more than it asked for, as a
  // slow device would (kernel AIO: one at a time with overlap_events). The
  // real kernel holds the rest for the next wait; nothing fails.
  Trickle,
};

struct FaultAction {
  FaultKind kind = FaultKind::None;
  int errno_value = 0;
};

class FaultInjector {
 public:
  // op_filter: 0 = reads, 1 = writes, 2 = both. The fault hits matching I/Os
  // number nth .. nth+count-1 (1-based), counted from this call.
  void arm(FaultKind kind, int errno_value, int op_filter, uint64_t nth, uint64_t count);
  void disarm();
  // Called once per I/O (each submitted chunk, each open with O_DIRECT).
  FaultAction on_io(Op op);
  // Called once per open of a path; answers OpenDirect and NoDirectStatx.
  FaultAction on_open_direct(Op op);
  // Whether a Trickle fault is armed (answered on every wait, never counted).
  bool trickle() const { return trickle_.load(std::memory_order_relaxed); }
  uint64_t hits() const { return hits_.load(); }

 private:
  bool matches(Op op) const;
  std::atomic<bool> armed_{false};
  std::atomic<bool> trickle_{false};
  std::mutex mu_;
  FaultKind kind_ = FaultKind::None;
  int errno_value_ = 0;
  int op_filter_ = 2;
  uint64_t nth_ = 1;
  uint64_t count_ = 1;
  uint64_t seen_ = 0;
  std::atomic<uint64_t> hits_{0};
};

}  // namespace aio
