"""glibc malloc settings for streaming a model through memory (see
:func:`set_mmap_threshold`); process-wide, no-ops without glibc."""

from __future__ import annotations

import errno
import os
from typing import Any

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
BUILD_MMAP_THRESHOLD = 1 << 20
TRAIN_MMAP_THRESHOLD = 8 << 20
TRAIN_TRIM_THRESHOLD = 64 << 20
_mmap_threshold: int | None = None
_trim_threshold: int | None = None


def set_mmap_threshold(nbytes: int, trim_bytes: int | None = None) -> None:
    """Fix glibc's mmap threshold: blocks of `nbytes` or more get their own
    mapping, returned to the OS on free (process-wide; a no-op without glibc).
    With `trim_bytes`, also its trim threshold: free memory at the top of the
    heap goes back to the OS only beyond that much.

    glibc's own threshold rises with every large block freed, up to 32 MiB;
    blocks under it come from the heap and stay in the process when freed.
    Streaming a model through memory (building it, adopting it) then leaves
    RSS growing with the model: while building, :data:`BUILD_MMAP_THRESHOLD`
    (1 MiB) keeps every parameter-sized tensor in its own mapping. In
    training, the same setting makes every large temporary of a step a fresh
    mapping, faulted in page by page (minor faults and system time each
    step): :data:`TRAIN_MMAP_THRESHOLD` (8 MiB) lets the heap recycle the
    step's temporaries up to that size while keeping peak RSS close to the
    1 MiB figure (a fully adaptive threshold more than doubled it).

    A fixed mmap threshold also stops glibc from raising the trim threshold
    (to twice the mmap threshold, at most 64 MiB), leaving it at 128 KiB:
    the temporaries a step frees at the top of the heap (a backward's
    gradients) went back to the OS and the next step faulted them in again,
    ~1000 minor faults per step in CPU offload against DeepSpeed's handful.
    Training sets :data:`TRAIN_TRIM_THRESHOLD` (64 MiB, glibc's own most)."""
    global _mmap_threshold, _trim_threshold
    if (_mmap_threshold, _trim_threshold) == (nbytes, trim_bytes):
        return
    _mmap_threshold, _trim_threshold = nbytes, trim_bytes
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, nbytes)
        if trim_bytes is not None:
            libc.mallopt(_M_TRIM_THRESHOLD, trim_bytes)
    except (OSError, AttributeError):  # not glibc
        pass


