#include "handle.h"

#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <functional>
#include <list>

#include "alignment.h"
#include "error.h"
#include "interrupt.h"
#include "pid.h"

namespace aio {

static std::string settings_problem(const Settings& s) {
  if (s.block_size == 0) return "block_size must be positive";
  if (s.queue_depth == 0) return "queue_depth must be positive";
  if (s.queue_depth > 65536) return "queue_depth must be at most 65536";
  if (s.thread_count == 0) return "thread_count must be positive";
  if (s.thread_count > 1024) return "thread_count must be at most 1024";
  return "";
}

// engine="auto": io_uring, else kernel AIO, else posix threads; `reason`
// says which and why the others were passed over. io_uring comes first: on
// the drive measured (docs/performance.md) it moves 1 MiB direct I/O at
// kernel AIO's speed with less CPU (fixed buffers) and 4 KiB random reads
// faster, and it queues buffered I/O too. Where it is refused (seccomp,
// kernel.io_uring_disabled, a kernel before 5.6) kernel AIO serves.
// aio-sweep measures both and names the faster in the `engine` key.
template <typename MakeAll>
static std::string pick_auto(MakeAll& make_all, std::string* reason) {
  std::string passed;
  for (const char* name : {"io_uring", "kernel_aio"}) {
    try {
      make_all(name);
      *reason = std::string("auto: ") + passed + name + " is available here";
      return name;
    } catch (const Error& e) {
      passed += std::string(name) + " unavailable (" + e.what() + "); ";
    }
  }
  make_all("posix");
  *reason = "auto: " + passed + "using posix threads";
  return "posix";
}

Handle::Handle(const Settings& s, const std::string& engine)
    : settings_(s),
      owner_pid_(current_pid()),
      alignment_(page_size()),
      idle_cv_(new std::condition_variable()) {
  const std::string bad = settings_problem(s);
  if (!bad.empty()) throw Error(EINVAL, "create handle", "", 0, 0, bad);

  EngineContext ctx{settings_, counters_, faults_};
  std::vector<std::unique_ptr<Engine>> engines;
  auto make_all = [&](const std::string& name) {
    engines.clear();
    for (unsigned i = 0; i < s.thread_count; ++i) engines.push_back(make_engine(name, ctx));
  };
  if (engine == "auto") {
    engine_name_ = pick_auto(make_all, &engine_reason_);
  } else {
    make_all(engine);
    engine_name_ = engine;
    engine_reason_ = "requested explicitly";
  }
  for (auto& e : engines) {
    Worker* w = new Worker();
    w->engine = std::move(e);
    workers_.push_back(w);
  }
  // Workers inherit a mask blocking asynchronous signals, so SIGINT & co. go
  // to the application's threads (and interrupt their blocking calls).
  AsyncSignalBlock block;
  for (Worker* w : workers_) w->thread = std::thread(&Handle::worker_main, this, w);
}

bool Handle::forked() const { return current_pid() != owner_pid_; }

Handle::~Handle() {
  if (forked()) {
    // The threads exist only in the parent. Touch neither them nor any lock or
    // condition variable a parent thread may have held or waited on at fork():
    // detach() would fail (no such thread) and terminate, a joinable
    // std::thread's destructor terminates, and destroying a condition variable
    // with (parent) waiters blocks. Leak them instead.
    for (Worker*& w : workers_) w = nullptr;
    (void)idle_cv_.release();
    return;
  }
  drain();
  for (Worker* w : workers_) {
    {
      std::lock_guard<std::mutex> g(w->mu);
      w->stop = true;
    }
    w->cv.notify_all();
  }
  for (Worker* w : workers_) {
    if (w->thread.joinable()) w->thread.join();
    delete w;
  }
}

// A worker's queue as its engine's SliceFeed: tasks are taken in queue
// order (a task whose earlier overlapping requests are not done waits for
// them), their pieces handed out in file order, and a task reported to its
// request once every piece ended. Several tasks may be open at once: a
// queued engine runs their pieces together.
class Handle::Feed final : public SliceFeed {
 public:
  Feed(Handle& h, Worker* w) : h_(h), w_(w) {}

