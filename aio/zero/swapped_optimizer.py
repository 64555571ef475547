"""The optimizer backend with master weights and optimizer state on the
drive (``offload_optimizer.device: nvme``): :class:`aio.swap.OptimizerSwapper`
implementing :class:`aio.zero.optimizer.ZeroOptimizer`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..swap import OptimizerSwapper
from .malloc import long_lived_zeros
from .optimizer import GradientBuffer, PendingWrite, set_lr

if TYPE_CHECKING:
    from ..pinned import Lease

logger = logging.getLogger("aio.zero")


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._holding = threading.Lock()  # one gradient allocation at a time (see reserve_memory)
        self._reserving: threading.Thread | None = None
        self._stop_reserving = threading.Event()

    def reserve_memory(self, background: bool = False) -> None:
        """Allocate the swap buffers now and, with gradients in memory, each
        sub-group's gradient (zeros, so faulted in, on small pages: see
        aio.zero.malloc.long_lived_zeros; on the dev box's VM this took 11 s
        of a 2B model's first backward). Thread-safe beside initialize_many().

        With `background`, they are allocated in a thread while the first
        forward runs (fresh memory cost 0.5-0.9 s per GiB on the dev box's
        VM, most of a 2B bf16 model's set-up): the gradients first, the last
        sub-groups' first (backward needs them first), then the buffers (the
        step needs them), or with gradients on the drive the buffers alone
        (backward gathers gradients in them). open_gradient() allocates a
        gradient the thread has not reached itself, a first acquire waits
        for the buffers; step() and close() wait for the thread."""
        if not background:
            self.reserve_buffers()
            if not self.gradients_on_drive:
                self._reserve_gradients()
            return
        self._check_usable()
        pool = self._pool() if self.groups else None  # made here: only its memory in the thread
        self.wait_reserved()
        self._stop_reserving.clear()
        self._reserving = threading.Thread(
            target=self._reserve_quietly, args=(pool,), name="aio-reserve", daemon=True
        )
        self._reserving.start()

    def _reserve_gradients(self) -> None:
        for index in sorted(self.groups, reverse=True):
            if self._stop_reserving.is_set():
                return
            self._held_gradient(index, self.groups[index].numel)

    def _reserve_quietly(self, pool: Any) -> None:
        try:
            if not self.gradients_on_drive:
                self._reserve_gradients()
            if pool is not None and not self._stop_reserving.is_set():
                pool.allocate()
        except Exception as e:  # noqa: BLE001 - open_gradient() or the first acquire meets it again
            logger.debug("allocating ahead stopped: %r", e)

    def wait_reserved(self, stop: bool = False) -> None:
        """Wait for reserve_memory(background=True)'s thread, if any (`stop`:
        tell it to stop first, leaving the rest to open_gradient())."""
        thread, self._reserving = self._reserving, None
        if thread is not None:
            if stop:
                self._stop_reserving.set()
            thread.join()

    def _held_gradient(self, index: int, numel: int) -> Any:
        """Sub-group `index`'s gradient kept in memory, allocated if not yet."""
        with self._holding:
            held = self.groups[index].grad_mem
            if held is None or held.numel() != numel:
                held = long_lived_zeros(numel)
                self.hold_gradient(index, held)  # validates numel against the sub-group
            return held

    def open_gradient(self, index: int, numel: int, resume: bool) -> GradientBuffer:
        """Sub-group `index`'s gradient buffer, holding the gradient accumulated so
        far when `resume` (read back from the drive with ``gradients: nvme``),
        else unspecified (the caller writes every element); waits for a free
        pinned buffer with ``gradients: nvme``."""
        if self.gradients_on_drive:
            return self._fill(index, numel, resume, self.acquire_buffer())
        self._check_usable()
        return GradientBuffer(self._held_gradient(index, numel))

    def step(
        self,
        after: Callable[[int, Any], None] | None = None,
        grad_scale: Any = None,
        lowp: dict[int, Any] | None = None,
    ) -> None:
        """OptimizerSwapper.step(), once reserve_memory()'s thread is done."""
        self.wait_reserved()
        super().step(after, grad_scale, lowp)

    def close(self) -> None:
        """OptimizerSwapper.close(), reserve_memory()'s thread stopped first."""
        self.wait_reserved(stop=True)
        super().close()

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
