"""SubGroup: one optimizer sub-group of an OptimizerSwapper and its extent.

A sub-group's tensors live back to back in one aligned extent of the swap
file (``[ grad | master | state_0 | ... ]``, see :mod:`aio.swap.optimizer`),
each taking whole aligned blocks so that every tensor is read and written
with its own direct I/O. :func:`layout` places them, :func:`part_bytes`
sizes one, :func:`slot_bytes` sizes the buffer that holds any one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._buffers import MAX_OFFSET
from .drives import IOFuture
from .storage import align_up

# Elements of one sub-group, at most: all its tensors' bytes stay a valid file offset.
MAX_NUMEL = MAX_OFFSET // 64

# ``source(out)`` starts reading a sub-group's fp32 master weights into `out`
# and returns the reads in flight (see OptimizerSwapper.initialize_from).
MasterSource = Callable[[Any], list[IOFuture]]


@dataclass
class SubGroup:
    """One registered sub-group of an OptimizerSwapper: where its extent is,
    what it holds and how far its state is (the swapper and its step
    pipeline, :class:`aio.swap.step_io.StepIO`, keep these fields current).

    ``parts``: tensor name -> (byte offset in the extent, dtype on the
    drive); ``scalars``: its scalar optimizer state (None until its first
    step); ``valid``: the drive copy holds a complete state;
    ``grad_future``: its gradient's write in flight; ``grad_mem``: the fp32
    CPU tensor holding its gradient instead of the drive, or its pieces (a
    tuple: :mod:`aio.swap.pieces`); ``proxy``: the parameter the torch
    optimizer steps in its place; ``master_source``: until its master
    weights are first written, where they are read from (initialize_from);
    ``master_pieces``: master weights stepped where they live
    (initialize_in_place), asked at each use."""

    index: int
    numel: int
    offset: int  # of its extent in the swap file
    parts: dict[str, tuple[int, Any]]  # name -> (byte offset in the extent, dtype)
    nbytes: int  # of its extent
    scalars: dict[str, Any] | None = None  # None until its first step
    valid: bool = False  # drive copy holds a complete state
    grad_future: IOFuture | None = None
    # fp32 CPU tensor holding the gradient instead of the drive, or its pieces (a tuple: pieces.py)
    grad_mem: Any = None
    proxy: Any = None
    history: list[str] = field(default_factory=list)
    # Until its master weights are first written: reads them from elsewhere (initialize_from).
    master_source: MasterSource | None = None
    # Master weights stepped where they live (initialize_in_place): their pieces, asked at each use.
    master_pieces: Callable[[], Sequence[Any]] | None = None

    def part_io(self, name: str) -> tuple[int, int]:
        """(offset in the swap file, bytes) of its tensor `name`, whole aligned blocks."""
        off, dt = self.parts[name]
        return self.offset + off, part_bytes(self.numel, dt)

    def settle_grad(self) -> None:
        """Wait for its gradient's write in flight, if any, and forget it
        (raising its error: the drive copy of the gradient is not there)."""
        fut, self.grad_future = self.grad_future, None
        if fut is not None:
            fut.result()


def part_bytes(numel: int, dtype: Any) -> int:
    """Bytes of one tensor of a sub-group in the swap file and its I/O: whole aligned blocks."""
    import torch

    return align_up(numel * torch.empty(0, dtype=dtype).element_size())


def layout(numel: int, tensors: Sequence[tuple[str, Any]]) -> tuple[dict[str, tuple[int, Any]], int]:
    """The extent of a `numel`-element sub-group holding `tensors` ((name,
    dtype on the drive), in order) back to back: name -> (byte offset in
    the extent, dtype), and the extent's bytes."""
    parts: dict[str, tuple[int, Any]] = {}
    off = 0
    for name, dtype in tensors:
        parts[name] = (off, dtype)
        off += part_bytes(numel, dtype)
    return parts, off


def slot_bytes(numel: int, spec: Sequence[tuple[str, Any]]) -> int:
    """Bytes one buffer needs for any single tensor of a `numel`-element
    sub-group: float32 (gradient, master weights, a widened state) or any
    state's dtype in `spec` ((name, dtype) of each optimizer state)."""
    import torch

    return max(part_bytes(numel, dt) for dt in [torch.float32, *(d for _, d in spec)])
