#include "queued_engine.h"

#include <errno.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>

namespace aio {

namespace {

// transfer(): a feed of one slice whose error is rethrown.
class OneSlice final : public SliceFeed {
 public:
  explicit OneSlice(const Slice& s) : s_(&s) {}
  const Slice* next(bool) override {
    const Slice* s = s_;
    s_ = nullptr;
    return s;
  }
  void finished(const Slice*, const Error* err) override {
    if (err) error.emplace(*err);
  }
  std::optional<Error> error;

 private:
  const Slice* s_;
};

}  // namespace

QueuedEngine::QueuedEngine(const EngineContext& ctx, unsigned depth, uint64_t max_chunk)
    : s_(ctx.settings), c_(ctx.counters), f_(ctx.faults), depth_(depth), max_chunk_(max_chunk) {
  slots_.resize(depth_);
  for (Slot& sl : slots_) free_.push_back(&sl);
  pending_.reserve(depth_);
}

void QueuedEngine::transfer(const Slice& s) {
  OneSlice feed(s);
  run(feed);
  if (feed.error) throw *feed.error;
}

void QueuedEngine::run(SliceFeed& feed) {
  feed_ = &feed;
  bool open = true;
  while (true) {
    // With overlap_events the queue is topped up as completions arrive;
    // without it a new batch starts only once the last one drained.
    if (s_.overlap_events || inflight_ == 0) {
      if (open)
        open = admit();
      else
        fill();
    }
    if (!pending_.empty()) submit();
    if (inflight_ > 0) {
      wait(s_.overlap_events ? 1 : inflight_);
      continue;
    }
    if (!open && pending_.empty() && jobs_.empty()) break;
  }
  feed_ = nullptr;
}

// Hands out the jobs' chunks, then takes slices from the feed while a slot is
// still free (every job then has all its chunks handed out, so slices start
// in the feed's order). Returns false once the feed said stop.
bool QueuedEngine::admit() {
  while (true) {
    if (!fill() || free_.empty()) return true;
    const Slice* s = held_;
    if (s) {
      if (stage_free_.size() < stage_count_) return true;  // the staging memory is in use
      held_ = nullptr;
    } else {
      const bool idle = jobs_.empty() && inflight_ == 0 && pending_.empty();
      s = feed_->next(idle);
      if (!s) return !idle;
    }
    start(*s);
  }
}

// Makes a job of the slice, or moves it synchronously, or holds it until the
// staging memory can grow.
void QueuedEngine::start(const Slice& s) {
  if (!queues(s)) {
    move_sync(s);
    return;
  }
  Job j;
  j.s = &s;
  j.align = s.direct ? s.file->alignment().offset : 1;
  j.chunk = std::max<uint64_t>(
      j.align,
      std::min<uint64_t>(s_.block_size, max_chunk_ / j.align * j.align) / j.align * j.align);
  // No chunk larger than the slice (nor smaller than 1 MiB, so that staging is
  // not made again for each larger transfer): staging is chunk x queue_depth,
  // which at a large block_size would be GiBs for a small unaligned transfer.
  const uint64_t floor_chunk = std::max<uint64_t>(j.align, (uint64_t{1} << 20) / j.align * j.align);
  const uint64_t slice_chunk = (s.len + j.align - 1) / j.align * j.align;
  j.chunk = std::min<uint64_t>(j.chunk, std::max<uint64_t>(floor_chunk, slice_chunk));
  try {
    // Opening the buffered descriptor may fail: nothing is in flight for it.
    j.fd = s.direct ? s.file->direct_fd() : s.file->buffered_fd();
    if (s.direct && s.bounce && !stage_ready(j)) {
      held_ = &s;
      return;
    }
    if (spare_.empty()) spare_.emplace_back();
  } catch (const Error& e) {
    feed_->finished(&s, &e);
    return;
  } catch (const std::exception& e) {  // staging memory or a job node: std::bad_alloc
    const Error err(ENOMEM, op_name(s.op), s.file->path(), s.off, s.len,
                    std::string("no memory for staging or the job: ") + e.what());
    feed_->finished(&s, &err);
    return;
  }
  spare_.front() = std::move(j);
  jobs_.splice(jobs_.end(), spare_, spare_.begin());
  finish_if_done(jobs_.back());  // an empty slice
}

// Whether the staging areas fit the job's chunk; false while staged chunks
// of earlier slices are in flight in areas too small (they are then made
// again once those are back). Throws when the first area cannot be made.
bool QueuedEngine::stage_ready(const Job& j) {
  if (stage_chunk_ < j.chunk) {
    if (stage_free_.size() < stage_count_) return false;
    stage_free_.clear();
    stage_.clear();
    stage_count_ = 0;
    stage_chunk_ = j.chunk;
  }
  if (stage_count_ == 0) grow_stage(1);
  return true;
}

// Adds areas for `want` more staged chunks: at least as many as there are
// (so they are made O(log queue_depth) times), within queue_depth and
// kStageBytes.
void QueuedEngine::grow_stage(uint64_t want) {
  const uint64_t limit =
      std::min<uint64_t>(depth_, std::max<uint64_t>(1, kStageBytes / stage_chunk_));
  const uint64_t n = std::min(limit - std::min(limit, stage_count_), std::max(want, stage_count_));
  if (n == 0) return;
  stage_.push_back(std::make_unique<PinnedBuffer>(n * stage_chunk_, false));
  char* base = static_cast<char*>(stage_.back()->data());
  for (uint64_t i = 0; i < n; ++i) stage_free_.push_back(base + i * stage_chunk_);
  stage_count_ += n;
}

// A free staging area for the job's next chunk, made if need be; null when
// every area is in use (or more memory cannot be had now): the chunk waits.
char* QueuedEngine::take_stage(const Job& j) {
  if (stage_free_.empty()) {
    const uint64_t left = (j.s->len - j.next + j.chunk - 1) / j.chunk;
    try {
      grow_stage(std::min<uint64_t>(left, free_.size()));
    } catch (const std::exception&) {  // staged chunks in flight free areas
    }
    if (stage_free_.empty()) return nullptr;
  }
  char* area = stage_free_.back();
  stage_free_.pop_back();
  return area;
}

// Hands the next chunks of the jobs, in order, to free slots (a staged chunk
// also takes a staging area). Returns whether every job has all its chunks
// handed out.
bool QueuedEngine::fill() {
  for (Job& j : jobs_) {
    const Slice& s = *j.s;
    const bool bounce = s.direct && s.bounce;
    while (!j.error && j.next < s.len) {
      char* stage = nullptr;
      if (free_.empty() || (bounce && !(stage = take_stage(j)))) return false;
      Slot* sl = free_.back();
      free_.pop_back();
      sl->job = &j;
      sl->user = s.buf + j.next;
      sl->len = std::min<uint64_t>(j.chunk, s.len - j.next);
      sl->off = s.off + static_cast<int64_t>(j.next);
      sl->done = 0;
      sl->spins = 0;
      sl->stage = stage;
      if (sl->stage && s.op == Op::Write) {
        std::memcpy(sl->stage, sl->user, sl->len);
        c_.bounce_bytes.fetch_add(sl->len, std::memory_order_relaxed);
      }
      ++j.owned;
      j.next += sl->len;
      pending_.push_back(sl);
    }
  }
  return true;
}

void QueuedEngine::release(Slot& sl) {
  Job& j = *sl.job;
  sl.job = nullptr;
  if (sl.stage) stage_free_.push_back(sl.stage);
  sl.stage = nullptr;
  free_.push_back(&sl);
  --j.owned;
  finish_if_done(j);
}

// A job is done once nothing of it is owned by a slot and either every byte
// was handed out or it failed (its remaining chunks are never started).
void QueuedEngine::finish_if_done(Job& j) {
  if (j.owned > 0 || (!j.error && j.next < j.s->len)) return;
  const Slice* s = j.s;
  std::optional<Error> err = std::move(j.error);
  for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
    if (&*it != &j) continue;
    spare_.splice(spare_.end(), jobs_, it);
    break;
  }
  feed_->finished(s, err ? &*err : nullptr);
}

