// FixedBuffers (csrc/core/fixed_buffers.h) with a recording holder in place
// of an io_uring ring: slots, splitting at 1 GiB, exhaustion, refusal, removal
// and address reuse. Addresses are never touched, so none are allocated.
#include <errno.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "error.h"
#include "fixed_buffers.h"
#include "pinned.h"

namespace {

using aio::FixedBuffers;
constexpr size_t GiB = size_t{1} << 30;

// Records what is registered per slot, as the kernel's table would hold it.
struct Recorder : FixedBuffers::Holder {
  std::map<unsigned, std::pair<char*, size_t>> slots;
  int refuse = 0;  // errno every registration fails with (0: accept)
  int registrations = 0;
  std::vector<int> refusals;  // errnos told by refused()
  int register_slot(unsigned slot, void* base, size_t len) override {
    if (refuse) return refuse;
    ++registrations;
    slots[slot] = {static_cast<char*>(base), len};
    return 0;
  }
  void clear_slot(unsigned slot) override { slots.erase(slot); }
  void refused(int err) override { refusals.push_back(err); }
};

// A ring that can copy another's table, as IORING_REGISTER_CLONE_BUFFERS does.
struct Cloner : Recorder {
  int clones = 0;
  int refuse_clone = 0;
  int clone_from(FixedBuffers::Holder& src) override {
    if (refuse_clone) return refuse_clone;
    ++clones;
    slots = static_cast<Recorder&>(src).slots;
    return 0;
  }
};

// Fake addresses far from anything mapped (never dereferenced).
char* at(uint64_t gib) { return reinterpret_cast<char*>(uintptr_t{0x100000000000} + gib * GiB); }

struct Attached {
  Recorder r;
  Attached() { FixedBuffers::attach(&r); }
  ~Attached() { FixedBuffers::detach(&r); }
};

TEST(fixed_buffers_registered_on_rings_now_and_later) {
  const uint64_t early = FixedBuffers::add(at(0), 1 << 20);
  Attached a;  // an existing buffer is registered when the ring arrives
  CHECK_EQ(a.r.slots.size(), 1u);
  const uint64_t late = FixedBuffers::add(at(1), 8192);  // a later one at once
  CHECK_EQ(a.r.slots.size(), 2u);
  CHECK(FixedBuffers::find(&a.r, at(0) + 4096, 4096) >= 0);
  CHECK(FixedBuffers::find(&a.r, at(1), 8192) >= 0);
  CHECK_EQ(FixedBuffers::find(&a.r, at(1), 8193), -1);  // runs past the buffer
  CHECK_EQ(FixedBuffers::find(&a.r, at(2), 1), -1);     // not a buffer
  FixedBuffers::remove(early);
  FixedBuffers::remove(late);
  CHECK(a.r.slots.empty());
  CHECK_EQ(FixedBuffers::find(&a.r, at(0), 4096), -1);
}

TEST(fixed_buffers_split_at_the_kernel_limit_per_slot) {
  Attached a;
  const uint64_t t = FixedBuffers::add(at(4), 2 * GiB + 4096);
  CHECK_EQ(a.r.slots.size(), 3u);
  for (const auto& s : a.r.slots) CHECK(s.second.second <= FixedBuffers::kMaxSlotBytes);
  const int first = FixedBuffers::find(&a.r, at(4), GiB);
  const int second = FixedBuffers::find(&a.r, at(5), 4096);
  CHECK(first >= 0 && second >= 0 && first != second);
  CHECK_EQ(FixedBuffers::find(&a.r, at(5) - 4096, 8192), -1);  // straddles two slots
  CHECK_EQ(FixedBuffers::bytes() >= 2 * GiB + 4096, true);
  FixedBuffers::remove(t);
  CHECK(a.r.slots.empty());
}

TEST(fixed_buffers_refused_registration_is_not_used) {
  Attached a;
  a.r.refuse = ENOMEM;  // e.g. RLIMIT_MEMLOCK for an unprivileged user
  const uint64_t t = FixedBuffers::add(at(8), 1 << 20);
  CHECK(a.r.slots.empty());
  CHECK_EQ(FixedBuffers::find(&a.r, at(8), 4096), -1);
  FixedBuffers::remove(t);
  FixedBuffers::set_register_fault(EPERM);  // the test hook, for every ring
  a.r.refuse = 0;
  const uint64_t u = FixedBuffers::add(at(9), 1 << 20);
  FixedBuffers::set_register_fault(0);
  CHECK(a.r.slots.empty());
  CHECK_EQ(FixedBuffers::find(&a.r, at(9), 4096), -1);
  FixedBuffers::remove(u);
}

TEST(fixed_buffers_full_table_leaves_the_rest_unfixed) {
  Attached a;
  std::vector<uint64_t> tokens;
  for (unsigned i = 0; i < FixedBuffers::kSlots + 2; ++i)
    tokens.push_back(FixedBuffers::add(at(16) + uint64_t{i} * 8192, 4096));
  CHECK(a.r.slots.size() <= FixedBuffers::kSlots);
  const uint64_t last = uint64_t{FixedBuffers::kSlots + 1} * 8192;
  CHECK_EQ(FixedBuffers::find(&a.r, at(16) + last, 4096), -1);
  for (uint64_t t : tokens) FixedBuffers::remove(t);
  CHECK(a.r.slots.empty());
  // Slots freed are used again.
  const uint64_t t = FixedBuffers::add(at(16), 4096);
  CHECK(FixedBuffers::find(&a.r, at(16), 4096) >= 0);
  FixedBuffers::remove(t);
}

TEST(fixed_buffers_address_reused_by_a_new_buffer_gets_its_own_slot) {
  Attached a;
  const uint64_t old_buf = FixedBuffers::add(at(32), 1 << 20);
  FixedBuffers::remove(old_buf);
  const uint64_t new_buf = FixedBuffers::add(at(32), 2 << 20);
  const int slot = FixedBuffers::find(&a.r, at(32) + (1 << 20), 4096);
  REQUIRE(slot >= 0);
  CHECK_EQ(a.r.slots.count(static_cast<unsigned>(slot)), 1u);
  CHECK_EQ(a.r.slots[static_cast<unsigned>(slot)].second, size_t{2} << 20);
  FixedBuffers::remove(new_buf);
}

TEST(fixed_buffers_locked_pinned_buffer_is_fixed_until_it_goes) {
  Attached a;
  std::unique_ptr<aio::PinnedBuffer> b;
  try {
    b = std::make_unique<aio::PinnedBuffer>(3 << 20, true);
  } catch (const aio::Error& e) {
    SKIP(std::string("cannot mlock here: ") + e.what());
  }
  CHECK(FixedBuffers::find(&a.r, b->data(), 3 << 20) >= 0);
  aio::PinnedBuffer plain(1 << 20, false);  // pageable: not fixed...
  CHECK_EQ(FixedBuffers::find(&a.r, plain.data(), 4096), -1);
  plain.make_fixed();  // ...unless pinned by other means and said so
  CHECK(FixedBuffers::find(&a.r, plain.data(), 4096) >= 0);
  b.reset();
  CHECK_EQ(a.r.slots.size(), 1u);
}

struct AttachedCloner {
  Cloner r;
  AttachedCloner() { FixedBuffers::attach(&r); }
  ~AttachedCloner() { FixedBuffers::detach(&r); }
};

TEST(fixed_buffers_one_ring_registers_the_others_copy_its_table) {
  AttachedCloner a, b;
  const uint64_t t = FixedBuffers::add(at(40), 1 << 20);
  CHECK_EQ(a.r.registrations, 1);  // pinned (and charged) once...
  CHECK_EQ(b.r.registrations, 0);
  CHECK_EQ(b.r.clones, 1);  // ...and shared
  CHECK(FixedBuffers::find(&b.r, at(40), 4096) >= 0);
  AttachedCloner late;  // a ring made later copies the table too
  CHECK_EQ(late.r.registrations, 0);
  CHECK(FixedBuffers::find(&late.r, at(40), 4096) >= 0);
  FixedBuffers::remove(t);
  CHECK(a.r.slots.empty() && b.r.slots.empty() && late.r.slots.empty());
}

TEST(fixed_buffers_a_ring_that_cannot_copy_registers_itself) {
  AttachedCloner a, b;
  b.r.refuse_clone = EINVAL;  // a kernel before 6.13
  const uint64_t t = FixedBuffers::add(at(41), 1 << 20);
  CHECK_EQ(b.r.registrations, 1);
  CHECK(FixedBuffers::find(&b.r, at(41), 4096) >= 0);
  FixedBuffers::set_clone(false);  // the test hook: no ring copies
  AttachedCloner c;
  FixedBuffers::set_clone(true);
  CHECK_EQ(c.r.clones, 0);
  CHECK_EQ(c.r.registrations, 1);
  FixedBuffers::remove(t);
}

TEST(fixed_buffers_a_copy_never_drops_what_only_the_copying_ring_holds) {
  AttachedCloner a, b;
  a.r.refuse = ENOMEM;  // the first ring is refused one buffer, the second holds it
  const uint64_t t = FixedBuffers::add(at(42), 1 << 20);
  CHECK_EQ(FixedBuffers::find(&a.r, at(42), 4096), -1);
  REQUIRE(FixedBuffers::find(&b.r, at(42), 4096) >= 0);
  a.r.refuse = 0;
  const uint64_t u = FixedBuffers::add(at(43), 1 << 20);  // a copy of a's table would lose at(42)
  CHECK(FixedBuffers::find(&b.r, at(42), 4096) >= 0);
  CHECK(FixedBuffers::find(&b.r, at(43), 4096) >= 0);
  CHECK_EQ(b.r.registrations, 2);
  FixedBuffers::remove(t);
  FixedBuffers::remove(u);
}

TEST(fixed_buffers_refusals_are_told_to_the_ring) {
  AttachedCloner a;
  a.r.refuse = ENOMEM;
  const uint64_t t = FixedBuffers::add(at(44), 2 * GiB);  // two slots, both refused
  CHECK_EQ(a.r.refusals.size(), 2u);
  CHECK(!a.r.refusals.empty() && a.r.refusals[0] == ENOMEM);
  FixedBuffers::remove(t);
}

TEST(fixed_buffers_a_forked_child_keeps_neither_rings_nor_buffers) {
  AttachedCloner a;
  const uint64_t t = FixedBuffers::add(at(45), 1 << 20);
  const pid_t pid = fork();
  if (pid == 0) {
    // The parent's buffers are wiped in the child: none is registered on a
    // ring the child makes, and the parent's ring is not told anything.
    Recorder mine;
    FixedBuffers::attach(&mine);
    const bool ok = mine.slots.empty() && FixedBuffers::bytes() == 0 &&
                    FixedBuffers::find(&a.r, at(45), 4096) == -1;
    FixedBuffers::remove(t);  // the child's copy of the buffer going: nothing to do
    _exit(ok ? 0 : 1);
  }
  REQUIRE(pid > 0);
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(FixedBuffers::find(&a.r, at(45), 4096) >= 0);
  FixedBuffers::remove(t);
}

}  // namespace
