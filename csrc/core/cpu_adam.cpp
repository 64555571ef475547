// The fused Adam/AdamW pass (cpu_adam.h). Each chunk is walked in blocks
// small enough for L1: pass one reads the gradient and moments and writes the
// moments, the square root runs on the block, pass two writes the parameter
// (and its low-precision copy). The loops are plain C++ that the compiler
// vectorizes; std::fma is spelled out exactly where torch's kernels fuse, and
// nowhere else (the build turns contraction off).
#include "cpu_adam.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "bf16_inplace.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#if defined(__GNUC__)
#define AIO_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define AIO_ALWAYS_INLINE inline
#endif

// x86-64: an AVX2+FMA copy of the loops, picked at run time; the portable
// copy runs everywhere else (and there std::fma may be a library call).
#if defined(__x86_64__) && defined(__GNUC__)
#define AIO_ADAM_AVX2 1
#include <immintrin.h>
#endif

namespace aio {
namespace {

// Elements per block (1 KiB of each array). Measured here on 49M elements:
// 256 is 15-35% faster than 1024 (a 4 KiB page per array per block), which
// makes the prefetchers restart on every page; 128 is no better than 256.
constexpr size_t kBlock = 256;
// Work is handed out in chunks of this many elements (whole blocks, 1 MiB
// per array), taken from a shared counter: on a shared machine a thread
// whose core is busy elsewhere takes fewer, instead of every call waiting
// for the slowest fixed share.
constexpr size_t kChunk = 1024 * kBlock;

// Instruction sets the loops are built for; the best the CPU (and the OS,
// for AVX-512's registers) supports runs, lowered by AIO_MAX_CPU_ISA
// (adam_isa()).
enum class Isa { Portable, Avx2, Avx512 };

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512:
      return "avx512";
    case Isa::Avx2:
      return "avx2";
    case Isa::Portable:
      break;
  }
  return "portable";
}

// The best the CPU and OS support, capped by AIO_MAX_CPU_ISA; `bad` holds a
// value of the variable that names no instruction set.
struct IsaChoice {
  Isa isa = Isa::Portable;
  std::string bad;
};

IsaChoice choose_isa() {
  IsaChoice c;
#ifdef AIO_ADAM_AVX2
  // libgcc's checks include the OS saving the wider registers (XGETBV).
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    c.isa = Isa::Avx2;
    if (__builtin_cpu_supports("avx512f")) c.isa = Isa::Avx512;
  }
#endif
  const char* env = std::getenv("AIO_MAX_CPU_ISA");
  if (env == nullptr || *env == '\0') return c;
  for (Isa cap : {Isa::Portable, Isa::Avx2, Isa::Avx512}) {
    if (std::strcmp(env, isa_name(cap)) == 0) {
      c.isa = std::min(c.isa, cap);
      return c;
    }
  }
  c.bad = env;
  return c;
}

Isa kernel_isa() {
  static const IsaChoice choice = choose_isa();
  if (!choice.bad.empty())
    throw std::invalid_argument("AIO_MAX_CPU_ISA must be 'avx512', 'avx2' or 'portable', got '" +
                                choice.bad + "'");
  return choice.isa;
}

// The per-element constants, each rounded to float once as ATen does.
struct Scalars {
  float scale, wd, w, w_minus_1, b2, c2, bc2_sqrt, eps, decay, neg_step_size;
  bool l2, small_weight, scaled;
};

Scalars make_scalars(const AdamHyper& hp) {
  Scalars s{};
  // torch computes these in Python doubles; std::pow is the same libm pow.
  const double bias_correction1 = 1.0 - std::pow(hp.beta1, hp.step);
  const double bias_correction2 = 1.0 - std::pow(hp.beta2, hp.step);
  const double step_size = hp.lr / bias_correction1;
  s.neg_step_size = static_cast<float>(-step_size);
  s.bc2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  s.scale = hp.has_grad_scale ? static_cast<float>(hp.grad_scale) : 1.0f;
  s.scaled = hp.has_grad_scale;
  s.l2 = hp.weight_decay != 0 && !hp.decoupled;
  s.wd = static_cast<float>(hp.weight_decay);
  s.decay = (hp.weight_decay != 0 && hp.decoupled)
                ? static_cast<float>(1.0 - hp.lr * hp.weight_decay)
                : 1.0f;
  s.w = static_cast<float>(1.0 - hp.beta1);
  s.w_minus_1 = s.w - 1.0f;
  s.small_weight = std::fabs(s.w) < 0.5f;  // ATen's lerp switches formula here
  s.b2 = static_cast<float>(hp.beta2);
  s.c2 = static_cast<float>(1.0 - hp.beta2);
  s.eps = static_cast<float>(hp.eps);
  return s;
}

AIO_ALWAYS_INLINE uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

AIO_ALWAYS_INLINE float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even; every NaN becomes 0xFFFF as in ATen's vector path.
AIO_ALWAYS_INLINE uint16_t to_bf16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(f != f ? 0xFFFFu : r);
}

