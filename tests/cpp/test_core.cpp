// Unit tests of csrc/core, linked directly (no Python, no pybind11), so they
// also run under AddressSanitizer/UndefinedBehaviorSanitizer
// (scripts/sanitize.sh). Files live in a fresh mkdtemp directory under /tmp.
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "check.h"
#include "engine.h"
#include "error.h"
#include "handle.h"
#include "pinned.h"

namespace {

constexpr uint64_t KiB = 1024, MiB = 1024 * 1024;
const char* const kEngines[] = {"kernel_aio", "posix", "io_uring"};

// A private directory for this run's files, removed at exit.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/aio-cpp-test-XXXXXX";
    if (!mkdtemp(tmpl)) {
      std::perror("mkdtemp");
      std::exit(2);
    }
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

TempDir& tmp() {
  static TempDir d;
  return d;
}

// n bytes at page alignment + misalign (2048 is what torch's CUDA pinned
// allocator hands out for small tensors).
struct Buffer {
  char* base = nullptr;
  char* p = nullptr;
  uint64_t n = 0;
  Buffer(uint64_t nbytes, size_t misalign) : n(nbytes) {
    void* b = nullptr;
    if (posix_memalign(&b, 4096, nbytes + 8192) != 0) throw std::bad_alloc();
    base = static_cast<char*>(b);
    p = base + misalign;
    std::memset(p, 0, nbytes);
  }
  ~Buffer() { std::free(base); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

void fill(char* p, uint64_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint64_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<char>(x >> 24);
  }
}

aio::Settings small_settings(unsigned threads) {
  aio::Settings s;
  s.block_size = 256 * KiB;  // several I/Os per slice for the larger sizes
  s.queue_depth = 4;
  s.thread_count = threads;
  return s;
}

// A handle on `engine`; skips the test where kernel AIO cannot be set up.
std::unique_ptr<aio::Handle> make_handle(const std::string& engine, unsigned threads) {
  try {
    return std::make_unique<aio::Handle>(small_settings(threads), engine);
  } catch (const aio::Error& e) {
    // Both are probed at runtime (kernel config, sysctl, seccomp).
    if (engine == "kernel_aio") SKIP(std::string("kernel AIO unavailable here: ") + e.what());
    if (engine == "io_uring") SKIP(std::string("io_uring unavailable here: ") + e.what());
    throw;
  }
}

// Submits and waits; the error, whether raised at submit or by the request.
std::optional<aio::Error> run(aio::Handle& h, aio::Op op, char* buf, uint64_t n,
                              const std::string& path, int64_t off) {
  try {
    auto req = h.submit(op, buf, n, path, -1, off);
    REQUIRE(req->wait(120.0));  // generous: only a hang fails here
    return req->error();
  } catch (const aio::Error& e) {
    return e;
  }
}

// The file's bytes, read with plain POSIX calls (independent of the core).
std::string file_bytes(const std::string& path) {
  std::string out;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  struct stat st;
  if (fstat(fd, &st) == 0) {
    out.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < out.size()) {
      ssize_t r = ::pread(fd, &out[got], out.size() - got, static_cast<off_t>(got));
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
    out.resize(got);
  }
  ::close(fd);
  return out;
}

// A fresh file of `size` zero bytes.
std::string fresh_file(const std::string& name, int64_t size) {
  const std::string path = tmp().file(name);
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, size) == 0);
  ::close(fd);
  return path;
}

// Writes then reads back every size/offset/buffer alignment combination and
// checks the file's bytes independently.
void roundtrip(const std::string& engine, unsigned threads) {
  auto h = make_handle(engine, threads);
  const uint64_t sizes[] = {0, 1, 4095, 4096, MiB + 3};
  const int64_t offsets[] = {0, 4096, 513};
  const size_t misaligns[] = {0, 1, 2048};
  int cases = 0;
  for (uint64_t n : sizes)
    for (int64_t off : offsets)
      for (size_t mis : misaligns) {
        const std::string ctx = engine + " threads=" + std::to_string(threads) +
                                " n=" + std::to_string(n) + " off=" + std::to_string(off) +
                                " misalign=" + std::to_string(mis);
        const std::string path = fresh_file("rt.bin", off);
        Buffer src(n, mis), dst(n, (mis + 1) % 4096);
        fill(src.p, n, n * 31 + static_cast<uint64_t>(off) + mis);
        auto werr = run(*h, aio::Op::Write, src.p, n, path, off);
        if (werr) ::check::fail(__FILE__, __LINE__, ctx + ": write failed: " + werr->what());
        auto rerr = run(*h, aio::Op::Read, dst.p, n, path, off);
        if (rerr) ::check::fail(__FILE__, __LINE__, ctx + ": read failed: " + rerr->what());
        if (std::memcmp(src.p, dst.p, n) != 0)
          ::check::fail(__FILE__, __LINE__, ctx + ": data read back differs");
        const std::string disk = file_bytes(path);
        if (disk.size() != static_cast<size_t>(off) + n ||
            disk.compare(static_cast<size_t>(off), n, src.p, n) != 0 ||
            disk.find_first_not_of('\0') < static_cast<size_t>(off))
          ::check::fail(__FILE__, __LINE__, ctx + ": file contents differ");
        ++cases;
      }
  CHECK_EQ(cases, 45);
  h->drain();
  const aio::Stats st = h->stats();
  CHECK_EQ(st.failed_requests, 0u);
  CHECK_EQ(st.outstanding, 0u);
  CHECK_EQ(st.engine, engine);
}

