// One error type for every failure in the core. It carries what a user needs
// to act on the failure (errno, operation, file, byte range); the bindings turn
// it into the matching built-in OSError subclass.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace aio {

class Error : public std::runtime_error {
 public:
  Error(int err, std::string op, std::string path, int64_t offset, uint64_t length,
        std::string detail = "", bool eof = false);

  int err() const noexcept { return err_; }
  const std::string& op() const noexcept { return op_; }
  const std::string& path() const noexcept { return path_; }
  int64_t offset() const noexcept { return offset_; }
  uint64_t length() const noexcept { return length_; }
  const std::string& detail() const noexcept { return detail_; }
  // True when the failure is a read past the end of the file (no errno from
  // the kernel: the file is simply shorter than the request).
  bool eof() const noexcept { return eof_; }

 private:
  int err_;
  std::string op_;
  std::string path_;
  int64_t offset_;
  uint64_t length_;
  std::string detail_;
  bool eof_;
};

// Formats "op failed on PATH at offset O, length L: strerror (detail)".
std::string format_error(int err, const std::string& op, const std::string& path, int64_t offset,
                         uint64_t length, const std::string& detail);

}  // namespace aio
