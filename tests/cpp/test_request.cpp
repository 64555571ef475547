// Unit tests of csrc/core/request.cpp: plan_slices, the pure function that
// splits a request into per-worker slices (buffered head, O_DIRECT middle,
// buffered tail). No file is opened: the planner only does arithmetic.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "check.h"
#include "request.h"

namespace {

constexpr int64_t kPage = 4096;

// Heap memory at a chosen distance from a page boundary, so that bounce
// decisions are deterministic.
struct Memory {
  std::vector<char> bytes;
  char* p;
  Memory(uint64_t n, size_t misalign) : bytes(n + 2 * kPage) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(bytes.data());
    const uintptr_t page = (a + kPage - 1) / kPage * kPage;
    p = bytes.data() + (page - a) + misalign;
  }
};

aio::SlicePlanInput input(char* buf, int64_t offset, uint64_t nbytes, size_t threads, bool direct) {
  aio::SlicePlanInput in;
  in.op = aio::Op::Write;
  in.buf = buf;
  in.offset = offset;
  in.nbytes = nbytes;
  in.threads = threads;
  in.direct = direct;
  in.granularity = kPage;
  in.memory_alignment = kPage;
  return in;
}

// What every plan must satisfy: one list per worker, slices in file order
// within a list, together covering [offset, offset + nbytes) exactly once,
// each pointing at its own bytes of the buffer; direct slices whole granules.
void check_invariants(const aio::SlicePlanInput& in,
                      const std::vector<std::vector<aio::Slice>>& plan) {
  REQUIRE(plan.size() == in.threads);
  std::vector<const aio::Slice*> all;
  for (const auto& list : plan) {
    for (size_t i = 0; i < list.size(); ++i) {
      if (i > 0) CHECK(list[i - 1].off + static_cast<int64_t>(list[i - 1].len) <= list[i].off);
      all.push_back(&list[i]);
    }
  }
  std::sort(all.begin(), all.end(),
            [](const aio::Slice* a, const aio::Slice* b) { return a->off < b->off; });
  int64_t pos = in.offset;
  for (const aio::Slice* s : all) {
    CHECK_EQ(s->off, pos);
    CHECK(s->len > 0);
    CHECK(s->buf == in.buf + (s->off - in.offset));
    CHECK(s->op == in.op);
    CHECK(s->file == in.file);
    if (s->direct) {
      CHECK_EQ(s->off % static_cast<int64_t>(in.granularity), 0);
      CHECK_EQ(s->len % in.granularity, 0u);
      CHECK(!s->edge);
    }
    pos = s->off + static_cast<int64_t>(s->len);
  }
  CHECK_EQ(pos, in.offset + static_cast<int64_t>(in.nbytes));
}

std::vector<std::vector<aio::Slice>> plan_checked(const aio::SlicePlanInput& in) {
  auto plan = aio::plan_slices(in);
  check_invariants(in, plan);
  return plan;
}

// Lengths of the direct slices of each worker (0 for none), in worker order.
std::vector<uint64_t> direct_lengths(const std::vector<std::vector<aio::Slice>>& plan) {
  std::vector<uint64_t> out;
  for (const auto& list : plan) {
    uint64_t n = 0;
    for (const aio::Slice& s : list) n += s.direct ? s.len : 0;
    out.push_back(n);
  }
  return out;
}

}  // namespace

TEST(plan_zero_bytes_has_no_slices) {
  for (bool direct : {true, false}) {
    const auto plan = plan_checked(input(nullptr, 12345, 0, 4, direct));
    for (const auto& list : plan) CHECK(list.empty());
  }
}

TEST(plan_small_unaligned_request_is_one_buffered_edge) {
  Memory m(200, 0);
  const auto plan = plan_checked(input(m.p, 100, 200, 4, true));
  REQUIRE(plan[0].size() == 1);
  const aio::Slice& s = plan[0][0];
  CHECK_EQ(s.off, 100);
  CHECK_EQ(s.len, 200u);
  CHECK(!s.direct);
  CHECK(s.edge);
  CHECK(!s.bounce);
  for (size_t i = 1; i < plan.size(); ++i) CHECK(plan[i].empty());
}

TEST(plan_aligned_request_splits_whole_granules_over_workers) {
  Memory m(10 * kPage, 0);
  // 10 granules: the first (10 % threads) workers take one more.
  // A plain array, not vector<pair<size_t, vector>>: g++ 13 -O2 reports a false
  // -Warray-bounds in copying the latter's initializer list (-Werror fails the build).
  struct Case {
    size_t threads;
    uint64_t granules[4];
  };
  const Case cases[] = {{1, {10}}, {3, {4, 3, 3}}, {4, {3, 3, 2, 2}}};
  for (const auto& [threads, granules] : cases) {
    const auto plan = plan_checked(input(m.p, 8 * kPage, 10 * kPage, threads, true));
    const std::vector<uint64_t> got = direct_lengths(plan);
    for (size_t i = 0; i < threads; ++i) {
      CHECK_EQ(got[i], granules[i] * kPage);
      REQUIRE(plan[i].size() == 1);
      CHECK(plan[i][0].direct);
      CHECK(!plan[i][0].edge);
      CHECK(!plan[i][0].bounce);
    }
  }
}

