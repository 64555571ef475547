// One submitted read or write: how it is split into slices for the workers
// (plan_slices), and its state, shared by the caller's future and the worker
// tasks it was split into; completes when the last task finishes.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine.h"
#include "error.h"
#include "fault.h"
#include "file.h"

namespace aio {

// What plan_slices needs to know about one request. Pure data: the planner
// never dereferences file or buf, it only copies them into the slices.
struct SlicePlanInput {
  Op op = Op::Read;
  File* file = nullptr;
  char* buf = nullptr;
  uint64_t nbytes = 0;
  int64_t offset = 0;  // offset + nbytes must not exceed INT64_MAX
  size_t threads = 1;  // workers; the result has this many lists
  // The file has an O_DIRECT descriptor. Without one every byte goes through
  // the page cache, split evenly over the workers.
  bool direct = false;
  // Direct-I/O unit for offsets and lengths (callers pass at least a page, so
  // that no page is touched both by a buffered edge and a direct slice).
  size_t granularity = 4096;
  size_t memory_alignment = 1;  // buffer address unit for O_DIRECT
};

// Splits [offset, offset + nbytes) into per-worker slice lists (in file order
// within each list): the unaligned head and tail go through the page cache
// (edge slices: the head on worker 0, the tail on the last worker that got a
// direct slice, or worker 0 if none did); the aligned middle goes O_DIRECT as
// at most `threads` contiguous slices of whole granules, the first workers
// taking one granule more when they do not divide evenly. The middle is
// bounced when its first byte in memory is not memory_alignment-aligned.
// Zero bytes: no slices at all.
std::vector<std::vector<Slice>> plan_slices(const SlicePlanInput& in);

class RequestState {
 public:
  RequestState(Op op, uint64_t nbytes, int64_t offset, std::shared_ptr<File> file, int tasks,
               std::function<void(RequestState&)> on_complete);
  ~RequestState();
  RequestState(const RequestState&) = delete;
  RequestState& operator=(const RequestState&) = delete;

  Op op() const { return op_; }
  uint64_t nbytes() const { return nbytes_; }
  int64_t offset() const { return offset_; }
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Blocks until done or the timeout passes (timeout_s < 0 or infinite: no
  // timeout). Returns done(). Call without the GIL. Throws aio::Error (err 0)
  // in a process other than the one that submitted the request: after fork()
  // the I/O belongs to the parent and would never complete here.
  bool wait(double timeout_s);
  // Throws the error wait() throws in a forked child; no-op otherwise.
  void check_owner() const;
  // The error of a failed request: errno and operation of the first failure
  // by file position; offset is the first byte not known to be transferred
  // and length runs to the end of the request.
  const std::optional<Error>& error() const { return error_; }

  // Called by a worker when one of the tasks of this request ends; fail_at is
  // the lowest byte the task did not transfer (ignored when err is null;
  // negative: err->offset()).
  void task_finished(const Error* err, int64_t fail_at = -1);
  // Blocks until done, in the submitting process (used to order requests).
  void wait_done();

 private:
  struct Sync {
    std::mutex mu;
    std::condition_variable cv;
  };
  void settle_error();

  Op op_;
  uint64_t nbytes_;
  int64_t offset_;
  std::string path_;
  pid_t creator_pid_;
  std::shared_ptr<File> file_;  // keeps the descriptors open until the end
  std::atomic<int> pending_;
  std::atomic<bool> done_{false};
  // Heap-held so a forked child can leak them: a condition variable some
  // parent thread waited on at fork() would block its destructor forever.
  std::unique_ptr<Sync> sync_;
  std::optional<Error> error_;
  int64_t fail_at_ = 0;
  std::function<void(RequestState&)> on_complete_;
};

}  // namespace aio