// IEEE half, round to nearest even; a NaN stays a NaN with its sign and the
// top of its payload, quiet (as F16C's vcvtps2ph, which torch uses). Written with
// selects only, so the loop vectorizes.
AIO_ALWAYS_INLINE uint16_t to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Below 2^-14 the half is subnormal: adding 0.5 rounds |f| to a multiple
  // of 2^-24 (the half's subnormal step), which lands in the low mantissa.
  const uint32_t sub = bits_of(float_of(a) + 0.5f) - 0x3F000000u;
  // Normal: round the mantissa to 10 bits, then rebias the exponent
  // (127 -> 15); a carry out of the mantissa correctly bumps the exponent.
  const uint32_t norm = ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - 0x1C000u;
  uint32_t h = a < 0x38800000u ? sub : norm;
  h = a >= 0x477FF000u ? 0x7C00u : h;                        // rounds to 65536 or more: infinity
  h = a > 0x7F800000u ? 0x7E00u | ((a >> 13) & 0x3FFu) : h;  // NaN
  return static_cast<uint16_t>(sign | h);
}

// Pass one: gradient (scaled, L2), both moments; v also goes to `sq`.
// kFixed: a whole block, a trip count known at compile time, which GCC
// vectorizes even at -O2 (no epilogue needed); 0: the chunk's last n.
template <bool kL2, bool kSmall, size_t kFixed>
AIO_ALWAYS_INLINE void moments(const Scalars& s, const float* __restrict grad,
                               const float* __restrict param, float* __restrict m,
                               float* __restrict v, float* __restrict sq, size_t n) {
  const size_t count = kFixed ? kFixed : n;
  for (size_t i = 0; i < count; ++i) {
    float g = grad[i] * s.scale;
    if (kL2) g = std::fma(s.wd, param[i], g);  // add(param, alpha=wd)
    const float mi = m[i];
    const float diff = g - mi;
    m[i] = kSmall ? std::fma(s.w, diff, mi) : std::fma(s.w_minus_1, diff, g);  // lerp_
    const float vi = std::fma(s.c2 * g, g, v[i] * s.b2);                       // mul_(b2).addcmul_
    v[i] = vi;
    sq[i] = vi;
  }
}

// Pass two: denominator, parameter update, low-precision copy.
template <LowpKind kLowp, bool kRootGiven, size_t kFixed>
AIO_ALWAYS_INLINE void apply(const Scalars& s, const float* __restrict root,
                             const float* __restrict m, float* __restrict p, void* __restrict lowp,
                             size_t n) {
  uint16_t* __restrict out = static_cast<uint16_t*>(lowp);
  const size_t count = kFixed ? kFixed : n;
  for (size_t i = 0; i < count; ++i) {
    const float r = kRootGiven ? root[i] : std::sqrt(root[i]);
    const float denom = r / s.bc2_sqrt + s.eps;
    float pi = p[i] * s.decay;
    pi = pi + (s.neg_step_size * m[i]) / denom;  // addcdiv_
    p[i] = pi;
    if (kLowp == LowpKind::BFloat16) out[i] = to_bf16(pi);
    if (kLowp == LowpKind::Float16) out[i] = to_f16(pi);
  }
}

#ifdef AIO_ADAM_AVX2
// MKL's SSE sqrt kernel, lane by lane (SqrtKind::MklSse); n a multiple of 4.
// Lanes outside [smallest normal, 0x7F7FF000] are the ones MKL hands to its
// rare-case code: zeros give themselves, any other makes the result true.
// Plain SSE2 (every x86-64 has it), no FMA: the same roundings as MKL.
AIO_ALWAYS_INLINE bool mkl_sse_sqrt_128(const float* in, float* out, size_t n) {
  const __m128 half = _mm_set1_ps(0.5f);
  const __m128i bias = _mm_set1_epi32(0x7F800000);
  const __m128i limit = _mm_set1_epi32(static_cast<int>(0xFEFFF000u));
  const __m128i abs_mask = _mm_set1_epi32(0x7FFFFFFF);
  __m128i rare = _mm_setzero_si128();
  for (size_t i = 0; i < n; i += 4) {
    const __m128 x = _mm_loadu_ps(in + i);
    const __m128 y = _mm_rsqrt_ps(x);
    const __m128 s = _mm_mul_ps(x, y);
    const __m128 h = _mm_mul_ps(y, half);
    const __m128 e = _mm_sub_ps(half, _mm_mul_ps(s, h));
    const __m128 s1 = _mm_add_ps(_mm_mul_ps(s, e), s);
    const __m128 h1 = _mm_add_ps(_mm_mul_ps(h, e), h);
    const __m128 r = _mm_sub_ps(x, _mm_mul_ps(s1, s1));
    const __m128 root = _mm_add_ps(_mm_mul_ps(r, h1), s1);
    const __m128i bits = _mm_castps_si128(x);
    const __m128i special = _mm_cmpgt_epi32(_mm_add_epi32(bits, bias), limit);
    const __m128i zero = _mm_cmpeq_epi32(_mm_and_si128(bits, abs_mask), _mm_setzero_si128());
    rare = _mm_or_si128(rare, _mm_andnot_si128(zero, special));
    const __m128 sp = _mm_castsi128_ps(special);
    _mm_storeu_ps(out + i, _mm_or_ps(_mm_andnot_ps(sp, root), _mm_and_ps(sp, x)));
  }
  return _mm_movemask_epi8(rare) != 0;
}

