"""A sub-group's tensor given as pieces: float32 CPU tensors laid end to end
(NVMeAdamW's parameters and gradients, each a slice of one parameter) that
the swapper steps where they are instead of packing them into one buffer
and copying the result back (:meth:`aio.swap.OptimizerSwapper.initialize_in_place`,
:meth:`~aio.swap.OptimizerSwapper.hold_gradient` with a list).

The optimizers stepped are elementwise, so stepping a sub-group as
segments -- one per run of elements that lies in one piece of every
tensor -- gives the bits stepping it whole would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

Pieces = tuple[torch.Tensor, ...]


def is_pieces(t: Any) -> bool:
    """Whether `t` is a tensor given as pieces (see :func:`check_pieces`)."""
    return isinstance(t, tuple)


def check_pieces(pieces: Any, numel: int, what: str) -> Pieces:
    """`pieces` (a sequence of float32 CPU tensors, each contiguous, their
    elements `numel` in all) as flat views, in order; TypeError/ValueError
    naming `what` otherwise."""
    if isinstance(pieces, torch.Tensor) or not isinstance(pieces, Sequence):
        raise TypeError(f"{what} must be a list or tuple of tensors, got {type(pieces).__name__}")
    out = []
    for k, t in enumerate(pieces):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu":
            kind = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{what}: piece {k} must be a float32 CPU tensor, got {kind}")
        if t.is_sparse or not t.is_contiguous():
            raise ValueError(f"{what}: piece {k} must be a dense contiguous tensor")
        out.append(t.detach().view(-1))
    total = sum(t.numel() for t in out)
    if total != numel:
        raise ValueError(f"{what}: the pieces hold {total} elements, the sub-group {numel}")
    return tuple(out)


def _bounds(t: Any, numel: int) -> list[int]:
    """Where `t`'s pieces end (a whole tensor: at `numel`)."""
    if not is_pieces(t):
        return [numel]
    ends, at = [], 0
    for piece in t:
        at += piece.numel()
        ends.append(at)
    return ends


def _cut(t: Any, starts: list[int], lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of `t` (a whole tensor, or pieces starting at
    `starts`), which lie in one piece."""
    if not is_pieces(t):
        return t[lo:hi]
    k = _piece_at(starts, lo)
    return t[k][lo - starts[k] : hi - starts[k]]


def _piece_at(starts: list[int], at: int) -> int:
    """The piece holding element `at` (the last start at or before it)."""
    lo, hi = 0, len(starts) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if starts[mid] <= at:
            lo = mid
        else:
            hi = mid - 1
    return lo


def segments(numel: int, tensors: Mapping[str, Any]) -> list[dict[str, torch.Tensor]]:
    """`tensors` (name -> a whole tensor of `numel` elements, or pieces, or
    None: left out) cut at every piece's end: per segment, by name, its
    view of each tensor. Empty pieces give no segment."""
    present = {n: t for n, t in tensors.items() if t is not None}
    cuts = sorted({0, *(e for t in present.values() for e in _bounds(t, numel))})
    starts = {n: [0, *_bounds(t, numel)[:-1]] for n, t in present.items() if is_pieces(t)}
    return [
        {n: _cut(t, starts.get(n, []), lo, hi) for n, t in present.items()}
        for lo, hi in zip(cuts, cuts[1:], strict=False)
        if hi > lo
    ]
