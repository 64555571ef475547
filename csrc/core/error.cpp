#include "error.h"

#include <cstring>
#include <sstream>

namespace aio {

std::string format_error(int err, const std::string& op, const std::string& path, int64_t offset,
                         uint64_t length, const std::string& detail) {
  std::ostringstream os;
  os << op << " failed";
  if (!path.empty()) os << " on '" << path << "'";
  if (length > 0 || offset > 0) os << " at offset " << offset << ", length " << length;
  os << ": ";
  if (err != 0) os << std::strerror(err);
  if (!detail.empty()) os << (err != 0 ? " (" : "") << detail << (err != 0 ? ")" : "");
  return os.str();
}

Error::Error(int err, std::string op, std::string path, int64_t offset, uint64_t length,
             std::string detail, bool eof)
    : std::runtime_error(format_error(err, op, path, offset, length, detail)),
      err_(err),
      op_(std::move(op)),
      path_(std::move(path)),
      offset_(offset),
      length_(length),
      detail_(std::move(detail)),
      eof_(eof) {}

}  // namespace aio