// MKL's SSE sqrt of eight lanes (as mkl_sse_sqrt_128); `rare` gets the lanes
// MKL hands to its rare-case code (not zeros: they give themselves).
__attribute__((target("avx2,fma"), always_inline)) inline __m256 mkl_sqrt_8(__m256 x,
                                                                            __m256i* rare) {
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 y = _mm256_rsqrt_ps(x);
  const __m256 s = _mm256_mul_ps(x, y);
  const __m256 h = _mm256_mul_ps(y, half);
  const __m256 e = _mm256_sub_ps(half, _mm256_mul_ps(s, h));
  const __m256 s1 = _mm256_add_ps(_mm256_mul_ps(s, e), s);
  const __m256 h1 = _mm256_add_ps(_mm256_mul_ps(h, e), h);
  const __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(s1, s1));
  const __m256 root = _mm256_add_ps(_mm256_mul_ps(r, h1), s1);
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i special = _mm256_cmpgt_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7F800000)),
                                             _mm256_set1_epi32(static_cast<int>(0xFEFFF000u)));
  const __m256i zero = _mm256_cmpeq_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                          _mm256_setzero_si256());
  *rare = _mm256_andnot_si256(zero, special);
  return _mm256_blendv_ps(root, x, _mm256_castsi256_ps(special));
}

// The same, eight lanes at a time; n a multiple of 8. Not inlined (a call
// per block): GCC inlines a target("avx2") function only into another.
__attribute__((target("avx2,fma"))) bool mkl_sse_sqrt_256(const float* in, float* out, size_t n) {
  __m256i rare = _mm256_setzero_si256();
  for (size_t i = 0; i < n; i += 8) {
    __m256i r;
    _mm256_storeu_ps(out + i, mkl_sqrt_8(_mm256_loadu_ps(in + i), &r));
    rare = _mm256_or_si256(rare, r);
  }
  return !_mm256_testz_si256(rare, rare);
}

// A whole block in one pass, eight lanes at a time: the operations of
// moments() and apply() in their order (fma exactly where they use
// std::fma), so the same bits, but each value is loaded and stored once and
// nothing goes through a scratch array. The square root: kMkl, MKL's SSE
// algorithm inline (SqrtKind::MklSse; a vector with a rare lane takes the
// library's sqrt for those eight values), else the hardware's correctly
// rounded one (SqrtKind::CorrectlyRounded, as apply() with std::sqrt).
// n a multiple of 8. Writes p, m and v; the low-precision copy follows.
template <bool kL2, bool kSmall, bool kMkl>
__attribute__((target("avx2,fma"))) void fused_256(const Scalars& s, const VectorSqrt& vs,
                                                   const float* __restrict grad,
                                                   float* __restrict p, float* __restrict m,
                                                   float* __restrict v, size_t n) {
  const __m256 scale = _mm256_set1_ps(s.scale), wd = _mm256_set1_ps(s.wd);
  const __m256 w = _mm256_set1_ps(kSmall ? s.w : s.w_minus_1);
  const __m256 b2 = _mm256_set1_ps(s.b2), c2 = _mm256_set1_ps(s.c2);
  const __m256 bc2 = _mm256_set1_ps(s.bc2_sqrt), eps = _mm256_set1_ps(s.eps);
  const __m256 decay = _mm256_set1_ps(s.decay), neg_step = _mm256_set1_ps(s.neg_step_size);
  for (size_t i = 0; i < n; i += 8) {
    const __m256 pi = _mm256_loadu_ps(p + i);
    __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + i), scale);
    if (kL2) g = _mm256_fmadd_ps(wd, pi, g);
    const __m256 mi = _mm256_loadu_ps(m + i);
    const __m256 diff = _mm256_sub_ps(g, mi);
    const __m256 mo = _mm256_fmadd_ps(w, diff, kSmall ? mi : g);
    const __m256 vo =
        _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
    _mm256_storeu_ps(m + i, mo);
    _mm256_storeu_ps(v + i, vo);
    __m256 root;
    if constexpr (kMkl) {
      __m256i rare;
      root = mkl_sqrt_8(vo, &rare);
      if (__builtin_expect(!_mm256_testz_si256(rare, rare), 0)) {
        alignas(32) float out[8];
        vs.fn(8, v + i, out, vs.mode);
        root = _mm256_load_ps(out);
      }
    } else {
      root = _mm256_sqrt_ps(vo);
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(root, bc2), eps);
    const __m256 step = _mm256_div_ps(_mm256_mul_ps(neg_step, mo), denom);
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_mul_ps(pi, decay), step));
  }
}

// MKL's SSE sqrt of sixteen lanes (as mkl_sqrt_8): the estimate must be
// rsqrtps's own (AVX-512's rsqrt14 gives other bits, so other roots), taken
// on the two halves; the rest runs on full-width registers, the special
// lanes found with mask compares. `rare` gets the lanes MKL hands to its
// rare-case code.
__attribute__((target("avx512f,avx2,fma"), always_inline)) inline __m512 mkl_sqrt_16(
    __m512 x, __mmask16* rare) {
  const __m512 half = _mm512_set1_ps(0.5f);
  // The halves as vector shuffles (GCC 12's cast and extract intrinsics
  // warn of an undefined input, -Wuninitialized); the join as one
  // vinsertf64x4 (a shuffle compiles to two register moves and a vshuff32x4:
  // 7% of the whole update in cache).
  const __m256 x_lo = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 x_hi = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256 y_lo = _mm256_rsqrt_ps(x_lo), y_hi = _mm256_rsqrt_ps(x_hi);
  __m512 y;
  __asm__("vinsertf64x4 $1, %2, %g1, %0" : "=v"(y) : "v"(y_lo), "v"(y_hi));
  const __m512 s = _mm512_mul_ps(x, y);
  const __m512 h = _mm512_mul_ps(y, half);
  const __m512 e = _mm512_sub_ps(half, _mm512_mul_ps(s, h));
  const __m512 s1 = _mm512_add_ps(_mm512_mul_ps(s, e), s);
  const __m512 h1 = _mm512_add_ps(_mm512_mul_ps(h, e), h);
  const __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(s1, s1));
  const __m512 root = _mm512_add_ps(_mm512_mul_ps(r, h1), s1);
  const __m512i bits = _mm512_castps_si512(x);
  const __mmask16 special =
      _mm512_cmpgt_epi32_mask(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7F800000)),
                              _mm512_set1_epi32(static_cast<int>(0xFEFFF000u)));
  const __mmask16 nonzero = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x7FFFFFFF));
  *rare = special & nonzero;
  return _mm512_mask_blend_ps(special, root, x);
}

