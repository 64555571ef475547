"""The one optimizer interface the trainer steps through.

:class:`ZeroOptimizer` is what :class:`aio.zero.OffloadTrainer` needs from
the optimizer side: sub-groups of fp32 master weights, a place to accumulate
each sub-group's gradient, a step over every sub-group, checkpoints and
accounting. Two implementations, a file each:
:class:`aio.zero.memory_optimizer.MemoryOptimizer` (state in CPU memory) and
:class:`aio.zero.swapped_optimizer.SwappedOptimizer` (state on the drive,
:class:`aio.swap.OptimizerSwapper` with the gradient-buffer methods added).
:func:`make_optimizer` picks one from the config; the trainer never asks
which one it has.

To add an optimizer backend: implement this Protocol and return it from
:func:`make_optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..pinned import Lease, Register
    from ..swap.drives import IOFuture, SwapSpace
    from ..swap.param_groups import TorchGroups


class GradientBuffer:
    """A sub-group's fp32 gradient being accumulated: `tensor`, and the pinned
    buffer lease it lives in (None when it is the optimizer's own memory)."""

    __slots__ = ("tensor", "lease")

    def __init__(self, tensor: Any, lease: Lease | None = None) -> None:
        self.tensor = tensor
        self.lease = lease

    def release(self) -> None:
        """Give the pinned buffer back (nothing to do for a memory buffer)."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()


class PendingWrite:
    """A gradient write in flight; its buffer is given back once it lands."""

    __slots__ = ("lease", "future")

    def __init__(self, lease: Lease, future: IOFuture) -> None:
        self.lease = lease
        self.future = future

    def wait(self) -> None:
        """Wait for the write (raising its error) and give the buffer back."""
        try:
            self.future.result()
        finally:
            self.lease.release()

    def abandon(self) -> None:
        """Wait for the write, ignore its outcome, give the buffer back."""
        self.future.exception()
        self.lease.release()


class ZeroOptimizer(Protocol):
    """What the trainer needs from the optimizer side (see the module docstring)."""

    hyper: dict[str, Any]

    def register_subgroup(self, index: int, numel: int, group: int = 0) -> None:
        """Declare sub-group `index` of `numel` fp32 elements, stepped with torch
        param group `group`'s hyper-parameters (the trainer registers every
        sub-group, 0 up, before initializing any)."""
        ...

    def initialize(self, index: int, master: Any) -> None:
        """Set sub-group `index`'s fp32 master weights (`numel` elements) before the first step."""
        ...

    def initialize_many(self, fills: Iterable[tuple[int, Callable[[Any], Any]]]) -> None:
        """initialize() for each (index, fill) pair: ``fill(out)`` writes the
        sub-group's fp32 master weights into `out` (a float32 tensor of its
        size, e.g. a pinned buffer the drive backend then writes from); the
        drive backend fills the next sub-group while the last one's write lands."""
        ...

    def initialize_from(self, index: int, source: Callable[[Any], list[Any]]) -> bool:
        """initialize() from master weights stored elsewhere, read only when first
        needed: ``source(out)`` starts reading them into `out` (a float32 tensor
        of the sub-group's size) and returns the reads' futures, and must give
        the same values until the first step. False when this backend cannot
        wait (the caller initializes the sub-group itself then)."""
        ...

    def reserve_memory(self, background: bool = False) -> None:
        """Allocate (and fault in) now what the first step would: swap buffers
        and every gradient buffer kept in memory (thread-safe beside
        initialize_many()); with `background`, the swap buffers now and the
        gradients in a thread, while the first forward runs."""
        ...

    def update_master(self, index: int, edit: Callable[[Any], Any]) -> None:
        """Between steps: ``edit(master)`` changes sub-group `index`'s fp32
        master weights (a float32 tensor of its size) in place; stored before
        this returns, the optimizer state untouched."""
        ...

    def try_open_gradient(self, index: int, numel: int, resume: bool) -> GradientBuffer | None:
        """The sub-group's gradient buffer, holding the gradient accumulated so
        far when `resume`, else with unspecified contents (the caller writes
        every element before closing it); None when no buffer is free now."""
        ...

    def open_gradient(self, index: int, numel: int, resume: bool) -> GradientBuffer:
        """try_open_gradient(), waiting for a free buffer."""
        ...

    def close_gradient(self, index: int, buf: GradientBuffer) -> PendingWrite | None:
        """The sub-group's gradient is complete for now: store it (a write in
        flight, or None when it already is where the step reads it)."""
        ...

    def discard_gradients(self) -> None:
        """Forget the current window's gradients, waiting for writes in flight
        (failed or not); the optimizer state is untouched."""
        ...

    def step(
        self,
        after: Callable[[int, Any], None] | None = None,
        grad_scale: Any = None,
        lowp: dict[int, Any] | None = None,
    ) -> None:
        """One optimizer step over every sub-group, in index order: gradients are
        multiplied by `grad_scale` (None: 1) first, and `after(index, master)` gets
        each sub-group's updated fp32 master weights, valid only during the call.
        For each sub-group index in `lowp`, its bfloat16/float16 tensor (the
        sub-group's size) holds the updated master weights rounded to its dtype
        before `after` runs (aio's Adam writes it in its update's pass)."""
        ...

    def master_extent(self, index: int) -> tuple[SwapSpace, int] | None:
        """Where sub-group `index`'s fp32 master weights live on the drive (the
        swap space and the logical offset of element 0), or None when they are
        not on a drive (in memory, or not written yet: initialize_from()).
        The drive copy is current between steps once flush() ran; only the
        optimizer writes it."""
        ...

    def flush(self) -> None:
        """Make the drive copy of every stepped sub-group current (state a step
        left only in buffers is written; the buffers are kept)."""
        ...

    def set_lr(self, lr: float) -> None:
        """The learning rate of every param group from the next step on."""
        ...

    def set_group_hyper(self, values: list[dict[str, Any]]) -> None:
        """Param group k's hyper-parameters (lr, weight decay, betas...) from
        `values[k]` from the next step on (the keys it has; others ignored)."""
        ...

    def export_checkpoint(self, directory: str) -> None:
        """Write master weights, optimizer state and step count to `directory`
        durably, the ``complete`` marker last; `directory` must not exist or be empty."""
        ...

    def verify_checkpoint(self, directory: str) -> dict[str, Any]:
        """Check a checkpoint from export_checkpoint() without changing anything;
        raises (ValueError, OSError) when it is incomplete, corrupt or for another
        layout. Returns what apply_checkpoint() takes."""
        ...

    def apply_checkpoint(self, directory: str, verified: dict[str, Any]) -> None:
        """Load the checkpoint verify_checkpoint() returned `verified` for."""
        ...

    def pinned_bytes(self) -> int:
        """Page-locked bytes held (or to be held at first use)."""
        ...

    def io_bytes(self) -> int:
        """Bytes read from and written to the drive so far (0 when in memory)."""
        ...

    def io_bytes_by_part(self) -> dict[str, dict[str, int]]:
        """The same bytes per tensor kind: ``{"read": {...}, "written": {...}}``
        keyed "param" (fp32 master weights), "grad" and each state by name."""
        ...

    def stats(self) -> dict[str, Any]:
        """The backend's counters, for the trainer's stats()."""
        ...

    def close(self) -> None:
        """Free buffers and files; no use afterwards."""
        ...


