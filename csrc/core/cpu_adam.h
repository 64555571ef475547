// One fused pass of the Adam/AdamW update over fp32 CPU buffers, bit-identical
// to torch's single-tensor Adam (torch.optim.Adam/AdamW with foreach=False,
// fused=False) when given the same vector square root as torch uses.
//
// torch runs a chain of full passes over memory (lerp_, mul_, addcmul_, sqrt,
// div, add_, addcdiv_); here each element is read once and written once, in
// cache-sized blocks, vectorized, over a small persistent thread pool. Every
// rounding step is the one torch's CPU kernels perform, in the same order:
//   g  = grad * grad_scale                      (only with a grad scale)
//   g  = fma(weight_decay, param, g)            (Adam: L2, torch add(alpha))
//   m  = fma(w, g - m, m) if w < 0.5 else fma(w - 1, g - m, g), w = 1 - beta1
//   v  = fma((1 - beta2) * g, g, v * beta2)     (mul_ then addcmul_)
//   d  = sqrt(v) / sqrt(bias_correction2) + eps
//   p  = p * (1 - lr * weight_decay)            (AdamW: decoupled)
//   p  = p + (-step_size * m) / d               (addcdiv_)
// with every scalar computed in double as torch's Python code does, then
// rounded to float as ATen does. Files compiled from this need
// -ffp-contract=off: a fused multiply-add torch does not do changes results.
#pragma once

#include <cstddef>
#include <cstdint>

namespace aio {

// The square root torch's sqrt computes. On x86 that is MKL's vmsSqrt, which
// is not always the correctly rounded one, so the result must come from the
// same algorithm:
//   CorrectlyRounded  IEEE sqrt (torch builds without MKL; aarch64).
//   External          fn (MKL VML's signature: count, input, output, mode).
//   MklSse            the algorithm of MKL's SSE kernel (what MKL runs on
//                     CPUs it gives no AVX path, e.g. AMD), in-line: one
//                     rsqrtps estimate, one Newton step for the root and its
//                     half-reciprocal, one correction, no FMA. Zeros give
//                     themselves; a block holding any other input MKL treats
//                     apart (subnormal, negative, huge, inf, NaN) is passed to
//                     fn. x86-64 only (mkl_sse_supported()); fn required.
// Python picks the kind that reproduces torch on the machine (aio/optim.py).
enum class SqrtKind { CorrectlyRounded, External, MklSse };

struct VectorSqrt {
  SqrtKind kind = SqrtKind::CorrectlyRounded;
  void (*fn)(int32_t n, const float* in, float* out, int64_t mode) = nullptr;
  int64_t mode = 0;
};

// Whether SqrtKind::MklSse can run here (x86-64 builds).
bool mkl_sse_supported();

// The instruction set adam_update's loops run with: "avx512", "avx2" or
// "portable", the best this CPU and OS support, lowered to the one the
// environment variable AIO_MAX_CPU_ISA names when it is set (read once, on
// first use). Every choice gives the same bits. Throws std::invalid_argument
// (as does adam_update) when the variable names none of the three.
const char* adam_isa();

// Optional low-precision copy of the updated parameter, written in the same
// pass: bfloat16 or IEEE half, rounded to nearest even like torch's
// .to(dtype) (NaN -> 0xFFFF for bfloat16; for half a quiet NaN keeping the
// sign and the top 10 payload bits).
enum class LowpKind { None, BFloat16, Float16 };

struct AdamBuffers {
  float* param = nullptr;
  const float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* lowp = nullptr;  // numel elements of lowp_kind, or nullptr
  LowpKind lowp_kind = LowpKind::None;
  size_t numel = 0;
  // bfloat16 moments instead of exp_avg/exp_avg_sq (both set, or neither):
  // each block is widened, updated in float32 exactly as above, and rounded
  // back to nearest even (bf16_from_bits), in the same pass.
  uint16_t* exp_avg_bf16 = nullptr;
  uint16_t* exp_avg_sq_bf16 = nullptr;
};

struct AdamHyper {
  double step = 1;  // the step count after this update's increment (>= 1)
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  bool decoupled = false;  // AdamW's decay of the parameter, else L2 on the gradient
  bool has_grad_scale = false;
  double grad_scale = 1;  // multiplies the gradient first (as grad.mul_(scale))
};

// An OpenMP runtime's GOMP_parallel(fn, data, num_threads, flags): libgomp's
// entry point, which LLVM's and Intel's runtimes export too. Found at run
// time in the runtime the process already has (torch's), never linked.
using ParallelFn = void (*)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);

// Updates param, exp_avg and exp_avg_sq in place (and writes lowp). grad is
// only read. threads <= 1, or fewer than about 64K elements, runs on the
// calling thread; otherwise chunks run on the calling thread plus threads - 1
// others: the OpenMP runtime's team when `parallel` is given (sharing the
// threads torch's own kernels use, which spin between jobs: a second pool
// would compete with them for the cores), else this library's pool, where
// concurrent calls are serialized. The result does not depend on the thread
// count. Buffers must not overlap. External and MklSse need vsqrt.fn
// (without one they fall back to CorrectlyRounded).
void adam_update(const AdamBuffers& buf, const AdamHyper& hp, unsigned threads,
                 const VectorSqrt& vsqrt = VectorSqrt(), ParallelFn parallel = nullptr);

// One tensor of adam_update_many: its buffers and its step count, kept as a
// float32 (as torch keeps Adam's in a float32 tensor) that the call counts on.
struct AdamTask {
  AdamBuffers buf;
  float* step = nullptr;
};

// adam_update for every task, each as if called alone with hp.step set to
// its *step + 1 (added in float32, as torch's `step_t += 1`), and the same
// bits; then each *step holds that count. One parallel region covers all of
// them, split by elements, not tensors: a model's many small tensors (biases,
// norms) cost a call each otherwise, more than their update. Every count is
// checked first (finite and at least 1, else std::invalid_argument naming the
// task) so that a refused call changes nothing. Tasks that write one buffer
// (a parameter listed twice, a shared count) run one after the other, in
// order, as separate calls would; buffers that partly overlap are not
// detected and must not be given.
void adam_update_many(const AdamTask* tasks, size_t count, const AdamHyper& hp, unsigned threads,
                      const VectorSqrt& vsqrt = VectorSqrt(), ParallelFn parallel = nullptr);

// The checks adam_update_many makes before it changes anything (the counts,
// the instruction set), alone: a caller stepping several lists with
// different hyper-parameters checks them all before the first call.
void check_adam_counts(const AdamTask* tasks, size_t count);

// Elements below which adam_update never uses the pool.
constexpr size_t kAdamSerialBelow = size_t{1} << 16;

}  // namespace aio