TEST(roundtrip_kernel_aio_1_thread) { roundtrip("kernel_aio", 1); }
TEST(roundtrip_kernel_aio_4_threads) { roundtrip("kernel_aio", 4); }
TEST(roundtrip_io_uring_1_thread) { roundtrip("io_uring", 1); }
TEST(roundtrip_io_uring_4_threads) { roundtrip("io_uring", 4); }
TEST(roundtrip_posix_1_thread) { roundtrip("posix", 1); }
TEST(roundtrip_posix_4_threads) { roundtrip("posix", 4); }

TEST(engines_are_registered_and_unknown_one_refused) {
  const auto names = aio::engine_names();
  CHECK(std::find(names.begin(), names.end(), "posix") != names.end());
  CHECK(std::find(names.begin(), names.end(), "kernel_aio") != names.end());
  CHECK(std::find(names.begin(), names.end(), "io_uring") != names.end());
  bool raised = false;
  try {
    aio::Handle h(small_settings(1), "no_such_engine");
  } catch (const aio::Error& e) {
    raised = true;
    CHECK_EQ(e.err(), EINVAL);
    CHECK(std::string(e.what()).find("no_such_engine") != std::string::npos);
  }
  CHECK(raised);
}

TEST(missing_file_error_has_errno_path_and_range) {
  for (const char* engine : {"posix"}) {
    auto h = make_handle(engine, 2);
    Buffer b(8192, 0);
    const std::string path = tmp().file("does-not-exist.bin");
    auto err = run(*h, aio::Op::Read, b.p, 8192, path, 0);
    REQUIRE(err.has_value());
    CHECK_EQ(err->err(), ENOENT);
    CHECK_EQ(err->path(), path);
    // The open failed, not a transfer: no byte range beyond the request's.
    CHECK_EQ(err->op().rfind("open", 0), 0u);
    CHECK_EQ(err->offset(), 0);
    CHECK(err->length() <= 8192u);
    CHECK(!err->eof());
    CHECK(std::string(err->what()).find(path) != std::string::npos);
  }
}

TEST(read_past_eof_error_has_path_and_range) {
  for (const char* engine : kEngines) {
    std::unique_ptr<aio::Handle> h;
    try {
      h = make_handle(engine, 2);
    } catch (const ::check::Skip&) {
      continue;  // kernel AIO or io_uring missing: the posix pass still runs
    }
    const std::string path = fresh_file("short.bin", 4096);
    Buffer b(8192, 0);
    auto err = run(*h, aio::Op::Read, b.p, 8192, path, 0);
    REQUIRE(err.has_value());
    CHECK(err->eof());
    CHECK_EQ(err->err(), ENODATA);
    CHECK_EQ(err->path(), path);
    CHECK_EQ(err->offset(), 0);
    CHECK_EQ(err->length(), 8192u);
  }
}

