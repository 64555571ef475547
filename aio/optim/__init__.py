"""A fast CPU Adam/AdamW step with torch's arithmetic.

torch's single-tensor Adam makes about eight passes over memory per step
(lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_); :func:`adam_update` does
the same arithmetic in one fused, vectorized, multi-threaded pass in the C++
core (csrc/core/cpu_adam.cpp), rounding exactly where torch rounds.

:class:`CPUAdam` and :class:`CPUAdamW` are drop-in optimizers built on it
(same hyper-parameters, same state and state_dict as torch's) that step each
parameter group in one call of the kernel, split over the threads by
elements: a model's many small tensors cost about 0.4 us each beyond the
checks, not a call each. :func:`fast_cpu_optimizer` swaps them in for torch's
classes.

The square root is the one choice. By default it is the correctly rounded
(IEEE) one, the hardware's: the results are the same bits on every CPU and
instruction set, and equal to ``torch.optim.Adam``/``AdamW`` with
``foreach=False, fused=False`` wherever torch's own ``sqrt`` is correctly
rounded (aarch64, builds without MKL). On x86 torch's ``sqrt`` is MKL's
``vmsSqrt``, which is not always correctly rounded (on the AMD CPU this was
written on it differs in the last bit for about one value in six).
``match_torch=True`` reproduces that too, bit for bit: the kernel computes
MKL's SSE algorithm in-line (what MKL runs on AMD CPUs), calls MKL's function
itself (found in torch's own library), or uses the correctly rounded root,
whichever a self-check against torch picks, once per process. That costs
about 35% more arithmetic per element (which shows only when the data is in
cache: a large update is bound by memory either way).
"""

from __future__ import annotations

import ctypes
import functools
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .. import _C
from .dtensor import check_pair, is_dtensor, local_of
from .grad_source import GradientSource
from .layout import Layout, ParamPiece

__all__ = [
    "CPUAdam",
    "CPUAdamW",
    "DriveLoadPlanner",
    "DriveSavePlanner",
    "GradientSource",
    "Layout",
    "NVMeAdam",
    "NVMeAdamW",
    "OpenMPThrottle",
    "ParamPiece",
    "adam_update",
    "fast_cpu_optimizer",
    "is_bit_exact",
    "kernel_isa",
]

# MKL VML mode torch passes (ATen/cpu/vml.h): VML_HA | VML_FTZDAZ_OFF |
# VML_ERRMODE_IGNORE.
_VML_MODE = 0x2 | 0x140000 | 0x100

_LOWP_KINDS = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _check_fp32(name: str, t: Any, numel: int | None, dtype: Any = torch.float32) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dtype != dtype:
        want = "float32" if dtype == torch.float32 else "float32 or bfloat16 (both moments alike)"
        raise TypeError(f"{name} must be {want}, got {t.dtype}")
    if t.is_sparse:
        raise TypeError(f"{name} must be dense, got a sparse tensor")
    if t.layout is not torch.strided:  # sparse CSR/BSR, mkldnn, jagged nested
        raise TypeError(f"{name} must be a dense strided tensor, got layout {t.layout}")
    if t.is_neg():  # its memory holds the negated values
        raise ValueError(f"{name} is a lazy negation view: pass {name}.resolve_neg()")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, param has {numel}")


def _check_lowp(lowp_out: Any, numel: int) -> tuple[int, str]:
    if lowp_out is None:
        return 0, "none"
    if not isinstance(lowp_out, torch.Tensor):
        raise TypeError(f"lowp_out must be a torch.Tensor or None, got {type(lowp_out).__name__}")
    if lowp_out.device.type != "cpu" or lowp_out.dtype not in _LOWP_KINDS:
        raise TypeError(
            f"lowp_out must be a CPU bfloat16 or float16 tensor, got {lowp_out.dtype} on {lowp_out.device}"
        )
    if not lowp_out.is_contiguous():
        raise ValueError("lowp_out must be contiguous")
    if lowp_out.numel() != numel:
        raise ValueError(f"lowp_out has {lowp_out.numel()} elements, param has {numel}")
    if numel == 0:  # nothing to write (and an empty tensor's data_ptr may be 0)
        return 0, "none"
    return lowp_out.data_ptr(), _LOWP_KINDS[lowp_out.dtype]


