#include "request.h"

#include <chrono>

namespace aio {

RequestState::RequestState(Op op, uint64_t nbytes, int64_t offset, std::shared_ptr<File> file,
                           int tasks, std::function<void(RequestState&)> on_complete)
    : op_(op),
      nbytes_(nbytes),
      offset_(offset),
      file_(std::move(file)),
      pending_(tasks),
      on_complete_(std::move(on_complete)) {
  if (tasks == 0) {
    if (on_complete_) on_complete_(*this);
    on_complete_ = nullptr;
    done_.store(true);
  }
}

bool RequestState::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto pred = [&] { return done_.load(std::memory_order_acquire); };
  if (timeout_s < 0) {
    cv_.wait(lk, pred);
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), pred);
}

void RequestState::task_finished(const Error* err) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (err && !error_) error_.emplace(*err);
  }
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  file_.reset();  // close our descriptors before anyone is told we're done
  // Statistics and the handle's outstanding count are settled before the
  // request reads as done, so a caller that saw done() sees them too.
  if (on_complete_) on_complete_(*this);
  on_complete_ = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

}  // namespace aio
