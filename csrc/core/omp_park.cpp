// See omp_park.h.
#include "omp_park.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace aio {
namespace {

// Each member of the parked team counts itself: the runtime may give fewer
// threads than asked (OMP_THREAD_LIMIT, OMP_DYNAMIC).
void count_member(void* members) { static_cast<std::atomic<unsigned>*>(members)->fetch_add(1); }

struct Parked {
  std::mutex mu;
  std::condition_variable cv;
  unsigned count = 0;             // acquires not yet released
  unsigned threads = 0;           // the parked team's members, 0 until it stands
  uint64_t generation = 0;        // moves on when a parked thread is told to go
  pid_t owner = 0;                // the process that started the thread
  std::thread* thread = nullptr;  // leaked, not destroyed, in a forked child
};

Parked& parked() {
  static Parked* p = new Parked();  // never destroyed: a thread may outlive exit
  return *p;
}

// Body of the parked thread: open the team, tell the acquirers how many it
// got, sleep until the generation it was started in is over (a flag could
// be reset by the next acquire before this thread saw it).
void park(ParallelFn parallel, unsigned threads, uint64_t generation) {
  std::atomic<unsigned> members{0};
  parallel(&count_member, &members, threads, 0);  // its workers stay in the runtime's pool
  Parked& p = parked();
  std::unique_lock<std::mutex> lk(p.mu);
  if (p.generation == generation) p.threads = members.load();
  p.cv.notify_all();
  p.cv.wait(lk, [&] { return p.generation != generation; });
}

// A child forked while a team was parked has none of its threads.
void forget_if_forked(Parked& p) {
  if (p.thread != nullptr && p.owner != getpid()) {
    p.thread = nullptr;  // leaked: destroying a joinable std::thread terminates
    p.count = 0;
    p.threads = 0;
  }
}

}  // namespace

void omp_park_acquire(ParallelFn parallel, unsigned threads) {
  if (parallel == nullptr) throw std::invalid_argument("omp_park_acquire: no parallel function");
  if (threads < 2) throw std::invalid_argument("omp_park_acquire: a team needs at least 2 threads");
  Parked& p = parked();
  std::unique_lock<std::mutex> lk(p.mu);
  forget_if_forked(p);
  if (p.count == 0) {
    // The thread first: if it cannot be made nothing has changed.
    p.thread = new std::thread(park, parallel, threads, p.generation);
    p.threads = 0;
    p.owner = getpid();
  }
  ++p.count;
  p.cv.wait(lk, [&] { return p.threads != 0; });  // every acquirer: the team stands
}

void omp_park_release() {
  Parked& p = parked();
  std::thread* t = nullptr;
  {
    std::lock_guard<std::mutex> lk(p.mu);
    forget_if_forked(p);
    if (p.thread == nullptr || p.count == 0) return;
    if (--p.count > 0) return;
    ++p.generation;
    p.threads = 0;
    std::swap(t, p.thread);
  }
  p.cv.notify_all();
  t->join();  // the thread's team ends with it
  delete t;
}

unsigned omp_parked_threads() {
  Parked& p = parked();
  std::lock_guard<std::mutex> lk(p.mu);
  return p.owner == getpid() ? p.threads : 0;
}

}  // namespace aio