def _number(name: str, v: Any) -> float:
    # numbers.Real: also numpy's scalars (torch's optimizers take them).
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    return float(v)


def _threads(threads: Any) -> int:
    if threads is None:
        return max(1, torch.get_num_threads())
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be an int or None, got {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    return threads


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float | None = None,
    lowp_out: torch.Tensor | None = None,
    threads: int | None = None,
    match_torch: bool = False,
) -> None:
    """One Adam (``decoupled=False``, L2 weight decay) or AdamW step, in place.

    torch's single-tensor Adam given the same ``step`` (the count after this
    step's increment, >= 1), rounding where it rounds, with the correctly
    rounded square root; ``match_torch=True``: with torch's own square root
    on this machine, so equal to it bit for bit (see the module's
    docstring; slower when the data is in cache). ``grad`` is only read;
    ``grad_scale`` multiplies it first, rounding as ``grad.mul_(grad_scale)``
    would. ``lowp_out`` (bfloat16 or float16, same numel) receives
    ``param.to(lowp_out.dtype)`` of the updated parameter in the same pass.
    ``threads`` defaults to ``torch.get_num_threads()``; below 64K elements
    the calling thread does all the work.

    ``exp_avg`` and ``exp_avg_sq`` may both be bfloat16 (aio's extension, for
    bf16 optimizer states): they are widened, updated in float32 exactly as
    above and rounded back to nearest even, in the same pass.

    All tensors must be contiguous CPU tensors of one size, float32 but for
    bfloat16 moments (TypeError for the wrong kind, ValueError for the wrong
    shape or layout); hyper-parameters out of range (e.g. beta1 outside
    [0, 1)) are ValueError.
    """
    n = _check_tensors(param, grad, exp_avg, exp_avg_sq)
    hyper = [step, lr, beta1, beta2, eps, weight_decay]
    if not all(type(x) is float for x in hyper):  # the usual case needs no checks
        hyper = [_number(k, x) for k, x in zip(_HYPER_NAMES, hyper, strict=True)]
    if grad_scale is not None:
        grad_scale = _number("grad_scale", grad_scale)
    lowp_ptr, lowp_kind = _check_lowp(lowp_out, n)
    threads = _threads(threads)
    sqrt_kind, sqrt_fn, sqrt_mode = _vector_sqrt() if match_torch else _IEEE_SQRT
    # Positional: pybind11 matches keywords by name on every call (~2 us).
    _C.adam_update(
        param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n,
        hyper[0], hyper[1], hyper[2], hyper[3], hyper[4], hyper[5], bool(decoupled), grad_scale,
        lowp_ptr, lowp_kind, threads, sqrt_kind, sqrt_fn, sqrt_mode,
        _omp_parallel() if threads > 1 else 0,
        "bfloat16" if exp_avg.dtype is torch.bfloat16 else "float32",
    )  # fmt: skip


_HYPER_NAMES = ("step", "lr", "beta1", "beta2", "eps", "weight_decay")


def _fp32_ok(t: Any, n: int, dtype: Any = torch.float32) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.dtype is dtype
        and t.layout is torch.strided
        and t.is_cpu
        and t.is_contiguous()
        and t.numel() == n
        and not t.is_neg()
    )


def _check_tensors(param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any) -> int:
    """The element count of four valid, distinct update tensors, else the
    TypeError/ValueError naming the first bad one. The step runs once per
    parameter or sub-group: the common case is checked in one go."""
    n = param.numel() if isinstance(param, torch.Tensor) else -1
    states = exp_avg.dtype if getattr(exp_avg, "dtype", None) is torch.bfloat16 else torch.float32
    ok = _fp32_ok(param, n) and _fp32_ok(grad, n)
    if not (ok and _fp32_ok(exp_avg, n, states) and _fp32_ok(exp_avg_sq, n, states)):
        _check_fp32("param", param, None)
        n = param.numel()
        _check_fp32("grad", grad, n)
        _check_fp32("exp_avg", exp_avg, n, states)
        _check_fp32("exp_avg_sq", exp_avg_sq, n, states)
    if n > 0 and not _disjoint([_span(t) for t in (param, grad, exp_avg, exp_avg_sq)]):
        # Torch refuses such operands too: the kernel reads and writes each
        # element of all four at once, so shared memory gives silent garbage.
        raise ValueError(
            "param, grad, exp_avg and exp_avg_sq must be four different tensors whose memory does not overlap"
        )
    return int(n)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


