#include "request.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "pid.h"

namespace aio {

namespace {

// min(v rounded up to a multiple of g, cap) for 0 <= v <= cap, without the
// overflow of v + g - 1 near 2**63.
int64_t round_up_to_cap(int64_t v, int64_t g, int64_t cap) {
  const int64_t down = v - v % g;
  if (down == v) return v;
  return cap - down <= g ? cap : down + g;
}

int64_t round_down(int64_t v, int64_t g) { return v / g * g; }

Slice make_slice(const SlicePlanInput& in, int64_t a, int64_t b, bool direct, bool edge) {
  Slice s;
  s.op = in.op;
  s.file = in.file;
  s.buf = in.buf + (a - in.offset);
  s.len = static_cast<uint64_t>(b - a);
  s.off = a;
  s.direct = direct;
  s.edge = edge;
  return s;
}

// No O_DIRECT descriptor: equal buffered slices, one per worker.
std::vector<std::vector<Slice>> plan_buffered(const SlicePlanInput& in) {
  const int64_t n = static_cast<int64_t>(in.threads);
  std::vector<std::vector<Slice>> per_worker(in.threads);
  const int64_t end = in.offset + static_cast<int64_t>(in.nbytes);
  const int64_t per = (static_cast<int64_t>(in.nbytes) + n - 1) / n;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = in.offset + i * per;
    const int64_t b = std::min(end, a + per);
    if (a < b) per_worker[static_cast<size_t>(i)].push_back(make_slice(in, a, b, false, false));
  }
  return per_worker;
}

}  // namespace

std::vector<std::vector<Slice>> plan_slices(const SlicePlanInput& in) {
  if (in.nbytes == 0 || in.threads == 0) return std::vector<std::vector<Slice>>(in.threads);
  if (!in.direct) return plan_buffered(in);
  std::vector<std::vector<Slice>> per_worker(in.threads);
  const int64_t g = static_cast<int64_t>(std::max<size_t>(in.granularity, 1));
  const int64_t offset = in.offset;
  const int64_t end = offset + static_cast<int64_t>(in.nbytes);
  const int64_t head_end = round_up_to_cap(offset, g, end);
  const int64_t tail_start = std::max(round_down(end, g), head_end);
  const bool bounce = reinterpret_cast<uintptr_t>(in.buf + (head_end - offset)) %
                          std::max<size_t>(in.memory_alignment, 1) !=
                      0;
  const int64_t units = (tail_start - head_end) / g;
  const int64_t n = static_cast<int64_t>(in.threads);
  int64_t pos = head_end;
  size_t last = 0;
  for (int64_t i = 0; i < n && units > 0; ++i) {
    const int64_t take = units / n + (i < units % n ? 1 : 0);
    if (take == 0) continue;
    Slice s = make_slice(in, pos, pos + take * g, true, false);
    s.bounce = bounce;
    per_worker[static_cast<size_t>(i)].push_back(s);
    pos += take * g;
    last = static_cast<size_t>(i);
  }
  if (head_end > offset)
    per_worker[0].insert(per_worker[0].begin(), make_slice(in, offset, head_end, false, true));
  if (end > tail_start)
    per_worker[units > 0 ? last : 0].push_back(make_slice(in, tail_start, end, false, true));
  return per_worker;
}

RequestState::RequestState(Op op, uint64_t nbytes, int64_t offset, std::shared_ptr<File> file,
                           int tasks, std::function<void(RequestState&)> on_complete)
    : op_(op),
      nbytes_(nbytes),
      offset_(offset),
      path_(file ? file->path() : ""),
      creator_pid_(current_pid()),
      file_(std::move(file)),
      pending_(tasks),
      sync_(new Sync()),
      on_complete_(std::move(on_complete)) {
  if (tasks == 0) {
    if (on_complete_) on_complete_(*this);
    on_complete_ = nullptr;
    done_.store(true);
  }
}

RequestState::~RequestState() {
  if (current_pid() != creator_pid_) (void)sync_.release();  // see Sync
}

void RequestState::check_owner() const {
  if (current_pid() == creator_pid_) return;
  throw Error(0, op_ == Op::Read ? "read" : "write", path_, offset_, nbytes_,
              "this request was submitted by process " + std::to_string(creator_pid_) +
                  " before fork(); its outcome is not known in this process. Submit the "
                  "I/O again from a handle created in this process");
}

bool RequestState::wait(double timeout_s) {
  check_owner();
  std::unique_lock<std::mutex> lk(sync_->mu);
  auto pred = [&] { return done_.load(std::memory_order_acquire); };
  // Beyond ~30 years wait_for's deadline arithmetic overflows (inf, 1e300)
  // and it returns at once; such a timeout means "no timeout".
  if (timeout_s < 0 || !(timeout_s < 1e9)) {
    sync_->cv.wait(lk, pred);
    return true;
  }
  return sync_->cv.wait_for(lk, std::chrono::duration<double>(timeout_s), pred);
}

void RequestState::wait_done() {
  std::unique_lock<std::mutex> lk(sync_->mu);
  sync_->cv.wait(lk, [&] { return done_.load(std::memory_order_acquire); });
}

void RequestState::task_finished(const Error* err, int64_t fail_at) {
  if (err && fail_at < 0) fail_at = err->offset();
  {
    std::lock_guard<std::mutex> g(sync_->mu);
    // Keep the failure lowest in the file: every byte from there on may be
    // missing, everything before it is known to have been transferred.
    if (err && (!error_ || fail_at < fail_at_)) {
      error_.emplace(*err);
      fail_at_ = fail_at;
    }
  }
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  file_.reset();  // close our descriptors before anyone is told we're done
  if (error_) settle_error();
  // Statistics and the handle's outstanding count are settled before the
  // request reads as done, so a caller that saw done() sees them too.
  if (on_complete_) on_complete_(*this);
  on_complete_ = nullptr;
  {
    std::lock_guard<std::mutex> g(sync_->mu);
    done_.store(true, std::memory_order_release);
  }
  sync_->cv.notify_all();
}

// Rewrites the error to cover every byte not known to be transferred: from
// the lowest failure to the end of the request (later slices may or may not
// have landed; the caller must treat the whole range as lost).
void RequestState::settle_error() {
  const int64_t end = offset_ + static_cast<int64_t>(nbytes_);
  const int64_t at = std::min(std::max(fail_at_, offset_), end);
  const Error& e = *error_;
  std::string detail = e.detail();
  if (!detail.empty()) detail += "; ";
  detail += std::to_string(at - offset_) + " of " + std::to_string(nbytes_) +
            " bytes of the request (from offset " + std::to_string(offset_) +
            ") were transferred; the remaining " + std::to_string(end - at) +
            " bytes from offset " + std::to_string(at) + " are not known to be " +
            (op_ == Op::Read ? "read" : "written");
  error_.emplace(
      Error(e.err(), e.op(), e.path(), at, static_cast<uint64_t>(end - at), detail, e.eof()));
}

}  // namespace aio
