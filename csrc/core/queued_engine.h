// The loop the kernel-queued engines (kernel_aio, io_uring) share, as fio's
// core holds the queue logic and its engines/ only the system calls: slices
// from a SliceFeed cut into block_size chunks, up to queue_depth chunks in
// flight across slices (so 64 small requests are 64 I/Os in flight), every
// completion checked against the length asked (short transfers resumed,
// EINTR/EAGAIN retried with a bound, anything else failing its slice), and a
// slice reported to the feed only once nothing of it is in flight, so its
// buffer is never released with I/O still aimed at it.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <vector>

#include "engine.h"
#include "error.h"
#include "pinned.h"

namespace aio {

// A wait hands at most this many completions (or as many as it waited for)
// to complete() before the run loop refills the freed slots and submits them;
// the rest stay queued in the kernel for the next wait. A device that
// completes the whole queue at once (virtio does) would otherwise sit idle
// while every completion is handled and every slot refilled: 4 KiB random
// reads at queue depth 64 went from 72-80 to 87-120 kIOPS on the dev box.
constexpr unsigned kReapBatch = 8;

// Staging memory a queued engine holds at most (one chunk when a chunk is
// larger): unaligned memory is the copying slow path, and 64 MiB of staged
// I/O in flight keeps a drive busy. Sized by queue_depth x block_size alone,
// an 8 MiB transfer at queue_depth 32768 asked for 256 GiB (ENOMEM).
constexpr uint64_t kStageBytes = uint64_t{64} << 20;

class QueuedEngine : public Engine {
 public:
  void transfer(const Slice& s) override;
  void run(SliceFeed& feed) override;

 protected:
  // max_chunk: the most bytes the backend moves in one I/O.
  QueuedEngine(const EngineContext& ctx, unsigned depth, uint64_t max_chunk);

  // One slice in progress.
  struct Job {
    const Slice* s = nullptr;
    int fd = -1;       // descriptor its I/Os use
    size_t align = 1;  // direct-I/O granularity (1 for buffered slices)
    uint64_t chunk = 0;
    uint64_t next = 0;   // first byte not yet handed to a slot
    unsigned owned = 0;  // slots working for it (in flight or queued)
    std::optional<Error> error;
    // Keep the failure lowest in the file: chunks below it all completed, so
    // the request's error can say which bytes are known to be transferred.
    void fail(Error e) {
      if (!error || e.offset() < error->offset()) error.emplace(std::move(e));
    }
  };
  // One chunk's I/O.
  struct Slot {
    Job* job = nullptr;
    char* user = nullptr;   // caller memory for this chunk
    char* stage = nullptr;  // aligned staging memory, or null
    uint64_t len = 0;
    int64_t off = 0;
    uint64_t done = 0;
    int spins = 0;
    char* io_buf() const { return (stage ? stage : user) + done; }
    int64_t io_off() const { return off + static_cast<int64_t>(done); }
    uint64_t io_len() const { return len - done; }
  };

  // Whether the slice goes through the kernel queue; if not, the synchronous
  // loop moves it (blocking the worker, as buffered kernel AIO would anyway).
  virtual bool queues(const Slice& s) const = 0;
  // Hands every slot in pending_ to the kernel and clears pending_; counts
  // what is in flight in inflight_; a slot the kernel refuses goes to refuse().
  virtual void submit() = 0;
  // Waits until `want` completions are ready and passes them to complete();
  // under the trickle fault no more than `want` per call.
  virtual void wait(unsigned want) = 0;

  // A slot the kernel refused (not in flight): its chunk fails with `e`.
  void refuse(Slot& sl, int e, const std::string& what);
  // One completion of an in-flight slot with the kernel's result.
  void complete(Slot& sl, long res);
  // An in-flight slot whose completion cannot be had (the queue is gone).
  void lose(Slot& sl, int e, const std::string& why);
  // Submission retries left for the current burst (EINTR/EAGAIN/EBUSY).
  bool spin_submit();
  size_t index(const Slot& sl) const { return static_cast<size_t>(&sl - slots_.data()); }

  const Settings& s_;
  Counters& c_;
  FaultInjector& f_;
  const unsigned depth_;
  std::vector<Slot> slots_;
  std::vector<Slot*> pending_;  // filled or retried, not yet handed to the kernel
  unsigned inflight_ = 0;       // handed to the kernel, completion not yet taken
  int submit_spins_ = 0;

 private:
  bool admit();
  void start(const Slice& s);
  bool stage_ready(const Job& j);
  bool fill();
  char* take_stage(const Job& j);
  void grow_stage(uint64_t want);
  void release(Slot& sl);
  void finish_if_done(Job& j);
  void resume_short(Slot& sl, uint64_t got);
  void move_sync(const Slice& s);

  const uint64_t max_chunk_;
  SliceFeed* feed_ = nullptr;
  std::list<Job> jobs_;
  // Nodes of finished jobs, reused for the next (spliced, not allocated): a
  // worker that could not make one under memory pressure would lose a slice.
  std::list<Job> spare_;
  std::vector<Slot*> free_;
  // Staging for memory not aligned for O_DIRECT: areas of stage_chunk_
  // bytes, one per staged chunk in flight, made as they are needed (at most
  // queue_depth of them, and kStageBytes in all unless one chunk is larger).
  std::vector<std::unique_ptr<PinnedBuffer>> stage_;
  std::vector<char*> stage_free_;
  uint64_t stage_count_ = 0;
  uint64_t stage_chunk_ = 0;
  const Slice* held_ = nullptr;  // waits for the staging memory to be free
};

}  // namespace aio
