"""glibc malloc settings for streaming a model through memory (see
:func:`set_mmap_threshold`); process-wide, no-ops without glibc."""

from __future__ import annotations

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
