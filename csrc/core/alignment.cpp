// Uses the kernel's <linux/stat.h> and a raw statx syscall rather than glibc's
// wrapper: older glibc headers lack the stx_dio_* fields, and including both
// definitions of struct statx conflicts.
#include "alignment.h"

#include <fcntl.h>
#include <linux/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#endif

namespace aio {

size_t page_size() {
  static const size_t ps = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return ps;
}

static size_t read_sysfs_size(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return 0;
  unsigned long v = 0;
  int n = std::fscanf(f, "%lu", &v);
  std::fclose(f);
  return n == 1 ? static_cast<size_t>(v) : 0;
}

Alignment probe_alignment(int fd) {
  Alignment a;
  struct statx sx{};
  long rc = syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN | STATX_TYPE, &sx);
  if (rc == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
    if (sx.stx_dio_offset_align == 0) {
      // The kernel says: this file does not support direct I/O at all.
      a.direct_supported = false;
      a.offset = a.memory = 1;
      a.source = "statx";
      return a;
    }
    a.offset = sx.stx_dio_offset_align;
    a.memory = sx.stx_dio_mem_align ? sx.stx_dio_mem_align : sx.stx_dio_offset_align;
    a.source = "statx";
    return a;
  }
  if (rc == 0) {
    // Device's logical block size: for a regular file, that of the device
    // holding it; for a block device, its own. Partitions have no queue/ dir,
    // so also try the parent disk's.
    unsigned maj, min;
    if ((sx.stx_mode & 0170000) == 0060000) {  // S_IFBLK
      maj = sx.stx_rdev_major;
      min = sx.stx_rdev_minor;
    } else {
      maj = sx.stx_dev_major;
      min = sx.stx_dev_minor;
    }
    std::string base = "/sys/dev/block/" + std::to_string(maj) + ":" + std::to_string(min);
    size_t lbs = read_sysfs_size(base + "/queue/logical_block_size");
    if (lbs == 0) lbs = read_sysfs_size(base + "/../queue/logical_block_size");
    if (lbs > 0) {
      a.offset = a.memory = lbs;
      a.source = "block-device";
      return a;
    }
  }
  a.offset = a.memory = 4096;
  a.source = "default";
  return a;
}

}  // namespace aio
