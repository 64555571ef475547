#include <errno.h>
#include <unistd.h>

#include <string>
#include <thread>

#include "engine.h"
#include "error.h"

namespace aio {

void sync_transfer(File& file, Op op, bool direct, char* buf, uint64_t len, int64_t off,
                   Counters& c, FaultInjector& faults) {
  const size_t align = file.alignment().offset;
  uint64_t done = 0;
  int spins = 0;
  int zero_writes = 0;
  while (done < len) {
    // After a short unaligned transfer the rest can no longer go O_DIRECT;
    // finish it through the buffered descriptor.
    const bool use_direct = direct && file.direct_fd() >= 0 && (done % align == 0);
    const int fd = use_direct ? file.direct_fd() : file.buffered_fd();
    const uint64_t want = len - done;
    FaultAction fa = faults.on_io(op);
    ssize_t r;
    if (fa.kind == FaultKind::Error) {
      r = -1;
      errno = fa.errno_value;
    } else {
      r = op == Op::Read ? ::pread(fd, buf + done, want, off + static_cast<int64_t>(done))
                         : ::pwrite(fd, buf + done, want, off + static_cast<int64_t>(done));
      // Injected short transfer: the syscall moved everything, report an odd
      // (unaligned) part of it so the resume path below really runs.
      if (fa.kind == FaultKind::Short && r > 1) r = (r / 2) | 1;
    }
    if (r < 0) {
      const int e = errno;
      if ((e == EINTR || e == EAGAIN) && spins < kMaxRetries) {
        ++spins;
        c.retries.fetch_add(1, std::memory_order_relaxed);
        if (e == EAGAIN) std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      throw Error(e, op_name(op), file.path(), off + static_cast<int64_t>(done), want);
    }
    if (r == 0) {
      if (op == Op::Read)
        throw Error(ENODATA, "read", file.path(), off + static_cast<int64_t>(done), want,
                    "end of file reached after " + std::to_string(done) + " of " +
                        std::to_string(len) + " bytes",
                    true);
      if (++zero_writes > 2)
        throw Error(EIO, "write", file.path(), off + static_cast<int64_t>(done), want,
                    "the kernel accepted no bytes");
      continue;
    }
    if (static_cast<uint64_t>(r) < want) c.short_resumed.fetch_add(1, std::memory_order_relaxed);
    if (!use_direct)
      c.buffered_bytes.fetch_add(static_cast<uint64_t>(r), std::memory_order_relaxed);
    c.ios.fetch_add(1, std::memory_order_relaxed);
    done += static_cast<uint64_t>(r);
    spins = 0;
  }
}

}  // namespace aio
