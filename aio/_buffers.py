"""Turn user buffers into (pointer, byte count) for the core, and keep track of
the memory that I/O in flight is writing into or reading from.

Accepted: contiguous torch tensors (CPU, or CUDA through a pinned bounce
buffer), numpy arrays, and any object exporting a C-contiguous buffer.
torch is imported only when a tensor is actually passed.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

# Largest size or offset the core (int64 offsets, off_t) can address.
MAX_OFFSET = 2**63 - 1
# A blocking wait in the core is cut into slices this long so that Python runs
# pending signal handlers (Ctrl-C) between them: the core waits with the GIL
# released and a signal alone never wakes it.
WAIT_SLICE_S = 0.05


@dataclass
class ResolvedBuffer:
    """A buffer as the core sees it: address and size, plus what keeps the memory alive."""

    ptr: int
    nbytes: int
    keepalive: Any  # objects that own the memory; held until the I/O is done
    cuda_tensor: Any = None  # set when the memory is a host bounce for this GPU tensor


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def tensor_nbytes(t: Any) -> int:
    """Bytes of a tensor's elements (numel x element size)."""
    return int(t.numel()) * int(t.element_size())


def _check_tensor(t: Any, argname: str) -> None:
    """Refuse tensors whose bytes are not plainly their values."""
    import torch

    if t.layout != torch.strided:
        raise ValueError(f"{argname}: {t.layout} tensors are not supported (call .to_dense())")
    if t.is_quantized:
        raise ValueError(f"{argname}: quantized tensors are not supported (call .dequantize())")
    if t.device.type == "meta":
        raise ValueError(f"{argname}: a meta tensor has no memory to read or write")
    # Lazy conjugation/negation is a flag: the memory holds the unconjugated
    # (un-negated) values, so moving the raw bytes would silently be wrong.
    if t.is_conj():
        raise ValueError(f"{argname}: tensor is lazily conjugated; call .resolve_conj() first")
    if t.is_neg():
        raise ValueError(f"{argname}: tensor is lazily negated; call .resolve_neg() first")
    if not t.is_contiguous() or any(s == 0 for s, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        raise ValueError(f"{argname}: tensor must be contiguous (call .contiguous() first)")


def _resolve_tensor(t: Any, writable: bool, argname: str) -> ResolvedBuffer:
    _check_tensor(t, argname)
    if t.device.type == "cuda":
        import torch

        host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        if not writable:
            host.copy_(t.reshape(-1))
        return ResolvedBuffer(host.data_ptr(), tensor_nbytes(t), host, cuda_tensor=t)
    if t.device.type != "cpu":
        raise ValueError(f"{argname}: tensors on device '{t.device}' are not supported")
    # Hold the storage, not just the tensor: t.set_() or free_locked_tensor(t)
    # detach the tensor from its storage, which must outlive the I/O.
    return ResolvedBuffer(t.data_ptr(), tensor_nbytes(t), (t, t.untyped_storage()))


def resolve(buffer: Any, *, writable: bool, argname: str = "buffer") -> ResolvedBuffer:
    """Validate `buffer` and return its address and size.

    writable=True is required for reads (the buffer receives data).
    Raises TypeError for unsupported objects (including memory holding Python
    object pointers) and ValueError for unusable ones.
    """
    if _is_tensor(buffer):
        return _resolve_tensor(buffer, writable, argname)
    if isinstance(buffer, np.ndarray):
        if buffer.dtype.hasobject:
            raise TypeError(
                f"{argname}: arrays of Python objects (dtype {buffer.dtype}) hold "
                "pointers, not data; they cannot be read or written"
            )
        if not buffer.flags.c_contiguous:
            raise ValueError(f"{argname}: array must be C-contiguous (use np.ascontiguousarray)")
        if writable and not buffer.flags.writeable:
            raise ValueError(f"{argname}: array is read-only; a read needs a writable buffer")
        # The array holds its base (and so the memory's owner) alive.
        return ResolvedBuffer(int(buffer.__array_interface__["data"][0]), int(buffer.nbytes), buffer)
    if isinstance(buffer, (str, int, float)) or buffer is None:
        raise TypeError(
            f"{argname}: expected a tensor, numpy array or buffer object, got {type(buffer).__name__}"
        )
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise TypeError(
            f"{argname}: expected a tensor, numpy array or buffer object, got {type(buffer).__name__}"
        ) from None
    if "O" in mv.format:
        raise TypeError(f"{argname}: buffer holds Python object pointers (format {mv.format!r})")
    if not mv.c_contiguous:
        raise ValueError(f"{argname}: buffer must be C-contiguous")
    if writable and mv.readonly:
        raise ValueError(
            f"{argname}: buffer is read-only ({type(buffer).__name__}); "
            "a read needs a writable buffer such as bytearray"
        )
    flat = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
    if flat.nbytes == 0:
        return ResolvedBuffer(0, 0, buffer)
    arr = np.frombuffer(flat, dtype=np.uint8)
    # The export (held by `arr`) keeps the exporter from resizing or freeing it.
    return ResolvedBuffer(int(arr.__array_interface__["data"][0]), int(flat.nbytes), (buffer, arr))


# -- timeouts and interruptible waits -----------------------------------------
def deadline(timeout: Any, name: str = "timeout") -> float | None:
    """Monotonic deadline for `timeout` seconds; None (or inf) means none."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or None, got {type(timeout).__name__}")
    t = float(timeout)
    if math.isnan(t) or t < 0:
        raise ValueError(f"{name} must be >= 0 seconds (or None/inf for no timeout), got {timeout}")
    if math.isinf(t):
        return None
    return time.monotonic() + t


def wait_sliced(wait_for: Any, until: float | None) -> bool:
    """Call ``wait_for(seconds) -> bool`` in short slices until it returns True
    or `until` passes; return the last answer. Ctrl-C interrupts it."""
    while True:
        if until is None:
            step = WAIT_SLICE_S
        else:
            left = until - time.monotonic()
            if left <= 0:
                return bool(wait_for(0.0))
            step = min(WAIT_SLICE_S, left)
        if wait_for(step):
            return True


# -- memory with I/O in flight ------------------------------------------------
_inflight_lock = threading.Lock()
# token -> (start, end, request, pid of the process that submitted it, what
# owns the memory). The registry, not the future, keeps the memory alive:
# a future dropped before it settles (Ctrl-C in sync_pread, a caller that
# never waits) must not free memory a worker still reads or writes.
_inflight: dict[int, tuple[int, int, Any, int, Any]] = {}
_tokens = itertools.count(1)


class UnattachedSubmit:
    """Stands in the registry for the request of a submit that has not handed
    one over: still running, or cut short after it may have queued I/O (a
    Ctrl-C handler that ran as the core returned, a MemoryError after some
    pieces were queued). Its I/O, if any, belongs to the handle `core`, so
    waiting for it means waiting until that handle is idle."""

    __slots__ = ("_core", "ended")

    def __init__(self, core: Any) -> None:
        self._core = core  # None once the handle was idle after the submit ended
        self.ended = False  # the submit is over: nothing more will be queued

    def wait(self, seconds: float) -> bool:
        """Whether the handle was idle within `seconds` (the core's request wait)."""
        core = self._core
        if core is None:
            return True
        ended = self.ended
        if not core.drain_for(seconds):
            return False
        if ended:
            # Idle after the submit ended: whatever it queued is done for good.
            self._core = None
        return True

    def done(self) -> bool:
        """Whether the submit ended and everything it may have queued is done."""
        return self.ended and self.wait(0.0)


def track_inflight(ptr: int, nbytes: int, keepalive: Any, core: Any) -> int:
    """Record, before its request is submitted on the core handle `core`, that
    [ptr, ptr + nbytes) will have I/O in flight, and hold `keepalive` (what
    owns that memory) until untrack_inflight(); attach the request with
    attach_request(). Returns the token both take. Until a request is
    attached, waiting for the range waits for `core` to be idle (see
    UnattachedSubmit), so a submit cut short after it queued I/O never lets
    the memory be reused under that I/O."""
    with _inflight_lock:
        if len(_inflight) >= 256:  # futures nobody collects: forget finished ones
            for tok in [k for k, v in _inflight.items() if v[2].done()]:
                del _inflight[tok]
        tok = next(_tokens)
        _inflight[tok] = (ptr, ptr + nbytes, UnattachedSubmit(core), os.getpid(), keepalive)
    return tok


def attach_request(token: int, req: Any) -> None:
    """The request now using a range registered by track_inflight()."""
    with _inflight_lock:
        start, end, _, pid, keep = _inflight[token]
        _inflight[token] = (start, end, req, pid, keep)


def abandon_inflight(token: int) -> None:
    """The submit of a range registered by track_inflight() ended without a
    future (interrupted, or failed after it may have queued I/O): the entry
    keeps the memory until its handle has been idle, then may be forgotten."""
    with _inflight_lock:
        entry = _inflight.get(token)
    if entry is not None and isinstance(entry[2], UnattachedSubmit):
        entry[2].ended = True


def untrack_inflight(token: int) -> None:
    """Forget a range registered by track_inflight() (its I/O is done, or its
    submit failed) and let go of its memory."""
    with _inflight_lock:
        _inflight.pop(token, None)


def wait_range_idle(start: int, nbytes: int) -> None:
    """Block (interruptibly) until no I/O in flight touches [start, start + nbytes)."""
    end = start + nbytes
    with _inflight_lock:
        # A parent's requests never finish in a forked child (no workers
        # there) and touch only the parent's copy of the memory: skip them.
        me = os.getpid()
        busy = [
            (tok, req)
            for tok, (lo, hi, req, pid, _) in _inflight.items()
            if lo < end and start < hi and pid == me
        ]
    for _, req in busy:
        wait_sliced(req.wait, None)
    # Abandoned submits have no future to untrack them: once done, their
    # memory can go.
    with _inflight_lock:
        for tok, req in busy:
            if isinstance(req, UnattachedSubmit) and req.done():
                _inflight.pop(tok, None)