def _disjoint(spans: list[tuple[int, int]]) -> bool:
    """Whether no two (address, bytes) ranges share a byte."""
    spans = sorted(s for s in spans if s[1] > 0)
    return all(a + na <= b for (a, na), (b, _) in zip(spans, spans[1:], strict=False))


_LOWP_CODES = {"none": 0, "bfloat16": 1, "float16": 2}


def _task_fields(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], low: Any) -> list[int]:
    """One parameter's entry in ``_C.adam_update_many``'s task list, after the
    checks :func:`adam_update` makes (its state made by ``CPUAdam._state_of``)."""
    m, v, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
    n = _check_tensors(p, grad, m, v)
    if n > 0 and not _disjoint([_span(t) for t in (p, grad, m, v, step)]):
        raise ValueError("the optimizer's step count shares memory with the parameter, gradient or state")
    lowp_ptr, lowp_kind = _check_lowp(low, n)
    bf16 = 1 if m.dtype is torch.bfloat16 else 0
    return [p.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), step.data_ptr(),
            lowp_ptr, _LOWP_CODES[lowp_kind], bf16, n]  # fmt: skip


def _usual_task(p: Any, grad: Any, state: Any, low: Any, keep: list[Any]) -> list[int] | None:
    """:func:`_task_fields` for the usual parameter, checked in one
    expression (a step of a model's many small tensors is mostly these
    checks): float32, CPU, contiguous with a data pointer (so strided), one
    size, four different tensors, none a lazy negation view, a float32 CPU
    step count, no lowp copy. None: anything else (also what is not a tensor
    at all), for the full checks and their messages. The tensors read are
    appended to `keep` (see :meth:`CPUAdam._tasks_of`)."""
    if not state or low is not None:
        return None
    m, v, step = state.get("exp_avg"), state.get("exp_avg_sq"), state.get("step")
    f32 = torch.float32
    try:
        ok = (
            p.dtype is f32 and grad.dtype is f32 and m.dtype is f32 and v.dtype is f32 and step.dtype is f32
            and p.is_cpu and grad.is_cpu and m.is_cpu and v.is_cpu and step.is_cpu
            and p.is_contiguous() and grad.is_contiguous() and m.is_contiguous() and v.is_contiguous()
            and not (p.is_neg() or grad.is_neg() or m.is_neg() or v.is_neg() or step.is_neg())
        )  # fmt: skip
        # Only now are the pointers read (a sparse COO tensor is not contiguous).
        n = p.numel() if ok else -1
        if not (ok and grad.numel() == n and m.numel() == n and v.numel() == n and step.numel() == 1):
            return None
        fields = [p.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), step.data_ptr(), 0, 0, 0, n]
    except (AttributeError, RuntimeError):  # not a tensor; sparse CSR or mkldnn (no strides or pointer)
        return None
    # The layouts left that are not strided have a null pointer (jagged nested).
    if not fields[4] or (n > 0 and not (all(fields[:4]) and _disjoint_f32(fields[:5], 4 * n))):
        return None
    keep += (grad, m, v, step)
    return fields


def _disjoint_f32(ptrs: list[int], nbytes: int) -> bool:
    """:func:`_disjoint` for the usual task: four tensors of `nbytes` and
    the 4-byte step count (the common case in few operations)."""
    a, b, c, d = sorted(ptrs[:4])
    if b - a < nbytes or c - b < nbytes or d - c < nbytes:
        return False
    s = ptrs[4]
    return not any(p - 4 < s < p + nbytes for p in (a, b, c, d))