def set_lr(hyper: dict[str, Any], optimizer: Any, lr: float, groups: TorchGroups | None = None) -> None:
    """The learning rate for the next step: in the hyper-parameters, in every
    group of `groups` and, once the torch optimizer exists, in its parameter
    groups."""
    hyper["lr"] = lr
    if optimizer is not None:
        for pg in optimizer.param_groups:
            pg["lr"] = lr
    if groups is not None:
        groups.update(optimizer, [{"lr": lr}] * len(groups.hyper))


def make_optimizer(
    cfg: TrainConfig,
    optimizer_cls: Any,
    hyper: dict[str, Any],
    register_host: Register | None = None,
    group_hyper: list[dict[str, Any]] | None = None,
    gradients: str | None = None,
) -> ZeroOptimizer:
    """The optimizer backend ``zero_optimization.offload_optimizer.device`` asks
    for. `register_host`: how the drive backend page-locks its buffers (a GPU
    job's cudaHostRegister; default mlock). `group_hyper`: each torch param
    group's hyper-parameters over `hyper` (default: one group). `gradients`:
    "cpu" or "nvme", where the drive backend keeps fp32 gradients (default
    ``aio_zero.gradients``; its "auto" is the trainer's to decide, with
    :func:`aio.config.gradients.place_gradients`, and means "cpu" here)."""
    if cfg.optimizer_device == "nvme":
        from .swapped_optimizer import SwappedOptimizer

        # from_config is typed as returning its base class; it builds a cls.
        swapped: SwappedOptimizer = SwappedOptimizer.from_config(  # type: ignore[assignment]
            cfg.offload,
            optimizer_cls,
            hyper,
            state_dtype=cfg.aio_zero.optimizer_states,
            register_host=register_host,
            group_hyper=group_hyper,
        )
        swapped.gradients_on_drive = (gradients or cfg.aio_zero.gradients) == "nvme"
        return swapped
    from .memory_optimizer import MemoryOptimizer

    return MemoryOptimizer(optimizer_cls, hyper, group_hyper)
