// Engines move one Slice (a contiguous piece of a request) between memory and
// a file. Each worker thread owns one engine instance. Engines are registered
// by name (as fio's engines/ are) and created through make_engine().
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "error.h"
#include "fault.h"
#include "file.h"

namespace aio {

struct Settings {
  size_t block_size = 1 << 20;  // bytes per submitted I/O
  unsigned queue_depth = 8;     // I/Os in flight per worker
  bool single_submit = false;   // one io_submit per I/O instead of per batch
  bool overlap_events = true;   // refill as completions arrive vs per batch
  unsigned thread_count = 1;    // workers; requests split into this many slices
};

// Counters shared by the workers of one handle (relaxed atomics: statistics).
struct Counters {
  std::atomic<uint64_t> ios{0};           // I/Os completed (chunks and edges)
  std::atomic<uint64_t> submit_calls{0};  // io_submit system calls
  std::atomic<uint64_t> getevents_calls{0};
  std::atomic<uint64_t> retries{0};         // EINTR/EAGAIN retried
  std::atomic<uint64_t> short_resumed{0};   // short transfers resumed
  std::atomic<uint64_t> bounce_bytes{0};    // bytes staged through a bounce buffer
  std::atomic<uint64_t> edge_bytes{0};      // unaligned edge bytes (buffered)
  std::atomic<uint64_t> buffered_bytes{0};  // bytes through buffered descriptors
  std::atomic<uint64_t> tasks{0};           // request slices run by workers
  std::atomic<uint64_t> max_inflight{0};    // most I/Os one worker had in flight
  std::atomic<uint64_t> fixed_ios{0};       // I/Os into registered (fixed) buffers
  std::atomic<uint64_t> fixed_refused{0};   // buffer registrations a ring was refused
  std::atomic<int> fixed_refused_errno{0};  // the last refusal's errno

  void note_inflight(uint64_t n) {
    uint64_t cur = max_inflight.load(std::memory_order_relaxed);
    while (n > cur && !max_inflight.compare_exchange_weak(cur, n, std::memory_order_relaxed)) {
    }
  }
};

struct Slice {
  Op op = Op::Read;
  File* file = nullptr;
  char* buf = nullptr;
  uint64_t len = 0;
  int64_t off = 0;
  bool direct = false;  // aligned middle: use the O_DIRECT descriptor
  bool bounce = false;  // memory not aligned for O_DIRECT: stage through engine buffers
  bool edge = false;    // unaligned edge of a request (statistics only)
};

// Where a worker's engine takes its slices from and reports them done: the
// worker's queue of tasks (handle.cpp). An engine may run several slices at
// once (kernel_aio and io_uring share queue_depth I/Os across them), so many
// small requests are in flight together, as fio's iodepth keeps them.
class SliceFeed {
 public:
  virtual ~SliceFeed() = default;
  // The next slice to start, or null. `idle`: the engine has nothing in
  // flight, so the feed may block until there is work; null then means stop.
  // Not idle: null means nothing is ready now (the engine reaps and asks again).
  virtual const Slice* next(bool idle) = 0;
  // A slice next() gave ended, every byte moved (err null) or not; nothing of
  // it is in flight any more.
  virtual void finished(const Slice* s, const Error* err) = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual const char* name() const = 0;
  // Moves the whole slice or throws aio::Error. Never returns with I/O still
  // in flight, so the caller may release the buffer when it returns.
  virtual void transfer(const Slice& s) = 0;
  // Runs the feed's slices until it says stop. This default moves them one
  // at a time through transfer(); queued engines overlap them.
  virtual void run(SliceFeed& feed);
};

struct EngineContext {
  const Settings& settings;
  Counters& counters;
  FaultInjector& faults;
};

using EngineFactory = std::function<std::unique_ptr<Engine>(const EngineContext&)>;

// Registers an engine under `name`; returns true so it can seed a static.
bool register_engine(const std::string& name, EngineFactory factory);
std::unique_ptr<Engine> make_engine(const std::string& name, const EngineContext& ctx);
std::vector<std::string> engine_names();

// pread/pwrite loop shared by the posix engine, unaligned edges, buffered
// fallback and the resumption of short direct I/O: moves exactly `len` bytes,
// resumes short transfers, retries EINTR/EAGAIN, raises everything else. A
// read that hits end of file raises an eof Error rather than returning less.
void sync_transfer(File& file, Op op, bool direct, char* buf, uint64_t len, int64_t off,
                   Counters& c, FaultInjector& faults);

// Test hook: io_uring_setup fails with this errno (0 = off), as it does
// where seccomp or kernel.io_uring_disabled refuses io_uring.
void set_uring_setup_fault(int err);

// Test hook: io_setup fails with this errno (0 = off), as it does where the
// system-wide AIO limit is exhausted (EAGAIN) or native AIO is blocked.
void set_kaio_setup_fault(int err);

// Upper bound on back-to-back EINTR/EAGAIN retries of a single I/O.
constexpr int kMaxRetries = 1000;

inline const char* op_name(Op op) { return op == Op::Read ? "read" : "write"; }

}  // namespace aio
