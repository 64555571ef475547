"""Parameters on their way up to the compute device.

:class:`Uploads` is the one orchestrator of a parameter store's host ->
device traffic (FSDP2's per-group stream/event state): it owns the copy
implementation (:mod:`.streams`: side stream, events, staging), the tickets
of the uploads in flight, and the window that bounds how far the host may
run ahead of the GPU. :class:`aio.zero.params.ParamStore` decides *what* to
fetch and release; this module says *when* host memory may be reused:

- an upload reads its host memory (a swap buffer, a resident partition)
  until its ticket is done: :meth:`settle` before overwriting it;
- a dropped partition whose upload is still queued keeps its swap buffer
  (:meth:`defer`) until :meth:`reap` finds the upload done;
- :meth:`pace` blocks the host before a module's fetch when the GPU is more
  than :attr:`UploadPolicy.modules_ahead` fetches behind.

On the CPU (:class:`.streams.HostCopies`) every ticket is done at once and
all of this costs nothing.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from .streams import DeviceCopies, HostCopies, Ticket


@dataclass(frozen=True)
class UploadPolicy:
    """How far uploads may run ahead (``aio_zero.modules_ahead``)."""

    modules_ahead: int = 2


class Uploads:
    """See the module docstring. `copies`: the compute device's copies."""

    def __init__(self, copies: HostCopies | DeviceCopies, policy: UploadPolicy | None = None) -> None:
        self.copies = copies
        self.policy = policy or UploadPolicy()
        self.uploading: dict[int, Ticket] = {}  # part id -> the upload reading its host memory
        self.deferred: dict[int, Ticket] = {}  # dropped part ids whose buffer waits for the upload
        self.window: collections.deque[Ticket] = collections.deque()  # fences of recent fetches
        self.counters = {"pace_waits": 0}

    def pace(self) -> None:
        """A module is about to be fetched: mark where the compute stream is,
        and block the host until the GPU has run everything queued before the
        fetch `modules_ahead` fetches ago. Device memory freed by earlier
        modules (marked used by the compute stream) is reused only once the
        GPU has passed it, so without this a host running ahead would hold
        most of the model on the device (FSDP's ``limit_all_gathers``)."""
        self.window.append(self.copies.fence())
        while len(self.window) > self.policy.modules_ahead:
            t = self.window.popleft()
            if not t.done():
                self.counters["pace_waits"] += 1
                t.wait()

    def upload(self, params: list[Any], hosts: list[Any]) -> None:
        """Point `params` at device copies of `hosts`, queued on the side
        stream: large ones one by one, the small ones in one transfer."""
        small = [i for i, h in enumerate(hosts) if h.nbytes <= self.copies.small_bytes]
        groups = [[i] for i, h in enumerate(hosts) if h.nbytes > self.copies.small_bytes]
        if small:
            groups.append(small)
        for group in groups:
            devs, ticket = self.copies.upload([hosts[i] for i in group])
            for i, dev in zip(group, devs, strict=True):
                p = params[i]
                self.uploading[p.aio_id] = ticket
                p.data = dev.view(p.aio_shape)

    def settle(self, part_id: int) -> None:
        """Wait for the upload still reading `part_id`'s host memory, if any."""
        ticket = self.uploading.pop(part_id, None)
        if ticket is not None:
            ticket.wait()

    def defer(self, part_id: int) -> bool:
        """`part_id` was dropped: True if its upload is still queued (its host
        memory must stay; :meth:`reap` hands it back later), else False (its
        memory is free now)."""
        ticket = self.uploading.get(part_id)
        if ticket is not None and not ticket.done():
            self.deferred[part_id] = ticket
            return True
        self.uploading.pop(part_id, None)
        return False

    def keep(self, part_id: int) -> None:
        """`part_id` is in use again: its deferred buffer is not handed back."""
        self.deferred.pop(part_id, None)

    def reap(self, block: bool) -> list[int]:
        """The deferred part ids whose upload is done (with `block`, all of
        them, waiting as needed); their host memory may be reused."""
        done = [part_id for part_id, t in self.deferred.items() if block or t.done()]
        for part_id in done:
            self.deferred.pop(part_id).wait()
            self.uploading.pop(part_id, None)
        return done

    def reap_oldest(self) -> int | None:
        """Wait for the oldest deferred upload (the first to finish) and
        return its part id, or None when nothing is deferred."""
        if not self.deferred:
            return None
        part_id = next(iter(self.deferred))
        self.deferred.pop(part_id).wait()
        self.uploading.pop(part_id, None)
        return part_id

    def synchronize(self) -> list[int]:
        """Wait for every upload; returns the deferred part ids (now free)."""
        for part_id in list(self.uploading):
            self.settle(part_id)
        done = self.reap(block=True)
        self.copies.synchronize()
        return done

    def close(self) -> None:
        """Wait for every upload and forget the deferred ones."""
        for part_id in list(self.uploading):
            self.settle(part_id)
        self.deferred.clear()
        self.copies.synchronize()
