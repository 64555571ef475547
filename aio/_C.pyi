# Type stubs for the compiled core (csrc/bindings/module.cpp).
# Integer arguments take any Python int (or __index__ object): a non-integer
# raises TypeError, a value below the allowed range ValueError, above it
# OverflowError, each naming the argument.
from typing import Any

class Request:
    def done(self) -> bool: ...
    # timeout in seconds; negative, None or inf: no timeout; NaN: ValueError.
    # In a forked child (request submitted by the parent) wait() and result()
    # raise HandleStateError.
    def wait(self, timeout: float | None = -1.0) -> bool: ...
    def result(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def is_write(self) -> bool: ...

class Handle:
    def __init__(
        self,
        block_size: int,
        queue_depth: int,
        single_submit: bool,
        overlap_events: bool,
        thread_count: int,
        engine: str,
    ) -> None: ...
    # offset + nbytes must fit in int64 (OverflowError); a path with a NUL byte
    # is a ValueError. Overlapping requests (either a write) run in order.
    def submit(self, op: int, ptr: int, nbytes: int, path: str, fd: int, offset: int) -> Request: ...
    # `count` requests of `piece` bytes: piece i at ptr + i * piece and file
    # offset offsets_ptr[i] (an int64 array); all checked before any is queued.
    def submit_pieces(
        self, op: int, ptr: int, piece: int, offsets_ptr: int, count: int, path: str, fd: int
    ) -> list[Request]: ...
    def drain(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    @property
    def engine(self) -> str: ...
    @property
    def engine_reason(self) -> str: ...
    def alignment(self) -> int: ...
    def take_notices(self) -> list[str]: ...
    def forked(self) -> bool: ...
    # kind: "error", "short", "open_direct" or "no_direct_statx"; op: "read", "write", "any".
    def inject_fault(self, kind: str, errno: int, op: str, nth: int, count: int) -> None: ...
    def clear_fault(self) -> None: ...
    def fault_hits(self) -> int: ...

class PinnedBuffer:
    def __init__(self, nbytes: int, lock: bool = True) -> None: ...
    def __buffer__(self, flags: int) -> memoryview: ...
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def locked(self) -> bool: ...

class PinnedPool:
    def __init__(self, count: int, slot_bytes: int, lock: bool = True) -> None: ...
    # timeout_ms: negative, None or float inf: no timeout; returns -1 on timeout.
    def acquire(self, timeout_ms: int | float | None = -1) -> int: ...
    def release(self, index: int) -> None: ...
    def available(self) -> int: ...
    def slot_ptr(self, index: int) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...

def probe_alignment(fd: int) -> dict[str, Any]: ...
def engines() -> list[str]: ...
def locked_bytes() -> int: ...
def set_lock_fault(errno: int) -> None: ...
def page_size() -> int: ...

# One fused Adam/AdamW step over numel float32 elements at these addresses
# (csrc/core/cpu_adam.h; aio.optim.adam_update checks the tensors). step >= 1,
# lr/eps/weight_decay >= 0, betas in [0, 1), all finite, threads in [1, 1024],
# numel >= 0, else ValueError. lowp_kind: 'none', 'bfloat16' or 'float16'
# (lowp_ptr given exactly when not 'none'). sqrt_kind: 'exact' (correctly
# rounded), 'external' (sqrt_fn: address of a vector square root with MKL
# vmsSqrt's signature, sqrt_mode its mode) or 'mkl_sse' (MKL's SSE algorithm
# in-line, sqrt_fn for its rare inputs); see SqrtKind in cpu_adam.h.
# parallel_fn: address of an OpenMP runtime's GOMP_parallel to split the work
# over its team (0: aio's own worker pool); see ParallelFn in cpu_adam.h.
# state_kind 'bfloat16': exp_avg/exp_avg_sq hold bfloat16 (AdamBuffers).
def adam_update(
    param_ptr: int,
    grad_ptr: int,
    exp_avg_ptr: int,
    exp_avg_sq_ptr: int,
    numel: int,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float | None = None,
    lowp_ptr: int = 0,
    lowp_kind: str = "none",
    threads: int = 1,
    sqrt_kind: str = "exact",
    sqrt_fn: int = 0,
    sqrt_mode: int = 0,
    parallel_fn: int = 0,
    state_kind: str = "float32",
) -> None: ...

# adam_update over many tensors in one call and one parallel region, each as
# if called alone with step = its float32 count + 1, which is then stored.
# tasks: nine integers per tensor: param, grad, exp_avg, exp_avg_sq and step
# (a float32) addresses, lowp address (0: none), lowp kind (0 none,
# 1 bfloat16, 2 float16), state kind (0 float32, 1 bfloat16), numel. A count
# that is not finite and at least 1 after the increment: ValueError, nothing
# changed. The other arguments as for adam_update.
def adam_update_many(
    tasks: list[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float | None = None,
    threads: int = 1,
    sqrt_kind: str = "exact",
    sqrt_fn: int = 0,
    sqrt_mode: int = 0,
    parallel_fn: int = 0,
) -> None: ...

# adam_update_many's checks alone (the task list, every step count, the
# instruction set): ValueError before anything changes.
def adam_check_counts(tasks: list[int]) -> None: ...

# The instruction set adam_update runs with: 'avx512', 'avx2' or 'portable'
# (capped by AIO_MAX_CPU_ISA; ValueError when that names none of them).
def adam_isa() -> str: ...

# A parked OpenMP team (csrc/core/omp_park.h): acquire opens it through the
# runtime's GOMP_parallel on first use (ValueError for a null function or
# fewer than 2 threads); release drops one acquire; parked_threads: its size.
def omp_park_acquire(parallel_fn: int, threads: int) -> None: ...
def omp_park_release() -> None: ...
def omp_parked_threads() -> int: ...

# bfloat16 <-> float32 in place over numel elements at buf_ptr (csrc/core/
# bf16_inplace.h; aio/swap/lowp.py checks the buffer holds 4 * numel bytes).
def bf16_widen_inplace(buf_ptr: int, numel: int) -> None: ...
def bf16_narrow_inplace(buf_ptr: int, numel: int) -> None: ...
