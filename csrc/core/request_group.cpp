#include "request_group.h"

#include <chrono>

namespace aio {

RequestGroup::RequestGroup(std::vector<std::shared_ptr<RequestState>> reqs)
    : reqs_(std::move(reqs)) {
  for (const auto& r : reqs_) nbytes_ += r->nbytes();
}

bool RequestGroup::done() const {
  if (!reqs_.back()->done()) return false;
  for (const auto& r : reqs_)
    if (!r->done()) return false;
  return true;
}

bool RequestGroup::wait(double timeout_s) {
  using Clock = std::chrono::steady_clock;
  const bool forever = timeout_s < 0 || !(timeout_s < 1e9);  // as RequestState::wait
  const Clock::time_point end = forever
                                    ? Clock::time_point::max()
                                    : Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                         std::chrono::duration<double>(timeout_s));
  auto left = [&] {
    if (forever) return -1.0;
    const double s = std::chrono::duration<double>(end - Clock::now()).count();
    return s > 0 ? s : 0.0;
  };
  if (!reqs_.back()->wait(left())) return false;
  for (const auto& r : reqs_)
    if (!r->done() && !r->wait(left())) return false;
  return true;
}

const Error* RequestGroup::error() const {
  for (const auto& r : reqs_)
    if (r->error()) return &*r->error();
  return nullptr;
}

}  // namespace aio
