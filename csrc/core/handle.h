// A handle: settings, a fixed set of worker threads (each with its own engine
// instance), request planning and statistics. Callers pass raw memory, a byte
// count and a file offset; nothing here knows about Python or torch.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine.h"
#include "request.h"
#include "request_group.h"

namespace aio {

struct Stats {
  std::string engine;
  std::string engine_reason;
  uint64_t read_requests = 0, write_requests = 0;
  uint64_t bytes_read = 0, bytes_written = 0;
  uint64_t failed_requests = 0;
  uint64_t ios = 0, submit_calls = 0, getevents_calls = 0;
  uint64_t retries = 0, short_resumed = 0;
  uint64_t bounce_bytes = 0, edge_bytes = 0, buffered_bytes = 0;
  bool buffered_fallback = false;
  uint64_t outstanding = 0;
  uint64_t tasks = 0, max_inflight = 0, fixed_ios = 0;
  uint64_t fixed_refused = 0;        // pinned-buffer registrations the rings were refused
  std::string fixed_refused_reason;  // why (fixed_refusal()), "" when none
  size_t alignment = 0;
};

class Handle {
 public:
  // engine: "auto" (kernel_aio if it works here, else posix), or a registered name.
  Handle(const Settings& s, const std::string& engine);
  ~Handle();
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  // Opens `path` (or uses the caller's descriptor `fd` when path is empty),
  // checks the range, and queues the I/O. Throws aio::Error for anything
  // detectable before I/O starts (missing file, read past end of file...).
  std::shared_ptr<RequestState> submit(Op op, char* buf, uint64_t nbytes, const std::string& path,
                                       int fd, int64_t offset);
  // offsets.size() requests of `piece` bytes each, piece i at buf + i * piece
  // and file offset offsets[i], with one open of the file. Every piece is
  // checked before any is queued, so a refusal queues nothing. Out of memory
  // part-way (std::bad_alloc), the pieces queued before it stay in flight:
  // the caller keeps `buf` until drain() (they count as outstanding).
  std::shared_ptr<RequestGroup> submit_pieces(Op op, char* buf, uint64_t piece,
                                              const std::vector<int64_t>& offsets,
                                              const std::string& path, int fd);
  // Waits until no request of this handle is in flight.
  void drain();
  // drain() for at most `seconds`: whether nothing is outstanding now.
  bool drain_for(double seconds);

  Stats stats() const;
  const Settings& settings() const { return settings_; }
  const std::string& engine_name() const { return engine_name_; }
  const std::string& engine_reason() const { return engine_reason_; }
  FaultInjector& faults() { return faults_; }
  // Largest direct-I/O granularity this handle has used (page size at least).
  size_t alignment() const { return alignment_.load(); }
  // Messages for the user (buffered fallback...), each returned once.
  std::vector<std::string> take_notices();
  // Why this handle's rings were refused pinned-buffer registrations (one
  // line with what to do), or "" when none was.
  std::string fixed_refusal() const;
  // True in a child process that inherited this handle through fork().
  bool forked() const;

 private:
  // One request's slices for one worker, and the worker's progress on them.
  struct Task {
    std::shared_ptr<RequestState> req;
    std::vector<Slice> pieces;
    // Earlier requests that overlap this one (and one of them writes): the
    // task starts only once they are done, so overlapping I/O keeps its order.
    std::vector<std::shared_ptr<RequestState>> deps;
    size_t next = 0;             // pieces handed to the engine
    size_t ended = 0;            // pieces finished
    std::optional<Error> error;  // the failure lowest in the file
    int64_t fail_at = 0;
  };
  // A task's list node is made before its request is registered, and tasks
  // move between lists only by splicing nodes, which cannot fail: a request
  // is queued whole or not at all, and a worker taking a task allocates
  // nothing (std::bad_alloc there would lose the task).
  using TaskList = std::list<Task>;
  struct InFlight {
    const RequestState* req;
    std::weak_ptr<RequestState> weak;
    uint64_t dev, ino;
    int64_t start, end;
    Op op;
  };
  struct Worker {
    std::thread thread;
    std::mutex mu;
    std::condition_variable cv;
    TaskList queue;
    bool stop = false;
    std::unique_ptr<Engine> engine;
  };
  class Feed;
  void worker_main(Worker* w);
  void enqueue(size_t worker, TaskList& tasks) noexcept;
  void uncount();
  void on_request_done(RequestState& r);
  void check_request(Op op, const char* buf, uint64_t nbytes, const std::string& path, int fd,
                     int64_t offset) const;
  void note_fallback(const File& file);
  std::shared_ptr<File> open_file(Op op, const std::string& path, int fd);
  void check_size(Op op, File& file, int64_t offset, uint64_t nbytes);
  bool write_may_extend(const File& file, int64_t size);
  std::shared_ptr<RequestState> queue(Op op, char* buf, uint64_t nbytes, std::shared_ptr<File> file,
                                      int64_t offset);
  std::vector<std::vector<Slice>> plan(Op op, char* buf, uint64_t nbytes, File* file,
                                       int64_t offset);
  std::vector<TaskList> make_tasks(const std::shared_ptr<RequestState>& req,
                                   std::vector<std::vector<Slice>>& per_worker);
  void hand_out(const std::shared_ptr<RequestState>& req, const File& file,
                std::vector<TaskList>& tasks);
  std::vector<std::shared_ptr<RequestState>> overlapping(const RequestState& req,
                                                         const File& file) const;
  void register_inflight(const std::shared_ptr<RequestState>& req, const File& file);

  Settings settings_;
  std::string engine_name_;
  std::string engine_reason_;
  Counters counters_;
  FaultInjector faults_;
  std::vector<Worker*> workers_;
  pid_t owner_pid_;

  std::atomic<size_t> alignment_;
  mutable std::mutex mu_;  // guards outstanding_, notices_, request stats
  // Heap-held so a forked child can leak it (see ~Handle).
  std::unique_ptr<std::condition_variable> idle_cv_;
  std::mutex order_mu_;  // guards inflight_; serializes registration + enqueue
  std::unordered_map<const RequestState*, InFlight> inflight_;
  size_t writes_inflight_ = 0;  // writes in inflight_: reads alone never wait
  uint64_t outstanding_ = 0;
  uint64_t read_requests_ = 0, write_requests_ = 0, bytes_read_ = 0, bytes_written_ = 0;
  uint64_t failed_ = 0;
  bool buffered_fallback_ = false;
  bool fallback_noticed_ = false;
  std::vector<std::string> notices_;
};

}  // namespace aio
