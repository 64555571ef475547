"""Pinned (page-locked, page-aligned) host memory.

Two ways to get it, pinned differently:

- ``new_locked_tensor`` (and the handle's ``new_cpu_locked_tensor``):
  without CUDA, memory locked with ``mlock`` by the core (the kernel never
  pages it out and direct I/O lands straight in it). Once this process uses
  CUDA (``torch.cuda.is_initialized()``; pinning never creates a context on
  its own), page-aligned memory registered with ``cudaHostRegister`` instead, so it
  also serves fast host<->GPU copies (torch's own pinned allocator is the
  fallback; it may hand out memory that is not page-aligned, which the core
  then stages through an aligned bounce buffer). ``pinned_kind`` says which.
- ``PinnedPool``: one page-aligned allocation cut into equal slots, locked
  with ``mlock`` when ``lock=True`` (plain page-aligned memory otherwise).
  The pool itself never registers its memory with CUDA: copies between a
  slot and a GPU tensor are pageable-memory copies unless its owner
  registered it. Owners that feed a GPU do: aio.swap's swap buffers and
  aio.fsdp's parameter tier (device shards, ``pin_memory=True``) make the
  pool with ``lock=False``, register it with ``cudaHostRegister``
  (:func:`cuda_register`, counted once in :func:`locked_bytes`), make it an
  io_uring fixed buffer (:meth:`PinnedPool.make_fixed`), and fall back to
  ``lock=True`` when CUDA refuses.

Locking costs about 1 s per GiB, so allocate once and reuse.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from . import _C
from ._buffers import MAX_OFFSET, deadline, wait_range_idle, wait_sliced

_lock = threading.Lock()
# start address -> (byte count, how it was pinned, bytes it adds to
# locked_bytes()) of tensors handed out here
_regions: dict[int, tuple[int, str, int]] = {}
# Bytes pinned through CUDA (registered or torch-allocated); the mlock'ed
# bytes are counted by the core.
_cuda_pinned = 0

MLOCK, CUDA_REGISTER, CUDA_PIN_MEMORY = "mlock", "cuda_register", "cuda_pin_memory"


def _cuda_available() -> bool:
    """Whether this process already uses CUDA. Pinning through CUDA creates a
    context (hundreds of MiB on GPU 0), so a job that never touched CUDA (CPU
    offload only) gets ``mlock``-ed memory instead; so does a forked child of
    a CUDA parent, where CUDA cannot be used at all."""
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:  # pragma: no cover - torch missing or broken CUDA setup
        return False


def _cudart() -> Any:
    import torch

    return torch.cuda.cudart()


def _cuda_ok(res: Any) -> bool:
    try:
        return int(res) == 0  # cudaSuccess
    except (TypeError, ValueError):
        return getattr(res, "value", None) == 0


def _count_cuda(nbytes: int) -> None:
    global _cuda_pinned
    with _lock:
        _cuda_pinned += nbytes


def _unregister(ptr: int, nbytes: int, buf: Any, pid: int) -> None:
    # Runs when the last view of the memory is gone; `buf` (the mapping) is
    # released only after the registration is. A forked child never
    # registered it (and cannot call CUDA): nothing to undo there.
    try:
        if os.getpid() == pid:
            _cudart().cudaHostUnregister(ptr)
    finally:
        _count_cuda(-nbytes)
        del buf


def _clear_cuda_error() -> None:
    # A failed runtime call leaves the thread's last error set, and the next
    # unrelated kernel launch would raise it: read it to clear it.
    try:
        _cudart().cudaGetLastError()
    except (AttributeError, RuntimeError):  # pragma: no cover - older torch bindings
        pass


def cuda_register(ptr: int, nbytes: int) -> Callable[[], None] | None:
    """Register `nbytes` of host memory at `ptr` with CUDA (cudaHostRegister):
    page-locked without ``mlock`` (so RLIMIT_MEMLOCK does not apply) and a DMA
    source for host<->GPU copies. Returns the callable that unregisters it
    (call it before freeing the memory), or None when CUDA refuses; then the
    memory stays pageable and CUDA's error state is cleared."""
    if not _cuda_ok(_cudart().cudaHostRegister(ptr, nbytes, 0)):
        _clear_cuda_error()
        return None
    _count_cuda(nbytes)
    pid = os.getpid()

    def unregister() -> None:
        try:
            if os.getpid() == pid:  # a forked child has no registration to undo
                _cudart().cudaHostUnregister(ptr)
        finally:
            _count_cuda(-nbytes)

    return unregister


Register = Callable[[int, int], "Callable[[], None] | None"]