// An injected EIO surfaces as an aio::Error inside the request's range, and
// the handle stays usable afterwards.
void injected_eio(const std::string& engine, aio::Op op) {
  auto h = make_handle(engine, 2);
  const uint64_t n = 2 * MiB;
  const std::string path = fresh_file("eio.bin", 0);
  Buffer src(n, 0), dst(n, 0);
  fill(src.p, n, 7);
  REQUIRE(!run(*h, aio::Op::Write, src.p, n, path, 0));
  h->faults().arm(aio::FaultKind::Error, EIO, op == aio::Op::Read ? 0 : 1, 3, 1);
  auto err = run(*h, op, op == aio::Op::Read ? dst.p : src.p, n, path, 0);
  REQUIRE(err.has_value());
  CHECK_EQ(err->err(), EIO);
  CHECK_EQ(err->path(), path);
  CHECK_EQ(err->op(), std::string(aio::op_name(op)));
  CHECK(err->length() > 0);
  CHECK(err->offset() >= 0 && static_cast<uint64_t>(err->offset()) + err->length() <= n);
  CHECK_EQ(h->faults().hits(), 1u);
  h->drain();
  CHECK_EQ(h->stats().failed_requests, 1u);
  h->faults().disarm();
  std::memset(dst.p, 0, n);
  CHECK(!run(*h, aio::Op::Read, dst.p, n, path, 0));
  CHECK(std::memcmp(src.p, dst.p, n) == 0);
}

TEST(injected_eio_kernel_aio_read) { injected_eio("kernel_aio", aio::Op::Read); }
TEST(injected_eio_kernel_aio_write) { injected_eio("kernel_aio", aio::Op::Write); }
TEST(injected_eio_io_uring_read) { injected_eio("io_uring", aio::Op::Read); }
TEST(injected_eio_io_uring_write) { injected_eio("io_uring", aio::Op::Write); }
TEST(injected_eio_posix_read) { injected_eio("posix", aio::Op::Read); }
TEST(injected_eio_posix_write) { injected_eio("posix", aio::Op::Write); }

// Short transfers (kind Short) are resumed and EINTR (kind Error, EINTR) is
// retried: the request succeeds and the data is intact.
void recovered_fault(const std::string& engine, aio::Op op, aio::FaultKind kind, int err) {
  auto h = make_handle(engine, 2);
  const uint64_t n = 3 * MiB + 5;
  const int64_t off = 4096;
  const std::string path = fresh_file("recover.bin", off);
  Buffer src(n, 0), dst(n, 0);
  fill(src.p, n, 11);
  if (op == aio::Op::Read) REQUIRE(!run(*h, aio::Op::Write, src.p, n, path, off));
  h->faults().arm(kind, err, op == aio::Op::Read ? 0 : 1, 2, 3);
  auto e = run(*h, op, op == aio::Op::Read ? dst.p : src.p, n, path, off);
  if (e) ::check::fail(__FILE__, __LINE__, std::string("fault not recovered: ") + e->what());
  CHECK(h->faults().hits() >= 1u);
  const aio::Stats st = h->stats();
  if (kind == aio::FaultKind::Short) CHECK(st.short_resumed >= 1u);
  if (kind == aio::FaultKind::Error) CHECK(st.retries >= 1u);
  h->faults().disarm();
  if (op == aio::Op::Write) REQUIRE(!run(*h, aio::Op::Read, dst.p, n, path, off));
  CHECK(std::memcmp(src.p, dst.p, n) == 0);
  const std::string disk = file_bytes(path);
  CHECK_EQ(disk.size(), static_cast<size_t>(off) + n);
  CHECK(disk.compare(static_cast<size_t>(off), n, src.p, n) == 0);
}

TEST(short_resumed_kernel_aio) {
  recovered_fault("kernel_aio", aio::Op::Read, aio::FaultKind::Short, 0);
  recovered_fault("kernel_aio", aio::Op::Write, aio::FaultKind::Short, 0);
}
TEST(short_resumed_io_uring) {
  recovered_fault("io_uring", aio::Op::Read, aio::FaultKind::Short, 0);
  recovered_fault("io_uring", aio::Op::Write, aio::FaultKind::Short, 0);
}
TEST(short_resumed_posix) {
  recovered_fault("posix", aio::Op::Read, aio::FaultKind::Short, 0);
  recovered_fault("posix", aio::Op::Write, aio::FaultKind::Short, 0);
}
TEST(eintr_retried_kernel_aio) {
  recovered_fault("kernel_aio", aio::Op::Read, aio::FaultKind::Error, EINTR);
  recovered_fault("kernel_aio", aio::Op::Write, aio::FaultKind::Error, EINTR);
}
TEST(eintr_retried_io_uring) {
  recovered_fault("io_uring", aio::Op::Read, aio::FaultKind::Error, EINTR);
  recovered_fault("io_uring", aio::Op::Write, aio::FaultKind::Error, EINTR);
}
TEST(eintr_retried_posix) {
  recovered_fault("posix", aio::Op::Read, aio::FaultKind::Error, EINTR);
  recovered_fault("posix", aio::Op::Write, aio::FaultKind::Error, EINTR);
}