// fused_256 sixteen lanes at a time (AVX-512F): the same operations in the
// same order, so the same bits, in fewer instructions per element (the
// kernel is bound by instruction throughput once the data is in cache).
// With kMkl a vector with a rare lane takes the library's sqrt for those
// sixteen values. kScaled: the gradient is multiplied by s.scale (else by
// nothing, which gives the same bits: x * 1 == x). n a multiple of 16.
template <bool kL2, bool kSmall, bool kScaled, bool kMkl>
__attribute__((target("avx512f,avx2,fma"))) void fused_512(const Scalars& s, const VectorSqrt& vs,
                                                           const float* __restrict grad,
                                                           float* __restrict p, float* __restrict m,
                                                           float* __restrict v, size_t n) {
  const __m512 scale = _mm512_set1_ps(s.scale), wd = _mm512_set1_ps(s.wd);
  const __m512 w = _mm512_set1_ps(kSmall ? s.w : s.w_minus_1);
  const __m512 b2 = _mm512_set1_ps(s.b2), c2 = _mm512_set1_ps(s.c2);
  const __m512 bc2 = _mm512_set1_ps(s.bc2_sqrt), eps = _mm512_set1_ps(s.eps);
  const __m512 decay = _mm512_set1_ps(s.decay), neg_step = _mm512_set1_ps(s.neg_step_size);
  for (size_t i = 0; i < n; i += 16) {
    const __m512 pi = _mm512_loadu_ps(p + i);
    __m512 g = _mm512_loadu_ps(grad + i);
    if (kScaled) g = _mm512_mul_ps(g, scale);
    if (kL2) g = _mm512_fmadd_ps(wd, pi, g);
    const __m512 mi = _mm512_loadu_ps(m + i);
    const __m512 diff = _mm512_sub_ps(g, mi);
    const __m512 mo = _mm512_fmadd_ps(w, diff, kSmall ? mi : g);
    const __m512 vo =
        _mm512_fmadd_ps(_mm512_mul_ps(c2, g), g, _mm512_mul_ps(_mm512_loadu_ps(v + i), b2));
    _mm512_storeu_ps(m + i, mo);
    _mm512_storeu_ps(v + i, vo);
    __m512 root;
    if constexpr (kMkl) {
      __mmask16 rare;
      root = mkl_sqrt_16(vo, &rare);
      if (__builtin_expect(rare != 0, 0)) {
        alignas(64) float out[16];
        vs.fn(16, v + i, out, vs.mode);
        root = _mm512_load_ps(out);
      }
    } else {
      root = _mm512_maskz_sqrt_ps(0xFFFF, vo);  // plain form: GCC 12 warns (undefined input)
    }
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(root, bc2), eps);
    const __m512 step = _mm512_div_ps(_mm512_mul_ps(neg_step, mo), denom);
    _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_mul_ps(pi, decay), step));
  }
}
#endif