# OpenMP runtimes, by file name, in the order preferred when several are in
# the process (all export libgomp's GOMP_parallel).
_OMP_RUNTIMES = ("libgomp", "libomp", "libiomp5")


def _loaded_omp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process, torch's first."""
    try:
        with open("/proc/self/maps") as f:
            fields = [line.split(None, 5) for line in f]
        paths = {x[5].strip() for x in fields if len(x) == 6}
    except OSError:  # not Linux: no runtime is used, aio's pool does the work
        return []
    found = [p for p in paths if os.path.basename(p).startswith(_OMP_RUNTIMES) and ".so" in p]
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    return sorted(found, key=lambda p: (not os.path.realpath(p).startswith(torch_dir), p))


# Set in a child forked after this module was imported: it inherits the
# OpenMP runtime's state but not its threads, and a team started there waits
# for threads that do not exist, so a child uses aio's own pool.
_forked = False


def _mark_forked() -> None:
    global _forked
    _forked = True
    _omp_parallel.cache_clear()


os.register_at_fork(after_in_child=_mark_forked)


@functools.lru_cache(maxsize=1)
def _omp_parallel() -> int:
    """Address of GOMP_parallel in the OpenMP runtime torch already loaded, 0
    if there is none or this is a forked child. The kernel then runs on the
    threads torch's own kernels use (and spin on between jobs) instead of a
    second pool competing with them for the cores."""
    if _forked:
        return 0
    for path in _loaded_omp_runtimes():
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
            return ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value or 0
        except (OSError, AttributeError):
            continue
    return 0


def _libgomp_parallel() -> int:
    """GOMP_parallel of the runtime the kernel uses when that runtime is GNU
    libgomp (the one whose spin count depends on the thread count), else 0."""
    runtimes = _loaded_omp_runtimes()
    if not runtimes or not os.path.basename(runtimes[0]).startswith("libgomp"):
        return 0
    return _omp_parallel()


# Variables by which the user picked libgomp's waiting; then it is left alone.
_OMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