TEST(pinned_buffer_unlocked_is_page_aligned) {
  aio::PinnedBuffer b(10000, false);
  CHECK(!b.locked());
  CHECK_EQ(b.size(), 10000u);
  CHECK_EQ(reinterpret_cast<uintptr_t>(b.data()) % 4096, 0u);
  std::memset(b.data(), 0x5a, b.size());  // the whole size is usable
}

TEST(pinned_buffer_lock_failure_is_an_error) {
  const uint64_t before = aio::PinnedBuffer::total_locked_bytes();
  aio::PinnedBuffer::set_lock_fault(ENOMEM);
  bool raised = false;
  try {
    aio::PinnedBuffer b(8192, true);
  } catch (const aio::Error& e) {
    raised = true;
    CHECK_EQ(e.err(), ENOMEM);
    CHECK_EQ(e.length(), 8192u);
    CHECK(std::string(e.what()).find("RLIMIT_MEMLOCK") != std::string::npos);
  }
  aio::PinnedBuffer::set_lock_fault(0);
  CHECK(raised);
  CHECK_EQ(aio::PinnedBuffer::total_locked_bytes(), before);
}

TEST(pinned_buffer_locked_is_accounted) {
  const uint64_t before = aio::PinnedBuffer::total_locked_bytes();
  std::unique_ptr<aio::PinnedBuffer> b;
  try {
    b = std::make_unique<aio::PinnedBuffer>(5000, true);
  } catch (const aio::Error& e) {
    SKIP(std::string("cannot mlock here: ") + e.what());
  }
  CHECK(b->locked());
  CHECK_EQ(aio::PinnedBuffer::total_locked_bytes(), before + 8192);
  b.reset();
  CHECK_EQ(aio::PinnedBuffer::total_locked_bytes(), before);
}

TEST(pinned_mapping_is_whole_huge_pages_where_that_is_cheap) {
  const size_t huge = size_t{2} << 20, ps = aio::page_size();
  CHECK_EQ(aio::mapped_size(5000), 8192u);
  CHECK_EQ(aio::mapped_size(huge + ps), huge + ps);        // doubling it: whole pages only
  CHECK_EQ(aio::mapped_size(16007168), size_t{16} << 20);  // four 4 MB slots: +4.8 %
  const uint64_t before = aio::PinnedBuffer::total_locked_bytes();
  std::unique_ptr<aio::PinnedBuffer> b;
  try {
    b = std::make_unique<aio::PinnedBuffer>(16007168, true);
  } catch (const aio::Error& e) {
    SKIP(std::string("cannot mlock here: ") + e.what());
  }
  CHECK_EQ(b->size(), 16007168u);  // what was asked for; the whole mapping is locked
  CHECK_EQ(aio::PinnedBuffer::total_locked_bytes(), before + (size_t{16} << 20));
}

TEST(pinned_pool_leases_distinct_aligned_slots) {
  aio::PinnedPool pool(3, 5000, false);
  CHECK_EQ(pool.count(), 3u);
  CHECK_EQ(pool.slot_bytes(), 8192u);  // rounded up to whole pages
  CHECK(pool.total_bytes() >= 3 * 8192u);
  CHECK_EQ(pool.available(), 3u);
  std::set<long> got;
  for (int i = 0; i < 3; ++i) got.insert(pool.acquire(0));
  CHECK_EQ(got.size(), 3u);
  CHECK(*got.begin() == 0 && *got.rbegin() == 2);
  CHECK_EQ(pool.available(), 0u);
  CHECK_EQ(pool.acquire(0), -1L);  // none free: times out at once
  for (long i : got) {
    const auto a = reinterpret_cast<uintptr_t>(pool.slot(static_cast<size_t>(i)));
    CHECK_EQ(a % 4096, 0u);
    std::memset(pool.slot(static_cast<size_t>(i)), static_cast<int>(i), pool.slot_bytes());
  }
  for (long i : got)
    CHECK_EQ(static_cast<char*>(pool.slot(static_cast<size_t>(i)))[8191], static_cast<char>(i));
  pool.release(1);
  CHECK_EQ(pool.available(), 1u);
  CHECK_EQ(pool.acquire(0), 1L);
  for (long i : got) pool.release(static_cast<size_t>(i));
  CHECK_EQ(pool.available(), 3u);
}

}  // namespace

int main() { return ::check::run_all(); }
