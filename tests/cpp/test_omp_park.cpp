// omp_park: a parked team through a stand-in for GOMP_parallel that records
// its calls and runs the job once per member; acquires share one team, the last release joins its
// thread, and a release racing the next acquire neither hangs nor leaks a parked thread.
#include <atomic>
#include <stdexcept>
#include <thread>

#include "check.h"
#include "omp_park.h"

namespace {

std::atomic<int> calls{0};
std::atomic<unsigned> last_threads{0};
std::thread::id caller;

void fake_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned) {
  ++calls;
  last_threads = num_threads;
  caller = std::this_thread::get_id();
  for (unsigned i = 0; i < num_threads; ++i) fn(data);  // every member, here one by one
}

template <class F>
bool throws_invalid_argument(F f) {
  try {
    f();
  } catch (const std::invalid_argument&) {
    return true;
  }
  return false;
}

}  // namespace

TEST(omp_park_shares_one_team_and_the_last_release_ends_it) {
  calls = 0;
  aio::omp_park_acquire(&fake_parallel, 3);
  CHECK_EQ(aio::omp_parked_threads(), 3u);
  CHECK(caller != std::this_thread::get_id());  // opened on the parked thread
  aio::omp_park_acquire(&fake_parallel, 5);     // shares the parked team
  CHECK_EQ(calls.load(), 1);
  aio::omp_park_release();
  CHECK_EQ(aio::omp_parked_threads(), 3u);
  aio::omp_park_release();
  CHECK_EQ(aio::omp_parked_threads(), 0u);
  aio::omp_park_release();  // one release too many: nothing to do
  CHECK_EQ(aio::omp_parked_threads(), 0u);
}

TEST(omp_park_release_then_acquire_at_once_does_not_hang) {
  calls = 0;
  for (int i = 0; i < 200; ++i) {
    aio::omp_park_acquire(&fake_parallel, 2);
    aio::omp_park_release();
  }
  CHECK_EQ(calls.load(), 200);
  CHECK_EQ(last_threads.load(), 2u);
  CHECK_EQ(aio::omp_parked_threads(), 0u);
}

TEST(omp_park_refuses_a_null_function_or_a_team_of_one) {
  CHECK(throws_invalid_argument([] { aio::omp_park_acquire(nullptr, 2); }));
  CHECK(throws_invalid_argument([] { aio::omp_park_acquire(&fake_parallel, 1); }));
  CHECK_EQ(aio::omp_parked_threads(), 0u);
}

namespace {

void short_team(void (*fn)(void*), void* data, unsigned, unsigned) { fn(data); }  // one member only

}  // namespace

TEST(omp_park_reports_the_members_the_runtime_gave) {
  aio::omp_park_acquire(&short_team, 4);
  CHECK_EQ(aio::omp_parked_threads(), 1u);
  aio::omp_park_release();
  CHECK_EQ(aio::omp_parked_threads(), 0u);
}
