// Unit tests of csrc/core/cpu_adam.cpp without torch: the fused pass against
// a one-element-at-a-time reference written from torch's op sequence, the
// thread count and block boundaries not changing any bit, the bf16/fp16
// copies on known encodings. Equality with torch itself is tested from
// Python (tests/test_optim.py).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "bf16_inplace.h"
#include "check.h"
#include "cpu_adam.h"

namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct State {
  std::vector<float> p, g, m, v;
  explicit State(size_t n, unsigned seed) : p(n), g(n), m(n), v(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (size_t i = 0; i < n; ++i) {
      p[i] = normal(rng);
      g[i] = normal(rng) * std::exp(normal(rng) * 3);
    }
  }
  aio::AdamBuffers buffers() {
    aio::AdamBuffers b;
    b.param = p.data();
    b.grad = g.data();
    b.exp_avg = m.data();
    b.exp_avg_sq = v.data();
    b.numel = p.size();
    return b;
  }
};

// torch's _single_tensor_adam for one element, op by op (correctly rounded
// sqrt), with the fused multiply-adds ATen's CPU kernels use.
void reference_step(State& st, size_t i, const aio::AdamHyper& h) {
  float g = st.g[i];
  if (h.has_grad_scale) g = g * static_cast<float>(h.grad_scale);
  float p = st.p[i];
  if (h.weight_decay != 0 && !h.decoupled) g = std::fma(static_cast<float>(h.weight_decay), p, g);
  if (h.weight_decay != 0 && h.decoupled) p = p * static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float w = static_cast<float>(1.0 - h.beta1);
  const float m = st.m[i];
  st.m[i] = w < 0.5f ? std::fma(w, g - m, m) : std::fma(w - 1.0f, g - m, g);
  const float v = st.v[i] * static_cast<float>(h.beta2);
  st.v[i] = std::fma(static_cast<float>(1.0 - h.beta2) * g, g, v);
  const double bc1 = 1.0 - std::pow(h.beta1, h.step);
  const double bc2 = 1.0 - std::pow(h.beta2, h.step);
  const float denom =
      std::sqrt(st.v[i]) / static_cast<float>(std::pow(bc2, 0.5)) + static_cast<float>(h.eps);
  st.p[i] = p + (static_cast<float>(-(h.lr / bc1)) * st.m[i]) / denom;
}

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  // An empty vector's data() may be null, which memcmp must not be given.
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

void check_against_reference(size_t n, aio::AdamHyper h, unsigned threads) {
  State ours(n, 7), ref(n, 7);
  for (int step = 1; step <= 5; ++step) {
    h.step = step;
    aio::adam_update(ours.buffers(), h, threads);
    for (size_t i = 0; i < n; ++i) reference_step(ref, i, h);
  }
  CHECK(same(ours.p, ref.p));
  CHECK(same(ours.m, ref.m));
  CHECK(same(ours.v, ref.v));
}

}  // namespace

TEST(adam_matches_reference_adam_and_adamw) {
  for (size_t n : {size_t{1}, size_t{7}, size_t{255}, size_t{257}, size_t{1025}, size_t{70001}}) {
    for (bool decoupled : {false, true}) {
      aio::AdamHyper h;
      h.lr = 1e-2;
      h.weight_decay = 0.01;
      h.decoupled = decoupled;
      check_against_reference(n, h, 2);
    }
  }
}

TEST(adam_matches_reference_large_weight_and_grad_scale) {
  aio::AdamHyper h;
  h.beta1 = 0.3;  // lerp weight 0.7: ATen's other lerp formula
  h.beta2 = 0.9;
  h.has_grad_scale = true;
  h.grad_scale = 1.0 / 3;
  check_against_reference(5000, h, 1);
}

TEST(adam_thread_count_changes_nothing) {
  const size_t n = (size_t{1} << 18) + 13;
  aio::AdamHyper h;
  h.weight_decay = 0.01;
  h.decoupled = true;
  State one(n, 3);
  aio::adam_update(one.buffers(), h, 1);
  for (unsigned threads : {2u, 3u, 8u}) {
    State many(n, 3);
    aio::adam_update(many.buffers(), h, threads);
    CHECK(same(one.p, many.p));
    CHECK(same(one.m, many.m));
    CHECK(same(one.v, many.v));
  }
}

static int fake_gomp_calls = 0;

