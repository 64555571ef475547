"""Gradient buffers: each parameter's gradient is added, in fp32, into its
sub-group's buffer as soon as autograd has it; a sub-group's buffer is stored
(written to the drive, or left in memory) when all its gradients are in.
Gradient accumulation over ``gradient_accumulation_steps`` micro-steps reads a
stored buffer back and adds to it.

Gradients computed on a GPU come down without stopping the host: each one
(in chunks of at most the staging size) is queued for a copy into pinned
staging on a side stream, and added into its buffer later -- by a following
gradient's hook once its copy has finished (a hook waits only when the
staging ring is full or :data:`IN_FLIGHT` copies are queued), or at the end
of backward -- so backward keeps running while earlier gradients travel. Gradients are
still added one by one in arrival order, so the sums are exactly those of
blocking copies. On the CPU nothing is copied and each gradient is added at
once."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

from .optimizer import GradientBuffer, PendingWrite, ZeroOptimizer
from .placement import SubGroupLayout
from .streams import DeviceCopies, HostCopies, Ticket, copies_for

# Gradient copies a hook leaves running, at most: a hook lands the finished
# ones and waits only beyond this many (or when the staging ring is full),
# so backward never runs in lockstep with its copies.
IN_FLIGHT = 64

# Elements per add when a gradient's dtype differs from its fp32 buffer: on
# the CPU, torch first casts the whole input into a temporary (TensorIterator
# promotes CPU inputs by copying). A 16 MiB bf16 download made a 32 MiB
# temporary, above malloc's mmap threshold (aio.zero.malloc): a fresh mapping
# faulted in page by page for every chunk, 1 GB of faults and 0.6 s of system
# time per step for a 277M model on an H200. 256K elements (1 MiB of fp32)
# stay in malloc's heap and in cache.
ADD_CHUNK = 1 << 18


def add_into(dst: Any, src: Any, copy: bool = False) -> None:
    """``dst += src`` (flat, same length), without a temporary larger than
    :data:`ADD_CHUNK` elements when the dtypes differ; same bits as one add_.
    `copy`: ``dst = src`` instead (one converting pass, no temporary)."""
    if copy:
        dst.copy_(src)
        return
    if src.dtype == dst.dtype:
        dst.add_(src)
        return
    n = src.numel()
    for start in range(0, n, ADD_CHUNK):
        stop = min(n, start + ADD_CHUNK)
        dst[start:stop].add_(src[start:stop])


def _zero_except(buf: Any, written: list[tuple[int, int]]) -> None:
    """Zero the elements of flat `buf` outside the `written` [start, stop) ranges
    (a fresh buffer's parameters that got no gradient, and parts not yet landed)."""
    at = 0
    for lo, hi in sorted(written):
        if lo > at:
            buf[at:lo].zero_()
        at = max(at, hi)
    if at < buf.numel():
        buf[at:].zero_()


class _Arriving(NamedTuple):
    """Elements [start, stop) of a parameter's gradient on their way to the host."""

    param: Any
    start: int
    stop: int
    host: Any  # where they land (the gradient itself on the CPU)
    ticket: Ticket
    src: Any  # the device gradient, kept alive until the copy is done
    first: bool  # the parameter's first gradient in this micro-step


class GradientAccumulator:
    """The gradients of one accumulation window (`gas` micro-steps).

    `record_norms`: keep each parameter's gradient norm at the window's last
    micro-step (for clipping and overflow checks). `copies`: how gradients
    come down from the compute device (default: by the first gradient's device)."""

    def __init__(
        self,
        opt: ZeroOptimizer,
        layout: SubGroupLayout,
        gas: int,
        record_norms: bool,
        copies: HostCopies | DeviceCopies | None = None,
    ) -> None:
        self.opt = opt
        self.layout = layout
        self.gas = gas
        self.record_norms = record_norms
        self.micro_steps = 0
        self._open: dict[int, GradientBuffer] = {}  # sub-groups being filled this micro-step
        self._arrived: dict[int, int] = {}
        self._touched: set[int] = set()  # sub-groups with a gradient in this micro-step
        # Sub-groups stored at least once in this window (a micro-step, a
        # part-way flush, an earlier backward): opened again, they are read
        # back and added to; any other is opened afresh. Not the micro-step's
        # place in the window: a micro-step without backward stores nothing.
        self._stored: set[int] = set()
        self._pending: list[PendingWrite] = []  # gradient writes in flight
        self._norms: dict[int, Any] = {}  # place order -> grad norm (accumulation boundary)
        # Sub-groups some gradient reached in this window: at its boundary their
        # parameters without a gradient in the last micro-step are normed too.
        self._graded: set[int] = set()
        # The compute device's copies (the parameter store's, sharing its side
        # stream); None: chosen by the first gradient's device.
        self._copies: HostCopies | DeviceCopies | None = copies
        self._arriving: collections.deque[_Arriving] = collections.deque()
        # Sub-groups opened afresh in this micro-step -> the element ranges
        # written since (first gradients are copied in, not added); the rest
        # is zeroed at close, so no buffer is zeroed whole first.
        self._fresh: dict[int, list[tuple[int, int]]] = {}
        self._seen: set[int] = set()  # parameters (aio_id) with a gradient in this backward
        # Backwards finished in this micro-step: a second one before step()
        # adds to the first's gradients, as torch sums into .grad.
        self._passes = 0
        self._normed: set[int] = set()  # place orders whose norm this backward took
        self.norms_on_device = 0  # gradient norms taken on the compute device, in all
        # Parameters whose gradient a backward computed straight into its
        # buffer (target()), until their gradient hook counts the arrival.
        self._placed: set[int] = set()
        self.in_place = 0  # gradients computed in their buffers, in all

    def is_boundary(self) -> bool:
        """Whether the current micro-step ends the accumulation window."""
        return (self.micro_steps + 1) % self.gas == 0

    @property
    def has_open(self) -> bool:
        """Whether a sub-group's gradient buffer is still open (not yet stored), or a
        gradient still on its way, in this micro-step."""
        return bool(self._open) or bool(self._arriving)

    @property
    def in_backward(self) -> bool:
        """Whether gradients arrived since the last finish_backward() (a
        backward run by autograd directly, loss.backward(), is finished by
        the step)."""
        return bool(self._seen) or self.has_open

    @property
    def touched(self) -> bool:
        """Whether any gradient has arrived in the current micro-step."""
        return bool(self._touched)

    def target(self, param: Any, dtype: Any, device: Any) -> Any:
        """Where a backward may compute `param`'s first gradient of this
        micro-step itself (flat, float32, in its sub-group's buffer), instead
        of handing autograd a new tensor for add() to copy: saves the copy
        and the fresh memory (faulted in each step) of every weight gradient.
        None unless the gradient is float32 on the CPU, the parameter's first
        in this backward, and its buffer is opened afresh (not added to).
        Whoever takes it must fill it before the parameter's gradient hook
        runs, which then calls add() with what else arrived (None if nothing)."""
        import torch

        if dtype != torch.float32 or torch.device(device).type != "cpu" or param.aio_id in self._seen:
            return None
        s = self.layout.places[param.aio_id]
        if s.group not in self._open and s.group in self._stored:
            return None  # read back and added to: not the first gradient
        self._land(keep=0)  # earlier arrivals first, as add() keeps them in order
        buf = self._buffer(s.group)
        written = self._fresh.get(s.group)
        if written is None:
            return None
        self._seen.add(param.aio_id)
        self._placed.add(param.aio_id)
        self._graded.add(s.group)
        written.append((s.offset, s.offset + s.numel))
        self.in_place += 1
        return buf.tensor[s.offset : s.offset + s.numel]

    def _land_placed(self, param: Any) -> None:
        """`param`'s gradient was computed in its buffer (target()): take its
        norm and count it as arrived (its buffer is stored once all are in)."""
        self._placed.discard(param.aio_id)
        self._arrive(self.layout.places[param.aio_id])

    def _take_norm(self, s: Any, again: bool = False) -> None:
        """Record parameter place `s`'s gradient norm at the window's boundary,
        unless this backward took it already (`again`: take it from the sum)."""
        import torch

        if self.record_norms and self.is_boundary() and (again or s.order not in self._normed):
            buf = self._buffer(s.group).tensor
            self._norms[s.order] = torch.linalg.vector_norm(buf[s.offset : s.offset + s.numel])
            self._normed.add(s.order)

    def _arrive(self, s: Any) -> None:
        """Place `s`'s first gradient of this backward is all in: take its norm,
        count it, and store its sub-group once all of the group's are in."""
        self._take_norm(s)
        self._arrived[s.group] = self._arrived.get(s.group, 0) + 1
        # Written out meanwhile to make room (_buffer()), it holds the gradient
        # on the drive already: nothing to store unless opened again.
        if self._arrived[s.group] == len(self.layout.groups[s.group]) and s.group in self._open:
            self._close(s.group)

    def add(self, param: Any, grad: Any) -> None:
        """Add `param`'s gradient into its sub-group's buffer (on a GPU: start
        its copy down; it is added by a later call or finish_backward()).
        `grad` None: nothing arrived beyond what a backward computed in the
        buffer (target()), if anything."""
        if grad is not None:
            self._add(param, grad)
        if param.aio_id in self._placed:
            self._land(keep=0)  # the rest of its gradient first: the norm is the sum's
            self._land_placed(param)

    def _add(self, param: Any, grad: Any) -> None:
        flat = grad.detach().reshape(-1)
        if self._copies is None:
            self._copies = copies_for(flat.device)
        copies = self._copies
        self._graded.add(self.layout.places[param.aio_id].group)
        first = param.aio_id not in self._seen
        self._seen.add(param.aio_id)
        self._device_norm(param, flat, first)
        n = flat.numel()
        chunk = max(1, copies.max_download_bytes // max(flat.element_size(), 1))
        for start in range(0, max(n, 1), chunk):
            stop = min(n, start + chunk)
            while (got := copies.download(flat[start:stop])) is None:
                if not self._arriving:
                    raise RuntimeError("gradient staging is full with no copy in flight")
                self._land_oldest()
            self._arriving.append(_Arriving(param, start, stop, got[0], got[1], flat, first))
        self._land(keep=IN_FLIGHT)

    def _device_norm(self, param: Any, flat: Any, first: bool) -> None:
        """Take `param`'s gradient norm on the compute device, when the window is
        one micro-step on a GPU (the gradient there is the whole window's). The
        hooks add each parameter's gradient once per backward (see aio.zero.hooks)."""
        if not (first and self.record_norms and self.gas == 1 and getattr(self._copies, "on_device", False)):
            return
        if self._passes:  # not the whole window's gradient: taken from the sum on the host
            return
        s = self.layout.places[param.aio_id]
        import torch

        wide = None if flat.dtype == torch.float32 else torch.float32
        self._norms[s.order] = torch._foreach_norm([flat], 2, dtype=wide)[0]
        self._normed.add(s.order)
        self.norms_on_device += 1

    def _land(self, keep: int) -> None:
        """Add the arrived gradients, oldest first: every finished copy, and
        older ones (waiting for them) until at most `keep` are in flight."""
        while self._arriving and (len(self._arriving) > keep or self._arriving[0].ticket.done()):
            self._land_oldest()

    def _land_oldest(self) -> None:

        a = self._arriving.popleft()
        try:
            a.ticket.wait()
            s = self.layout.places[a.param.aio_id]
            buf = self._buffer(s.group).tensor
            lo, hi = s.offset + a.start, s.offset + a.stop
            written = self._fresh.get(s.group) if a.first else None
            add_into(buf[lo:hi], a.host, copy=written is not None)
            if written is not None:
                written.append((lo, hi))
        finally:
            self._recycle()
        if a.stop < s.numel:
            return
        # A second gradient of a parameter in one backward (a module shared
        # by reentrant-checkpointed segments): its norm is the sum's, and it
        # does not count as another parameter arriving.
        if not a.first:
            self._take_norm(s, again=True)
            return
        self._arrive(s)

    def _drop_arriving(self) -> None:
        """Forget the gradients on their way (after their copies finished: the
        staging is reused and the device gradients freed after this)."""
        while self._arriving:
            self._arriving.popleft().ticket.wait()
            self._recycle()

    def _recycle(self) -> None:
        if self._copies is not None:
            self._copies.recycle()

    def pinned_bytes(self) -> int:
        """Pinned staging held for gradient copies (0 on the CPU)."""
        return 0 if self._copies is None else self._copies.pinned_bytes()

    def stats(self) -> dict[str, Any]:
        """Copy counters (``d2h_copies``, ``d2h_bytes``; none on the CPU) and
        ``norms_on_device``, the gradient norms taken on the compute device."""
        return {
            **getattr(self._copies, "counters", {}),
            "norms_on_device": self.norms_on_device,
            "in_place": self.in_place,
        }

    def _buffer(self, gi: int) -> GradientBuffer:
        if gi in self._open:
            return self._open[gi]
        resume = gi in self._stored
        self._touched.add(gi)
        if not resume:
            self._fresh[gi] = []
        numel = self.layout.group_numel[gi]
        while (buf := self.opt.try_open_gradient(gi, numel, resume)) is None:
            if self._pending:
                self._pending.pop(0).wait()
            elif self._open:
                # Every buffer holds a partly filled sub-group: write the oldest
                # out; its next gradient reads it back and adds to it.
                oldest = next(iter(self._open))
                self._close(oldest)
            else:
                buf = self.opt.open_gradient(gi, numel, resume)
                break
        self._open[gi] = buf
        return buf

    def _norm_earlier(self, gi: int, buf: Any) -> None:
        """At the window's boundary (of more than one micro-step), the norms of
        sub-group `gi`'s parameters that have none yet, from `buf` holding its
        gradient: those whose gradient came in earlier micro-steps only (a
        branch not taken in the last) count in the window's norm as in
        torch's clip_grad_norm_. One that arrives later in this backward takes
        its norm again then (it is not in ``_normed``)."""
        if not (self.record_norms and self.gas > 1 and self.is_boundary() and gi in self._graded):
            return
        import torch

        for s in self.layout.groups[gi]:
            if s.order not in self._norms:
                self._norms[s.order] = torch.linalg.vector_norm(buf[s.offset : s.offset + s.numel])

    def _norm_stored(self) -> None:
        """_norm_earlier() for the sub-groups this backward did not open: their
        gradient is read back where it is stored (and left there)."""
        for gi in sorted(self._stored & self._graded):
            if all(s.order in self._norms for s in self.layout.groups[gi]):
                continue
            numel = self.layout.group_numel[gi]
            while (buf := self.opt.try_open_gradient(gi, numel, True)) is None and self._pending:
                self._pending.pop(0).wait()
            buf = buf or self.opt.open_gradient(gi, numel, True)
            try:
                self._norm_earlier(gi, buf.tensor)
            finally:
                buf.release()

    def _close(self, gi: int) -> None:
        written = self._fresh.pop(gi, None)
        if written is not None:
            _zero_except(self._open[gi].tensor, written)
        self._norm_earlier(gi, self._open[gi].tensor)
        self._stored.add(gi)
        pending = self.opt.close_gradient(gi, self._open.pop(gi))
        if pending is not None:
            self._pending.append(pending)

    def finish_backward(self) -> None:
        """Add the gradients still on their way, then store every open
        sub-group, and zeros for those not stored in this window yet (they
        still hold the last window's)."""
        self._land(keep=0)
        for pid in sorted(self._placed):  # a gradient hook that did not run
            self._land_placed(self.layout.places[pid].param)
        for gi in list(self._open):
            self._close(gi)
        for gi in range(len(self.layout.groups)):
            if gi not in self._stored:
                self._buffer(gi)
                self._close(gi)
        if self.record_norms and self.gas > 1 and self.is_boundary():
            self._norm_stored()
        self._arrived.clear()
        self._seen.clear()
        self._normed.clear()
        self._passes += 1

    def settle_writes(self) -> None:
        """Wait for every gradient write; every buffer is given back even when one fails."""
        first: BaseException | None = None
        while self._pending:
            try:
                self._pending.pop(0).wait()
            except BaseException as e:  # noqa: BLE001 - every lease back first
                first = first or e
        if first is not None:
            raise first

    def boundary_norms(self) -> list[Any]:
        """The per-parameter gradient norms of the window, in model order."""
        return [self._norms[k] for k in sorted(self._norms)]

    def end_micro_step(self) -> None:
        """A micro-step inside the window is over."""
        self._touched.clear()
        self._passes = 0
        self.micro_steps += 1

    def end_window(self) -> None:
        """The window's optimizer step is over (or skipped)."""
        self._norms.clear()
        self._graded.clear()
        self._stored.clear()
        self.end_micro_step()

    def reset(self) -> None:
        """Drop this window's gradients and give every buffer back; the next
        backward starts the window again."""
        self._drop_arriving()
        for buf in self._open.values():
            buf.release()
        self._open.clear()
        for pending in self._pending:
            pending.abandon()
        self._pending.clear()
        self.opt.discard_gradients()
        self._arrived.clear()
        self._stored.clear()
        self._touched.clear()
        self._norms.clear()
        self._graded.clear()
        self._fresh.clear()
        self._seen.clear()
        self._normed.clear()
        self._placed.clear()
        self._passes = 0
        self.micro_steps -= self.micro_steps % self.gas

    def close(self) -> None:
        """Wait for the copies and writes in flight and give their buffers back."""
        self._drop_arriving()
        for pending in self._pending:
            pending.abandon()
        self._pending.clear()
