"""The optimizer backend with master weights and optimizer state on the
drive (``offload_optimizer.device: nvme``): :class:`aio.swap.OptimizerSwapper`
implementing :class:`aio.zero.optimizer.ZeroOptimizer`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..swap import OptimizerSwapper
from .malloc import long_lived_zeros
from .optimizer import GradientBuffer, PendingWrite, set_lr

if TYPE_CHECKING:
    from ..pinned import Lease


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

    def gradient_slot(self) -> bool:
        """Room for fp32 gradients on the drive only with ``gradients: nvme``
        (set before the sub-groups are registered)."""
        return self.gradients_on_drive

    def try_open_gradient(self, index: int, numel: int, resume: bool) -> GradientBuffer | None:
        """The sub-group's gradient buffer (see open_gradient()); None only when
        gradients go through pinned buffers and none is free now."""
        if not self.gradients_on_drive:
            return self.open_gradient(index, numel, resume)
        lease = self.try_acquire_buffer()
        return None if lease is None else self._fill(index, numel, resume, lease)

    def reserve_memory(self) -> None:
        """Allocate the swap buffers now and, with gradients in memory, each
        sub-group's gradient (zeros, so faulted in, on small pages: see
        aio.zero.malloc.long_lived_zeros; on the dev box's VM this took 11 s
        of a 2B model's first backward). Thread-safe beside initialize_many()."""
        self.reserve_buffers()
        if self.gradients_on_drive:
            return
        for index, g in list(self.groups.items()):
            if g.grad_mem is None:
                self.hold_gradient(index, long_lived_zeros(g.numel))

    def open_gradient(self, index: int, numel: int, resume: bool) -> GradientBuffer:
        """Sub-group `index`'s gradient buffer, holding the gradient accumulated so
        far when `resume` (read back from the drive with ``gradients: nvme``),
        else unspecified (the caller writes every element); waits for a free
        pinned buffer with ``gradients: nvme``."""
        if self.gradients_on_drive:
            return self._fill(index, numel, resume, self.acquire_buffer())
        self._check_usable()
        held = self.groups[index].grad_mem
        if held is None or held.numel() != numel:
            held = long_lived_zeros(numel)
            self.hold_gradient(index, held)  # validates numel against the sub-group
        return GradientBuffer(held)

    def _fill(self, index: int, numel: int, resume: bool, lease: Lease) -> GradientBuffer:
        import torch

        try:
            buf = lease.tensor(torch.float32, numel)
            if resume:
                self.read_gradient(index, buf)
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
        """The learning rate of every param group from the next step on."""
        set_lr(self.hyper, self.optimizer, lr, self.torch_groups)

    def set_group_hyper(self, values: list[dict[str, Any]]) -> None:
        """Param group k's hyper-parameters from `values[k]` from the next step on."""
        self.torch_groups.update(self.optimizer, values)

    def io_bytes(self) -> int:
        """Bytes this swapper has read and written so far (master weights, states and
        gradients)."""
        return int(self.counters["bytes_read"] + self.counters["bytes_written"])

    def io_bytes_by_part(self) -> dict[str, dict[str, int]]:
        """Bytes per tensor kind so far (``OptimizerSwapper.bytes_by_part``)."""
        return {d: dict(c) for d, c in self.bytes_by_part.items()}
