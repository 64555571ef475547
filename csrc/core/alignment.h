// Direct-I/O alignment of an open file: what O_DIRECT requires of the file
// offset/length and of the memory address.
#pragma once

#include <cstddef>
#include <string>

namespace aio {

struct Alignment {
  size_t offset = 4096;  // file offset and length granularity
  size_t memory = 4096;  // buffer address granularity
  bool direct_supported = true;
  std::string source;  // "statx", "block-device", "default"
};

// statx(STATX_DIOALIGN) where the kernel reports it (Linux 6.1+), else the
// logical block size of the backing device, else 4096.
Alignment probe_alignment(int fd);

size_t page_size();

}  // namespace aio
