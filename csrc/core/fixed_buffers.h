// Pinned buffers that io_uring rings register once as fixed buffers, so I/O
// into them goes out as READ_FIXED / WRITE_FIXED and the kernel does not pin
// and unpin the pages on every I/O (256 pages for each 1 MiB chunk).
//
// Every PinnedBuffer made for I/O is added here and removed before its memory
// is unmapped; every live ring (one per io_uring worker) is told of each
// addition and removal as it happens, under one lock. A lookup takes the same
// lock, so what it answers for a ring is exactly what that ring's kernel
// table holds: an address reused by a new buffer can never reach the old
// buffer's registration.
//
// A buffer is registered (pinned, and for a user without CAP_IPC_LOCK
// charged to RLIMIT_MEMLOCK) on one ring; the other rings copy that ring's
// table (Holder::clone_from, Linux 6.13), which shares the registrations
// without charging them again. Where the kernel cannot clone, each ring
// registers the buffer itself, as before.
#pragma once

#include <errno.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace aio {

class FixedBuffers {
 public:
  // The kernel's table is sized once per ring (sparse registration); a
  // buffer added when every slot is taken is simply not fixed.
  static constexpr unsigned kSlots = 1024;
  // The kernel registers at most 1 GiB per slot: larger buffers take several.
  static constexpr size_t kMaxSlotBytes = size_t{1} << 30;

  // A ring that holds fixed buffers (implemented by the io_uring engine).
  class Holder {
   public:
    virtual ~Holder() = default;
    // Registers [base, base + len) in `slot`; returns 0 or the errno the
    // kernel refused with (the slot is then not used on this ring).
    virtual int register_slot(unsigned slot, void* base, size_t len) = 0;
    virtual void clear_slot(unsigned slot) = 0;
    // Makes this ring's table a copy of `src`'s (the same registrations,
    // pinned and charged once); 0 or errno, and the table is then unchanged.
    virtual int clone_from(Holder& src) {
      (void)src;
      return EOPNOTSUPP;
    }
    // A buffer this ring was refused (errno), for its statistics.
    virtual void refused(int err) { (void)err; }
  };

  // Adds a buffer to every ring, now and to come; returns a token for remove().
  static uint64_t add(void* base, size_t len);
  // Unregisters the buffer from every ring (before its memory goes).
  static void remove(uint64_t token);
  // Registers every live buffer on `h` and tells it of later ones; a ring
  // that cannot hold fixed buffers at all (kernel before 5.19) is not attached.
  static void attach(Holder* h);
  static void detach(Holder* h);
  // The slot holding [p, p + len) that is registered on `h`, or -1.
  static int find(const Holder* h, const void* p, size_t len);
  // Bytes added and live (statistics).
  static uint64_t bytes();
  // Test hook: make registrations fail with this errno (0 = off).
  static void set_register_fault(int err);
  // Test hook: false makes every ring register each buffer itself, as where
  // the kernel cannot clone a table (true again: clone where it can).
  static void set_clone(bool on);
};

}  // namespace aio