// Stands in for an OpenMP runtime's GOMP_parallel: runs fn on num_threads
// threads (the caller one of them) and returns when all are done.
static void fake_gomp_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned) {
  fake_gomp_calls++;
  std::vector<std::thread> team;
  for (unsigned t = 1; t < num_threads; ++t) team.emplace_back([=] { fn(data); });
  fn(data);
  for (auto& t : team) t.join();
}

TEST(adam_openmp_team_changes_nothing) {
  const size_t n = (size_t{1} << 19) + 7;
  aio::AdamHyper h;
  h.weight_decay = 0.01;
  State one(n, 5);
  aio::adam_update(one.buffers(), h, 1);
  for (unsigned threads : {2u, 4u}) {
    State team(n, 5);
    const int before = fake_gomp_calls;
    aio::adam_update(team.buffers(), h, threads, aio::VectorSqrt(), &fake_gomp_parallel);
    CHECK(fake_gomp_calls == before + 1);
    CHECK(same(one.p, team.p));
    CHECK(same(one.m, team.m));
    CHECK(same(one.v, team.v));
  }
  State serial(n, 5);  // one thread never starts a team
  const int before = fake_gomp_calls;
  aio::adam_update(serial.buffers(), h, 1, aio::VectorSqrt(), &fake_gomp_parallel);
  CHECK(fake_gomp_calls == before);
}

TEST(adam_lowp_copies_known_encodings) {
  // value, bf16, fp16 (round to nearest even; NaN rules as torch).
  struct Case {
    uint32_t in;
    uint16_t bf16, fp16;
  };
  const Case cases[] = {
      {0x3F800000, 0x3F80, 0x3C00},  // 1.0
      {0x3F808000, 0x3F80, 0x3C04},  // bf16 tie -> even (down)
      {0x3F818000, 0x3F82, 0x3C0C},  // bf16 tie -> even (up)
      {0xC0490FDB, 0xC049, 0xC248},  // -pi
      {0x477FE000, 0x4780, 0x7BFF},  // 65504: largest half
      {0x477FF000, 0x4780, 0x7C00},  // half tie to 65536: infinity
      {0x33000001, 0x3300, 0x0001},  // just above half of the smallest subnormal
      {0x33000000, 0x3300, 0x0000},  // exactly half: ties to zero
      {0x387FC000, 0x3880, 0x03FF},  // largest half subnormal
      {0x7F800000, 0x7F80, 0x7C00},  // inf
      {0xFFC00000, 0xFFFF, 0xFE00},  // -NaN
      {0x7FD648B2, 0xFFFF, 0x7EB2},  // NaN with payload
  };
  const size_t n = sizeof(cases) / sizeof(cases[0]);
  for (aio::LowpKind kind : {aio::LowpKind::BFloat16, aio::LowpKind::Float16}) {
    State st(n, 1);
    for (size_t i = 0; i < n; ++i) {
      st.p[i] = from_bits(cases[i].in);
      st.g[i] = 0;
    }
    std::vector<uint16_t> out(n, 0x1234);
    aio::AdamBuffers b = st.buffers();
    b.lowp = out.data();
    b.lowp_kind = kind;
    aio::AdamHyper h;
    h.lr = 0;  // the parameter stays as it is (NaNs stay NaN)
    aio::adam_update(b, h, 1);
    for (size_t i = 0; i < n; ++i) {
      const uint16_t want = kind == aio::LowpKind::BFloat16 ? cases[i].bf16 : cases[i].fp16;
      CHECK_EQ(bits(st.p[i]), cases[i].in);
      CHECK_EQ(out[i], want);
    }
  }
}

namespace {

size_t g_sqrt_calls = 0;

void counting_sqrt(int32_t n, const float* in, float* out, int64_t) {
  ++g_sqrt_calls;
  for (int32_t i = 0; i < n; ++i) out[i] = std::sqrt(in[i]);
}

}  // namespace