// The low-precision copy of p[0, n) into out, sixteen lanes at a time, with
// the same bits as to_bf16/to_f16 (F16C's conversion is the one torch uses
// for half). Where out is 32-byte aligned (whole blocks of an aligned
// tensor), non-temporal stores: the copy is read later (by the forward, or
// an upload), so fetching its lines before writing them (2 of the 30 bytes
// the pass moves per element) is wasted; the range function fences them.
// n a multiple of 16.
template <LowpKind kLowp>
__attribute__((target("avx512f,avx2,fma"))) void lowp_copy_512(const float* __restrict p,
                                                               uint16_t* __restrict out, size_t n) {
  const bool stream = (reinterpret_cast<uintptr_t>(out) & 31) == 0;
  for (size_t i = 0; i < n; i += 16) {
    const __m512 x = _mm512_loadu_ps(p + i);
    // The zero-masking forms and vector arithmetic: GCC 12's plain
    // conversion and shift intrinsics warn of an undefined input.
    __m256i h;
    if constexpr (kLowp == LowpKind::Float16) {
      h = _mm512_maskz_cvtps_ph(0xFFFF, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      using U32x16 = uint32_t __attribute__((vector_size(64)));
      const U32x16 u = reinterpret_cast<U32x16>(x);
      const U32x16 r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
      const U32x16 nan = reinterpret_cast<U32x16>(x != x);  // all ones in NaN lanes
      h = _mm512_maskz_cvtepi32_epi16(0xFFFF,
                                      reinterpret_cast<__m512i>((r & ~nan) | (nan & 0xFFFFu)));
    }
    auto* dst = reinterpret_cast<__m256i*>(out + i);
    if (stream)
      _mm256_stream_si256(dst, h);
    else
      _mm256_storeu_si256(dst, h);
  }
}

// The low-precision copy of p[0, n) into lowp (after fused_256).
template <LowpKind kLowp, size_t kFixed>
AIO_ALWAYS_INLINE void lowp_copy(const float* __restrict p, void* __restrict lowp, size_t n) {
  uint16_t* __restrict out = static_cast<uint16_t*>(lowp);
  const size_t count = kFixed ? kFixed : n;
  for (size_t i = 0; i < count; ++i) {
    if (kLowp == LowpKind::BFloat16) out[i] = to_bf16(p[i]);
    if (kLowp == LowpKind::Float16) out[i] = to_f16(p[i]);
  }
}

// Square roots of sq[0, n) into root, as vs says (the CorrectlyRounded kind
// is done in apply()). sq has room for a whole block: a short tail is padded
// with ones so the vector loop needs no remainder.
template <Isa kIsa>
AIO_ALWAYS_INLINE void roots(const VectorSqrt& vs, float* __restrict sq, float* __restrict root,
                             size_t n) {
#ifdef AIO_ADAM_AVX2
  if (vs.kind == SqrtKind::MklSse) {
    const size_t padded = (n + 7) / 8 * 8;
    for (size_t i = n; i < padded; ++i) sq[i] = 1.0f;
    bool rare;
    if constexpr (kIsa != Isa::Portable)
      rare = mkl_sse_sqrt_256(sq, root, padded);
    else
      rare = mkl_sse_sqrt_128(sq, root, padded);
    if (!rare) return;
  }
#endif
  vs.fn(static_cast<int32_t>(n), sq, root, vs.mode);
}

#ifdef AIO_ADAM_AVX2
// A whole block of kBlock elements at i through the fused loop of the ISA,
// then its low-precision copy. The square root kind (MklSse or
// CorrectlyRounded; not External) and the scale are chosen per block: a
// branch per 256 elements.
template <bool kL2, bool kSmall, LowpKind kLowp, Isa kIsa>
AIO_ALWAYS_INLINE void fused_block(const Scalars& s, const AdamBuffers& b, const VectorSqrt& vs,
                                   size_t i, uint16_t* lowp) {
  constexpr size_t n = kBlock;
  static_assert(n % 16 == 0, "whole vectors");
  const float* g = b.grad + i;
  float *p = b.param + i, *m = b.exp_avg + i, *v = b.exp_avg_sq + i;
  const bool mkl = vs.kind == SqrtKind::MklSse;
  if constexpr (kIsa == Isa::Avx512) {
    if (s.scaled)
      mkl ? fused_512<kL2, kSmall, true, true>(s, vs, g, p, m, v, n)
          : fused_512<kL2, kSmall, true, false>(s, vs, g, p, m, v, n);
    else
      mkl ? fused_512<kL2, kSmall, false, true>(s, vs, g, p, m, v, n)
          : fused_512<kL2, kSmall, false, false>(s, vs, g, p, m, v, n);
    if constexpr (kLowp != LowpKind::None) lowp_copy_512<kLowp>(p, lowp, n);
  } else {
    mkl ? fused_256<kL2, kSmall, true>(s, vs, g, p, m, v, n)
        : fused_256<kL2, kSmall, false>(s, vs, g, p, m, v, n);
    if constexpr (kLowp != LowpKind::None) lowp_copy<kLowp, n>(p, lowp, n);
  }
}
#endif

// One block of n elements starting at i (n == kFixed when kFixed != 0).
template <bool kL2, bool kSmall, LowpKind kLowp, Isa kIsa, size_t kFixed>
AIO_ALWAYS_INLINE void run_block(const Scalars& s, const AdamBuffers& b, const VectorSqrt& vs,
                                 size_t i, size_t n, float* __restrict sq, float* __restrict root) {
  uint16_t* lowp = b.lowp ? static_cast<uint16_t*>(b.lowp) + i : nullptr;
#ifdef AIO_ADAM_AVX2
  if constexpr (kIsa != Isa::Portable && kFixed == kBlock) {
    if (vs.kind != SqrtKind::External) {
      fused_block<kL2, kSmall, kLowp, kIsa>(s, b, vs, i, lowp);
      return;
    }
  }
#endif
  moments<kL2, kSmall, kFixed>(s, b.grad + i, b.param + i, b.exp_avg + i, b.exp_avg_sq + i, sq, n);
  if (vs.kind != SqrtKind::CorrectlyRounded) {
    roots<kIsa>(vs, sq, root, n);
    apply<kLowp, true, kFixed>(s, root, b.exp_avg + i, b.param + i, lowp, n);
  } else {
    apply<kLowp, false, kFixed>(s, sq, b.exp_avg + i, b.param + i, lowp, n);
  }
}

template <bool kL2, bool kSmall, LowpKind kLowp, Isa kIsa>
AIO_ALWAYS_INLINE void run_range(const Scalars& s, const AdamBuffers& b, const VectorSqrt& vs,
                                 size_t begin, size_t end) {
  alignas(64) float sq[kBlock];
  alignas(64) float root[kBlock];
  size_t i = begin;
  for (; end - i >= kBlock; i += kBlock)
    run_block<kL2, kSmall, kLowp, kIsa, kBlock>(s, b, vs, i, kBlock, sq, root);
  if (i < end) run_block<kL2, kSmall, kLowp, kIsa, 0>(s, b, vs, i, end - i, sq, root);
}

using RangeFn = void (*)(const Scalars&, const AdamBuffers&, const VectorSqrt&, size_t, size_t);

template <bool kL2, bool kSmall, LowpKind kLowp>
void range_portable(const Scalars& s, const AdamBuffers& b, const VectorSqrt& vs, size_t begin,
                    size_t end) {
  run_range<kL2, kSmall, kLowp, Isa::Portable>(s, b, vs, begin, end);
}

#ifdef AIO_ADAM_AVX2
template <bool kL2, bool kSmall, LowpKind kLowp>
__attribute__((target("avx2,fma"))) void range_avx2(const Scalars& s, const AdamBuffers& b,
                                                    const VectorSqrt& vs, size_t begin,
                                                    size_t end) {
  run_range<kL2, kSmall, kLowp, Isa::Avx2>(s, b, vs, begin, end);
}

template <bool kL2, bool kSmall, LowpKind kLowp>
__attribute__((target("avx512f,avx2,fma"))) void range_avx512(const Scalars& s,
                                                              const AdamBuffers& b,
                                                              const VectorSqrt& vs, size_t begin,
                                                              size_t end) {
  run_range<kL2, kSmall, kLowp, Isa::Avx512>(s, b, vs, begin, end);
  // lowp_copy_512's non-temporal stores, ordered before the caller (or the
  // thread waiting for this one) goes on.
  if constexpr (kLowp != LowpKind::None) _mm_sfence();
}
#endif

template <bool kL2, bool kSmall, LowpKind kLowp>
RangeFn pick_isa() {
#ifdef AIO_ADAM_AVX2
  const Isa isa = kernel_isa();
  if (isa == Isa::Avx512) return &range_avx512<kL2, kSmall, kLowp>;
  if (isa == Isa::Avx2) return &range_avx2<kL2, kSmall, kLowp>;
#endif
  return &range_portable<kL2, kSmall, kLowp>;
}

template <bool kL2, bool kSmall>
RangeFn pick_lowp(LowpKind k) {
  switch (k) {
    case LowpKind::BFloat16:
      return pick_isa<kL2, kSmall, LowpKind::BFloat16>();
    case LowpKind::Float16:
      return pick_isa<kL2, kSmall, LowpKind::Float16>();
    case LowpKind::None:
      break;
  }
  return pick_isa<kL2, kSmall, LowpKind::None>();
}

// [begin, end) with bfloat16 moments: per block, the moments are widened into
// float32 arrays, updated by the float32 range function `fn` (the same
// operations, so the same bits as widening the whole tensor first), and
// rounded back. Memory sees 2 bytes per moment each way instead of 4.
void range_bf16_states(RangeFn fn, const Scalars& s, const AdamBuffers& b, const VectorSqrt& vs,
                       size_t begin, size_t end) {
  alignas(64) float m[kBlock];
  alignas(64) float v[kBlock];
  for (size_t i = begin; i < end; i += kBlock) {
    const size_t n = std::min(kBlock, end - i);
    for (size_t k = 0; k < n; ++k)
      m[k] = float_of(static_cast<uint32_t>(b.exp_avg_bf16[i + k]) << 16);
    for (size_t k = 0; k < n; ++k)
      v[k] = float_of(static_cast<uint32_t>(b.exp_avg_sq_bf16[i + k]) << 16);
    AdamBuffers block;
    block.param = b.param + i;
    block.grad = b.grad + i;
    block.exp_avg = m;
    block.exp_avg_sq = v;
    block.lowp = b.lowp ? static_cast<unsigned char*>(b.lowp) + 2 * i : nullptr;
    block.lowp_kind = b.lowp_kind;
    block.numel = n;
    fn(s, block, vs, 0, n);
    for (size_t k = 0; k < n; ++k) b.exp_avg_bf16[i + k] = bf16_from_bits(bits_of(m[k]));
    for (size_t k = 0; k < n; ++k) b.exp_avg_sq_bf16[i + k] = bf16_from_bits(bits_of(v[k]));
  }
}

RangeFn pick(const Scalars& s, LowpKind k) {
  if (s.l2) return s.small_weight ? pick_lowp<true, true>(k) : pick_lowp<true, false>(k);
  return s.small_weight ? pick_lowp<false, true>(k) : pick_lowp<false, false>(k);
}

// Spins for up to kSpin waiting for done() before the caller blocks. A
// sleeping thread takes tens of microseconds to wake on a virtual machine
// (measured here: ~50 us per call, 7% of a 24-sub-group step), while calls
// come back to back inside one optimizer step; a short spin bridges them.
// OpenMP (DeepSpeedCPUAdam's threads) spins far longer by default.
constexpr auto kSpin = std::chrono::microseconds(100);

template <class Done>
bool spin_until(Done done) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (unsigned i = 1;; ++i) {
    if (done()) return true;
#ifdef AIO_ADAM_AVX2
    _mm_pause();
#endif
    if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) return done();
  }
}

