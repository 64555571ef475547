#include "handle.h"

#include <errno.h>
#include <unistd.h>

#include <algorithm>

#include "alignment.h"
#include "error.h"

namespace aio {

static std::string settings_problem(const Settings& s) {
  if (s.block_size == 0) return "block_size must be positive";
  if (s.queue_depth == 0) return "queue_depth must be positive";
  if (s.queue_depth > 65536) return "queue_depth must be at most 65536";
  if (s.thread_count == 0) return "thread_count must be positive";
  if (s.thread_count > 1024) return "thread_count must be at most 1024";
  return "";
}

Handle::Handle(const Settings& s, const std::string& engine)
    : settings_(s), owner_pid_(getpid()), alignment_(page_size()) {
  const std::string bad = settings_problem(s);
  if (!bad.empty()) throw Error(EINVAL, "create handle", "", 0, 0, bad);

  EngineContext ctx{settings_, counters_, faults_};
  std::vector<std::unique_ptr<Engine>> engines;
  auto make_all = [&](const std::string& name) {
    engines.clear();
    for (unsigned i = 0; i < s.thread_count; ++i) engines.push_back(make_engine(name, ctx));
  };
  if (engine == "auto") {
    try {
      make_all("kernel_aio");
      engine_name_ = "kernel_aio";
      engine_reason_ = "auto: kernel AIO is available (io_setup succeeded)";
    } catch (const Error& e) {
      make_all("posix");
      engine_name_ = "posix";
      engine_reason_ =
          std::string("auto: kernel AIO unavailable, using posix threads: ") + e.what();
    }
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
  for (Worker* w : workers_) w->thread = std::thread(&Handle::worker_main, this, w);
}

bool Handle::forked() const { return getpid() != owner_pid_; }

Handle::~Handle() {
  if (forked()) {
    // The threads exist only in the parent; joining here would hang. Leak the
    // bookkeeping (the child rarely keeps running long with it).
    for (Worker* w : workers_) {
      w->thread.detach();
      w->engine.release();
    }
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

void Handle::worker_main(Worker* w) {
  while (true) {
    Task t;
    {
      std::unique_lock<std::mutex> lk(w->mu);
      w->cv.wait(lk, [&] { return w->stop || !w->queue.empty(); });
      if (w->queue.empty()) return;  // stop requested and nothing left
      t = std::move(w->queue.front());
      w->queue.pop_front();
    }
    counters_.tasks.fetch_add(1, std::memory_order_relaxed);
    std::optional<Error> err;
    for (const Slice& p : t.pieces) {
      try {
        w->engine->transfer(p);
        if (p.edge) counters_.edge_bytes.fetch_add(p.len, std::memory_order_relaxed);
      } catch (const Error& e) {
        err.emplace(e);
      } catch (const std::exception& e) {
        err.emplace(EIO, op_name(p.op), p.file->path(), p.off, p.len,
                    std::string("internal error: ") + e.what());
      }
      if (err) break;
    }
    t.req->task_finished(err ? &*err : nullptr);
  }
}

void Handle::enqueue(size_t worker, Task t) {
  Worker* w = workers_[worker];
  {
    std::lock_guard<std::mutex> g(w->mu);
    w->queue.push_back(std::move(t));
  }
  w->cv.notify_one();
}

void Handle::on_request_done(RequestState& r) {
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
  idle_cv_.notify_all();
}

static int64_t round_up(int64_t v, int64_t g) { return (v + g - 1) / g * g; }
static int64_t round_down(int64_t v, int64_t g) { return v / g * g; }

std::shared_ptr<RequestState> Handle::submit(Op op, char* buf, uint64_t nbytes,
                                             const std::string& path, int fd, int64_t offset) {
  const char* opn = op_name(op);
  const std::string where = path.empty() ? "fd " + std::to_string(fd) : path;
  if (forked())
    throw Error(0, opn, where, offset, nbytes,
                "this handle was created in another process (before fork); create a new "
                "AsyncIOHandle in this process");
  if (offset < 0) throw Error(EINVAL, opn, where, offset, nbytes, "file offset must be >= 0");
  if (buf == nullptr && nbytes > 0) throw Error(EINVAL, opn, where, offset, nbytes, "null buffer");
  if (path.empty() && fd < 0)
    throw Error(EBADF, opn, where, offset, nbytes, "no path and no descriptor");

  std::shared_ptr<File> file = path.empty() ? File::adopt(fd, op) : File::open(path, op, &faults_);
  if (file->fell_back()) {
    std::lock_guard<std::mutex> g(mu_);
    buffered_fallback_ = true;
    if (!fallback_noticed_) {
      fallback_noticed_ = true;
      notices_.push_back("O_DIRECT is not available for '" + file->path() + "' (" +
                         file->fallback_reason() +
                         "); using buffered I/O for such files. Data is correct, but "
                         "throughput and page-cache use differ from direct I/O.");
    }
  }
  if (op == Op::Read) {
    const int64_t size = file->size();
    if (size >= 0 && static_cast<uint64_t>(offset) + nbytes > static_cast<uint64_t>(size))
      throw Error(ENODATA, "read", file->path(), offset, nbytes,
                  "read past end of file: the file has " + std::to_string(size) +
                      " bytes, the request ends at byte " +
                      std::to_string(offset + static_cast<int64_t>(nbytes)),
                  true);
  }

  // Plan: unaligned head and tail go through the page cache; the aligned
  // middle goes O_DIRECT, split into thread_count contiguous slices. The
  // granularity is at least a page so that no page is ever touched both by a
  // buffered edge and a direct slice (mixing the two on one page can let a
  // stale cached page be written back over direct-written data).
  const size_t nthreads = workers_.size();
  std::vector<std::vector<Slice>> per_worker(nthreads);
  const int64_t end = offset + static_cast<int64_t>(nbytes);
  auto slice = [&](int64_t a, int64_t b, bool direct, bool edge) {
    Slice s;
    s.op = op;
    s.file = file.get();
    s.buf = buf + (a - offset);
    s.len = static_cast<uint64_t>(b - a);
    s.off = a;
    s.direct = direct;
    s.edge = edge;
    return s;
  };
  if (nbytes > 0 && file->direct_fd() < 0) {
    const int64_t per = (static_cast<int64_t>(nbytes) + static_cast<int64_t>(nthreads) - 1) /
                        static_cast<int64_t>(nthreads);
    for (size_t i = 0; i < nthreads; ++i) {
      const int64_t a = offset + static_cast<int64_t>(i) * per;
      const int64_t b = std::min(end, a + per);
      if (a < b) per_worker[i].push_back(slice(a, b, false, false));
    }
  } else if (nbytes > 0) {
    const Alignment& al = file->alignment();
    const int64_t g = static_cast<int64_t>(std::max(al.offset, page_size()));
    size_t prev = alignment_.load();
    while (static_cast<size_t>(g) > prev && !alignment_.compare_exchange_weak(prev, g)) {
    }
    const int64_t head_end = std::min(round_up(offset, g), end);
    const int64_t tail_start = std::max(round_down(end, g), head_end);
    const bool bounce =
        reinterpret_cast<uintptr_t>(buf + (head_end - offset)) % std::max<size_t>(al.memory, 1) !=
        0;
    const int64_t units = (tail_start - head_end) / g;
    int64_t pos = head_end;
    size_t last = 0;
    for (size_t i = 0; i < nthreads && units > 0; ++i) {
      const int64_t take =
          units / static_cast<int64_t>(nthreads) +
          (static_cast<int64_t>(i) < units % static_cast<int64_t>(nthreads) ? 1 : 0);
      if (take == 0) continue;
      Slice s = slice(pos, pos + take * g, true, false);
      s.bounce = bounce;
      per_worker[i].push_back(s);
      pos += take * g;
      last = i;
    }
    if (head_end > offset)
      per_worker[0].insert(per_worker[0].begin(), slice(offset, head_end, false, true));
    if (end > tail_start)
      per_worker[units > 0 ? last : 0].push_back(slice(tail_start, end, false, true));
  }

  int ntasks = 0;
  for (auto& v : per_worker) ntasks += v.empty() ? 0 : 1;
  {
    std::lock_guard<std::mutex> g(mu_);
    ++outstanding_;
  }
  auto req = std::make_shared<RequestState>(op, nbytes, offset, file, ntasks,
                                            [this](RequestState& r) { on_request_done(r); });
  for (size_t i = 0; i < nthreads; ++i)
    if (!per_worker[i].empty()) enqueue(i, Task{req, std::move(per_worker[i])});
  return req;
}

void Handle::drain() {
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_.wait(lk, [&] { return outstanding_ == 0; });
}

std::vector<std::string> Handle::take_notices() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::string> out;
  out.swap(notices_);
  return out;
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
  st.edge_bytes = counters_.edge_bytes.load();
  st.buffered_bytes = counters_.buffered_bytes.load();
  st.tasks = counters_.tasks.load();
  st.max_inflight = counters_.max_inflight.load();
  st.alignment = alignment_.load();
  return st;
}

}  // namespace aio
