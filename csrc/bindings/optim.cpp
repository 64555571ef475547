// aio._C.adam_update(_many): the fused CPU Adam/AdamW pass (csrc/core/cpu_adam.h).
// Python (aio/optim.py) checks the tensors (fp32, CPU, contiguous, sizes);
// this layer checks the numbers, releases the GIL and calls the core.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../core/bf16_inplace.h"
#include "../core/cpu_adam.h"
#include "../core/omp_park.h"

namespace py = pybind11;

namespace {

std::string num(double v) { return std::string(py::repr(py::float_(v))); }

// A finite number in [lo, hi] (hi_open: strictly below hi), else ValueError
// naming the argument. NaN fails every comparison and so is refused too.
double checked(const char* name, double v, double lo, double hi, bool hi_open) {
  const bool ok = std::isfinite(v) && v >= lo && (hi_open ? v < hi : v <= hi);
  if (!ok) {
    std::string range = "in [" + num(lo) + ", " + num(hi) + (hi_open ? ")" : "]");
    if (std::isinf(hi)) range = std::isinf(lo) ? "finite" : "finite and at least " + num(lo);
    throw py::value_error(std::string(name) + " must be " + range + ", got " + num(v));
  }
  return v;
}

float* fptr(const char* name, uintptr_t p, int64_t numel) {
  if (p == 0 && numel > 0) throw py::value_error(std::string(name) + " must not be null");
  return reinterpret_cast<float*>(p);
}

aio::SqrtKind sqrt_kind(const std::string& k, uintptr_t fn) {
  if (k == "exact") return aio::SqrtKind::CorrectlyRounded;
  aio::SqrtKind kind;
  if (k == "external")
    kind = aio::SqrtKind::External;
  else if (k == "mkl_sse")
    kind = aio::SqrtKind::MklSse;
  else
    throw py::value_error("sqrt_kind must be 'exact', 'external' or 'mkl_sse', got '" + k + "'");
  if (fn == 0) throw py::value_error("sqrt_kind '" + k + "' needs sqrt_fn");
  return kind;
}

aio::LowpKind lowp_kind(const std::string& k) {
  if (k == "none") return aio::LowpKind::None;
  if (k == "bfloat16") return aio::LowpKind::BFloat16;
  if (k == "float16") return aio::LowpKind::Float16;
  throw py::value_error("lowp_kind must be 'none', 'bfloat16' or 'float16', got '" + k + "'");
}

aio::AdamBuffers buffers(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq,
                         int64_t numel, bool bf16_states, uintptr_t lowp, aio::LowpKind kind) {
  if (numel < 0) throw py::value_error("numel must be at least 0, got " + std::to_string(numel));
  aio::AdamBuffers b;
  b.param = fptr("param", param, numel);
  b.grad = fptr("grad", grad, numel);
  if (bf16_states) {
    b.exp_avg_bf16 = reinterpret_cast<uint16_t*>(fptr("exp_avg", exp_avg, numel));
    b.exp_avg_sq_bf16 = reinterpret_cast<uint16_t*>(fptr("exp_avg_sq", exp_avg_sq, numel));
  } else {
    b.exp_avg = fptr("exp_avg", exp_avg, numel);
    b.exp_avg_sq = fptr("exp_avg_sq", exp_avg_sq, numel);
  }
  if ((kind == aio::LowpKind::None) != (lowp == 0))
    throw py::value_error("lowp_ptr must be given exactly when lowp_kind is not 'none'");
  b.lowp_kind = kind;
  b.lowp = reinterpret_cast<void*>(lowp);
  b.numel = static_cast<size_t>(numel);
  return b;
}

aio::AdamHyper hyper(double step, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool decoupled, const py::object& grad_scale) {
  const double inf = INFINITY;
  aio::AdamHyper h;
  h.step = checked("step", step, 1, inf, false);
  h.lr = checked("lr", lr, 0, inf, false);
  h.beta1 = checked("beta1", beta1, 0, 1, true);
  h.beta2 = checked("beta2", beta2, 0, 1, true);
  h.eps = checked("eps", eps, 0, inf, false);
  h.weight_decay = checked("weight_decay", weight_decay, 0, inf, false);
  h.decoupled = decoupled;
  h.has_grad_scale = !grad_scale.is_none();
  if (h.has_grad_scale)
    h.grad_scale = checked("grad_scale", grad_scale.cast<double>(), -inf, inf, false);
  return h;
}

aio::VectorSqrt vector_sqrt(const std::string& kind, uintptr_t fn, int64_t mode) {
  aio::VectorSqrt vs;
  vs.kind = sqrt_kind(kind, fn);
  vs.fn = reinterpret_cast<void (*)(int32_t, const float*, float*, int64_t)>(fn);
  vs.mode = mode;
  return vs;
}

unsigned thread_count(int64_t threads) {
  if (threads < 1 || threads > 1024)
    throw py::value_error("threads must be in [1, 1024], got " + std::to_string(threads));
  return static_cast<unsigned>(threads);
}

bool bf16_states(const std::string& state_kind) {
  if (state_kind == "bfloat16") return true;
  if (state_kind == "float32") return false;
  throw py::value_error("state_kind must be 'float32' or 'bfloat16', got '" + state_kind + "'");
}

void adam_update(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq,
                 int64_t numel, double step, double lr, double beta1, double beta2, double eps,
                 double weight_decay, bool decoupled, py::object grad_scale, uintptr_t lowp,
                 const std::string& kind, int64_t threads, const std::string& sqrt,
                 uintptr_t sqrt_fn, int64_t sqrt_mode, uintptr_t parallel_fn,
                 const std::string& state_kind) {
  const unsigned n_threads = thread_count(threads);
  const aio::AdamBuffers b = buffers(param, grad, exp_avg, exp_avg_sq, numel,
                                     bf16_states(state_kind), lowp, lowp_kind(kind));
  const aio::AdamHyper h = hyper(step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale);
  const aio::VectorSqrt vs = vector_sqrt(sqrt, sqrt_fn, sqrt_mode);
  const auto parallel = reinterpret_cast<aio::ParallelFn>(parallel_fn);
  py::gil_scoped_release nogil;
  aio::adam_update(b, h, n_threads, vs, parallel);
}

// Fields per tensor in adam_update_many's list, in this order.
constexpr size_t kTaskFields = 9;
constexpr aio::LowpKind kLowpCodes[] = {aio::LowpKind::None, aio::LowpKind::BFloat16,
                                        aio::LowpKind::Float16};

std::vector<aio::AdamTask> tasks_of(const std::vector<uint64_t>& f) {
  if (f.size() % kTaskFields != 0)
    throw py::value_error("tasks must hold 9 integers per tensor, got " + std::to_string(f.size()));
  std::vector<aio::AdamTask> tasks(f.size() / kTaskFields);
  for (size_t k = 0; k < tasks.size(); ++k) {
    const uint64_t* t = f.data() + k * kTaskFields;
    if (t[4] == 0) throw py::value_error("step_ptr must not be null");
    if (t[6] > 2 || t[7] > 1 || t[8] > uint64_t{INT64_MAX})
      throw py::value_error("tensor " + std::to_string(k) + ": bad lowp kind, state kind or numel");
    tasks[k].buf = buffers(t[0], t[1], t[2], t[3], static_cast<int64_t>(t[8]), t[7] == 1, t[5],
                           kLowpCodes[t[6]]);
    tasks[k].step = reinterpret_cast<float*>(t[4]);
  }
  return tasks;
}

void adam_update_many(const std::vector<uint64_t>& fields, double lr, double beta1, double beta2,
                      double eps, double weight_decay, bool decoupled, py::object grad_scale,
                      int64_t threads, const std::string& sqrt, uintptr_t sqrt_fn,
                      int64_t sqrt_mode, uintptr_t parallel_fn) {
  const unsigned n_threads = thread_count(threads);
  const std::vector<aio::AdamTask> tasks = tasks_of(fields);
  const aio::AdamHyper h = hyper(1, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale);
  const aio::VectorSqrt vs = vector_sqrt(sqrt, sqrt_fn, sqrt_mode);
  const auto parallel = reinterpret_cast<aio::ParallelFn>(parallel_fn);
  py::gil_scoped_release nogil;
  aio::adam_update_many(tasks.data(), tasks.size(), h, n_threads, vs, parallel);
}

void adam_check_counts(const std::vector<uint64_t>& fields) {
  const std::vector<aio::AdamTask> tasks = tasks_of(fields);
  aio::check_adam_counts(tasks.data(), tasks.size());
}

}  // namespace

