"""How :class:`aio.optim.NVMeAdamW` packs its parameters into sub-groups.

Each parameter contributes its local tensor (a DTensor's shard on this rank,
else the tensor), flattened; the local tensors of one param group are laid
end to end and cut into sub-groups of at most ``sub_group_size`` elements
(a large tensor spans several). Adam is elementwise, so where the cuts fall
changes no bit of the result. A sub-group never mixes param groups (each is
stepped with its group's hyper-parameters), and a parameter with no local
elements (a shard of zero rows) is in none.

:class:`Layout` is the read-only view of it that
:meth:`aio.optim.NVMeAdam.layout` gives other modules (aio.fsdp's gradient
stream), per parameter rather than per sub-group.
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


@dataclass(frozen=True)
class ParamPiece:
    """Elements [start, start + count) of one parameter's flattened local
    tensor, at `offset` in sub-group `subgroup` (a :class:`Piece` seen from
    the parameter)."""

    subgroup: int
    start: int
    count: int
    offset: int


@dataclass(frozen=True, eq=False)  # compared by identity: its tensors have no truth value
class Layout:
    """How an :class:`aio.optim.NVMeAdam` laid its parameters out, frozen
    at the moment it was asked for (a later layout, after the parameters
    are swapped for others, is a new one): `params`, the parameters in the
    optimizer's order (param_groups', state_dict's ids); `pieces[k]`,
    parameter k's pieces in order (none when it has no local elements); and
    `subgroup_numels[i]`, sub-group i's elements."""

    params: tuple[Any, ...]
    pieces: tuple[tuple[ParamPiece, ...], ...]
    subgroup_numels: tuple[int, ...]

    def numel(self, index: int) -> int:
        """Parameter `index`'s local elements (those of its pieces)."""
        return sum(pc.count for pc in self.pieces[index])


def layout_of(params: Sequence[Any], subgroups: Sequence[SubGroup]) -> Layout:
    """The :class:`Layout` of `params` packed into `subgroups`."""
    per_param: list[list[ParamPiece]] = [[] for _ in params]
    for i, pc in pieces_of(subgroups):
        per_param[pc.param].append(ParamPiece(i, pc.start, pc.count, pc.offset))
    return Layout(tuple(params), tuple(map(tuple, per_param)), tuple(sg.numel for sg in subgroups))


def local_flat(p: Any, name: str) -> torch.Tensor:
    """The flattened local tensor of parameter `p` (sharing its memory: a
    write through it updates the parameter, e.g. FSDP's sharded storage).
    Resolved at every use: FSDP may replace a parameter's tensor between
    steps (a load_state_dict), never its size."""
    return local_view(p, name)[0]


def local_view(p: Any, name: str) -> tuple[torch.Tensor, torch.Size]:
    """:func:`local_flat` of `p`, and the shape of its local tensor."""
    # The local tensor detached, not the DTensor: a DTensor's detach() is a
    # dispatched op (several times the cost), the same memory either way.
    local = local_of(p).detach()
    if not local.is_contiguous():
        raise ValueError(
            f"{name}: its local tensor is not contiguous (a channels_last or transposed parameter); "
            "NVMeAdamW steps each parameter's memory as one flat run: make the parameters contiguous "
            "before the first step (model.to(memory_format=torch.contiguous_format))"
        )
    return local.view(-1), local.shape


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
