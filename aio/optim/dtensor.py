"""DTensor (torch.distributed.tensor) parameters for aio's optimizers.

FSDP2 (``fully_shard``) and tensor parallelism hand the optimizer
``DTensor`` parameters: each rank holds a local tensor (its shard, or a
replica) and the gradient is a DTensor laid out the same way. Adam is
elementwise, so stepping each rank's local parameter with its local gradient
is the whole step -- as torch's own single-tensor AdamW does when it
dispatches its ops to the local shards. A gradient laid out differently (a
``Partial`` one, still to be reduced; another mesh) cannot be stepped that
way: TypeError naming what differs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


@functools.lru_cache(maxsize=1)
def dtensor_class() -> Any:
    """torch's DTensor class, or None in a build without torch.distributed
    (imported on first need: it costs a noticeable fraction of a second)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor (a parameter wrapping one included)."""
    if type(t) in _PLAIN or not isinstance(t, torch.Tensor):
        return False
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_of(t: Any) -> Any:
    """The local tensor of a DTensor (sharing its memory), else `t` itself."""
    return t.to_local() if is_dtensor(t) else t


def check_pair(p: Any, grad: Any, name: str = "parameter") -> None:
    """TypeError unless `p` and `grad` are both plain tensors, or both
    DTensors on one mesh with the same placements, none of them Partial
    (an unreduced sum: its local tensor is not this rank's gradient)."""
    p_dt, g_dt = is_dtensor(p), is_dtensor(grad)
    if not (p_dt or g_dt):
        return
    if p_dt != g_dt:
        kinds = ("a DTensor" if p_dt else "a plain tensor", "a DTensor" if g_dt else "a plain tensor")
        raise TypeError(f"{name} is {kinds[0]} but its gradient is {kinds[1]}; both must be alike")
    if grad.device_mesh != p.device_mesh:
        raise TypeError(
            f"{name}'s gradient is on another device mesh ({grad.device_mesh} vs {p.device_mesh})"
        )
    if tuple(grad.placements) != tuple(p.placements):
        raise TypeError(
            f"{name}'s gradient has placements {tuple(grad.placements)}, the parameter "
            f"{tuple(p.placements)}; redistribute the gradient to the parameter's layout before step()"
        )
    if any(pl.is_partial() for pl in p.placements):
        raise TypeError(
            f"{name} has a Partial placement ({tuple(p.placements)}): it cannot be stepped locally"
        )


def like(p: Any, local: torch.Tensor) -> Any:
    """`local` (this rank's part of a tensor shaped like `p`) as a DTensor
    laid out as `p` when `p` is one, else `local` itself."""
    if not is_dtensor(p):
        return local
    return dtensor_class().from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def shard_of(full: torch.Tensor, p: Any) -> torch.Tensor | None:
    """This rank's part of `full`, a whole tensor shaped like DTensor `p`,
    as `p`'s layout cuts it: ``torch.chunk`` along the dimension of each
    ``Shard`` placement in mesh order (as DTensor and FSDP2 cut; a rank past
    the last chunk gets none), ``Replicate`` keeping it whole. A view of
    `full`. None for any other placement (a strided or Partial one) or a
    rank outside `p`'s mesh: the caller refuses those."""
    from torch.distributed.tensor import Replicate, Shard

    coordinate = p.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    out = full
    for i, placement in enumerate(p.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            return None
        chunks = torch.chunk(out, p.device_mesh.size(i), dim=placement.dim)
        c = coordinate[i]
        out = chunks[c] if c < len(chunks) else out.narrow(placement.dim, 0, 0)
    return out
