// Allocation failure while a request is being queued (std::bad_alloc under
// memory pressure: RLIMIT_AS, a container's memory limit). The handle must
// count a request as outstanding only once it is queued: a count left behind
// by a submit that threw made drain(), the destructor and Python's exit-time
// drain wait forever.
//
// operator new is replaced for this whole test binary: it throws at the Nth
// allocation made by the thread that armed it (the workers are left alone),
// so each test can fail every allocation a submit makes, one at a time.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "check.h"
#include "handle.h"

namespace {

// 0: off; n > 0: the n-th allocation from now on this thread throws.
thread_local uint64_t t_fail_in = 0;
// While set, every allocation on any thread but an exempt one throws.
std::atomic<bool> g_fail_others{false};
thread_local bool t_exempt = false;

}  // namespace

// GCC sees the replaced delete inlined next to `new` and takes its free() for
// a mismatch; here the pair is malloc/free on purpose.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

void* operator new(std::size_t n) {
  if (t_fail_in != 0 && --t_fail_in == 0) throw std::bad_alloc();
  if (g_fail_others.load(std::memory_order_relaxed) && !t_exempt) throw std::bad_alloc();
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

constexpr uint64_t kFileBytes = 1 << 20;

std::string alloc_test_file(const std::string& engine) {
  const std::string path = "/tmp/aio-cpp-alloc-" + std::to_string(getpid()) + "-" + engine;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, kFileBytes) == 0);
  ::close(fd);
  return path;
}

std::unique_ptr<aio::Handle> alloc_test_handle(const std::string& engine) {
  aio::Settings s;
  s.block_size = 64 << 10;
  s.queue_depth = 4;
  s.thread_count = 2;  // a request of several tasks: one per worker
  try {
    return std::make_unique<aio::Handle>(s, engine);
  } catch (const aio::Error& e) {
    if (engine != "posix") SKIP(engine + " unavailable here: " + e.what());
    throw;
  }
}

// Submits `pieces` overlapping writes (pieces == 0: one plain submit) of an
// unaligned range -- a buffered head and tail, a direct middle split over the
// workers -- with the nth allocation of this thread failing. Returns whether
// the submit threw; *reached: whether it made n allocations at all.
bool submit_failing_at(aio::Handle& h, const std::string& path, char* buf, unsigned pieces,
                       uint64_t nth, bool* reached) {
  const uint64_t len = (256 << 10) + 3;
  const std::vector<int64_t> offsets(pieces, 513);  // overlapping: later ones wait
  bool threw = false;
  t_fail_in = nth;
  try {
    if (pieces == 0)
      h.submit(aio::Op::Write, buf, len, path, -1, 513)->wait_done();
    else
      h.submit_pieces(aio::Op::Write, buf, len, offsets, path, -1)->wait(-1);
  } catch (const std::bad_alloc&) {
    threw = true;
  }
  *reached = t_fail_in == 0;
  t_fail_in = 0;
  return threw;
}

// Fails each allocation of one submit in turn; after every failure nothing
// may stay counted (drain returns), and the handle keeps working.
void every_allocation_fails_once(const std::string& engine, unsigned pieces) {
  auto h = alloc_test_handle(engine);
  const std::string path = alloc_test_file(engine);
  std::vector<char> buf(((256 << 10) + 3) * (pieces ? pieces : 1), 'x');
  uint64_t nth = 1;
  for (;; ++nth) {
    REQUIRE(nth < 10000);
    bool reached = false;
    const bool threw = submit_failing_at(*h, path, buf.data(), pieces, nth, &reached);
    if (!h->drain_for(10.0)) {
      ::check::fail(__FILE__, __LINE__,
                    engine + ": still outstanding after allocation " + std::to_string(nth) +
                        " failed: " + std::to_string(h->stats().outstanding));
      // ~Handle would wait for it forever.
      (void)h.release();
      ::unlink(path.c_str());
      return;
    }
    CHECK_EQ(h->stats().outstanding, 0u);
    if (!threw) {
      CHECK(!reached);  // a failed allocation that did not surface
      break;
    }
  }
  CHECK(nth > 5);  // the loop went through the submit's allocations
  CHECK_EQ(h->stats().failed_requests, 0u);
  ::unlink(path.c_str());
}

}  // namespace