def trim_malloc() -> None:
    """Give free heap memory back to the OS (after building a model)."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


# Free bytes in malloc's heaps above which the end of a backward gives them
# back (see trim_if_fragmented).
TRIM_FREE_BYTES = 256 << 20


_MALLINFO2_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
)
_mallinfo2: Any = None  # glibc's mallinfo2, bound once (False: not there)


def heap_free_bytes() -> int | None:
    """Bytes lying free inside glibc malloc's heaps (``mallinfo2().fordblks``,
    every arena), or None without glibc 2.33+."""
    global _mallinfo2
    if _mallinfo2 is None:
        try:
            import ctypes

            class MallInfo2(ctypes.Structure):
                _fields_ = [(name, ctypes.c_size_t) for name in (*_MALLINFO2_FIELDS, "keepcost")]

            fn = ctypes.CDLL(None).mallinfo2
            fn.restype = MallInfo2
            _mallinfo2 = fn
        except (OSError, AttributeError):
            _mallinfo2 = False
    return int(_mallinfo2().fordblks) if _mallinfo2 else None


def trim_if_fragmented(limit: int = TRIM_FREE_BYTES) -> bool:
    """Give free heap pages back to the OS when more than `limit` bytes lie free
    in malloc's heaps; returns whether it trimmed.

    A CPU forward's activations (a few MiB each, under the mmap threshold)
    come from the heap; backward frees them in an order that leaves holes, so
    the heap cannot shrink from the top and each step's new activations land
    partly beside the old holes: RSS grew by ~0.5 GiB per step at 16 layers of
    width 2880 (1.6 GiB free inside the heap after 3 steps). ``malloc_trim``
    releases the free pages anywhere in the heap (madvise), at the price of
    faulting them in again in the next forward."""
    free = heap_free_bytes()
    if free is None or free <= limit:
        return False
    trim_malloc()
    return True


_libc_madvise: Any = None  # libc's madvise, bound once (False: not there)


def _madvise(addr: int, length: int, advice: int) -> int:
    """madvise(): 0 when it succeeded, else its errno (ENOSYS where libc has
    no madvise)."""
    import ctypes

    global _libc_madvise
    if _libc_madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            fn.restype = ctypes.c_int
            _libc_madvise = fn
        except (OSError, AttributeError):
            _libc_madvise = False
    if not _libc_madvise:
        return errno.ENOSYS
    if _libc_madvise(addr, length, advice) == 0:
        return 0
    return ctypes.get_errno() or errno.EINVAL


# madvise(MADV_POPULATE_WRITE) (Linux 5.14; not in Python's mmap module).
_MADV_POPULATE_WRITE = 23
# Below this many bytes long_lived_zeros is plain torch.zeros: a mapping each
# would cost more than the faults it saves.
LONG_LIVED_MAP_BYTES = 1 << 20


def long_lived_zeros(numel: int) -> Any:
    """`numel` float32 zeros on the CPU, faulted in now, on small (4 KiB) pages.

    For memory kept all run long (gradients held in memory, in-memory master
    weights), allocated at set-up. aio-train puts torch's large tensors on
    transparent huge pages (``THP_MEM_ALLOC_ENABLE``), which saves faults on
    a step's short-lived temporaries; but on a VM whose host takes freed
    memory back (virtio-balloon free page reporting), each fresh huge page is
    backed anew by the host: zeroing 1 GiB took 1.3-3.5 s on the dev box
    against 0.25-0.8 s on small pages. Streaming through it costs about the
    same either way.

    The memory is a private anonymous mapping of its own (the tensor holds
    it), which the kernel hands out zeroed: ``MADV_POPULATE_WRITE`` faults it
    in from one thread without writing it again (``zero_()`` on torch's
    allocation wrote every byte a second time, on every core, beside the
    first forward that now runs while gradients are allocated; the faults
    themselves, 0.5-0.9 s per GiB of fresh memory on the dev box's VM, cost
    the same either way). Where the kernel lacks the advice (``EINVAL``), the
    pages are touched by ``zero_()`` instead. ``MemoryError`` when the kernel
    cannot back them (``ENOMEM``: a memory cgroup's limit), the mapping
    freed; another refusal is an ``OSError`` with its errno."""
    import mmap

    import torch

    nbytes = numel * 4
    if nbytes < LONG_LIVED_MAP_BYTES:
        return torch.zeros(numel, dtype=torch.float32)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.float32)  # holds `m` while the tensor lives
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        _madvise(t.data_ptr(), nbytes, advice)
    err = _madvise(t.data_ptr(), nbytes, _MADV_POPULATE_WRITE)
    if err in (0, errno.EINVAL, errno.ENOSYS):
        if err:
            t.zero_()  # zeros already: this only faults the pages in
        return t
    # Touching the pages by hand after ENOMEM would fault them in one by one
    # past the limit, and under a memory cgroup the OOM killer ends the
    # process instead of an error being raised: give the mapping back.
    del t
    try:
        m.close()
    except BufferError:  # pragma: no cover - a view still exported: unmapped when it goes
        pass
    if err == errno.ENOMEM:
        raise MemoryError(
            f"cannot fault in {nbytes} bytes of zeros (madvise MADV_POPULATE_WRITE: ENOMEM); "
            "the memory limit (a memory cgroup's, or the machine's) is reached"
        )
    raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {nbytes} bytes of zeros failed: {os.strerror(err)}")