  const Slice* next(bool idle) override {
    for (Task& o : open_)
      if (o.next < o.pieces.size()) return &o.pieces[o.next++];
    if (!take(idle)) return nullptr;
    h_.counters_.tasks.fetch_add(1, std::memory_order_relaxed);
    return next(idle);
  }

  void finished(const Slice* s, const Error* err) override {
    auto o = open_.begin();
    while (o != open_.end() && !owns(*o, s)) ++o;
    if (o == open_.end()) return;  // cannot happen: every slice came from a task
    ++o->ended;
    if (err) {
      const int64_t end = s->off + static_cast<int64_t>(s->len);
      // Errors that are not about a byte of this piece (open of the buffered
      // descriptor...) lose the whole piece.
      const int64_t at = err->offset() >= s->off && err->offset() < end ? err->offset() : s->off;
      if (!o->error || at < o->fail_at) {
        o->error.emplace(*err);
        o->fail_at = at;
      }
    } else if (s->edge) {
      h_.counters_.edge_bytes.fetch_add(s->len, std::memory_order_relaxed);
    }
    if (o->ended < o->pieces.size()) return;
    std::shared_ptr<RequestState> req = std::move(o->req);
    std::optional<Error> e = std::move(o->error);
    const int64_t fail_at = o->fail_at;
    open_.erase(o);
    req->task_finished(e ? &*e : nullptr, fail_at);
  }

 private:
  static bool owns(const Task& t, const Slice* s) {
    const std::less_equal<const Slice*> le;
    return !t.pieces.empty() && le(&t.pieces.front(), s) && le(s, &t.pieces.back());
  }

  // Moves the next task of the queue to open_. Idle (nothing of this worker
  // in flight): waits for one, and for the requests it must follow; false
  // means stop. Else takes one only if it is there and free to start.
  bool take(bool idle) {
    std::unique_lock<std::mutex> lk(w_->mu);
    if (idle) w_->cv.wait(lk, [&] { return w_->stop || !w_->queue.empty(); });
    if (w_->queue.empty()) return false;
    if (!idle)
      for (const auto& d : w_->queue.front().deps)
        if (!d->done()) return false;
    open_.splice(open_.end(), w_->queue, w_->queue.begin());
    lk.unlock();
    for (const auto& d : open_.back().deps) d->wait_done();
    return true;
  }

