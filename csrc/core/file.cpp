#include "file.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "error.h"

namespace aio {

static int open_retry(const char* path, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::open(path, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

static int base_flags(Op op) {
  return (op == Op::Read ? O_RDONLY : (O_WRONLY | O_CREAT)) | O_CLOEXEC;
}

std::shared_ptr<File> File::open(const std::string& path, Op op, FaultInjector* faults) {
  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->op_ = op;
  f->open_flags_ = base_flags(op);
  const char* opname = op == Op::Read ? "open for read" : "open for write";

  int injected = 0;
  if (faults) {
    FaultAction a = faults->on_open_direct(op);
    if (a.kind == FaultKind::OpenDirect) injected = a.errno_value;
  }
  int fd = -1;
  int err = 0;
  if (injected) {
    err = injected;
  } else {
    fd = open_retry(path.c_str(), f->open_flags_ | O_DIRECT, 0644);
    if (fd < 0) err = errno;
  }
  if (fd >= 0) {
    f->direct_fd_ = fd;
    f->owns_direct_ = true;
    f->align_ = probe_alignment(fd);
    if (!f->align_.direct_supported) {
      ::close(fd);
      f->direct_fd_ = -1;
      f->owns_direct_ = false;
      f->fell_back_ = true;
      f->fallback_reason_ = "the filesystem reports no direct-I/O support for this file (statx)";
    }
    return f;
  }
  // EINVAL is how open() says "this filesystem does not do O_DIRECT"; anything
  // else (ENOENT, EACCES, ...) is a real error for the caller.
  if (err != EINVAL) throw Error(err, opname, path, 0, 0);
  fd = open_retry(path.c_str(), f->open_flags_, 0644);
  if (fd < 0) throw Error(errno, opname, path, 0, 0);
  f->buffered_fd_ = fd;
  f->owns_buffered_ = true;
  f->fell_back_ = true;
  f->fallback_reason_ = "the filesystem rejected O_DIRECT (EINVAL at open)";
  f->align_ = Alignment{1, 1, false, "buffered"};
  return f;
}

std::shared_ptr<File> File::adopt(int fd, Op op) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0) throw Error(errno, "fcntl(F_GETFL)", "fd " + std::to_string(fd), 0, 0);
  int acc = fl & O_ACCMODE;
  if ((op == Op::Read && acc == O_WRONLY) || (op == Op::Write && acc == O_RDONLY))
    throw Error(EBADF, op == Op::Read ? "read" : "write", "fd " + std::to_string(fd), 0, 0,
                "descriptor not open for this operation");
  std::shared_ptr<File> f(new File());
  f->path_ = "fd " + std::to_string(fd);
  f->op_ = op;
  f->adopted_fd_ = fd;
  f->open_flags_ = (fl & O_ACCMODE) | O_CLOEXEC;
  if (fl & O_DIRECT) {
    f->direct_fd_ = fd;
    f->align_ = probe_alignment(fd);
  } else {
    // The caller chose buffered I/O; honour it.
    f->buffered_fd_ = fd;
    f->align_ = Alignment{1, 1, false, "buffered"};
  }
  return f;
}

int File::buffered_fd() {
  std::lock_guard<std::mutex> g(mu_);
  if (buffered_fd_ >= 0) return buffered_fd_;
  std::string p = adopted_fd_ >= 0 ? "/proc/self/fd/" + std::to_string(adopted_fd_) : path_;
  int fd = open_retry(p.c_str(), open_flags_ & ~O_CREAT, 0);
  if (fd < 0) throw Error(errno, "open (buffered)", path_, 0, 0);
  buffered_fd_ = fd;
  owns_buffered_ = true;
  return fd;
}

int64_t File::size() const {
  int fd = direct_fd_ >= 0 ? direct_fd_ : buffered_fd_;
  struct stat st;
  if (fstat(fd, &st) != 0) throw Error(errno, "fstat", path_, 0, 0);
  if (S_ISBLK(st.st_mode)) {
    uint64_t bytes = 0;
    if (ioctl(fd, BLKGETSIZE64, &bytes) != 0)
      throw Error(errno, "ioctl(BLKGETSIZE64)", path_, 0, 0);
    return static_cast<int64_t>(bytes);
  }
  if (!S_ISREG(st.st_mode)) return -1;
  return st.st_size;
}

File::~File() {
  if (owns_direct_ && direct_fd_ >= 0) ::close(direct_fd_);
  if (owns_buffered_ && buffered_fd_ >= 0) ::close(buffered_fd_);
}

}  // namespace aio