class OpenMPThrottle:
    """While open, torch's OpenMP workers sleep almost as soon as a parallel
    region ends instead of spinning for milliseconds.

    libgomp (torch's OpenMP runtime on Linux) spins a worker about 300,000
    iterations after each region before it sleeps, and 100 when the process
    has more OpenMP threads than CPUs (``GOMP_SPINCOUNT`` in its manual); the
    count is read once, when the runtime loads. This parks a sleeping team
    of as many threads as CPUs (csrc/core/omp_park.h), so that any region
    with workers puts the count over the CPUs. It is for processes whose
    main thread waits for I/O between short parallel regions: the spinning
    workers would take the cores the I/O threads need (aio.zero with NVMe
    offload). A compute-bound loop loses a little: its workers wake from
    sleep for every region. The parked threads only sleep; each has a
    thread's stack reserved.

    Nothing is parked (:attr:`active` is False) without libgomp, in a forked
    child, when torch runs one thread, or when ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` is set (the user's choice stands). Throttles share one
    team; :meth:`close` (or leaving the ``with`` block) ends this one's
    share, and the last one the team.
    """

    def __init__(self) -> None:
        self.active = False
        self._pid = os.getpid()
        parallel = _libgomp_parallel()
        if not parallel or any(k in os.environ for k in _OMP_WAIT_VARS) or torch.get_num_threads() < 2:
            return
        # libgomp counts a main-thread team of t as t threads and the parked
        # team of p as p - 1 more: with p = cpus any t >= 2 is over.
        _C.omp_park_acquire(parallel, max(2, len(os.sched_getaffinity(0))))
        self.active = True

    def close(self) -> None:
        """End this throttle (the team goes when the last one ends)."""
        if self.active:
            self.active = False
            if os.getpid() == self._pid:  # a forked child has no team to end
                _C.omp_park_release()

    def __enter__(self) -> OpenMPThrottle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _mkl_sqrt_address() -> int:
    """Address of MKL's vmsSqrt inside torch's CPU library, 0 if absent."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not torch.backends.mkl.is_available() or not os.path.exists(path):
        return 0
    try:
        lib = ctypes.CDLL(path)  # already loaded by torch: this only finds it
        fn = lib.vmsSqrt
    except (OSError, AttributeError):
        return 0
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


# (kind, function address, mode) as _C.adam_update takes them.
_Sqrt = tuple[str, int, int]
# The correctly rounded square root, the default (C++ SqrtKind::CorrectlyRounded).
_IEEE_SQRT: _Sqrt = ("exact", 0, 0)


def _matches_torch(sqrt: _Sqrt) -> bool:
    """Whether the kernel with this square root reproduces torch's Adam and
    AdamW here, on values spread over many magnitudes (zeros and subnormal
    second moments included)."""
    g = torch.Generator().manual_seed(1234)
    n = 4099
    for decoupled in (False, True):
        p0 = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
        grads = [torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 8) for _ in range(3)]
        for grad in grads:
            grad[:64] = 0.0
            grad[64:128] *= 1e-22
        ref = p0.clone().requires_grad_(True)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        opt = cls([ref], lr=1e-2, weight_decay=0.01, foreach=False)
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        for step, grad in enumerate(grads, start=1):
            ref.grad = grad.clone()
            opt.step()
            _C.adam_update(
                p.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), n,
                step=float(step), lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                decoupled=decoupled, sqrt_kind=sqrt[0], sqrt_fn=sqrt[1], sqrt_mode=sqrt[2],
            )  # fmt: skip
        if not torch.equal(ref.detach(), p):
            return False
    return True


@functools.lru_cache(maxsize=1)
def _choose_sqrt() -> tuple[_Sqrt, bool]:
    """(square root, bit-exact): the first that reproduces torch here of MKL's
    SSE algorithm in-line (x86 CPUs MKL runs its SSE kernel on), MKL's
    function itself, the correctly rounded one."""
    mkl = _mkl_sqrt_address()
    candidates: list[_Sqrt] = [("mkl_sse", mkl, _VML_MODE), ("external", mkl, _VML_MODE)] if mkl else []
    candidates.append(("exact", 0, 0))
    for cand in candidates:
        if _matches_torch(cand):
            return cand, True
    # None reproduces torch: still a correct Adam, to within an ulp.
    return candidates[-2 if mkl else -1], False


def _vector_sqrt() -> _Sqrt:
    return _choose_sqrt()[0]


def kernel_isa() -> str:
    """The instruction set :func:`adam_update` runs with here: ``"avx512"``,
    ``"avx2"`` or ``"portable"``, the best the CPU supports unless the
    environment variable ``AIO_MAX_CPU_ISA`` (read once, on first use) names
    a lower one. Every choice gives the same bits; a value of the variable
    naming none of the three is a ValueError here and in every update."""
    return str(_C.adam_isa())


def is_bit_exact() -> bool:
    """Whether :func:`adam_update` with ``match_torch=True`` reproduces torch's
    Adam bit for bit on this machine (checked once per process against torch
    itself)."""
    return _choose_sqrt()[1]


# Options of torch's Adam this implementation does not have, with the value
# that means "off".
_UNSUPPORTED_OFF: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "capturable": False,
    "differentiable": False,
}


def _unsupported(hyper: dict[str, Any]) -> str | None:
    """Why these hyper-parameters need torch's own Adam, or None."""
    for key, off in _UNSUPPORTED_OFF.items():
        if hyper.get(key, off):
            return f"{key}=True"
    for key in ("foreach", "fused"):
        if hyper.get(key):
            return f"{key}=True"
    if isinstance(hyper.get("lr"), torch.Tensor):
        return "a Tensor lr"
    betas = hyper.get("betas", (0.9, 0.999))
    if any(isinstance(b, torch.Tensor) for b in betas):
        return "Tensor betas"
    return None