// A few workers that spin briefly, then sleep on a condition variable
// between jobs (they share the cores with the I/O threads). One job at a
// time; the caller runs part 0 itself.
class WorkerPool {
 public:
  // Calls fn(begin, end) over [0, n) in chunks of `chunk`, on the caller and
  // up to parts - 1 workers. Returns once every chunk is done; it never waits
  // for a worker that has not joined yet (a late worker finds the job over).
  void run(unsigned parts, size_t n, size_t chunk, const std::function<void(size_t, size_t)>& fn) {
    std::lock_guard<std::mutex> job(job_mu_);
    grow(parts - 1);
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_ = n;
      chunk_ = chunk;
      parts_ = parts;
      next_.store(0, std::memory_order_relaxed);
      generation_.store(generation_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    }
    wake_.notify_all();  // no system call when every worker is spinning
    take_chunks(fn);
    // Every chunk is taken; wait for the workers still inside theirs.
    spin_until([&] { return active_.load(std::memory_order_acquire) == 0; });
    std::unique_lock<std::mutex> lk(mu_);
    // Workers that joined finish the chunks they took; then none may join.
    done_.wait(lk, [&] { return active_.load(std::memory_order_relaxed) == 0; });
    fn_ = nullptr;
  }

 private:
  void take_chunks(const std::function<void(size_t, size_t)>& fn) {
    for (;;) {
      const size_t begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
      if (begin >= n_) return;
      fn(begin, std::min(n_, begin + chunk_));
    }
  }

