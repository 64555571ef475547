// The few io_uring kernel ABI definitions the io_uring engine uses. The
// system's <linux/io_uring.h> is used when it exists; otherwise (old or
// missing kernel headers) the definitions below stand in, so the package
// still builds with nothing but a C++17 compiler. They mirror the kernel's
// uapi layout exactly (checked by the static_asserts) and name only fields
// that exist since the operations used here (IORING_OP_READ/WRITE, 5.6).
#pragma once

#include <sys/syscall.h>

#include <cstdint>

#if __has_include(<linux/io_uring.h>) && !defined(AIO_OWN_IO_URING_ABI)
#include <linux/io_uring.h>
#else
struct io_uring_sqe {
  uint8_t opcode;
  uint8_t flags;
  uint16_t ioprio;
  int32_t fd;
  uint64_t off;
  uint64_t addr;
  uint32_t len;
  uint32_t rw_flags;
  uint64_t user_data;
  uint16_t buf_index;
  uint16_t personality;
  int32_t splice_fd_in;
  uint64_t pad2[2];
};

struct io_uring_cqe {
  uint64_t user_data;
  int32_t res;
  uint32_t flags;
};

struct io_sqring_offsets {
  uint32_t head, tail, ring_mask, ring_entries, flags, dropped, array, resv1;
  uint64_t resv2;
};

struct io_cqring_offsets {
  uint32_t head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1;
  uint64_t resv2;
};

struct io_uring_params {
  uint32_t sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd;
  uint32_t resv[3];
  struct io_sqring_offsets sq_off;
  struct io_cqring_offsets cq_off;
};

struct io_uring_probe_op {
  uint8_t op;
  uint8_t resv;
  uint16_t flags;
  uint32_t resv2;
};

struct io_uring_probe {
  uint8_t last_op;
  uint8_t ops_len;
  uint16_t resv;
  uint32_t resv2[3];
  struct io_uring_probe_op ops[1];  // really ops_len entries follow
};

#define IORING_OFF_SQ_RING 0ULL
#define IORING_OFF_CQ_RING 0x8000000ULL
#define IORING_OFF_SQES 0x10000000ULL
#define IORING_SETUP_CLAMP (1U << 4)
#define IORING_FEAT_SINGLE_MMAP (1U << 0)
#define IORING_ENTER_GETEVENTS (1U << 0)
#define IORING_REGISTER_PROBE 8
#define IO_URING_OP_SUPPORTED (1U << 0)
#define IORING_OP_READ 22
#define IORING_OP_WRITE 23

static_assert(sizeof(io_uring_sqe) == 64, "io_uring_sqe layout");
static_assert(sizeof(io_uring_cqe) == 16, "io_uring_cqe layout");
static_assert(sizeof(io_uring_params) == 120, "io_uring_params layout");
#endif

// Fixed buffers (5.13: IORING_REGISTER_BUFFERS2/_UPDATE; 5.19: sparse
// tables) and IORING_SETUP_COOP_TASKRUN (5.19). Defined here whatever the
// system header says, under their own names where they are structs, so older
// headers that lack them still build.
#ifndef IORING_OP_READ_FIXED
#define IORING_OP_READ_FIXED 4
#endif
#ifndef IORING_OP_WRITE_FIXED
#define IORING_OP_WRITE_FIXED 5
#endif
#ifndef IORING_UNREGISTER_BUFFERS
#define IORING_UNREGISTER_BUFFERS 1
#endif
#ifndef IORING_REGISTER_BUFFERS2
#define IORING_REGISTER_BUFFERS2 15
#endif
#ifndef IORING_REGISTER_BUFFERS_UPDATE
#define IORING_REGISTER_BUFFERS_UPDATE 16
#endif
#ifndef IORING_RSRC_REGISTER_SPARSE
#define IORING_RSRC_REGISTER_SPARSE (1U << 0)
#endif
#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif

// struct io_uring_rsrc_register
struct aio_uring_rsrc_register {
  uint32_t nr;
  uint32_t flags;
  uint64_t resv2;
  uint64_t data;
  uint64_t tags;
};
// struct io_uring_rsrc_update2
struct aio_uring_rsrc_update2 {
  uint32_t offset;
  uint32_t resv;
  uint64_t data;
  uint64_t tags;
  uint32_t nr;
  uint32_t resv2;
};
static_assert(sizeof(aio_uring_rsrc_register) == 32, "io_uring_rsrc_register layout");
static_assert(sizeof(aio_uring_rsrc_update2) == 32, "io_uring_rsrc_update2 layout");

// IORING_REGISTER_CLONE_BUFFERS (6.12) with IORING_REGISTER_DST_REPLACE
// (6.13): a ring's buffer table replaced by a copy of another ring's, under
// names of their own (an enum and a flag that older headers lack).
constexpr unsigned kAioRegisterCloneBuffers = 30;
constexpr uint32_t kAioCloneDstReplace = 1U << 1;
// struct io_uring_clone_buffers
struct aio_uring_clone_buffers {
  uint32_t src_fd;
  uint32_t flags;
  uint32_t src_off;
  uint32_t dst_off;
  uint32_t nr;
  uint32_t pad[3];
};
static_assert(sizeof(aio_uring_clone_buffers) == 32, "io_uring_clone_buffers layout");

// The syscall numbers are the same on every architecture but alpha (the
// syscalls were added after the tables were unified).
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif
