// FixedBuffers (csrc/core/fixed_buffers.h) with a recording holder in place
// of an io_uring ring: slots, splitting at 1 GiB, exhaustion, refusal, removal
// and address reuse. Addresses are never touched, so none are allocated.
#include <errno.h>

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
  int register_slot(unsigned slot, void* base, size_t len) override {
    if (refuse) return refuse;
    slots[slot] = {static_cast<char*>(base), len};
    return 0;
  }
  void clear_slot(unsigned slot) override { slots.erase(slot); }
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

}  // namespace