  Handle& h_;
  Worker* w_;
  TaskList open_;  // tasks taken from the queue and not yet finished
};

void Handle::worker_main(Worker* w) {
  Feed feed(*this, w);
  w->engine->run(feed);
}

void Handle::enqueue(size_t worker, TaskList& tasks) noexcept {
  Worker* w = workers_[worker];
  {
    std::lock_guard<std::mutex> g(w->mu);
    w->queue.splice(w->queue.end(), tasks);
  }
  w->cv.notify_one();
}

// Takes back the count of a request that was never queued.
void Handle::uncount() {
  {
    std::lock_guard<std::mutex> g(mu_);
    --outstanding_;
  }
  idle_cv_->notify_all();
}

void Handle::on_request_done(RequestState& r) {
  {
    std::lock_guard<std::mutex> g(order_mu_);
    auto it = inflight_.find(&r);
    if (it != inflight_.end()) {
      if (it->second.op == Op::Write) --writes_inflight_;
      inflight_.erase(it);
    }
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    if (r.error()) {
      ++failed_;
    } else if (r.op() == Op::Read) {
      ++read_requests_;
      bytes_read_ += r.nbytes();
    } else {
      ++write_requests_;
      bytes_written_ += r.nbytes();
    }
    --outstanding_;
  }
  idle_cv_->notify_all();
}

// Everything detectable about the arguments before a file is opened.
void Handle::check_request(Op op, const char* buf, uint64_t nbytes, const std::string& path, int fd,
                           int64_t offset) const {
  const char* opn = op_name(op);
  const std::string where = path.empty() ? "fd " + std::to_string(fd) : path;
  if (forked())
    throw Error(0, opn, where, offset, nbytes,
                "this handle was created in another process (before fork); create a new "
                "AsyncIOHandle in this process");
  if (offset < 0) throw Error(EINVAL, opn, where, offset, nbytes, "file offset must be >= 0");
  int64_t end;
  if (nbytes > static_cast<uint64_t>(INT64_MAX) ||
      __builtin_add_overflow(offset, static_cast<int64_t>(nbytes), &end))
    throw Error(EOVERFLOW, opn, where, offset, nbytes,
                "offset + nbytes exceeds the largest file offset (2**63 - 1)");
  uintptr_t last;
  if (__builtin_add_overflow(reinterpret_cast<uintptr_t>(buf), nbytes, &last))
    throw Error(EINVAL, opn, where, offset, nbytes, "the buffer wraps around the address space");
  if (buf == nullptr && nbytes > 0) throw Error(EINVAL, opn, where, offset, nbytes, "null buffer");
  if (path.empty() && fd < 0)
    throw Error(EBADF, opn, where, offset, nbytes, "no path and no descriptor");
}

void Handle::note_fallback(const File& file) {
  if (!file.fell_back()) return;
  std::lock_guard<std::mutex> g(mu_);
  buffered_fallback_ = true;
  if (fallback_noticed_) return;
  fallback_noticed_ = true;
  notices_.push_back("O_DIRECT is not available for '" + file.path() + "' (" +
                     file.fallback_reason() +
                     "); using buffered I/O for such files. Data is correct, but "
                     "throughput and page-cache use differ from direct I/O.");
}

// The direct-I/O granularity is at least a page (see plan_slices); the
// handle reports the largest one it has used.
std::vector<std::vector<Slice>> Handle::plan(Op op, char* buf, uint64_t nbytes, File* file,
                                             int64_t offset) {
  SlicePlanInput in;
  in.op = op;
  in.file = file;
  in.buf = buf;
  in.nbytes = nbytes;
  in.offset = offset;
  in.threads = workers_.size();
  in.direct = nbytes > 0 && file->direct_fd() >= 0;
  if (in.direct) {
    const Alignment& al = file->alignment();
    in.granularity = std::max(al.offset, page_size());
    in.memory_alignment = al.memory;
    size_t prev = alignment_.load();
    while (in.granularity > prev && !alignment_.compare_exchange_weak(prev, in.granularity)) {
    }
  }
  return plan_slices(in);
}

// The in-flight requests `req` must wait for: same file, overlapping bytes,
// either a write. Caller holds order_mu_.
std::vector<std::shared_ptr<RequestState>> Handle::overlapping(const RequestState& req,
                                                               const File& file) const {
  std::vector<std::shared_ptr<RequestState>> deps;
  if (file.ino() == 0) return deps;  // identity unknown: nothing to order against
  // A read can only wait for a write: with none in flight (random reads, the
  // swappers' prefetch) there is nothing to scan.
  if (req.op() == Op::Read && writes_inflight_ == 0) return deps;
  const int64_t start = req.offset(), end = start + static_cast<int64_t>(req.nbytes());
  for (const auto& kv : inflight_) {
    const InFlight& o = kv.second;
    if (o.dev != file.dev() || o.ino != file.ino() || o.end <= start || end <= o.start) continue;
    if (o.op == Op::Read && req.op() == Op::Read) continue;
    if (auto d = o.weak.lock()) deps.push_back(std::move(d));
  }
  return deps;
}

// Registers the request as in flight, for later ones to order against; on
// std::bad_alloc nothing is registered. Caller holds order_mu_.
void Handle::register_inflight(const std::shared_ptr<RequestState>& req, const File& file) {
  const int64_t end = req->offset() + static_cast<int64_t>(req->nbytes());
  InFlight me{req.get(), req, file.dev(), file.ino(), req->offset(), end, req->op()};
  inflight_.emplace(req.get(), std::move(me));
  if (req->op() == Op::Write) ++writes_inflight_;
}

std::shared_ptr<File> Handle::open_file(Op op, const std::string& path, int fd) {
  std::shared_ptr<File> file = path.empty() ? File::adopt(fd, op) : File::open(path, op, &faults_);
  note_fallback(*file);
  return file;
}

// Whether a write in flight on `file` ends past `size`: a read ordered
// behind it may find the bytes it is adding.
bool Handle::write_may_extend(const File& file, int64_t size) {
  if (file.ino() == 0) return false;
  std::lock_guard<std::mutex> lock(order_mu_);
  if (writes_inflight_ == 0) return false;
  for (const auto& kv : inflight_) {
    const InFlight& o = kv.second;
    if (o.op == Op::Write && o.dev == file.dev() && o.ino == file.ino() && o.end > size)
      return true;
  }
  return false;
}

// Refuses a read past the end of the file at once, with a clear message;
// unless a write in flight may extend the file first (the read waits for it,
// and a read still past the end when it runs fails there the same way).
void Handle::check_size(Op op, File& file, int64_t offset, uint64_t nbytes) {
  if (op != Op::Read) return;
  const int64_t size = file.size();
  if (size >= 0 && static_cast<uint64_t>(offset) + nbytes > static_cast<uint64_t>(size) &&
      !write_may_extend(file, size))
    throw Error(ENODATA, "read", file.path(), offset, nbytes,
                "read past end of file: the file has " + std::to_string(size) +
                    " bytes, the request ends at byte " +
                    std::to_string(offset + static_cast<int64_t>(nbytes)),
                true);
}

std::shared_ptr<RequestState> Handle::submit(Op op, char* buf, uint64_t nbytes,
                                             const std::string& path, int fd, int64_t offset) {
  check_request(op, buf, nbytes, path, fd, offset);
  std::shared_ptr<File> file = open_file(op, path, fd);
  check_size(op, *file, offset, nbytes);
  return queue(op, buf, nbytes, std::move(file), offset);
}

std::shared_ptr<RequestGroup> Handle::submit_pieces(Op op, char* buf, uint64_t piece,
                                                    const std::vector<int64_t>& offsets,
                                                    const std::string& path, int fd) {
  uint64_t total;
  if (offsets.empty()) throw Error(EINVAL, op_name(op), path, 0, 0, "no pieces (no file offsets)");
  if (__builtin_mul_overflow(piece, static_cast<uint64_t>(offsets.size()), &total))
    throw Error(EOVERFLOW, op_name(op), path, 0, piece, "pieces x piece size overflows");
  for (size_t i = 0; i < offsets.size(); ++i)
    check_request(op, buf + i * piece, piece, path, fd, offsets[i]);
  std::shared_ptr<File> file = open_file(op, path, fd);
  // One fstat: the piece reaching furthest decides whether any reads past the end.
  check_size(op, *file, *std::max_element(offsets.begin(), offsets.end()), piece);
  std::vector<std::shared_ptr<RequestState>> out;
  out.reserve(offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i)
    out.push_back(queue(op, buf + i * piece, piece, file, offsets[i]));
  return std::make_shared<RequestGroup>(std::move(out));
}

// The request's tasks, one list node each (made here, where a failure
// leaves nothing queued).
std::vector<Handle::TaskList> Handle::make_tasks(const std::shared_ptr<RequestState>& req,
                                                 std::vector<std::vector<Slice>>& per_worker) {
  std::vector<TaskList> tasks(per_worker.size());
  for (size_t i = 0; i < per_worker.size(); ++i) {
    if (per_worker[i].empty()) continue;
    tasks[i].emplace_back();
    tasks[i].back().req = req;
    tasks[i].back().pieces = std::move(per_worker[i]);
  }
  return tasks;
}

// Registers the request and queues its tasks, or (std::bad_alloc) does
// neither. Registration and enqueueing happen under one lock so that every
// worker queue holds the tasks of an earlier request before those of a later
// one that waits for it (no wait cycle).
void Handle::hand_out(const std::shared_ptr<RequestState>& req, const File& file,
                      std::vector<TaskList>& tasks) {
  std::lock_guard<std::mutex> g(order_mu_);
  const std::vector<std::shared_ptr<RequestState>> deps = overlapping(*req, file);
  for (TaskList& t : tasks)
    if (!t.empty()) t.front().deps = deps;
  register_inflight(req, file);
  // Nothing below can throw: the request is queued whole.
  for (size_t i = 0; i < tasks.size(); ++i)
    if (!tasks[i].empty()) enqueue(i, tasks[i]);
}

std::shared_ptr<RequestState> Handle::queue(Op op, char* buf, uint64_t nbytes,
                                            std::shared_ptr<File> file, int64_t offset) {
  std::vector<std::vector<Slice>> per_worker = plan(op, buf, nbytes, file.get(), offset);
  int ntasks = 0;
  for (auto& v : per_worker) ntasks += v.empty() ? 0 : 1;
  // Counted before the request exists: one without tasks completes (and is
  // uncounted) in its constructor. Anything that throws before the request
  // is queued takes the count back, or drain() would wait for it forever.
  {
    std::lock_guard<std::mutex> g(mu_);
    ++outstanding_;
  }
  try {
    const File& f = *file;
    auto req = std::make_shared<RequestState>(op, nbytes, offset, std::move(file), ntasks,
                                              [this](RequestState& r) { on_request_done(r); });
    if (ntasks == 0) return req;
    std::vector<TaskList> tasks = make_tasks(req, per_worker);
    hand_out(req, f, tasks);
    return req;
  } catch (...) {
    uncount();
    throw;
  }
}

void Handle::drain() {
  // In a forked child nothing of this process is in flight here; the parent's
  // requests never complete in this copy.
  if (forked()) return;
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_->wait(lk, [&] { return outstanding_ == 0; });
}

bool Handle::drain_for(double seconds) {
  if (forked()) return true;
  std::unique_lock<std::mutex> lk(mu_);
  const auto limit = std::chrono::duration<double>(seconds > 0 ? seconds : 0.0);
  return idle_cv_->wait_for(lk, limit, [&] { return outstanding_ == 0; });
}

std::vector<std::string> Handle::take_notices() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::string> out;
  out.swap(notices_);
  return out;
}