def _group_hyper(group: dict[str, Any]) -> list[float]:
    """lr, beta1, beta2, eps and weight_decay of `group` as the kernel takes
    them (numbers, finite: else TypeError/ValueError naming the key), after
    :func:`_check_hyper`'s checks of their range."""
    beta1, beta2 = group["betas"]
    hyper = [group["lr"], beta1, beta2, group["eps"], group["weight_decay"]]
    if not all(type(x) is float for x in hyper):
        hyper = [_number(k, x) for k, x in zip(_HYPER_NAMES[1:], hyper, strict=True)]
    for name, x in zip(_HYPER_NAMES[1:], hyper, strict=True):
        if not math.isfinite(x):
            raise ValueError(f"{name} must be finite, got {x}")
    return hyper


def _check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    lr, eps, weight_decay = _number("lr", lr), _number("eps", eps), _number("weight_decay", weight_decay)
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= _number(f"betas[{i}]", b) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class CPUAdam(torch.optim.Optimizer):
    """``torch.optim.Adam`` for float32 CPU parameters: each parameter group
    in one fused, multi-threaded pass (:func:`adam_update`'s, over all of its
    tensors); a step refused (a bad tensor, a bad ``lowp_out``) changes nothing.

    Same constructor, state (``step`` as a float32 0-dim tensor,
    ``exp_avg``, ``exp_avg_sq``) and state_dict as torch's, so either can load
    the other's; the arithmetic of torch's default CPU Adam
    (``foreach=False, fused=False``) with the correctly rounded square root,
    or with ``match_torch=True`` bit-identical to it on this machine.
    ``amsgrad``, ``maximize``, ``capturable``, ``differentiable``,
    ``foreach=True``, ``fused=True`` and Tensor lr/betas are refused with
    ValueError; CUDA, non-float32 and sparse parameters or gradients with
    TypeError. ``threads`` and ``match_torch`` (not part of the state):
    ``threads`` defaults to ``torch.get_num_threads()``.

    DTensor parameters (FSDP2's ``fully_shard``, with ``CPUOffloadPolicy``
    on the CPU) are stepped through their local tensors, with the same bits
    as torch's AdamW; their ``exp_avg``/``exp_avg_sq`` are DTensors laid out
    as the parameter, as torch's are. A gradient laid out otherwise (a
    Partial one, another mesh) is a TypeError (:mod:`aio.optim.dtensor`).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        threads: int | None = None,
        match_torch: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        self._check_options(defaults)
        self.threads = _threads(threads) if threads is not None else None
        if not isinstance(match_torch, bool):
            raise TypeError(f"match_torch must be a bool, got {type(match_torch).__name__}")
        self.match_torch = match_torch
        super().__init__(params, defaults)  # each group checked by add_param_group

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, the group refused whole (left out of
        ``param_groups``) with a ValueError/TypeError when it cannot be
        stepped, not at the next step."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_options(group)
            for p in group["params"]:
                _check_param(p)
        except BaseException:
            del self.param_groups[-1]
            raise

    def __getstate__(self) -> dict[str, Any]:
        # torch's keeps defaults, state and param_groups only: a copy or a
        # pickle would lose these (torch's __setstate__ restores every key).
        return {**super().__getstate__(), "threads": self.threads, "match_torch": self.match_torch}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("threads", None)  # pickled before these were kept
        self.__dict__.setdefault("match_torch", False)

    def _check_options(self, group: dict[str, Any]) -> None:
        why = _unsupported(group)
        if why is not None:
            raise ValueError(f"{type(self).__name__} does not support {why}; use torch.optim.Adam/AdamW")
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: Any = None,
        lowp_out: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        """One optimizer step over every parameter that has a gradient.

        `grad_scale` (aio's addition: a number or a one-element tensor) steps as
        if every gradient had first been multiplied in place by it, rounding as
        ``grad.mul_(grad_scale)`` does, but in the same pass over memory and
        leaving the gradients unchanged. `lowp_out` (aio's addition) maps
        parameters to contiguous bfloat16/float16 tensors of their size: each
        receives its parameter's new values rounded as ``.to(dtype)`` does,
        written in the same pass."""
        scale = None if grad_scale is None else _scale_value(grad_scale)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every check of every group before any change: the step goes through
        # whole (parameters and step counts) or, refused, changes nothing.
        keep: list[Any] = []  # what the kernel reads lives until it is done
        groups = enumerate(self.param_groups)
        planned = [(self._tasks_of(g, lowp_out, keep, k), _group_hyper(g), g) for k, g in groups]
        if len(planned) > 1:  # the kernel's own checks (the counts) of every group too
            _C.adam_check_counts([x for tasks, _, _ in planned for x in tasks])
        for tasks, hyper, group in planned:
            if tasks:
                self._step_group(tasks, hyper, bool(group["decoupled_weight_decay"]), scale)
        return loss

    def _tasks_of(self, group: dict[str, Any], lowp_out: Any, keep: list[Any], index: int = 0) -> list[int]:
        """The task list of every parameter of `group` with a gradient,
        after every check (the state of a first step is made here). Every
        tensor it points into but the parameters is appended to `keep`: the
        kernel runs without the GIL, and a gradient or state replaced from
        another thread meanwhile must not be freed under it (a parameter's
        storage replaced, ``p.data = ...``, is not guarded: not from
        another thread during step())."""
        self._check_options(group)  # a group may have been edited or loaded
        tasks: list[int] = []
        for j, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                continue
            low = None if lowp_out is None else lowp_out.get(p)
            if is_dtensor(p) or is_dtensor(grad):  # FSDP2's shards: their local tensors
                check_pair(p, grad, f"parameter {j} of param group {index}")
                tasks += self._dtensor_task(p, grad, low, keep)
                continue
            state: Any = self.state.get(p)
            fields = _usual_task(p, grad, state, low, keep)
            if fields is None:  # first step, or anything unusual: every check
                state = self._state_of(p, grad)
                if grad._is_zerotensor():  # autograd's all-zero tensor has no memory
                    grad = torch.zeros(grad.shape, dtype=grad.dtype)
                grad = grad.resolve_neg().contiguous()  # what torch's step reads
                fields = _task_fields(p, grad, state, low)
                keep += (grad, state["exp_avg"], state["exp_avg_sq"], state["step"], low)
            tasks += fields
        return tasks

    def _dtensor_task(self, p: Any, grad: Any, low: Any, keep: list[Any]) -> list[int]:
        """The task of a DTensor parameter (FSDP2's shards): its local tensor
        stepped with its gradient's local tensor and the local tensors of its
        state, which are DTensors laid out as the parameter (as torch's AdamW
        makes them, so state_dict() and DCP see torch's format); `p` and
        `grad` already passed :func:`check_pair`."""
        state = self._state_of(p, grad)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        for name, t in (("exp_avg", m), ("exp_avg_sq", v)):
            if not is_dtensor(t):
                raise TypeError(
                    f"the state {name!r} of a DTensor parameter must be a DTensor laid out as the "
                    f"parameter (as torch's AdamW keeps it), got {type(t).__name__}"
                )
        grad = local_of(grad)
        if grad._is_zerotensor():
            grad = torch.zeros(grad.shape, dtype=grad.dtype)
        grad = grad.resolve_neg().contiguous()
        local = {"exp_avg": local_of(m), "exp_avg_sq": local_of(v), "step": state["step"]}
        fields = _task_fields(local_of(p), grad, local, low)
        keep += (grad, local["exp_avg"], local["exp_avg_sq"], state["step"], low)
        return fields

    def _step_group(self, tasks: list[int], hyper: list[float], decoupled: bool, scale: float | None) -> None:
        threads = _threads(self.threads)
        sqrt_kind, sqrt_fn, sqrt_mode = _vector_sqrt() if self.match_torch else _IEEE_SQRT
        _C.adam_update_many(
            tasks, hyper[0], hyper[1], hyper[2], hyper[3], hyper[4], decoupled,
            scale, threads, sqrt_kind, sqrt_fn, sqrt_mode, _omp_parallel() if threads > 1 else 0,
        )  # fmt: skip

    def _state_of(self, p: torch.Tensor, grad: torch.Tensor) -> dict[str, Any]:
        """`p`'s state (made on its first step), after checking `p` and its gradient."""
        _check_param(p)
        if grad.is_sparse:
            raise TypeError("CPUAdam does not support sparse gradients")
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        else:
            step = state["step"]
            if not (
                isinstance(step, torch.Tensor)
                and step.dtype is torch.float32
                and step.is_cpu
                and step.numel() == 1
                and step.layout is torch.strided
                and not step.is_neg()
                and not step._is_zerotensor()
            ):
                # A plain number, another dtype or device (older checkpoints):
                # counted on in a float32 CPU tensor from here, as torch's Adam does.
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
        return state


def _scale_value(v: Any) -> float:
    # torch's mul_ rounds a float32 gradient times a Python number or a float32 /
    # float64 one-element tensor in float32: the kernel casts the value to float.
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.is_complex() or not v.is_floating_point():
            raise TypeError(f"grad_scale must be a real one-element tensor, got {v.dtype} {tuple(v.shape)}")
        return float(v.item())
    return _number("grad_scale", v)


def step_scaled(
    optimizer: Any,
    grads: Iterable[torch.Tensor],
    grad_scale: Any,
    lowp_out: Mapping[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``optimizer.step()`` as if each of `grads` (the gradients it will use) had
    first been multiplied in place by `grad_scale` (None: 1): in the update's
    own pass for :class:`CPUAdam`/:class:`CPUAdamW`, else by ``grad.mul_``.
    Each parameter in `lowp_out` then also has its new values, rounded to
    the dtype of its tensor there, in that tensor: written by the update's
    pass (CPUAdam), else copied after the step."""
    if isinstance(optimizer, CPUAdam):
        optimizer.step(grad_scale=grad_scale, lowp_out=lowp_out)
        return
    if grad_scale is not None:
        for g in grads:
            g.mul_(grad_scale)
    optimizer.step()
    for p, out in (lowp_out or {}).items():
        out.copy_(p.detach().reshape(-1))


def _check_param(p: Any) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"params must be tensors, got {type(p).__name__}")
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise TypeError(
            f"CPUAdam/CPUAdamW take float32 CPU parameters, got {p.dtype} on {p.device}; "
            "use torch.optim.Adam/AdamW"
        )


class CPUAdamW(CPUAdam):
    """``torch.optim.AdamW`` for float32 CPU parameters: :class:`CPUAdam`
    with decoupled weight decay (default 1e-2)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        threads: int | None = None,
        match_torch: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
            threads=threads,
            match_torch=match_torch,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


def fast_cpu_optimizer(
    optimizer_cls: Any, hyper: dict[str, Any], match_torch: bool = False
) -> tuple[Any, dict[str, Any]]:
    """``(CPUAdam or CPUAdamW, hyper)`` in place of ``torch.optim.Adam`` or
    ``AdamW`` when the hyper-parameters are ones the fused kernel supports;
    otherwise the inputs unchanged. ``match_torch=True``: only where the
    kernel reproduces torch bit for bit on this machine (:func:`is_bit_exact`),
    and the returned hyper-parameters ask for that. The caller must only use
    the result for float32 CPU parameters (the classes refuse others with
    TypeError)."""
    fast = {torch.optim.Adam: CPUAdam, torch.optim.AdamW: CPUAdamW}.get(optimizer_cls)
    if fast is None or _unsupported(hyper) is not None or (match_torch and not is_bit_exact()):
        return optimizer_cls, hyper
    if fast is CPUAdamW and "decoupled_weight_decay" in hyper:
        return optimizer_cls, hyper  # torch's AdamW would reject it too
    return fast, {**hyper, "match_torch": True} if match_torch else dict(hyper)


if TYPE_CHECKING:
    from .dcp import DriveLoadPlanner, DriveSavePlanner
    from .nvme import NVMeAdam, NVMeAdamW


def __getattr__(name: str) -> Any:
    # NVMeAdam/NVMeAdamW on first use: they bring in aio.swap and aio.config,
    # which `import aio.optim` (the CPU kernel) does not need.
    if name in ("NVMeAdam", "NVMeAdamW"):
        from . import nvme

        return getattr(nvme, name)
    if name in ("DriveSavePlanner", "DriveLoadPlanner"):
        # The streamed DCP planners: torch.distributed.checkpoint on first use.
        from . import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
