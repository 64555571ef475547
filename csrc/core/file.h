// An open file as the engines see it: an O_DIRECT descriptor for the aligned
// middle of requests, and a buffered descriptor (opened on first need, from
// the first one, never by name again) for unaligned edges, resumed short
// transfers and filesystems without O_DIRECT.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "alignment.h"
#include "fault.h"

namespace aio {

class File {
 public:
  // Opens `path` for `op` (writes create the file, never truncate it). If the
  // filesystem rejects O_DIRECT the file is opened buffered and fell_back()
  // says so with the reason.
  static std::shared_ptr<File> open(const std::string& path, Op op, FaultInjector* faults);
  // Uses a duplicate of a descriptor the caller owns (the caller's own is
  // never closed here, and may be closed while I/O is in flight). Direct I/O
  // is used only if the caller opened it with O_DIRECT.
  static std::shared_ptr<File> adopt(int fd, Op op);

  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  int direct_fd() const { return direct_fd_; }
  // Buffered descriptor on the same file (the same inode, whatever has
  // happened to the name since); opened on first use.
  int buffered_fd();
  const Alignment& alignment() const { return align_; }
  bool fell_back() const { return fell_back_; }
  const std::string& fallback_reason() const { return fallback_reason_; }
  const std::string& path() const { return path_; }
  // Current size in bytes (regular files and block devices), -1 for others.
  int64_t size() const;
  // Identity of the file (st_dev, st_ino); both 0 if fstat failed. Requests
  // on the same identity are ordered when they overlap.
  uint64_t dev() const { return dev_; }
  uint64_t ino() const { return ino_; }

 private:
  File() = default;
  void use_buffered(int fd, const std::string& reason);
  void open_buffered_fallback(const std::string& reason);
  int reopen_buffered(int fd, bool interruptible);
  void note_identity(int fd);
  std::string path_;
  bool by_name_ = false;  // opened by path_ (not adopted): the name may be looked up again
  Op op_ = Op::Read;
  int direct_fd_ = -1;
  int buffered_fd_ = -1;
  bool owns_direct_ = false;
  bool owns_buffered_ = false;
  int open_flags_ = 0;
  Alignment align_;
  bool fell_back_ = false;
  std::string fallback_reason_;
  uint64_t dev_ = 0;
  uint64_t ino_ = 0;
  std::mutex mu_;
};

}  // namespace aio