def registered_tensor(num_elem: int, dtype: Any, register: Register) -> tuple[Any, int]:
    """A 1-D tensor of `num_elem` elements in page-aligned host memory of its
    own (whole pages, no power-of-two rounding), page-locked by
    ``register(ptr, nbytes)`` (e.g. a compute device's cudaHostRegister) and
    unregistered when its last view is gone. Returns the tensor and the bytes
    registered (0 when `register` refused: the memory is then pageable)."""
    import torch

    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = max(num_elem * itemsize, 1)
    pages = page_round(nbytes)
    buf = _C.PinnedBuffer(pages, False)
    mv = memoryview(buf)
    undo = register(buf.ptr, pages)
    if undo is not None:
        buf.make_fixed()
        weakref.finalize(mv, _run_then_drop, undo, buf)
    t = torch.frombuffer(mv, dtype=torch.uint8, count=num_elem * itemsize).view(dtype)
    return t, pages if undo is not None else 0


def _run_then_drop(undo: Callable[[], None], buf: Any) -> None:
    # The registration goes before the memory does.
    try:
        undo()
    finally:
        del buf


def _cuda_pinned_bytes(nbytes: int) -> tuple[memoryview, str]:
    """Page-aligned memory pinned for CUDA: our mapping registered with CUDA,
    else torch's pinned allocator. The memoryview owns it; its death releases it."""
    import torch

    buf = _C.PinnedBuffer(nbytes, False)
    mv = memoryview(buf)
    if _cuda_ok(_cudart().cudaHostRegister(buf.ptr, nbytes, 0)):
        buf.make_fixed()
        _count_cuda(nbytes)
        weakref.finalize(mv, _unregister, buf.ptr, nbytes, buf, os.getpid())
        return mv, CUDA_REGISTER
    _clear_cuda_error()
    del mv, buf
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    # ndarray.data is a memoryview of the array that holds it, and so the
    # tensor's pinned storage (numpy's stubs do not type memoryview(ndarray)).
    mv = host.numpy().data
    _count_cuda(nbytes)
    weakref.finalize(mv, _count_cuda, -nbytes)
    return mv, CUDA_PIN_MEMORY