// Registered from module.cpp.
void bind_optim(py::module_& m) {
  m.def("adam_update", &adam_update, py::arg("param_ptr"), py::arg("grad_ptr"),
        py::arg("exp_avg_ptr"), py::arg("exp_avg_sq_ptr"), py::arg("numel"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("decoupled"), py::arg("grad_scale") = py::none(), py::arg("lowp_ptr") = 0,
        py::arg("lowp_kind") = "none", py::arg("threads") = 1, py::arg("sqrt_kind") = "exact",
        py::arg("sqrt_fn") = 0, py::arg("sqrt_mode") = 0, py::arg("parallel_fn") = 0,
        py::arg("state_kind") = "float32");
  // tasks: per tensor the pointers of param, grad, exp_avg, exp_avg_sq and
  // its float32 step count, the lowp pointer (0: none), the lowp kind (0 none,
  // 1 bfloat16, 2 float16), the state kind (0 float32, 1 bfloat16), numel.
  m.def("adam_update_many", &adam_update_many, py::arg("tasks"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"),
        py::arg("grad_scale") = py::none(), py::arg("threads") = 1, py::arg("sqrt_kind") = "exact",
        py::arg("sqrt_fn") = 0, py::arg("sqrt_mode") = 0, py::arg("parallel_fn") = 0);
  m.def("adam_check_counts", &adam_check_counts, py::arg("tasks"));
  m.def("adam_isa", &aio::adam_isa);
  // aio/optim.py passes GOMP_parallel of the runtime torch loaded.
  m.def(
      "omp_park_acquire",
      [](uintptr_t parallel_fn, unsigned threads) {
        py::gil_scoped_release nogil;
        aio::omp_park_acquire(reinterpret_cast<aio::ParallelFn>(parallel_fn), threads);
      },
      py::arg("parallel_fn"), py::arg("threads"));
  m.def("omp_park_release", &aio::omp_park_release, py::call_guard<py::gil_scoped_release>());
  m.def("omp_parked_threads", &aio::omp_parked_threads);
  // aio/swap/lowp.py checks the buffer (4 * numel bytes, CPU, contiguous).
  m.def(
      "bf16_widen_inplace",
      [](uintptr_t buf, int64_t numel) {
        if (numel < 0) throw py::value_error("numel must be at least 0");
        py::gil_scoped_release nogil;
        aio::bf16_widen_inplace(reinterpret_cast<void*>(buf), static_cast<size_t>(numel));
      },
      py::arg("buf_ptr"), py::arg("numel"));
  m.def(
      "bf16_narrow_inplace",
      [](uintptr_t buf, int64_t numel) {
        if (numel < 0) throw py::value_error("numel must be at least 0");
        py::gil_scoped_release nogil;
        aio::bf16_narrow_inplace(reinterpret_cast<void*>(buf), static_cast<size_t>(numel));
      },
      py::arg("buf_ptr"), py::arg("numel"));
}
