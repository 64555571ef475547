"""Parameters read from NVMeAdamW's master weights (``params_from_master``).

With :class:`aio.optim.NVMeAdamW` each float32 parameter's local shard is,
after a step, bit for bit its slice of the optimizer's fp32 master weights on
the drive (the step copies the master into the parameter). So the tier reads
a group's shards from those slices -- the optimizer's sub-group extents,
once the swapper has flushed the masters it kept in buffers -- and the step
writes the master once and nothing else: the tier writes no parameters.

The step's copy into the parameters is skipped for shards the tier has
released (their storage is freed: writing it would be a write to freed
memory); a resident shard still gets it, so memory and master agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..swap.storage import ALIGN, align_up

FLOAT32_BYTES = 4


@dataclass
class Source:
    """Where a group's shards are read from: `reads` (swap space, aligned
    drive offset, aligned bytes, offset in the staging slot), then `copies`
    (staging offset, shard index, byte offset in the shard, bytes) and the
    shards' padding to zero (shard index, first padding byte)."""

    reads: list[tuple[Any, int, int, int]]
    copies: list[tuple[int, int, int, int]]
    zero: list[tuple[int, int]] = field(default_factory=list)

    @property
    def staging_bytes(self) -> int:
        """Pinned bytes one read of the group needs."""
        return sum(r[2] for r in self.reads)


def is_nvme_adam(opt: Any) -> bool:
    """Whether `opt` is aio's NVMeAdam/NVMeAdamW (master weights on the drive)."""
    from ..optim.nvme import NVMeAdam

    return isinstance(opt, NVMeAdam)


def is_laid_out(opt: Any) -> bool:
    """Whether NVMeAdamW `opt` has laid its sub-groups out (first step or load)."""
    return opt.master_mode is not None


def master_sources(opt: Any, groups: list[Any]) -> dict[int, Source]:
    """A master-weights Source for every group all of whose shards are
    float32 parameters of `opt` with their whole master on the drive."""
    index = opt.parameter_index()
    if not index:
        return {}
    pieces, missing = opt.master_slices()
    out = {}
    for g in groups:
        src = _source(g, index, pieces, missing)
        if src is not None:
            out[g.index] = src
    return out


def _source(g: Any, index: dict[int, int], pieces: dict[int, list], missing: set[int]) -> Source | None:
    src, pos = Source([], []), 0
    for j, s in enumerate(g.shards):
        p = s.fsdp_param.sharded_param
        k = index.get(id(p))
        local_bytes = s.local_numel * FLOAT32_BYTES
        if k is None or k in missing or s.data.dtype != torch.float32:
            return None
        if sum(n for _, _, _, n in pieces.get(k, [])) != local_bytes:
            return None
        for space, off, dst, n in pieces.get(k, []):
            lo = off // ALIGN * ALIGN  # the aligned range around the slice: one direct read
            length = align_up(off + n) - lo
            src.reads.append((space, lo, length, pos))
            src.copies.append((pos + off - lo, j, dst, n))
            pos += length
        if local_bytes < s.nbytes:
            src.zero.append((j, local_bytes))
    return src


def skip_released_write_back(opt: Any) -> Any:
    """Make `opt`'s step copy its new master weights only into parameters
    whose storage is in memory (the tier reads the released ones from the
    master); returns the function that undoes it."""
    opt.skip_freed_parameters = True

    def undo() -> None:
        opt.skip_freed_parameters = False

    return undo