TEST(alloc_failure_in_submit_leaves_nothing_outstanding_kernel_aio) {
  every_allocation_fails_once("kernel_aio", 0);
}
TEST(alloc_failure_in_submit_leaves_nothing_outstanding_io_uring) {
  every_allocation_fails_once("io_uring", 0);
}
TEST(alloc_failure_in_submit_leaves_nothing_outstanding_posix) {
  every_allocation_fails_once("posix", 0);
}
TEST(alloc_failure_in_submit_pieces_leaves_nothing_outstanding_kernel_aio) {
  every_allocation_fails_once("kernel_aio", 3);
}
TEST(alloc_failure_in_submit_pieces_leaves_nothing_outstanding_io_uring) {
  every_allocation_fails_once("io_uring", 3);
}
TEST(alloc_failure_in_submit_pieces_leaves_nothing_outstanding_posix) {
  every_allocation_fails_once("posix", 3);
}

namespace {

// Aligned writes and reads, each split over both workers, waited for one by
// one. Returns the number of failed checks.
int aligned_round_trips(aio::Handle& h, const std::string& path, int rounds) {
  const uint64_t len = 256 << 10;
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, 2 * len) != 0) return 1;
  char* src = static_cast<char*>(mem);
  char* dst = src + len;
  int bad = 0;
  for (int i = 0; i < rounds; ++i) {
    std::memset(src, 'a' + i % 26, len);
    auto w = h.submit(aio::Op::Write, src, len, path, -1, 0);
    w->wait_done();
    auto r = h.submit(aio::Op::Read, dst, len, path, -1, 0);
    r->wait_done();
    bad += (w->error() || r->error() || std::memcmp(src, dst, len) != 0) ? 1 : 0;
  }
  std::free(mem);
  return bad;
}

// In a forked child (a worker that throws terminates the process): once warm,
// the workers must take and run tasks without allocating, for a worker that
// cannot allocate would lose the task it took. Exit status: 0 ok, 77 engine
// unavailable, else failed.
int workers_run_without_memory(const std::string& engine) {
  std::unique_ptr<aio::Handle> h;
  aio::Settings s;
  s.block_size = 64 << 10;
  s.queue_depth = 4;
  s.thread_count = 2;
  try {
    h = std::make_unique<aio::Handle>(s, engine);
  } catch (const aio::Error&) {
    return 77;
  }
  const std::string path = "/tmp/aio-cpp-alloc-w-" + std::to_string(getpid()) + "-" + engine;
  int bad = aligned_round_trips(*h, path, 3);  // warm: the engines' job nodes exist
  t_exempt = true;                             // this thread submits and checks
  g_fail_others.store(true);
  bad += aligned_round_trips(*h, path, 20);
  g_fail_others.store(false);
  h->drain();
  bad += h->stats().failed_requests != 0 || h->stats().outstanding != 0;
  ::unlink(path.c_str());
  return bad == 0 ? 0 : 1;
}

void workers_need_no_memory(const std::string& engine) {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    alarm(60);  // a lost task hangs: SIGALRM ends the child
    int rc = 1;
    try {
      rc = workers_run_without_memory(engine);
    } catch (...) {
    }
    _exit(rc);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) SKIP(engine + " unavailable here");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    ::check::fail(__FILE__, __LINE__,
                  engine + ": child " +
                      (WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                           : "exited " + std::to_string(WEXITSTATUS(status))));
}

}  // namespace

TEST(workers_take_and_run_tasks_without_allocating_kernel_aio) {
  workers_need_no_memory("kernel_aio");
}
TEST(workers_take_and_run_tasks_without_allocating_io_uring) { workers_need_no_memory("io_uring"); }
TEST(workers_take_and_run_tasks_without_allocating_posix) { workers_need_no_memory("posix"); }
