"""Device-resident FSDP2 shards up from the tier's pinned staging, on a side stream.

When FSDP2 keeps a group's local shards in GPU memory (no
``CPUOffloadPolicy``), the parameter tier (:mod:`aio.fsdp.tier`) reads them
from the drive into a pinned slot and :class:`ShardUploader` moves them up.
The ordering, and why each step is safe:

- **Allocation.** The shard's storage is allocated (``resize_``) with the
  side stream current, so the caching allocator cuts it from the side
  stream's pool: whatever used that block before was ordered before the side
  stream (see *Free*), and the copy needs no wait on the compute stream --
  it overlaps the compute already queued there.
- **Copy.** FSDP's padding rows are zeroed and the bytes copied
  (``non_blocking``) on the side stream; an event is recorded after them.
  The staging slot is pageable memory unless registered with CUDA
  (:meth:`ShardUploader.register`, done by the tier); the copy is then a
  DMA transfer the host does not wait for.
- **Landing.** Before FSDP may read the group -- its all-gather copies the
  shard in on FSDP's private copy-in stream, which in forward prefetch is
  ordered after the compute stream only once per iteration -- the host
  waits for the event (:meth:`ShardUploader.land`). Every stream's work
  queued after that (FSDP's copy-in stream, the compute stream, a user's)
  is ordered after the copy, with public API only. The tier starts an
  upload at the first gather (or the next group of a load of every shard)
  after its drive read landed, up to a window ahead of its own gather, so
  this wait has usually nothing left to wait for
  (``stats()["upload_waits"]`` counts the ones that blocked, also those
  forced by a slot an upload still held). The wait
  is an ``event.synchronize()`` even when a query found the event done:
  that is what ``TORCH_CUDA_SANITIZER`` counts as ordering.
- **Staging.** An upload owns its pinned slot until its event completed:
  the lease is given back only then (:meth:`ShardUploader.reclaim`), so no
  drive read or write-out reuses a slot a copy still reads.
- **Free.** Before ``resize_(0)`` the side stream waits for the compute
  stream (an event; the host does not wait). The block goes back to the
  pool of the stream it was allocated on with no ``record_stream``: for a
  block of the side stream, whatever is allocated next from that pool (by an
  upload, or by anyone sharing the pooled CUDA stream) is used by work
  queued on that stream after the wait, so after every use the compute stream had
  queued at the free (the optimizer's writes, the write-out's copy), and
  after FSDP's copy-in read too, which FSDP's copy-out made the compute
  stream wait for before the tier frees a gathered group. A block of the
  compute stream (a shard FSDP allocated, a blank group made in memory) is
  reused only by later work on that stream, in order. A group whose
  all-gather FSDP issued and nothing waited for (an iteration that raised
  in between) is not freed by the tier until that gather is waited for:
  FSDP's copy-in stream may still read it, and no public event orders a
  free after that stream.
- **Registration.** Undone after :meth:`ShardUploader.drain`, or, for an
  uploader dropped without :meth:`ShardUploader.close`, when its pool goes
  and after the side stream finished (the copies may still read it).

The write-out copy (device -> pinned staging before a drive write) stays
synchronous on the compute stream, in the tier: it orders the drive write
after the copy and the free after the copy without an event or a held
block, at the price of one host wait per dirty group written out (after
the optimizer's step or a write by the user); when the optimizer steps on
the GPU, that wait is for the step's kernels, a sync the step alone would
not have had.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..zero.streams import DeviceCopies, copies_for


class Upload:
    """One group's copies in flight: the event after them and the staging
    lease they read, held until the event completed."""

    __slots__ = ("event", "lease", "nbytes", "done")

    def __init__(self, event: Any, lease: Any) -> None:
        self.event = event
        self.lease = lease
        self.nbytes = 0
        self.done = False


class ShardUploader:
    """Uploads of one tier's device-resident shards (see the module
    docstring). `device`: the shards' CUDA device."""

    def __init__(self, device: Any) -> None:
        copies = copies_for(device)
        if not isinstance(copies, DeviceCopies):
            raise ValueError(f"device: ShardUploader moves shards to a CUDA device, got {device!r}")
        self._b = copies.backend
        self.side = self._b.side
        self._pending: collections.deque[Upload] = collections.deque()
        self._unregister: Any = None
        self.counters = collections.Counter[str]()

    def register(self, pool: Any) -> bool:
        """Register the pinned pool's memory with CUDA (cudaHostRegister), so
        copies from its slots are DMA transfers; the previous pool's
        registration is undone (after its uploads finished). Returns whether
        CUDA accepted it (if not, copies are pageable: correct, slower)."""
        self.drain()
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        undo = self._b.register_host(pool.base_ptr, pool.total_bytes)
        if undo is not None:
            # Undone when the pool goes, before its memory does, if no later call did (the
            # uploader dropped unclosed): after the side stream's copies, which may read it.
            self._unregister = weakref.finalize(pool, _unregister_after, self.side, undo)
        return undo is not None

    def holds(self, lease: Any) -> bool:
        """Whether an upload not yet done holds `lease` (its copies read the slot)."""
        return any(up.lease is lease for up in self._pending)

    @torch.no_grad()
    def fill(
        self,
        shards: Sequence[tuple[torch.Tensor, int]],
        zeros: Sequence[tuple[int, int]],
        copies: Sequence[tuple[int, int, int, int]],
        staging: torch.Tensor,
        lease: Any,
    ) -> Upload:
        """Allocate each shard (tensor, nbytes), zero its rows from each
        (shard, byte) of `zeros`, copy each (staging pos, shard, byte, nbytes)
        of `copies` from `staging`: all on the side stream. Holds `lease`
        (the slot of `staging`) from when its event exists (:meth:`holds`)
        until the copies are done, also when this raises part-way; if this
        raises before, the lease stays the caller's."""
        b = self._b
        up: Upload | None = None
        try:
            up = Upload(b.event(), lease)
            with b.on(self.side):
                for t, nbytes in shards:
                    t.untyped_storage().resize_(nbytes)
                for j, start in zeros:
                    shards[j][0].view(torch.uint8)[start:].zero_()
                for pos, j, dst, nbytes in copies:
                    b.copy(shards[j][0].view(torch.uint8)[dst : dst + nbytes], staging[pos : pos + nbytes])
                    up.nbytes += nbytes
        finally:
            if up is not None:
                # Copies queued before a failure still read the slot: it waits for them too.
                up.event.record(self.side)
                self._pending.append(up)
        self.counters["uploads"] += 1
        self.counters["upload_bytes"] += up.nbytes
        return up

    def land(self, up: Upload) -> None:
        """The host waits until `up`'s copies are done (counted when it had to
        block): anything queued afterwards, on any stream, reads the shards'
        new bytes. Gives its slot back."""
        if not up.done and not up.event.query():
            self.counters["upload_waits"] += 1
        # Also when done: a host wait is what orders the streams' later work after the copies
        # (a query that found them done does not, for TORCH_CUDA_SANITIZER); instant then.
        up.event.synchronize()
        self._retire(up)

    def reclaim(self, block: bool = False) -> bool:
        """Give back the slots of the uploads done; with `block`, if none is,
        wait for the oldest. Returns whether a slot was given back."""
        freed = False
        # One stream: its events complete in the order they were recorded.
        while self._pending and self._pending[0].event.query():
            self._retire(self._pending[0])
            freed = True
        if not freed and block and self._pending:
            self.land(self._pending[0])
            freed = True
        return freed

    def pending(self) -> int:
        """Uploads whose slot is still held."""
        return len(self._pending)

    def drain(self) -> None:
        """Wait for every upload and give their slots back."""
        while self._pending:
            self.land(self._pending[0])

    def free(self, tensors: Sequence[torch.Tensor]) -> None:
        """Free the shards' storage (``resize_(0)``) once the side stream is
        ordered after the compute stream (see *Free* in the module docstring)."""
        b = self._b
        ev = b.event()
        ev.record(b.compute())
        self.side.wait_event(ev)
        for t in tensors:
            t.untyped_storage().resize_(0)

    def close(self) -> None:
        """Wait for the uploads, then undo the staging's registration."""
        self.drain()
        if self._unregister is not None:
            self._unregister()
            self._unregister = None

    def _retire(self, up: Upload) -> None:
        if up.done:
            return
        up.done = True
        if up in self._pending:
            self._pending.remove(up)
        up.lease.release()


def _unregister_after(side: Any, undo: Any) -> None:
    """A registration's undo once `side` finished its copies (the finalizer
    of a pool whose uploader was dropped without close())."""
    try:
        side.synchronize()
    finally:
        undo()