// MklSse computes normal inputs in-line (within an ulp of the exact root) and
// zeros as themselves, and hands a block to fn only when it holds an input
// MKL treats apart (here a subnormal second moment).
TEST(adam_mkl_sse_uses_fn_only_for_rare_inputs) {
  if (!aio::mkl_sse_supported()) SKIP("MklSse is x86-64 only");
  const size_t n = 3000;  // several blocks
  State ours(n, 9), ref(n, 9);
  for (size_t i = 0; i < n; ++i) ours.g[i] = ref.g[i] = 1.0f + static_cast<float>(i % 7);
  ours.g[5] = ref.g[5] = 0.0f;
  aio::VectorSqrt vs;
  vs.kind = aio::SqrtKind::MklSse;
  vs.fn = &counting_sqrt;
  aio::AdamHyper h;
  g_sqrt_calls = 0;
  aio::adam_update(ours.buffers(), h, 1, vs);
  CHECK_EQ(g_sqrt_calls, size_t{0});
  for (size_t i = 0; i < n; ++i) reference_step(ref, i, h);
  CHECK(same(ours.m, ref.m));
  CHECK(same(ours.v, ref.v));
  for (size_t i = 0; i < n; ++i) {
    const int64_t ulps = static_cast<int64_t>(bits(ours.p[i])) - bits(ref.p[i]);
    CHECK(ulps >= -2 && ulps <= 2);
  }
  ours.v[2500] = 1e-41f;  // stays subnormal (zero gradient): its block (only) goes to fn
  ours.g[2500] = 0.0f;
  h.step = 2;
  aio::adam_update(ours.buffers(), h, 1, vs);
  CHECK_EQ(g_sqrt_calls, size_t{1});
}

TEST(adam_bf16_moments_equal_widen_update_round) {
  // Sizes around the block, one and several threads: the float32 update of
  // the widened moments, rounded back, bit for bit.
  for (size_t n : {size_t{5}, size_t{256}, size_t{1000}, (size_t{1} << 17) + 3}) {
    for (unsigned threads : {1u, 3u}) {
      aio::AdamHyper h;
      h.weight_decay = 0.01;
      h.decoupled = true;
      State ref(n, 9), fused(n, 9);
      std::vector<uint16_t> m16(n, 0), v16(n, 0);
      for (int step = 1; step <= 3; ++step) {
        h.step = step;
        aio::adam_update(ref.buffers(), h, threads);
        for (size_t i = 0; i < n; ++i) {
          ref.m[i] = from_bits(static_cast<uint32_t>(aio::bf16_from_bits(bits(ref.m[i]))) << 16);
          ref.v[i] = from_bits(static_cast<uint32_t>(aio::bf16_from_bits(bits(ref.v[i]))) << 16);
        }
        aio::AdamBuffers b = fused.buffers();
        b.exp_avg = b.exp_avg_sq = nullptr;
        b.exp_avg_bf16 = m16.data();
        b.exp_avg_sq_bf16 = v16.data();
        aio::adam_update(b, h, threads);
      }
      bool same_m = true, same_v = true;
      for (size_t i = 0; i < n; ++i) {
        same_m = same_m && bits(ref.m[i]) == static_cast<uint32_t>(m16[i]) << 16;
        same_v = same_v && bits(ref.v[i]) == static_cast<uint32_t>(v16[i]) << 16;
      }
      CHECK(same(ref.p, fused.p));
      CHECK(same_m);
      CHECK(same_v);
    }
  }
}

