"""Host <-> compute-device copies, and the ordering that keeps them safe.

One small interface, two implementations, picked by :func:`copies_for`:

- :class:`HostCopies` (the compute device is the CPU): nothing moves. An
  "upload" hands back the host tensors themselves, a "download" the gradient
  itself, and every :class:`Ticket` is already done.
- :class:`DeviceCopies` (CUDA): copies run on a side stream, ordered against
  the compute stream by events, so the host never waits for a copy it has just
  started. Uploads: pinned host memory -> a device tensor allocated on the
  side stream; the compute stream waits on the copy's event and the device
  tensor is marked used by the compute stream (``record_stream``), so its
  memory is not handed out again while compute kernels may still read it.
  Small tensors go up together: packed into one pinned staging region, one
  copy, device views. Downloads: an event recorded on the compute stream
  (the gradient is ready there), the side stream waits on it and copies into
  pinned staging; the caller waits on the ticket only when it needs the
  values.

The host memory a copy reads must stay untouched until its ticket is done:
the caller keeps that promise for memory it owns (see ``ParamStore``), the
staging rings here keep it for theirs. The CUDA calls sit behind a tiny
backend (:class:`CudaBackend`) so the ordering logic is tested with a fake
one on machines without a GPU.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Protocol

_ALIGN = 64  # bytes; keeps every staged tensor aligned for vector loads
SMALL_BYTES = 1 << 18  # parameters up to this size are packed into one upload
UPLOAD_RING_BYTES = 16 << 20
DOWNLOAD_RING_BYTES = 64 << 20


class Ticket(Protocol):
    """A copy in flight."""

    def done(self) -> bool:
        """Whether the copy has finished (never blocks)."""

    def wait(self) -> None:
        """Block the host until the copy has finished."""


class _Done:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE: Ticket = _Done()


class _EventTicket:
    """A ticket for the work queued on a stream before `event` was recorded."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class HostCopies:
    """The CPU implementation: no copies, every ticket done."""

    max_download_bytes = 1 << 62
    small_bytes = 0
    on_device = False  # the compute device is the host
    host_registered = 0

    def upload(self, hosts: list[Any]) -> tuple[list[Any], Ticket]:
        """The tensors to compute with: `hosts` themselves."""
        return list(hosts), DONE

    def download(self, src: Any) -> tuple[Any, Ticket] | None:
        """The host tensor holding `src`'s values: `src` itself."""
        return src, DONE

    def placeholder(self, dtype: Any) -> Any:
        """An empty host tensor (what a parameter shows between uses)."""
        import torch

        # An explicit device: a default-device context (transformers builds
        # under torch.device("meta")) must not change where parameters live.
        return torch.empty(0, dtype=dtype, device="cpu")

    register_host = None  # host memory needs no registration for the CPU

    def host_tensor(self, numel: int, dtype: Any) -> Any:
        """Host memory for values the device reads: plain memory."""
        import torch

        return torch.empty(numel, dtype=dtype, device="cpu")

    def recycle(self) -> None:
        """Nothing to give back (downloads stage nothing)."""

    def pinned_bytes(self) -> int:
        """Staging memory held: none."""
        return 0

    def close(self) -> None:
        """Nothing to let go."""

    def synchronize(self) -> None:
        """Nothing is ever in flight."""

    def fence(self) -> Ticket:
        """The host never runs ahead of the CPU: done."""
        return DONE