  void grow(unsigned workers) {
    while (threads_.size() < workers) {
      const unsigned id = static_cast<unsigned>(threads_.size()) + 1;
      threads_.emplace_back([this, id] { work(id); });
    }
  }

  void work(unsigned id) {
    uint64_t seen = 0;
    for (;;) {
      spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
      std::unique_lock<std::mutex> lk(mu_);
      wake_.wait(lk, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
      seen = generation_.load(std::memory_order_relaxed);
      if (fn_ == nullptr || id >= parts_) continue;  // woke after the job ended
      const std::function<void(size_t, size_t)>* fn = fn_;
      active_.fetch_add(1, std::memory_order_relaxed);
      lk.unlock();
      take_chunks(*fn);
      lk.lock();
      if (active_.fetch_sub(1, std::memory_order_release) == 1) done_.notify_one();
    }
  }

  std::mutex job_mu_;  // one job at a time
  std::mutex mu_;      // guards the job's fields; the atomics change under it too
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(size_t, size_t)>* fn_ = nullptr;  // the running job
  size_t n_ = 0, chunk_ = 1;
  unsigned parts_ = 0;
  std::atomic<unsigned> active_{0};  // workers inside take_chunks
  std::atomic<uint64_t> generation_{0};
  std::atomic<size_t> next_{0};
};

// The process's pool. Never destroyed: its workers sleep until exit. A
// forked child has none of the parent's threads, so it starts its own.
WorkerPool& pool() {
  static std::mutex mu;
  static WorkerPool* p = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lk(mu);
  if (!p || owner != getpid()) {
    p = new WorkerPool();
    owner = getpid();
  }
  return *p;
}

// One job for an OpenMP team: every member takes chunks until none is left.
struct TeamJob {
  const std::function<void(size_t, size_t)>* fn;
  size_t n, chunk;
  std::atomic<size_t> next{0};
};

void team_member(void* data) {
  auto* job = static_cast<TeamJob*>(data);
  for (;;) {
    const size_t begin = job->next.fetch_add(job->chunk, std::memory_order_relaxed);
    if (begin >= job->n) return;
    (*job->fn)(begin, std::min(job->n, begin + job->chunk));
  }
}

// Equal chunks of at most about kChunk elements, whole blocks, as many as a
// multiple of `parts`: with a count that does not divide evenly, one thread
// is left stepping the last chunk alone (24 sub-groups of 2M elements made 8
// chunks, 7.6 of them full). The shared counter still lets a thread whose
// core is busy elsewhere take fewer.
size_t chunk_size(size_t n, unsigned parts) {
  const size_t per_part = (n + parts - 1) / parts;
  const size_t rounds = (per_part + kChunk - 1) / kChunk;
  const size_t chunk = (n + parts * rounds - 1) / (parts * rounds);
  return (chunk + kBlock - 1) / kBlock * kBlock;
}

}  // namespace

const char* adam_isa() { return isa_name(kernel_isa()); }

bool mkl_sse_supported() {
#ifdef AIO_ADAM_AVX2
  return true;
#else
  return false;
#endif
}

namespace {

// The square root the caller asked for, or the one that can run here.
VectorSqrt usable(VectorSqrt vs) {
  if (vs.fn == nullptr || (vs.kind == SqrtKind::MklSse && !mkl_sse_supported()))
    vs.kind = vs.fn ? SqrtKind::External : SqrtKind::CorrectlyRounded;
  return vs;
}

// body(begin, end) over [0, n): on the calling thread for small n or one
// thread, else in chunks on the OpenMP team (`parallel`) or aio's pool.
void split(size_t n, unsigned threads, ParallelFn parallel,
           const std::function<void(size_t, size_t)>& body) {
  const size_t most = std::max<size_t>(1, n / (kAdamSerialBelow / 2));
  const unsigned parts = static_cast<unsigned>(std::min<size_t>(std::max(threads, 1u), most));
  if (parts <= 1 || n < kAdamSerialBelow) {
    body(0, n);
    return;
  }
  const size_t chunk = chunk_size(n, parts);
  if (parallel) {
    TeamJob job{&body, n, chunk};
    // The whole team even when there are fewer chunks than threads (members
    // without one return at once): a smaller team makes libgomp end the
    // surplus workers, start them again for the next full-size region, and
    // count fewer OpenMP threads (omp_park.h).
    parallel(&team_member, &job, threads, 0);  // returns when all are done
    return;
  }
  pool().run(parts, n, chunk, body);
}

// One tensor's update, ready to run over any range of its elements.
struct Prepared {
  Scalars s;
  AdamBuffers b;
  RangeFn fn;
  size_t start;  // its first element in the concatenation of all tasks