// Tensors of mixed sizes (empty first and last, tiny, across chunk and block
// edges, one large) with different step counts, one with a bfloat16 copy and
// one with bfloat16 moments: one call of adam_update_many equals adam_update
// called per tensor, bit for bit, on one thread, on aio's pool and on an
// OpenMP team, and counts every step on.
TEST(adam_many_equals_one_call_per_tensor) {
  const std::vector<size_t> sizes = {0, 1, 7, 255, 4096, 70001, (size_t{1} << 18) + 5, 3, 0};
  const size_t low_at = 5, bf16_at = 4;
  aio::AdamHyper h;
  h.weight_decay = 0.01;
  h.decoupled = true;
  struct Run {
    std::vector<State> st;
    std::vector<uint16_t> low, m16, v16;
    std::vector<aio::AdamTask> tasks;
  };
  // A fresh copy of every tensor, as tasks (steps given by the caller).
  auto fresh = [&](float* steps) {
    Run r;
    for (size_t k = 0; k < sizes.size(); ++k) r.st.emplace_back(sizes[k], 11 + unsigned(k));
    r.low.assign(sizes[low_at], 0);
    r.m16.assign(sizes[bf16_at], 0);
    r.v16.assign(sizes[bf16_at], 0);
    r.tasks.resize(sizes.size());
    for (size_t k = 0; k < sizes.size(); ++k) {
      r.tasks[k].buf = r.st[k].buffers();
      r.tasks[k].step = &steps[k];
    }
    r.tasks[low_at].buf.lowp = r.low.data();
    r.tasks[low_at].buf.lowp_kind = aio::LowpKind::BFloat16;
    aio::AdamBuffers& b = r.tasks[bf16_at].buf;
    b.exp_avg = b.exp_avg_sq = nullptr;
    b.exp_avg_bf16 = r.m16.data();
    b.exp_avg_sq_bf16 = r.v16.data();
    return r;
  };
  std::vector<float> start_steps(sizes.size());
  for (size_t k = 0; k < sizes.size(); ++k) start_steps[k] = float(k % 3);
  std::vector<float> unused = start_steps;
  Run one = fresh(unused.data());
  for (size_t k = 0; k < sizes.size(); ++k) {
    h.step = start_steps[k] + 1;
    aio::adam_update(one.tasks[k].buf, h, 1);
  }
  for (unsigned threads : {1u, 2u, 3u}) {
    for (aio::ParallelFn par : {aio::ParallelFn(nullptr), &fake_gomp_parallel}) {
      std::vector<float> steps = start_steps;
      Run many = fresh(steps.data());
      aio::adam_update_many(many.tasks.data(), many.tasks.size(), h, threads, aio::VectorSqrt(),
                            par);
      for (size_t k = 0; k < sizes.size(); ++k) {
        CHECK(same(one.st[k].p, many.st[k].p));
        CHECK(same(one.st[k].m, many.st[k].m));
        CHECK(same(one.st[k].v, many.st[k].v));
        CHECK(steps[k] == start_steps[k] + 1);
      }
      CHECK(many.low == one.low);
      CHECK(many.m16 == one.m16);
      CHECK(many.v16 == one.v16);
    }
  }
}

// A parameter listed twice (torch steps it twice) and a count shared by two
// tensors: the tasks that write one buffer again run after the others, as
// calls one after the other would, on a size split between threads.
TEST(adam_many_runs_a_repeated_buffer_in_order) {
  const size_t n = 70001;
  aio::AdamHyper h;
  for (unsigned threads : {1u, 3u}) {
    State a(n, 21), b(n, 22), c(5, 23), d(n, 24);
    State ra = a, rb = b, rc = c, rd = d;
    float steps[2] = {0, 4}, shared = 1;
    aio::AdamTask tasks[5];
    State* states[5] = {&a, &b, &a, &c, &d};
    float* counts[5] = {&steps[0], &steps[1], &steps[0], &shared, &shared};
    for (int k = 0; k < 5; ++k) tasks[k].buf = states[k]->buffers(), tasks[k].step = counts[k];
    aio::adam_update_many(tasks, 5, h, threads);
    for (auto [st, step] : {std::pair{&ra, 1.0}, {&rb, 5.0}, {&ra, 2.0}, {&rc, 2.0}, {&rd, 3.0}}) {
      h.step = step;
      aio::adam_update(st->buffers(), h, threads);
    }
    CHECK(same(a.p, ra.p) && same(a.m, ra.m) && same(a.v, ra.v));
    CHECK(same(b.p, rb.p) && same(c.p, rc.p) && same(d.p, rd.p));
    CHECK(steps[0] == 2 && steps[1] == 5 && shared == 3);
  }
}

// A count that cannot go on (NaN, negative, infinite) refuses the
// whole call before any tensor or count changes.
TEST(adam_many_refuses_a_bad_count_whole) {
  for (float bad : {NAN, -5.0f, INFINITY}) {
    State a(100, 1), b(100, 2);
    const State a0 = a, b0 = b;
    float steps[2] = {3, bad};
    aio::AdamTask tasks[2];
    tasks[0].buf = a.buffers();
    tasks[0].step = &steps[0];
    tasks[1].buf = b.buffers();
    tasks[1].step = &steps[1];
    bool thrown = false;
    try {
      aio::adam_update_many(tasks, 2, aio::AdamHyper(), 1);
    } catch (const std::invalid_argument&) {
      thrown = true;
    }
    CHECK(thrown);
    CHECK(steps[0] == 3.0f);
    CHECK(same(a.p, a0.p) && same(a.m, a0.m) && same(b.p, b0.p) && same(b.v, b0.v));
  }
  aio::adam_update_many(nullptr, 0, aio::AdamHyper(), 2);  // nothing to do
}
