"""Float32 parameters read from the optimizer's master weights.

With both offloads on the drive and parameters trained in float32, each
parameter's bytes are the same as its slice of its sub-group's fp32 master
weights: writing the parameters back after every step (4 bytes per parameter,
a fifth of a step's writes with AdamW and gradients on the drive) stores a
second copy nobody needs. :func:`mirror_master` points each such parameter's
drive copy at its slice of the master weights instead
(:meth:`aio.swap.ParamSwapper.alias`); after a step the trainer only refreshes
copies held in memory (:meth:`aio.zero.params.ParamStore.refresh`) and has the
optimizer write out what it kept in buffers (``flush``) before parameters are
read again. ``aio_zero.params_from_master: false`` keeps the separate copy.

Set-up writes no master weights for float32 parameters: the first step reads
them from the parameters (:meth:`aio.swap.OptimizerSwapper.initialize_from`),
so a sub-group's parameters are aliased (:func:`mirror_group`) as that step
writes its master weights.

A parameter whose values are stored from elsewhere (``gathered(modify=True)``,
a checkpoint) goes back to its own copy (the alias ends on any write); the
trainer mirrors again once the master weights hold the same values: after
``gathered(modify=True)`` (which stores them as the master weights too) and
after loading a checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .optimizer import ZeroOptimizer
    from .params import ParamStore
    from .placement import SubGroupLayout

FLOAT32_BYTES = 4


def mirror_master(store: ParamStore, opt: ZeroOptimizer, layout: SubGroupLayout) -> int:
    """Alias every float32 drive parameter to its slice of its sub-group's
    master weights; returns how many are aliased (0 when parameters or master
    weights are not on a drive, or parameters are not float32)."""
    return sum(mirror_group(store, opt, layout, gi) for gi in range(len(layout.groups)))


def mirror_group(store: ParamStore, opt: ZeroOptimizer, layout: SubGroupLayout, gi: int) -> int:
    """mirror_master() for sub-group `gi` alone: how many of its parameters are
    aliased (0 while its master weights are on no drive, e.g. not written
    yet: :meth:`aio.swap.OptimizerSwapper.initialize_from`)."""
    import torch

    swapper = store.swapper
    extent = opt.master_extent(gi)
    if swapper is None or store.dtype != torch.float32 or extent is None:
        return 0
    space, base = extent
    count = 0
    for s in layout.groups[gi]:
        if store.mirrors(s.param):
            count += 1
        elif swapper.alias(s.param.aio_id, space, base + FLOAT32_BYTES * s.offset):
            count += 1
    return count