std::string Handle::fixed_refusal() const {
  const int e = counters_.fixed_refused_errno.load();
  if (e == 0) return "";
  std::string why = "io_uring refused " + std::to_string(counters_.fixed_refused.load()) +
                    " pinned-buffer registration(s) on this handle's rings (" + std::strerror(e) +
                    ")";
  if (e == ENOMEM)
    why +=
        ": for a user without CAP_IPC_LOCK the kernel charges registered buffers to "
        "RLIMIT_MEMLOCK per user, across all of the user's processes (ranks on one node "
        "add up); raise the limit (ulimit -l, LimitMEMLOCK=, --ulimit memlock=-1)";
  return why + ". I/O into those buffers goes out as plain READ/WRITE: correct, more CPU per GB";
}

Stats Handle::stats() const {
  Stats st;
  st.engine = engine_name_;
  st.engine_reason = engine_reason_;
  {
    std::lock_guard<std::mutex> g(mu_);
    st.read_requests = read_requests_;
    st.write_requests = write_requests_;
    st.bytes_read = bytes_read_;
    st.bytes_written = bytes_written_;
    st.failed_requests = failed_;
    st.buffered_fallback = buffered_fallback_;
    st.outstanding = outstanding_;
  }
  st.ios = counters_.ios.load();
  st.submit_calls = counters_.submit_calls.load();
  st.getevents_calls = counters_.getevents_calls.load();
  st.retries = counters_.retries.load();
  st.short_resumed = counters_.short_resumed.load();
  st.bounce_bytes = counters_.bounce_bytes.load();
  st.fixed_ios = counters_.fixed_ios.load();
  st.fixed_refused = counters_.fixed_refused.load();
  st.fixed_refused_reason = fixed_refusal();
  st.edge_bytes = counters_.edge_bytes.load();
  st.buffered_bytes = counters_.buffered_bytes.load();
  st.tasks = counters_.tasks.load();
  st.max_inflight = counters_.max_inflight.load();
  st.alignment = alignment_.load();
  return st;
}

}  // namespace aio