void QueuedEngine::refuse(Slot& sl, int e, const std::string& what) {
  const Slice& s = *sl.job->s;
  sl.job->fail(Error(e, what + " " + op_name(s.op), s.file->path(), sl.io_off(), sl.io_len()));
  release(sl);
}

void QueuedEngine::lose(Slot& sl, int e, const std::string& why) {
  --inflight_;
  const Slice& s = *sl.job->s;
  sl.job->fail(Error(e, op_name(s.op), s.file->path(), sl.io_off(), sl.io_len(), why));
  release(sl);
}

bool QueuedEngine::spin_submit() {
  if (submit_spins_ >= kMaxRetries) return false;
  ++submit_spins_;
  c_.retries.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// One completion: done, resubmitted (EINTR/EAGAIN, a short transfer that can
// go on through the queue), finished through the buffered loop, or failed.
void QueuedEngine::complete(Slot& sl, long res) {
  --inflight_;
  const Slice& s = *sl.job->s;
  const uint64_t want = sl.io_len();
  FaultAction fa = f_.on_io(s.op);
  if (fa.kind == FaultKind::Error) res = -fa.errno_value;
  if (fa.kind == FaultKind::Short && res > 1) res = (res / 2) | 1;

  if (res < 0) {
    const int e = static_cast<int>(-res);
    if ((e == EINTR || e == EAGAIN) && sl.spins < kMaxRetries) {
      ++sl.spins;
      c_.retries.fetch_add(1, std::memory_order_relaxed);
      pending_.push_back(&sl);
      return;
    }
    sl.job->fail(Error(e, op_name(s.op), s.file->path(), sl.io_off(), want));
    release(sl);
    return;
  }
  const uint64_t got = static_cast<uint64_t>(res);
  if (s.op == Op::Read && sl.stage) {
    std::memcpy(sl.user + sl.done, sl.stage + sl.done, got);
    c_.bounce_bytes.fetch_add(got, std::memory_order_relaxed);
  }
  if (!s.direct) c_.buffered_bytes.fetch_add(got, std::memory_order_relaxed);
  sl.done += got;
  if (got >= want) {
    c_.ios.fetch_add(1, std::memory_order_relaxed);
    release(sl);
    return;
  }
  resume_short(sl, got);
}

// A short transfer of `got` bytes (possibly none).
void QueuedEngine::resume_short(Slot& sl, uint64_t got) {
  Job& j = *sl.job;
  const Slice& s = *j.s;
  c_.short_resumed.fetch_add(1, std::memory_order_relaxed);
  if (got > 0 && sl.done % j.align == 0) {
    // Progress, and still aligned for this descriptor: the rest goes on
    // through the queue.
    sl.spins = 0;
    pending_.push_back(&sl);
    return;
  }
  // An unaligned direct remainder, or no progress at all: finish it with the
  // buffered loop, which also turns end-of-file into a proper error.
  try {
    sync_transfer(*s.file, s.op, false, sl.user + sl.done, sl.io_len(), sl.io_off(), c_, f_);
    c_.ios.fetch_add(1, std::memory_order_relaxed);
  } catch (Error& e) {
    j.fail(std::move(e));
  }
  release(sl);
}

// A slice the queue does not take, in block_size pieces of the plain loop.
void QueuedEngine::move_sync(const Slice& s) {
  try {
    for (uint64_t pos = 0; pos < s.len; pos += s_.block_size) {
      const uint64_t n = std::min<uint64_t>(s_.block_size, s.len - pos);
      sync_transfer(*s.file, s.op, false, s.buf + pos, n, s.off + static_cast<int64_t>(pos), c_,
                    f_);
    }
  } catch (const Error& e) {
    feed_->finished(&s, &e);
    return;
  }
  feed_->finished(&s, nullptr);
}

}  // namespace aio
