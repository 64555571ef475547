#include "file.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "error.h"
#include "interrupt.h"

namespace aio {

// Retries EINTR. On the submitting thread (interruptible) the caller's
// signal handlers run first: open() of a FIFO with no writer blocks until a
// signal, and Ctrl-C must get out. Worker threads never call the hook.
static int open_retry(const char* path, int flags, mode_t mode, bool interruptible = true) {
  int fd;
  while ((fd = ::open(path, flags, mode)) < 0 && errno == EINTR)
    if (interruptible) check_interrupt();
  return fd;
}

static int base_flags(Op op) {
  return (op == Op::Read ? O_RDONLY : (O_WRONLY | O_CREAT)) | O_CLOEXEC;
}

static const char* open_name(Op op) { return op == Op::Read ? "open for read" : "open for write"; }

// A directory opens read-only (and refuses O_DIRECT with EINVAL, like a
// filesystem without direct I/O): name it for what it is, before anything is
// taken for a buffered fallback.
static void refuse_directory(int fd, Op op, const std::string& path) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode)) return;
  ::close(fd);
  throw Error(EISDIR, open_name(op), path, 0, 0);
}

void File::use_buffered(int fd, const std::string& reason) {
  buffered_fd_ = fd;
  owns_buffered_ = true;
  fell_back_ = true;
  fallback_reason_ = reason;
  align_ = Alignment{1, 1, false, "buffered"};
}

void File::open_buffered_fallback(const std::string& reason) {
  const int fd = open_retry(path_.c_str(), open_flags_, 0644);
  if (fd < 0) throw Error(errno, open_name(op_), path_, 0, 0);
  refuse_directory(fd, op_, path_);
  use_buffered(fd, reason);
}

// A second, buffered descriptor on the file `fd` is open on, reached through
// /proc/self/fd (the open file's inode), never by the name again: the name
// may have been renamed, replaced or unlinked since `fd` was opened, and the
// unaligned edges of a request must land in the same file as its middle.
int File::reopen_buffered(int fd, bool interruptible) {
  const std::string self = "/proc/self/fd/" + std::to_string(fd);
  int b = open_retry(self.c_str(), open_flags_ & ~O_CREAT, 0, interruptible);
  // No procfs mounted (a bare chroot): the name again, for a file we opened
  // by name, and the identity check below refuses another file there.
  if (b < 0 && errno == ENOENT && by_name_)
    b = open_retry(path_.c_str(), open_flags_ & ~O_CREAT, 0, interruptible);
  if (b < 0) throw Error(errno, "open (buffered)", path_, 0, 0);
  // Without procfs mounted there, that name could be anything.
  struct stat st;
  if (ino_ != 0 && (fstat(b, &st) != 0 || static_cast<uint64_t>(st.st_dev) != dev_ ||
                    static_cast<uint64_t>(st.st_ino) != ino_)) {
    ::close(b);
    throw Error(ESTALE, "open (buffered)", path_, 0, 0,
                "reopening through " + self + " did not give the same file");
  }
  return b;
}

std::shared_ptr<File> File::open(const std::string& path, Op op, FaultInjector* faults) {
  // c_str() would silently cut the path at the NUL and open another file.
  if (path.find('\0') != std::string::npos)
    throw Error(EINVAL, open_name(op), path.substr(0, path.find('\0')), 0, 0,
                "the path contains a NUL byte");
  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->by_name_ = true;
  f->op_ = op;
  f->open_flags_ = base_flags(op);

  FaultAction a;
  if (faults) a = faults->on_open_direct(op);
  int fd = -1;
  int err = 0;
  if (a.kind == FaultKind::OpenDirect) {
    err = a.errno_value;
  } else {
    fd = open_retry(path.c_str(), f->open_flags_ | O_DIRECT, 0644);
    if (fd < 0) err = errno;
  }
  if (fd >= 0) {
    refuse_directory(fd, op, path);
    f->direct_fd_ = fd;
    f->owns_direct_ = true;
    f->align_ = probe_alignment(fd);
    if (a.kind == FaultKind::NoDirectStatx) f->align_.direct_supported = false;
    f->note_identity(fd);
    if (!f->align_.direct_supported) {
      // The descriptor is valid but direct I/O on it is not: swap it for a
      // buffered one on the same file (e.g. ext4 data=journal).
      const int b = f->reopen_buffered(fd, true);
      ::close(fd);
      f->direct_fd_ = -1;
      f->owns_direct_ = false;
      f->use_buffered(b, "the filesystem reports no direct-I/O support for this file (statx)");
    }
    return f;
  }
  // EINVAL is how open() says "this filesystem does not do O_DIRECT"; anything
  // else (ENOENT, EACCES, ...) is a real error for the caller.
  if (err != EINVAL) throw Error(err, open_name(op), path, 0, 0);
  f->open_buffered_fallback("the filesystem rejected O_DIRECT (EINVAL at open)");
  f->note_identity(f->buffered_fd_);
  return f;
}

void File::note_identity(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return;
  dev_ = static_cast<uint64_t>(st.st_dev);
  ino_ = static_cast<uint64_t>(st.st_ino);
}

std::shared_ptr<File> File::adopt(int fd, Op op) {
  const std::string name = "fd " + std::to_string(fd);
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0) throw Error(errno, "fcntl(F_GETFL)", name, 0, 0);
  int acc = fl & O_ACCMODE;
  if ((op == Op::Read && acc == O_WRONLY) || (op == Op::Write && acc == O_RDONLY))
    throw Error(EBADF, op == Op::Read ? "read" : "write", name, 0, 0,
                "descriptor not open for this operation");
  // The kernel puts every write on an O_APPEND descriptor at the end of the
  // file, whatever offset it names (pwrite, kernel AIO and io_uring alike):
  // the request would land elsewhere than asked, silently.
  if (op == Op::Write && (fl & O_APPEND))
    throw Error(EINVAL, "write", name, 0, 0,
                "the descriptor is open with O_APPEND, so every write would go to the end of "
                "the file instead of its offset; pass a descriptor opened without O_APPEND "
                "(or the path)");
  std::shared_ptr<File> f(new File());
  f->path_ = name;
  f->op_ = op;
  f->open_flags_ = acc | O_CLOEXEC;
  // Our own descriptor on the caller's open file: the caller may close its
  // number while chunks are in flight, and the number may then be reused
  // for another file. The duplicate lives (and is closed) with the File.
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) throw Error(errno, "fcntl(F_DUPFD_CLOEXEC)", name, 0, 0);
  if (fl & O_DIRECT) {
    f->direct_fd_ = own;
    f->owns_direct_ = true;
    f->align_ = probe_alignment(own);
  } else {
    // The caller chose buffered I/O; honour it.
    f->buffered_fd_ = own;
    f->owns_buffered_ = true;
    f->align_ = Alignment{1, 1, false, "buffered"};
  }
  f->note_identity(own);
  return f;
}

int File::buffered_fd() {
  std::lock_guard<std::mutex> g(mu_);
  if (buffered_fd_ >= 0) return buffered_fd_;
  // On a worker: never interrupted (the caller's signal hooks are not ours to run).
  buffered_fd_ = reopen_buffered(direct_fd_, false);
  owns_buffered_ = true;
  return buffered_fd_;
}

int64_t File::size() const {
  const int fd = direct_fd_ >= 0 ? direct_fd_ : buffered_fd_;
  if (fd < 0) throw Error(EBADF, "fstat", path_, 0, 0, "internal: file has no open descriptor");
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
