// One submitted read or write. Shared by the caller's future and the worker
// tasks it was split into; completes when the last task finishes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "error.h"
#include "fault.h"
#include "file.h"

namespace aio {

class RequestState {
 public:
  RequestState(Op op, uint64_t nbytes, int64_t offset, std::shared_ptr<File> file, int tasks,
               std::function<void(RequestState&)> on_complete);

  Op op() const { return op_; }
  uint64_t nbytes() const { return nbytes_; }
  int64_t offset() const { return offset_; }
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Blocks until done or the timeout passes (timeout_s < 0: no timeout).
  // Returns done(). Call without the GIL.
  bool wait(double timeout_s);
  // The first error any task hit, if the request failed.
  const std::optional<Error>& error() const { return error_; }

  // Called by a worker when one of the tasks of this request ends.
  void task_finished(const Error* err);

 private:
  Op op_;
  uint64_t nbytes_;
  int64_t offset_;
  std::shared_ptr<File> file_;  // keeps the descriptors open until the end
  std::atomic<int> pending_;
  std::atomic<bool> done_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Error> error_;
  std::function<void(RequestState&)> on_complete_;
};

}  // namespace aio
