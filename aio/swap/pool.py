"""Fixed pools of pinned, aligned swap buffers with dtype-aware views."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from ..pinned import Lease, PinnedPool, Register, locked_size, page_round


class PoolExhaustedError(RuntimeError):
    """Every buffer of a pool is in use and none will come back by waiting."""


class BufferPool:
    """``count`` buffers of ``slot_bytes`` each, allocated (and locked) on
    first use, so a swapper that is configured but never used costs nothing.

    ``count_key``/``size_key`` name the config keys that errors point at, e.g.
    ``"zero_optimization.offload_param.buffer_count"`` and ``"...buffer_size"``.

    `register` (with `pin`): page-lock the buffers through it, e.g. a CUDA
    compute device's cudaHostRegister, instead of ``mlock``: copies between a
    buffer and the GPU are then DMA transfers, and RLIMIT_MEMLOCK (64 KiB
    under docker's defaults) does not apply. If it refuses, the buffers are
    ``mlock``-ed as without it.
    """

    def __init__(
        self,
        count: int,
        slot_bytes: int,
        pin: bool,
        count_key: str,
        size_key: str,
        register: Register | None = None,
    ) -> None:
        if count <= 0:
            raise ValueError(f"{count_key} must be positive, got {count}")
        if slot_bytes <= 0:
            raise ValueError(f"{size_key} must be positive, got {slot_bytes}")
        self.count = count
        self.slot_bytes = slot_bytes
        self.pin = pin
        self.count_key = count_key
        self.size_key = size_key
        self.register = register
        self.registered_bytes = 0
        self._pool: PinnedPool | None = None
        self._making = threading.Lock()  # allocate() may run in a set-up thread
        self.closed = False

    @property
    def allocated(self) -> bool:
        """Whether the buffers have been allocated (first acquire)."""
        return self._pool is not None

    @property
    def planned_bytes(self) -> int:
        """Bytes of the buffers, allocated or not: whole pages per buffer, the
        whole pool as locking it locks (:func:`~aio.pinned.locked_size`)."""
        return locked_size(self.count * page_round(self.slot_bytes))

    @property
    def pinned_bytes(self) -> int:
        """Bytes this pool has page-locked right now: 0 before the first use or
        when not pinned, else every buffer (whole pages)."""
        return self._pool.locked_bytes + self.registered_bytes if self._pool is not None else 0

    def allocate(self) -> None:
        """Allocate (and lock) the buffers now rather than at the first acquire;
        idempotent and thread-safe. Faulting in fresh locked memory is slow on a
        VM (1 GiB took 3 s on the dev box, where the host backs each huge page
        anew), so a set-up step can do it while it waits for I/O."""
        self._get()

    def _get(self) -> PinnedPool:
        if self._pool is not None:
            return self._pool
        with self._making:
            return self._make()

    def _make(self) -> PinnedPool:
        if self.closed:
            raise ValueError(f"the swap buffers ({self.count_key}) were freed: their swapper is closed")
        if self._pool is None:
            if self.pin and self.register is not None:
                pool = PinnedPool(self.count, self.slot_bytes, lock=False)
                undo = self.register(pool.base_ptr, pool.total_bytes)
                if undo is not None:
                    pool.make_fixed()
                    weakref.finalize(pool, undo)
                    self.registered_bytes = pool.total_bytes
                    self._pool = pool
                    return pool
            self._pool = PinnedPool(self.count, self.slot_bytes, lock=self.pin)
        return self._pool

    def close(self) -> None:
        """Let the buffers go (idempotent): unlocked (or unregistered) and freed
        at once, or when the last lease or view of them still held elsewhere
        goes (I/O in flight holds its buffer until it lands). Acquiring
        afterwards raises ValueError. Without it they last until the owner
        does, which a reference cycle can leave to the garbage collector."""
        with self._making:
            self.closed = True
            self._pool = None
            self.registered_bytes = 0

    def available(self) -> int:
        """Buffers free right now (all of them before the first use)."""
        return self._get().available() if self._pool is not None else self.count

    def try_acquire(self) -> Lease | None:
        """Lease a free buffer, or None at once when all are in use."""
        pool = self._get()
        try:
            return pool.acquire(timeout=0)
        except TimeoutError:
            return None

    def acquire(self, timeout: float | None = None) -> Lease:
        """Lease a buffer, waiting up to `timeout` seconds (None: no limit); TimeoutError then."""
        return self._get().acquire(timeout)

    @staticmethod
    def view(lease: Lease, dtype: Any, numel: int, offset_bytes: int = 0) -> Any:
        """A 1-D tensor of `numel` elements of `dtype` at `offset_bytes` in the slot."""
        import torch

        itemsize = torch.empty(0, dtype=dtype).element_size()
        end = offset_bytes + numel * itemsize
        if end > lease.nbytes:
            raise ValueError(f"view of {end} bytes does not fit a {lease.nbytes}-byte buffer")
        raw = torch.frombuffer(lease.buffer(), dtype=torch.uint8)
        return raw[offset_bytes:end].view(dtype)
