"""bfloat16 optimizer states on the drive, float32 in the buffer.

With ``aio_zero.optimizer_states: bf16`` each float32 optimizer state (Adam's
moments) is stored on the drive as bfloat16: half the bytes read and written
per step for it, while the master weights stay float32. A buffer holds one
float32 tensor of the sub-group, so the bfloat16 bytes read into its front
are widened in place before the step, and narrowed in place (rounded to
nearest even, as ``tensor.to(torch.bfloat16)``) before the write.

The conversions run in the C++ core (csrc/core/bf16_inplace.cpp), in an
order in which no value is overwritten before it is read.
:func:`widen_bf16_threaded` widens through torch's multi-threaded copy
instead (aio.zero's set-up widens bf16 parameters into master weights).
"""

from __future__ import annotations

from typing import Any

from .. import _C


def _check(raw: Any, n: int) -> None:
    import torch

    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.device.type != "cpu":
        raise TypeError("expected a CPU uint8 tensor (a swap buffer's bytes)")
    if not raw.is_contiguous():
        raise ValueError("the buffer must be contiguous")
    if n < 0 or raw.numel() < 4 * n:
        raise ValueError(f"{n} float32 values need {4 * n} bytes, the buffer has {raw.numel()}")


def widen_bf16(raw: Any, n: int) -> None:
    """Turn the `n` bfloat16 values in bytes [0, 2n) of the contiguous CPU
    uint8 tensor `raw` into `n` float32 values in bytes [0, 4n) (exact: a
    bfloat16 is the top half of a float32)."""
    _check(raw, n)
    _C.bf16_widen_inplace(raw.data_ptr(), n)


def widen_bf16_threaded(raw: Any, n: int) -> None:
    """widen_bf16() through torch's multi-threaded copy (5x faster for an
    82M-value sub-group on the dev box's 2 cores): back to front, in chunks
    that never overlap their own source (chunk [a, b) reads bytes [2a, 2b)
    and writes [4a, 4b): disjoint while a >= b / 2), the first value last
    through a copy. The same bits (a bfloat16 is the top half of a float32)."""
    import torch

    _check(raw, n)
    wide, narrow = raw[: 4 * n].view(torch.float32), raw[: 2 * n].view(torch.bfloat16)
    b = n
    while b > 1:
        a = (b + 1) // 2
        wide[a:b].copy_(narrow[a:b])
        b = a
    if n:
        wide[:1].copy_(narrow[:1].clone())


def narrow_bf16(raw: Any, n: int) -> None:
    """Turn the `n` float32 values in bytes [0, 4n) of the contiguous CPU
    uint8 tensor `raw` into `n` bfloat16 values in bytes [0, 2n), rounded to
    nearest even as ``tensor.to(torch.bfloat16)`` rounds (a NaN stays a NaN,
    its bits may differ from torch's)."""
    _check(raw, n)
    _C.bf16_narrow_inplace(raw.data_ptr(), n)
