"""The one optimizer interface the trainer steps through.

:class:`ZeroOptimizer` is what :class:`aio.zero.OffloadTrainer` needs from
the optimizer side: sub-groups of fp32 master weights, a place to accumulate
each sub-group's gradient, a step over every sub-group, checkpoints and
accounting. Two implementations: :class:`aio.zero.optim.MemoryOptimizer`
(state in CPU memory) and :class:`SwappedOptimizer` (state on the drive,
:class:`aio.swap.OptimizerSwapper` with the gradient-buffer methods added).
:func:`make_optimizer` picks one from the config; the trainer never asks
which one it has.

To add an optimizer backend: implement this Protocol and return it from
:func:`make_optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..swap import OptimizerSwapper

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..pinned import Lease
    from ..swap.drives import IOFuture


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

    def register_subgroup(self, index: int, numel: int) -> None:
        """Declare sub-group `index` of `numel` fp32 elements (the trainer registers
        every sub-group, 0 up, before initializing any)."""
        ...

    def initialize(self, index: int, master: Any) -> None:
        """Set sub-group `index`'s fp32 master weights (`numel` elements) before the first step."""
        ...

    def try_open_gradient(self, index: int, numel: int, resume: bool) -> GradientBuffer | None:
        """The sub-group's gradient buffer (zeroed, or holding the gradient
        accumulated so far when `resume`), or None when no buffer is free now."""
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

    def set_lr(self, lr: float) -> None:
        """The learning rate from the next step on."""
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

    def stats(self) -> dict[str, Any]:
        """The backend's counters, for the trainer's stats()."""
        ...

    def close(self) -> None:
        """Free buffers and files; no use afterwards."""
        ...


def set_lr(hyper: dict[str, Any], optimizer: Any, lr: float) -> None:
    """The learning rate for the next step: in the hyper-parameters and, once
    the torch optimizer exists, in its parameter groups."""
    hyper["lr"] = lr
    if optimizer is not None:
        for pg in optimizer.param_groups:
            pg["lr"] = lr


class SwappedOptimizer(OptimizerSwapper):
    """:class:`aio.swap.OptimizerSwapper` as a :class:`ZeroOptimizer`: master
    weights and optimizer state on the drive.

    Gradients (``aio_zero.gradients``): with ``cpu`` (the default) each
    sub-group's fp32 gradient is accumulated in CPU memory that lives as long
    as the optimizer -- as DeepSpeed keeps its gradient partitions -- and is
    stepped from there (:meth:`~aio.swap.OptimizerSwapper.hold_gradient`): no
    drive I/O and no pinned buffer for gradients. With ``nvme`` it is gathered
    in one of the swapper's pinned buffers and written to the drive, and the
    step reads it back: 8 bytes of I/O per element per step for the least memory.
    """

    gradients_on_drive = False

    def try_open_gradient(self, index: int, numel: int, resume: bool) -> GradientBuffer | None:
        """The sub-group's gradient buffer (see open_gradient()); None only when
        gradients go through pinned buffers and none is free now."""
        if not self.gradients_on_drive:
            return self.open_gradient(index, numel, resume)
        lease = self.try_acquire_buffer()
        return None if lease is None else self._fill(index, numel, resume, lease)

    def open_gradient(self, index: int, numel: int, resume: bool) -> GradientBuffer:
        """Sub-group `index`'s gradient buffer, holding the gradient accumulated so
        far when `resume` (read back from the drive with ``gradients: nvme``),
        else zeroed; waits for a free pinned buffer with ``gradients: nvme``."""
        if self.gradients_on_drive:
            return self._fill(index, numel, resume, self.acquire_buffer())
        import torch

        self._check_usable()
        held = self.groups[index].grad_mem
        if held is None or held.numel() != numel:
            held = torch.zeros(numel, dtype=torch.float32)
            self.hold_gradient(index, held)  # validates numel against the sub-group
        elif not resume:
            held.zero_()
        return GradientBuffer(held)

    def _fill(self, index: int, numel: int, resume: bool, lease: Lease) -> GradientBuffer:
        import torch

        try:
            buf = lease.tensor(torch.float32, numel)
            if resume:
                self.read_gradient(index, buf)
            else:
                buf.zero_()
        except BaseException:
            lease.release()
            raise
        return GradientBuffer(buf, lease)

    def close_gradient(self, index: int, buf: GradientBuffer) -> PendingWrite | None:
        """With ``gradients: cpu`` nothing to store (None: the gradient already is
        where step() reads it). With ``nvme``, start writing it to the drive; the
        buffer goes back when the returned write is waited for or abandoned.
        ValueError if `buf` was closed already."""
        if not self.gradients_on_drive:
            return None
        lease, buf.lease = buf.lease, None
        if lease is None:
            raise ValueError(f"sub-group {index}: this gradient buffer was closed already")
        try:
            fut = self.write_gradient(index, buf.tensor)
        except BaseException:
            lease.release()
            raise
        return PendingWrite(lease, fut)

    def set_lr(self, lr: float) -> None:
        """The learning rate from the next step on."""
        set_lr(self.hyper, self.optimizer, lr)

    def io_bytes(self) -> int:
        """Bytes this swapper has read and written so far (master weights, states and
        gradients)."""
        return int(self.counters["bytes_read"] + self.counters["bytes_written"])


def make_optimizer(cfg: TrainConfig, optimizer_cls: Any, hyper: dict[str, Any]) -> ZeroOptimizer:
    """The optimizer backend ``zero_optimization.offload_optimizer.device`` asks for."""
    if cfg.optimizer_device == "nvme":
        # from_config is typed as returning its base class; it builds a cls.
        swapped: SwappedOptimizer = SwappedOptimizer.from_config(  # type: ignore[assignment]
            cfg.offload, optimizer_cls, hyper, state_dtype=cfg.aio_zero.optimizer_states
        )
        swapped.gradients_on_drive = cfg.aio_zero.gradients == "nvme"
        return swapped
    from .optim import MemoryOptimizer

    return MemoryOptimizer(optimizer_cls, hyper)
