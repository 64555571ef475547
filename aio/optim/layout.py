"""How :class:`aio.optim.NVMeAdamW` packs its parameters into sub-groups.

Each parameter contributes its local tensor (a DTensor's shard on this rank,
else the tensor), flattened; the local tensors of one param group are laid
end to end and cut into sub-groups of at most ``sub_group_size`` elements
(a large tensor spans several). Adam is elementwise, so where the cuts fall
changes no bit of the result. A sub-group never mixes param groups (each is
stepped with its group's hyper-parameters), and a parameter with no local
elements (a shard of zero rows) is in none.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .dtensor import local_of


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + count) of a parameter's flattened local
    tensor, at `offset` in its sub-group."""

    param: int  # index of the parameter in the optimizer's order (state_dict's ids)
    start: int
    count: int
    offset: int


@dataclass
class SubGroup:
    """One sub-group: its param group and the pieces it holds, in order."""

    group: int
    numel: int = 0
    pieces: list[Piece] = field(default_factory=list)


def local_flat(p: Any, name: str) -> torch.Tensor:
    """The flattened local tensor of parameter `p` (sharing its memory: a
    write through it updates the parameter, e.g. FSDP's sharded storage).
    Resolved at every use: FSDP may replace a parameter's tensor between
    steps (a load_state_dict), never its size."""
    local = local_of(p.detach())
    if not local.is_contiguous():
        raise ValueError(f"{name}: its local tensor is not contiguous; NVMeAdamW writes it in place")
    return local.view(-1)


def pack(groups: Sequence[Sequence[tuple[int, int]]], sub_group_size: int) -> list[SubGroup]:
    """Sub-groups for `groups` (per param group, its parameters as
    (parameter index, local numel)), each at most `sub_group_size` elements."""
    out: list[SubGroup] = []
    for k, params in enumerate(groups):
        cur: SubGroup | None = None
        for index, numel in params:
            start = 0
            while start < numel:
                if cur is None or cur.numel == sub_group_size:
                    cur = SubGroup(k)
                    out.append(cur)
                take = min(numel - start, sub_group_size - cur.numel)
                cur.pieces.append(Piece(index, start, take, cur.numel))
                cur.numel += take
                start += take
    return out


def pieces_of(subgroups: Sequence[SubGroup]) -> Iterator[tuple[int, Piece]]:
    """Every (sub-group index, piece), in layout order."""
    for i, sg in enumerate(subgroups):
        for piece in sg.pieces:
            yield i, piece
