// posix engine: blocking pread/pwrite in block_size chunks on the worker
// thread. Portable and simple, it is the fallback when kernel AIO is missing
// and the oracle the kernel-AIO engine is tested against. queue_depth,
// single_submit and overlap_events have no meaning here (one I/O at a time).
#include <algorithm>
#include <cstring>
#include <memory>

#include "engine.h"
#include "pinned.h"

namespace aio {

namespace {

class PosixEngine final : public Engine {
 public:
  explicit PosixEngine(const EngineContext& ctx)
      : s_(ctx.settings), c_(ctx.counters), f_(ctx.faults) {}
  const char* name() const override { return "posix"; }

  void transfer(const Slice& s) override {
    const size_t align = s.direct ? s.file->alignment().offset : 1;
    const uint64_t chunk =
        std::max<uint64_t>(align, static_cast<uint64_t>(s_.block_size) / align * align);
    if (s.direct && s.bounce) ensure_stage(chunk);
    for (uint64_t pos = 0; pos < s.len; pos += chunk) {
      const uint64_t n = std::min<uint64_t>(chunk, s.len - pos);
      char* user = s.buf + pos;
      const int64_t off = s.off + static_cast<int64_t>(pos);
      if (s.direct && s.bounce) {
        char* st = static_cast<char*>(stage_->data());
        if (s.op == Op::Write) std::memcpy(st, user, n);
        sync_transfer(*s.file, s.op, true, st, n, off, c_, f_);
        if (s.op == Op::Read) std::memcpy(user, st, n);
        c_.bounce_bytes.fetch_add(n, std::memory_order_relaxed);
      } else {
        sync_transfer(*s.file, s.op, s.direct, user, n, off, c_, f_);
      }
    }
  }

 private:
  void ensure_stage(uint64_t n) {
    if (!stage_ || stage_->size() < n) stage_ = std::make_unique<PinnedBuffer>(n, false);
  }
  const Settings& s_;
  Counters& c_;
  FaultInjector& f_;
  std::unique_ptr<PinnedBuffer> stage_;
};

const bool registered = register_engine(
    "posix", [](const EngineContext& ctx) { return std::make_unique<PosixEngine>(ctx); });

}  // namespace

}  // namespace aio
