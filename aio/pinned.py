"""Pinned (page-locked, page-aligned) host memory.

Without CUDA, memory is locked with ``mlock`` by the core (the kernel never
pages it out and direct I/O lands straight in it). With CUDA, torch's pinned
allocator is used so the same memory also serves fast host<->GPU copies.
Locking costs about 1 s per GiB, so allocate once and reuse (see PinnedPool).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

from . import _C

_lock = threading.Lock()
# start address -> byte count of locked tensors handed out by this module
_regions: dict[int, int] = {}


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch missing or broken CUDA setup
        return False


def new_locked_tensor(num_elem: int, dtype: Any) -> Any:
    """Return a 1-D torch tensor of `num_elem` elements in pinned memory."""
    import torch

    if isinstance(num_elem, bool) or not isinstance(num_elem, int):
        raise TypeError(f"num_elem must be an int, got {type(num_elem).__name__}")
    if num_elem < 0:
        raise ValueError(f"num_elem must be >= 0, got {num_elem}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = num_elem * itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    if _cuda_available():
        t = torch.empty(num_elem, dtype=dtype, pin_memory=True)
    else:
        buf = _C.PinnedBuffer(nbytes, True)
        # frombuffer keeps `buf` alive for as long as the tensor's storage lives.
        t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype)
    start = t.data_ptr()
    with _lock:
        _regions[start] = nbytes
    weakref.finalize(t, _forget, start)
    return t


def _forget(start: int) -> None:
    with _lock:
        _regions.pop(start, None)


def is_locked(tensor: Any) -> bool:
    """True if the tensor's memory is pinned (by us or by CUDA)."""
    ptr = tensor.data_ptr()
    with _lock:
        for start, n in _regions.items():
            if start <= ptr < start + n:
                return True
    try:
        return bool(tensor.is_pinned())
    except Exception:  # CPU-only builds may refuse
        return False


def free_locked_tensor(tensor: Any) -> bool:
    """Detach `tensor` from its pinned memory; returns whether it was pinned by us.

    The memory itself is unlocked and returned when the last view of it goes,
    so a stale view can never see freed memory (unlike a raw free).
    """
    start = tensor.data_ptr()
    with _lock:
        known = _regions.pop(start, None) is not None
    if known:
        tensor.set_()
    return known


def locked_bytes() -> int:
    """Bytes of host memory currently locked by aio in this process (mlock path)."""
    return int(_C.locked_bytes())


class Lease:
    """One slot of a PinnedPool. Release it (or use ``with``) when done."""

    def __init__(self, pool: PinnedPool, index: int) -> None:
        self._pool = pool
        self.index = index
        self.ptr = pool._c.slot_ptr(index)
        self.nbytes = pool.slot_bytes
        self._released = False

    def buffer(self) -> memoryview:
        """The slot as a writable memoryview (valid while the pool lives)."""
        arr = (ctypes.c_char * self.nbytes).from_address(self.ptr)
        arr._aio_pool = self._pool  # type: ignore[attr-defined]  # keep the pool alive
        return memoryview(arr).cast("B")

    def tensor(self, dtype: Any, numel: int | None = None) -> Any:
        """The slot (or its first `numel` elements) as a torch tensor."""
        import torch

        t = torch.frombuffer(self.buffer(), dtype=torch.uint8).view(dtype)
        if numel is not None:
            if numel > t.numel():
                raise ValueError(
                    f"numel={numel} does not fit in a pool slot of {self.nbytes} bytes "
                    f"({t.numel()} elements of {dtype})"
                )
            t = t[:numel]
        return t

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._c.release(self.index)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PinnedPool:
    """`count` equal slots of `slot_bytes` carved from one locked allocation.

    Slots start on page boundaries, so every slot is aligned for direct I/O.
    ``acquire()`` blocks (without holding the GIL) until a slot is free.
    """

    def __init__(self, count: int, slot_bytes: int, lock: bool = True) -> None:
        for name, v in (("count", count), ("slot_bytes", slot_bytes)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        self._c = _C.PinnedPool(count, slot_bytes, lock)
        self.count = count
        self.slot_bytes = int(self._c.slot_bytes)

    @property
    def total_bytes(self) -> int:
        return int(self._c.total_bytes)

    def available(self) -> int:
        return int(self._c.available())

    def acquire(self, timeout: float | None = None) -> Lease:
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        i = self._c.acquire(ms)
        if i < 0:
            raise TimeoutError(
                f"no free slot in the pinned pool ({self.count} slots) within {timeout} s; "
                "raise the buffer count or release leases sooner"
            )
        return Lease(self, int(i))
