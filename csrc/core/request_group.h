// Several requests made by one call (Handle::submit_pieces) seen as one:
// done when all are; its error is the first failed piece's, in piece order.
#pragma once

#include <memory>
#include <vector>

#include "request.h"

namespace aio {

class RequestGroup {
 public:
  explicit RequestGroup(std::vector<std::shared_ptr<RequestState>> reqs);

  Op op() const { return reqs_.front()->op(); }
  uint64_t nbytes() const { return nbytes_; }
  int64_t offset() const { return reqs_.front()->offset(); }
  bool done() const;
  // As RequestState::wait, over every piece: the last one first (it is
  // queued last, so nearly always ends last), after which the others need
  // no sleep: one wake-up per group rather than one per piece.
  bool wait(double timeout_s);
  void check_owner() const { reqs_.front()->check_owner(); }
  // The first failed piece's error, or null; call once done().
  const Error* error() const;

 private:
  std::vector<std::shared_ptr<RequestState>> reqs_;
  uint64_t nbytes_ = 0;
};

}  // namespace aio