TEST(plan_fewer_granules_than_workers_leaves_workers_idle) {
  Memory m(2 * kPage, 0);
  const auto plan = plan_checked(input(m.p, 0, 2 * kPage, 4, true));
  CHECK_EQ(plan[0].size(), 1u);
  CHECK_EQ(plan[1].size(), 1u);
  CHECK(plan[2].empty());
  CHECK(plan[3].empty());
}

TEST(plan_unaligned_head_and_tail_are_buffered_edges) {
  Memory m(10 + 2 * kPage + 5, 0);
  // Head [kPage - 10, kPage) on worker 0 before its direct slice; the tail
  // goes to the last worker that got a direct slice.
  const auto plan = plan_checked(input(m.p, kPage - 10, 10 + 2 * kPage + 5, 3, true));
  REQUIRE(plan[0].size() == 2);
  CHECK(plan[0][0].edge && !plan[0][0].direct);
  CHECK_EQ(plan[0][0].off, kPage - 10);
  CHECK_EQ(plan[0][0].len, 10u);
  CHECK(plan[0][1].direct);
  REQUIRE(plan[1].size() == 2);
  CHECK(plan[1][0].direct);
  CHECK(plan[1][1].edge && !plan[1][1].direct);
  CHECK_EQ(plan[1][1].off, 3 * kPage);
  CHECK_EQ(plan[1][1].len, 5u);
  CHECK(plan[2].empty());
}

TEST(plan_head_and_tail_without_middle_go_to_worker_0) {
  Memory m(200, 0);
  const auto plan = plan_checked(input(m.p, kPage - 100, 200, 4, true));
  REQUIRE(plan[0].size() == 2);
  CHECK_EQ(plan[0][0].len, 100u);
  CHECK_EQ(plan[0][1].off, kPage);
  CHECK(plan[0][0].edge && plan[0][1].edge);
  for (size_t i = 1; i < plan.size(); ++i) CHECK(plan[i].empty());
}

TEST(plan_unaligned_memory_bounces_the_direct_middle) {
  Memory m(4 * kPage, 2048);  // what torch's pinned allocator hands out
  const auto plan = plan_checked(input(m.p, 0, 4 * kPage, 2, true));
  for (const auto& list : plan) {
    REQUIRE(list.size() == 1);
    CHECK(list[0].direct);
    CHECK(list[0].bounce);
  }
}

TEST(plan_memory_aligned_where_the_middle_starts_does_not_bounce) {
  // The buffer is 100 bytes past a page, as is the file offset: the direct
  // middle starts on a page boundary in memory too.
  Memory m(100 + 2 * kPage, kPage - 100);
  const auto plan = plan_checked(input(m.p, kPage - 100, 100 + 2 * kPage, 1, true));
  REQUIRE(plan[0].size() == 2);
  CHECK(plan[0][1].direct);
  CHECK(!plan[0][1].bounce);
}

TEST(plan_granularity_above_a_page) {
  Memory m(64 * 1024, 0);
  aio::SlicePlanInput in = input(m.p, 0, 64 * 1024, 2, true);
  in.granularity = 16 * 1024;
  const std::vector<uint64_t> got = direct_lengths(plan_checked(in));
  CHECK_EQ(got[0], 32u * 1024);
  CHECK_EQ(got[1], 32u * 1024);
}

TEST(plan_without_direct_descriptor_splits_evenly_buffered) {
  Memory m(10, 0);
  // ceil(10 / 4) = 3 bytes per worker, the last gets the remainder.
  const auto plan = plan_checked(input(m.p, 0, 10, 4, false));
  const uint64_t want[] = {3, 3, 3, 1};
  for (size_t i = 0; i < 4; ++i) {
    REQUIRE(plan[i].size() == 1);
    CHECK_EQ(plan[i][0].len, want[i]);
    CHECK(!plan[i][0].direct && !plan[i][0].edge && !plan[i][0].bounce);
  }
  // Fewer bytes than workers: the last workers get nothing.
  const auto small = plan_checked(input(m.p, 7, 2, 4, false));
  CHECK_EQ(small[0].size(), 1u);
  CHECK_EQ(small[1].size(), 1u);
  CHECK(small[2].empty() && small[3].empty());
}

TEST(plan_request_ending_at_the_largest_offset_does_not_overflow) {
  Memory m(100, 0);
  const int64_t offset = INT64_MAX - 100;
  const auto plan = plan_checked(input(m.p, offset, 100, 2, true));
  REQUIRE(plan[0].size() == 1);
  CHECK(plan[0][0].edge);
  CHECK_EQ(plan[0][0].off, offset);
}