  Prepared(const AdamBuffers& buf, const AdamHyper& hp, size_t at)
      : s(make_scalars(hp)), b(buf), start(at) {
    if (b.lowp == nullptr) b.lowp_kind = LowpKind::None;
    fn = pick(s, b.lowp_kind);
  }

  void run(const VectorSqrt& vs, size_t begin, size_t end) const {
    if (b.exp_avg_bf16 != nullptr)
      range_bf16_states(fn, s, b, vs, begin, end);
    else
      fn(s, b, vs, begin, end);
  }
};

}  // namespace

void adam_update(const AdamBuffers& buf, const AdamHyper& hp, unsigned threads,
                 const VectorSqrt& vsqrt_in, ParallelFn parallel) {
  if (buf.numel == 0) return;
  const VectorSqrt vsqrt = usable(vsqrt_in);
  const Prepared w(buf, hp, 0);
  split(buf.numel, threads, parallel, [&](size_t begin, size_t end) { w.run(vsqrt, begin, end); });
}

namespace {

// The buffers a task writes (nullptr: none); an empty tensor writes only
// its count.
std::array<const void*, 7> written(const AdamTask& t) {
  const AdamBuffers& b = t.buf;
  if (b.numel == 0) return {t.step};
  return {t.step, b.param, b.exp_avg, b.exp_avg_sq, b.exp_avg_bf16, b.exp_avg_sq_bf16, b.lowp};
}

// Where the tasks are cut into pieces that each write every buffer at most
// once (the end of each piece, in order). One piece but for a buffer listed
// twice: torch lets a group hold one parameter twice and steps it twice, and
// in one region the two updates would race on its memory.
std::vector<size_t> piece_ends(const AdamTask* tasks, size_t count) {
  std::vector<const void*> all;
  all.reserve(count * 7);
  for (size_t k = 0; k < count; ++k)
    for (const void* p : written(tasks[k]))
      if (p != nullptr) all.push_back(p);
  std::sort(all.begin(), all.end(), std::less<const void*>());  // a total order
  if (std::adjacent_find(all.begin(), all.end()) == all.end()) return {count};
  std::vector<size_t> ends;
  std::unordered_set<const void*> seen;  // this piece's buffers
  for (size_t k = 0; k < count; ++k) {
    const auto mine = written(tasks[k]);
    const bool clash = std::any_of(mine.begin(), mine.end(), [&](const void* p) {
      return p != nullptr && seen.count(p) != 0;
    });
    if (clash) ends.push_back(k), seen.clear();
    for (const void* p : mine)
      if (p != nullptr) seen.insert(p);
  }
  ends.push_back(count);
  return ends;
}

// adam_update_many for tasks that write distinct buffers, counts checked.
void update_piece(const AdamTask* tasks, size_t count, const AdamHyper& hp, unsigned threads,
                  const VectorSqrt& vsqrt, ParallelFn parallel) {
  std::vector<Prepared> work;
  work.reserve(count);
  size_t total = 0;
  for (size_t k = 0; k < count; ++k) {
    if (tasks[k].buf.numel == 0) continue;
    AdamHyper h = hp;
    h.step = *tasks[k].step + 1.0f;
    work.emplace_back(tasks[k].buf, h, total);
    total += tasks[k].buf.numel;
  }
  // A chunk of the concatenation: the pieces of the tensors it covers.
  const auto body = [&](size_t begin, size_t end) {
    auto it = std::upper_bound(work.begin(), work.end(), begin,
                               [](size_t at, const Prepared& w) { return at < w.start; });
    for (--it; it != work.end() && it->start < end; ++it) {
      const size_t lo = std::max(begin, it->start), hi = std::min(end, it->start + it->b.numel);
      it->run(vsqrt, lo - it->start, hi - it->start);
    }
  };
  if (total > 0) split(total, threads, parallel, body);
  for (size_t k = 0; k < count; ++k) *tasks[k].step += 1.0f;
}

}  // namespace

void check_adam_counts(const AdamTask* tasks, size_t count) {
  kernel_isa();  // a bad AIO_MAX_CPU_ISA throws here, before anything changes
  // A count that passes stays valid when counted on again (one listed
  // twice): adding 1 to a finite float never overflows.
  for (size_t k = 0; k < count; ++k) {
    const float next = *tasks[k].step + 1.0f;
    if (!(std::isfinite(next) && next >= 1.0f))
      throw std::invalid_argument("tensor " + std::to_string(k) + ": step count " +
                                  std::to_string(*tasks[k].step) + " cannot be counted on");
  }
}

void adam_update_many(const AdamTask* tasks, size_t count, const AdamHyper& hp, unsigned threads,
                      const VectorSqrt& vsqrt_in, ParallelFn parallel) {
  check_adam_counts(tasks, count);
  const VectorSqrt vsqrt = usable(vsqrt_in);
  size_t begin = 0;
  for (size_t end : piece_ends(tasks, count)) {
    update_piece(tasks + begin, end - begin, hp, threads, vsqrt, parallel);
    begin = end;
  }
}

}  // namespace aio