def new_locked_tensor(num_elem: int, dtype: Any) -> Any:
    """Return a 1-D torch tensor of `num_elem` elements in pinned memory."""
    import torch

    if isinstance(num_elem, bool) or not isinstance(num_elem, int):
        raise TypeError(f"num_elem must be an int, got {type(num_elem).__name__}")
    if num_elem < 0:
        raise ValueError(f"num_elem must be >= 0, got {num_elem}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = num_elem * itemsize
    if nbytes > MAX_OFFSET:
        raise OverflowError(f"num_elem * itemsize must be <= 2**63-1 bytes, got {nbytes}")
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    owner: Any
    if _cuda_available():
        owner, kind = _cuda_pinned_bytes(nbytes)
        counted = nbytes
    else:
        # mlock works on whole pages (whole huge pages for large ones): the
        # core counts the rounded-up size.
        owner, kind = _C.PinnedBuffer(nbytes, True), MLOCK
        counted = locked_size(nbytes)
    # frombuffer keeps `owner` alive for as long as the tensor's storage lives.
    t = torch.frombuffer(owner, dtype=torch.uint8, count=nbytes).view(dtype)
    start = t.data_ptr()
    entry = (nbytes, kind, counted)
    with _lock:
        _regions[start] = entry
    weakref.finalize(t, _forget, start, entry)
    return t


def _forget(start: int, entry: tuple[int, str, int]) -> None:
    # Only this tensor's own entry: once its memory is freed (after
    # free_locked_tensor) a new tensor can be given the same address before
    # this one is collected, and its entry must stay.
    with _lock:
        if _regions.get(start) is entry:
            del _regions[start]


def pinned_kind(tensor: Any) -> str | None:
    """How a tensor from new_locked_tensor was pinned: ``"mlock"``,
    ``"cuda_register"`` (page-aligned), ``"cuda_pin_memory"`` (torch's
    allocator, maybe not page-aligned), or None if it is not one of ours."""
    ptr = tensor.data_ptr()
    with _lock:
        for start, (n, kind, _counted) in _regions.items():
            if start <= ptr < start + n:
                return kind
    return None


def page_round(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages."""
    page = int(_C.page_size())
    return -(-nbytes // page) * page


def locked_size(nbytes: int) -> int:
    """What locking an allocation of `nbytes` locks (counted in
    :func:`locked_bytes`): whole pages and, from 2 MiB on, whole huge pages
    where that adds at most an eighth, so that io_uring moves each I/O on it
    in large physically contiguous pieces (a 4 MB read from a pool with a
    tail of small pages went to the disk as six requests instead of one)."""
    return int(_C.mapped_size(nbytes)) if nbytes else 0


def locked_nbytes(tensor: Any) -> int:
    """Bytes that the allocation behind `tensor` (from new_locked_tensor) adds to
    locked_bytes(): its size rounded up as :func:`locked_size` when mlock'ed, its size when
    pinned through CUDA; 0 for a tensor that is not ours (or was freed)."""
    with _lock:
        entry = _regions.get(tensor.data_ptr())
    return entry[2] if entry is not None else 0


def is_locked(tensor: Any) -> bool:
    """True if the tensor's memory is pinned (by us or by CUDA)."""
    if pinned_kind(tensor) is not None:
        return True
    try:
        return bool(tensor.is_pinned())
    except Exception:  # CPU-only builds may refuse
        return False


def free_locked_tensor(tensor: Any) -> bool:
    """Detach `tensor` from its pinned memory; returns whether it was pinned by us.

    The memory itself is unlocked and returned when the last view of it goes,
    so a stale view can never see freed memory (unlike a raw free). I/O still
    in flight on the memory is waited for first (Ctrl-C interrupts the wait
    and leaves the tensor as it was).
    """
    start = tensor.data_ptr()
    with _lock:
        entry = _regions.get(start)
    if entry is None:
        return False
    wait_range_idle(start, entry[0])
    with _lock:
        _regions.pop(start, None)
    tensor.set_()
    return True


def locked_bytes() -> int:
    """Bytes of host memory currently pinned by aio in this process: mlock'ed
    by the core, plus what new_locked_tensor pinned through CUDA."""
    with _lock:
        cuda = _cuda_pinned
    return int(_C.locked_bytes()) + cuda


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
        """Give the slot back to its pool (idempotent). I/O still in flight on
        the slot is waited for first, so the next lease never receives a late
        read; after a submit cut short before its future came back (Ctrl-C),
        until its handle has no I/O in flight. Ctrl-C interrupts the wait and
        leaves the lease held."""
        if not self._released:
            wait_range_idle(self.ptr, self.nbytes)
            self._released = True
            self._pool._c.release(self.index)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PinnedPool:
    """`count` equal slots of `slot_bytes` carved from one page-aligned allocation.

    The allocation is locked with ``mlock`` when `lock` is true (an
    ``OSError`` naming RLIMIT_MEMLOCK if the kernel refuses) and left
    pageable otherwise; the pool does not register it with CUDA, its owner
    may (``lock=False``, then :meth:`make_fixed`; see the module
    docstring). `slot_bytes` is rounded up to whole pages, so every slot
    starts on a page boundary and is aligned for direct I/O. ``acquire()``
    blocks (without holding the GIL) until a slot is free.
    """

    def __init__(self, count: int, slot_bytes: int, lock: bool = True) -> None:
        for name, v in (("count", count), ("slot_bytes", slot_bytes)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        page = int(_C.page_size())
        total = count * (-(-slot_bytes // page) * page)
        if total > MAX_OFFSET:
            raise OverflowError(
                f"count * slot_bytes (rounded up to pages) must be <= 2**63-1 bytes, "
                f"got {count} x {slot_bytes}"
            )
        self._c = _C.PinnedPool(count, slot_bytes, lock)
        self.count = count
        self.slot_bytes = int(self._c.slot_bytes)
        self.locked = lock

    @property
    def base_ptr(self) -> int:
        """Address of the allocation (the first slot)."""
        return int(self._c.slot_ptr(0))

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole allocation: ``count * slot_bytes`` (pages)."""
        return int(self._c.total_bytes)

    @property
    def locked_bytes(self) -> int:
        """Bytes of this pool counted in locked_bytes(): all of it (as
        :func:`locked_size` rounds it) when locked, else 0."""
        return locked_size(self.total_bytes) if self.locked else 0

    def available(self) -> int:
        """Slots free right now (not leased)."""
        return int(self._c.available())

    def make_fixed(self) -> None:
        """Have io_uring register the pool as a fixed buffer (done at once
        when `lock` is true). That pins its pages, so only for a pool pinned
        by other means, such as ``cudaHostRegister``."""
        self._c.make_fixed()

    def acquire(self, timeout: float | None = None) -> Lease:
        """Lease a free slot, waiting up to `timeout` seconds (None or inf: no
        limit); TimeoutError if none frees up. Ctrl-C interrupts the wait."""
        got: list[int] = []

        def try_once(seconds: float) -> bool:
            i = int(self._c.acquire(int(seconds * 1000)))
            if i >= 0:
                got.append(i)
            return i >= 0

        if not wait_sliced(try_once, deadline(timeout)):
            raise TimeoutError(
                f"no free slot in the pinned pool ({self.count} slots) within {timeout} s; "
                "raise the buffer count or release leases sooner"
            )
        return Lease(self, got[0])