class CudaBackend:
    """The CUDA calls :class:`DeviceCopies` makes, nothing else."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        # A high-priority stream: torch hands out streams round-robin from a
        # pool of 32 per priority, so a default-priority one may be the very
        # stream another library (or the user) queues long kernels on; the
        # high-priority pool is rarely used, and copies then also go first
        # when the GPU has a choice (FSDP2's copy streams do the same).
        self.side = torch.cuda.Stream(self.device, priority=-1)

    def compute(self) -> Any:
        """The stream compute kernels run on (the current stream)."""
        return self.torch.cuda.current_stream(self.device)

    def event(self) -> Any:
        """A new event."""
        return self.torch.cuda.Event()

    def on(self, stream: Any) -> Any:
        """Context manager: work (and device allocations) go to `stream`."""
        return self.torch.cuda.stream(stream)

    def empty(self, numel: int, dtype: Any) -> Any:
        """A device tensor, allocated on the current stream."""
        return self.torch.empty(numel, dtype=dtype, device=self.device)

    def pinned(self, nbytes: int) -> Any:
        """Page-locked host bytes."""
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)

    def copy(self, dst: Any, src: Any) -> None:
        """Queue dst <- src on the current stream."""
        dst.copy_(src, non_blocking=True)

    def record_stream(self, t: Any, stream: Any) -> None:
        """Tell the caching allocator `t` is used on `stream`."""
        t.record_stream(stream)

    def register_host(self, ptr: int, nbytes: int) -> Callable[[], None] | None:
        """Page-lock `nbytes` of host memory at `ptr` for CUDA (cudaHostRegister),
        so copies from and to it are DMA transfers; returns the callable that
        unregisters it, or None if CUDA refused (the memory stays pageable)."""
        from ..pinned import cuda_register

        return cuda_register(ptr, nbytes)

    def synchronize(self) -> None:
        """Wait for all work on the device."""
        self.torch.cuda.synchronize(self.device)


class PinnedRing:
    """A ring of pinned staging memory handed out first-in first-out.

    ``take`` returns a region or None when the ring is full; ``give_back``
    frees the oldest region. The ring is allocated on first use."""

    def __init__(self, backend: Any, capacity: int) -> None:
        self.backend = backend
        self.capacity = capacity
        self.buf: Any = None
        self.head = 0
        self.live: collections.deque[tuple[int, int]] = collections.deque()

    def take(self, nbytes: int) -> Any:
        """`nbytes` of staging (a uint8 tensor), or None if the ring is too full now."""
        n = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        if n > self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit a staging ring of {self.capacity}")
        if self.buf is None:
            self.buf = self.backend.pinned(self.capacity)
        start = self.head if self.head + n <= self.capacity else 0
        if any(s < start + n and start < e for s, e in self.live):
            return None
        self.live.append((start, start + n))
        self.head = start + n
        return self.buf[start : start + nbytes]

    def untake(self) -> None:
        """Free the newest region, which nothing used (its upload failed before
        its copy was queued): the next take may hand out its bytes again."""
        self.live.pop()
        self.head = self.live[-1][1] if self.live else 0

    def give_back(self) -> None:
        """Free the oldest region still taken."""
        self.live.popleft()
        if not self.live:
            self.head = 0

    def pinned_bytes(self) -> int:
        """Bytes of pinned memory held."""
        return 0 if self.buf is None else self.capacity

    def close(self) -> None:
        """Let the memory go (allocated again at the next take)."""
        self.buf = None
        self.live.clear()
        self.head = 0


class DeviceCopies:
    """The CUDA implementation (see the module docstring). `backend` is a
    :class:`CudaBackend` or a stand-in with the same methods."""

    on_device = True  # the compute device is not the host

    def __init__(self, backend: Any, small_bytes: int = SMALL_BYTES) -> None:
        self.backend = backend
        self.small_bytes = small_bytes
        self.up = PinnedRing(backend, UPLOAD_RING_BYTES)
        self.up_tickets: collections.deque[Ticket] = collections.deque()
        self.down = PinnedRing(backend, DOWNLOAD_RING_BYTES)
        self.max_download_bytes = DOWNLOAD_RING_BYTES // 4
        self.counters = {"h2d_copies": 0, "h2d_bytes": 0, "d2h_copies": 0, "d2h_bytes": 0}
        self.host_registered = 0  # bytes of host_tensor() memory registered (never freed before close)

    def placeholder(self, dtype: Any) -> Any:
        """An empty device tensor (what a parameter shows between uses)."""
        return self.backend.empty(0, dtype)

    def register_host(self, ptr: int, nbytes: int) -> Callable[[], None] | None:
        """Page-lock host memory for the device (see CudaBackend.register_host)."""
        return self.backend.register_host(ptr, nbytes)

    def host_tensor(self, numel: int, dtype: Any) -> Any:
        """Host memory for values the device reads: page-aligned, exactly
        `numel` elements (whole pages) and registered with the device, unlike
        torch's pinned allocator, which rounds every block up to a power of
        two and keeps it cached (pageable if the device refuses)."""
        from ..pinned import registered_tensor

        t, registered = registered_tensor(numel, dtype, self.backend.register_host)
        self.host_registered += registered
        return t

    # -- host -> device ---------------------------------------------------------------------
    def upload(self, hosts: list[Any]) -> tuple[list[Any], Ticket]:
        """Queue `hosts` (flat host tensors) up to the device; returns the device
        tensors and the ticket after which the host memory may be reused. The
        compute stream already waits for the copy: use the tensors right away."""
        if len(hosts) == 1 or sum(h.nbytes for h in hosts) > self.up.capacity // 4:
            return self._upload_each(hosts)
        return self._upload_packed(hosts)

    def _upload_each(self, hosts: list[Any]) -> tuple[list[Any], Ticket]:
        b = self.backend
        with b.on(b.side):
            devs = []
            for h in hosts:
                d = b.empty(h.numel(), h.dtype)
                b.copy(d, h)
                devs.append(d)
            ev = b.event()
            ev.record(b.side)
        self._publish(devs, ev)
        self.counters["h2d_copies"] += len(hosts)
        self.counters["h2d_bytes"] += sum(h.nbytes for h in hosts)
        return devs, _EventTicket(ev)

    def _upload_packed(self, hosts: list[Any]) -> tuple[list[Any], Ticket]:
        import torch

        b = self.backend
        offsets, total = [], 0
        for h in hosts:
            offsets.append(total)
            total += -(-h.nbytes // _ALIGN) * _ALIGN
        stage = self._take_up(total)
        try:
            for h, off in zip(hosts, offsets, strict=True):
                stage[off : off + h.nbytes].view(h.dtype).copy_(h.reshape(-1))
            with b.on(b.side):
                flat = b.empty(total, torch.uint8)  # out of device memory: nothing queued
                b.copy(flat, stage)
        except BaseException:
            # No ticket will free this region: a region held for good made
            # every later one wait for the upload after it.
            self.up.untake()
            raise
        with b.on(b.side):
            ev = b.event()
            ev.record(b.side)
        ticket = _EventTicket(ev)
        self.up_tickets.append(ticket)
        self._publish([flat], ev)
        devs = [flat[off : off + h.nbytes].view(h.dtype) for h, off in zip(hosts, offsets, strict=True)]
        self.counters["h2d_copies"] += 1
        self.counters["h2d_bytes"] += total
        return devs, ticket

    def _take_up(self, nbytes: int) -> Any:
        # The ring's oldest region is free once its upload has finished: give
        # back those already done (an event query each), so the regions and
        # events held stay few, then wait only if the ring is still full.
        while self.up_tickets and self.up_tickets[0].done():
            self._free_oldest_upload()
        while (stage := self.up.take(nbytes)) is None:
            self._free_oldest_upload()
        return stage

    def _free_oldest_upload(self) -> None:
        """Wait for the oldest upload still holding staging, then give its region back."""
        self.up_tickets.popleft().wait()
        self.up.give_back()

    def _publish(self, devs: list[Any], ev: Any) -> None:
        b = self.backend
        compute = b.compute()
        compute.wait_event(ev)
        for d in devs:
            b.record_stream(d, compute)

    # -- device -> host ----------------------------------------------------------------------
    def download(self, src: Any) -> tuple[Any, Ticket] | None:
        """Queue `src` (a flat device tensor of at most ``max_download_bytes``,
        ready on the compute stream now) down into pinned staging; returns the
        host tensor and its ticket, or None while the staging ring is full
        (``recycle`` the oldest download first). Keep `src` alive until the
        ticket is done."""
        stage = self.down.take(src.nbytes)
        if stage is None:
            return None
        b = self.backend
        ready = b.event()
        ready.record(b.compute())
        b.side.wait_event(ready)
        host = stage.view(src.dtype)
        with b.on(b.side):
            b.copy(host, src)
            ev = b.event()
            ev.record(b.side)
        self.counters["d2h_copies"] += 1
        self.counters["d2h_bytes"] += src.nbytes
        return host, _EventTicket(ev)

    def recycle(self) -> None:
        """The oldest download's host tensor is no longer needed."""
        self.down.give_back()

    def pinned_bytes(self) -> int:
        """Pinned staging memory held, in bytes."""
        return self.up.pinned_bytes() + self.down.pinned_bytes()

    def close(self) -> None:
        """Wait for the copies in flight, then let the staging memory go."""
        self.synchronize()
        self.backend.synchronize()  # downloads too
        self.up.close()
        self.down.close()

    def fence(self) -> Ticket:
        """A ticket done once the compute stream has run everything queued on it so far."""
        ev = self.backend.event()
        ev.record(self.backend.compute())
        return _EventTicket(ev)

    def synchronize(self) -> None:
        """Wait for every upload from staging."""
        while self.up_tickets:
            self._free_oldest_upload()


_factories: dict[str, Callable[[Any], Any]] = {"cuda": CudaBackend}


def set_backend_factory(
    device_type: str, factory: Callable[[Any], Any] | None
) -> Callable[[Any], Any] | None:
    """Make `factory(device)` build the backend (the methods of
    :class:`CudaBackend`) for compute devices of `device_type`; returns the
    previous factory. None removes it. This is how the test suite's CUDA
    simulator stands in for a GPU; nothing else needs it."""
    prev = _factories.pop(device_type, None)
    if factory is not None:
        _factories[device_type] = factory
    return prev


def copies_for(device: Any) -> HostCopies | DeviceCopies:
    """The copy implementation for a compute device."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return HostCopies()
    factory = _factories.get(device.type)
    if factory is None:
        raise ValueError(f"aio.zero computes on cpu or cuda, not {device.type}")
    return DeviceCopies(factory(device))
