#include "fault.h"

namespace aio {

void FaultInjector::arm(FaultKind kind, int errno_value, int op_filter, uint64_t nth,
                        uint64_t count) {
  std::lock_guard<std::mutex> g(mu_);
  kind_ = kind;
  errno_value_ = errno_value;
  op_filter_ = op_filter;
  nth_ = nth == 0 ? 1 : nth;
  count_ = count == 0 ? 1 : count;
  seen_ = 0;
  armed_.store(kind != FaultKind::None);
  trickle_.store(kind == FaultKind::Trickle);
}

void FaultInjector::disarm() {
  std::lock_guard<std::mutex> g(mu_);
  kind_ = FaultKind::None;
  armed_.store(false);
  trickle_.store(false);
}

bool FaultInjector::matches(Op op) const {
  return op_filter_ == 2 || (op_filter_ == 0 && op == Op::Read) ||
         (op_filter_ == 1 && op == Op::Write);
}

FaultAction FaultInjector::on_io(Op op) {
  // Fast path: one relaxed load when no test armed the hook.
  if (!armed_.load(std::memory_order_relaxed)) return {};
  std::lock_guard<std::mutex> g(mu_);
  if (kind_ != FaultKind::Error && kind_ != FaultKind::Short) return {};
  if (!matches(op)) return {};
  ++seen_;
  if (seen_ < nth_ || seen_ >= nth_ + count_) return {};
  hits_.fetch_add(1);
  return {kind_, errno_value_};
}

FaultAction FaultInjector::on_open_direct(Op op) {
  if (!armed_.load(std::memory_order_relaxed)) return {};
  std::lock_guard<std::mutex> g(mu_);
  if (kind_ != FaultKind::OpenDirect && kind_ != FaultKind::NoDirectStatx) return {};
  if (!matches(op)) return {};
  hits_.fetch_add(1);
  return {kind_, errno_value_};
}

}  // namespace aio
