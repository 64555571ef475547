"""FSDP2's reduced gradients streamed to NVMeAdamW's gradient slots on the drive.

Without it a rank holds two fp32 copies of its gradient shard until the
step: FSDP2's reduced gradient (``p.grad``) and NVMeAdamW's held copy, 8
bytes per local parameter (12.8 GB per rank for a 3.2B model on 2 ranks).
:func:`stream_gradients` keeps neither. FSDP2 calls each sharded
parameter's post-accumulate-grad hook as soon as the reduce-scatter has
produced its gradient; the hook copies the local gradient into the
optimizer's sub-group buffers (its own pinned swap buffers, leased from its
pool), drops ``p.grad`` and writes each sub-group to its gradient slot on
the drive once all its pieces are in. The step reads them back, as
aio.zero's does with ``gradients: nvme``. In memory: only the sub-groups
still filling (the first and the last wait for the root group's gradients,
reduced at the end of backward).

Gradient accumulation: several backwards before a step add up as FSDP2
adds them into ``p.grad``. Each backward must give every parameter of the
optimizer its gradient; once it has, the next one reads each sub-group's
sum back from the drive as its buffer opens, adds the new pieces and writes
it again (8 bytes per local parameter of drive traffic per extra
micro-batch, nothing more in memory). FSDP2's own no-sync micro-batches
(``set_requires_gradient_sync(False)``) reduce nothing, so they reach the
stream only at the synchronising backward.

``p.grad`` is therefore None after backward, so
``torch.nn.utils.clip_grad_norm_`` would find nothing to clip: call
:meth:`GradientStream.clip_grad_norm_` instead. Each gradient's DTensor
norm is taken in its hook, and the total and torch's clip coefficient are
made exactly as ``clip_grad_norm_`` makes them (parameters() order); the
step multiplies every gradient by it as it reads it (``grad_scale``). So
losses and parameters stay bit-identical to FSDP2 with
``clip_grad_norm_`` and ``torch.optim.AdamW(foreach=False)``.

The stream talks to NVMeAdamW through its public API only: it lays the
sub-groups out (``lay_out()``), reads where each parameter's pieces are
(``layout()``), leases pinned buffers from and writes gradient slots through
its ``swapper``, and is attached as the optimizer's gradient source
(``attach_gradient_source``, the :class:`aio.optim.grad_source.GradientSource`
protocol, which :class:`GradientStream` implements): the step asks it for
the gradients instead of reading ``p.grad``, applies its clip coefficient
and tells it when the step is over. :meth:`GradientStream.close` detaches
it (the optimizer reads ``p.grad`` again).
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from ..optim.dtensor import is_dtensor, like, local_of
from ._internals import TierError
from .master import is_nvme_adam


class GradientStream:
    """The gradient stream of one FSDP2 model and its NVMeAdamW on one rank
    (see the module docstring); made by :func:`stream_gradients`."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, tier: Any = None) -> None:
        if not is_nvme_adam(optimizer):
            raise TypeError(f"stream_gradients needs aio.optim.NVMeAdamW, got {type(optimizer).__name__}")
        if optimizer.options.gradients != "nvme":
            raise TierError(
                "stream_gradients writes the gradients to NVMeAdamW's gradient slots on the drive: "
                "build it with gradients='nvme'"
            )
        if optimizer.gradient_source is not None:
            raise TierError(
                "this optimizer already has a gradient stream (a gradient source); close() it first"
            )
        if tier is not None:
            tier.prepare_optimizer()  # reads the shards `window` groups at a time
        # Laid out anew if the parameters were swapped since (a no-op when current):
        # the hooks go on the parameters the step will read.
        optimizer.lay_out()
        self._opt = optimizer
        layout = optimizer.layout()
        self._sw = optimizer.swapper
        params, self._pieces = layout.params, layout.pieces
        self._params = list(params)
        self._sizes = list(layout.subgroup_numels)
        self._index = {id(p): k for k, p in enumerate(params)}
        names = {id(p): n for n, p in model.named_parameters()}
        self._names = [names.get(id(p), f"parameter {k}") for k, p in enumerate(params)]
        # clip_grad_norm_(model.parameters()) takes the norms in this order.
        self._order = [self._index[id(p)] for p in model.parameters() if id(p) in self._index]
        # Local elements per parameter, from the layout: an op on a parameter could read its shard.
        self._numel = [layout.numel(k) for k in range(len(params))]
        frozen = [k for k, p in enumerate(params) if not p.requires_grad]
        if frozen:  # decided on requires_grad alone: the same answer on every rank
            raise TierError(
                f"{self._names[frozen[0]]} does not require a gradient: the stream waits for every "
                "parameter of the optimizer in each backward; leave frozen parameters out of it"
            )
        self._expected = {k for k in range(len(params)) if self._numel[k]}
        self.counters = collections.Counter[str]()
        # Filling: buffer, lease (or None), whether it holds an earlier micro-batch's sum.
        self._open: dict[int, tuple[torch.Tensor, Any, bool]] = {}
        self._writes: collections.deque[tuple[Any, Any]] = collections.deque()  # future, lease
        self._reset()
        self._hooks: list[Any] = []
        optimizer.attach_gradient_source(self)
        try:
            for p in params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        except BaseException:  # nothing half-attached
            for h in self._hooks:
                h.remove()
            optimizer.detach_gradient_source(self)
            raise
        self.closed = False

    def _reset(self) -> None:
        """Forget this iteration's gradients (after the step, or discard()),
        giving back the buffers of any still filling or being written."""
        self._release_leases()
        self._got: set[int] = set()  # parameters with a gradient in any micro-batch
        self._new_micro_batch()
        self._written: set[int] = set()
        self._norms: dict[int, torch.Tensor] = {}
        self._scale: torch.Tensor | None = None

    def _new_micro_batch(self) -> None:
        """The next backward's gradients: each sub-group fills again, added
        to what the micro-batches before wrote (gradient accumulation)."""
        self._micro: set[int] = set()  # parameters with a gradient in this micro-batch
        self._left = dict(enumerate(self._sizes))  # elements still to come per sub-group

    # -- backward --------------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        k = self._index.get(id(p))
        if k is None or p.grad is None:
            return
        if k in self._micro:
            raise TierError(
                f"{self._names[k]}: a second gradient in one backward before every other parameter's "
                f"first ({len(self._expected - self._micro)} still to come); each backward must give "
                "every parameter of the optimizer a gradient (or call discard())"
            )
        grad = p.grad
        flat = local_of(grad).reshape(-1)
        if flat.dtype != torch.float32 or flat.numel() != self._numel[k]:
            raise TierError(f"{self._names[k]}: its gradient must be float32 and shaped like the parameter")
        bufs = [self._buffer(pc.subgroup) for pc in self._pieces[k]]
        if any(self._open[pc.subgroup][2] for pc in self._pieces[k]):
            flat, grad = self._accumulated(k, grad, flat, bufs)
        self._norms[k] = torch.linalg.vector_norm(grad, 2.0)  # as clip_grad_norm_ takes it
        for pc, buf in zip(self._pieces[k], bufs, strict=True):
            buf[pc.offset : pc.offset + pc.count].copy_(flat[pc.start : pc.start + pc.count])
        # Written only now: the pieces above are all this parameter's accumulated gradient.
        for pc in self._pieces[k]:
            self._left[pc.subgroup] -= pc.count
            if self._left[pc.subgroup] == 0:
                self._write(pc.subgroup)
        self._got.add(k)
        p.grad = None  # FSDP's reduce-scatter output is freed with the group's last gradient
        self.counters["bytes"] += 4 * flat.numel()
        if k in self._expected:
            self._micro.add(k)
            if self._micro >= self._expected:  # this backward is complete: the next one adds to it
                self.counters["micro_batches"] += 1
                self._new_micro_batch()

    def _accumulated(
        self, k: int, grad: torch.Tensor, flat: torch.Tensor, bufs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Parameter k's gradient plus what earlier micro-batches wrote (in
        `bufs`, read back): FSDP2 adds a new reduced gradient to ``p.grad``
        the same way (``old += new``; IEEE addition commutes, so the bits are
        the same), and its norm is taken from the sum, as clip_grad_norm_
        would take it after the last backward."""
        acc = flat.clone()
        for pc, buf in zip(self._pieces[k], bufs, strict=True):
            # On the gradient's device (a GPU's shards): the add FSDP2 would make there.
            acc[pc.start : pc.start + pc.count] += buf[pc.offset : pc.offset + pc.count].to(acc.device)
        self.counters["accumulated_bytes"] += 4 * acc.numel()
        return acc, like(grad, acc.view(local_of(grad).shape))

    def _buffer(self, i: int) -> torch.Tensor:
        """Sub-group i's buffer while it fills: one of the optimizer's pinned
        swap buffers when one is free (finishing gradient writes to free
        one), else ordinary memory (counted)."""
        if i in self._open:
            return self._open[i][0]
        lease = self._sw.try_acquire_buffer()
        while lease is None and self._writes:
            self._settle_oldest()
            lease = self._sw.try_acquire_buffer()
        if lease is None:
            self.counters["unpinned_buffers"] += 1
            buf = torch.empty(self._sizes[i], dtype=torch.float32)
        else:
            buf = lease.tensor(torch.float32, self._sizes[i])
        # Written by an earlier backward of this step: what the new pieces are added to.
        accumulate = i in self._written
        if accumulate:
            try:
                self._sw.read_gradient(i, buf)
            except BaseException:
                if lease is not None:
                    lease.release()
                raise
        self._open[i] = (buf, lease, accumulate)
        return buf

    def _write(self, i: int) -> None:
        buf, lease, _ = self._open[i]
        fut = self._sw.write_gradient(i, buf, async_op=True)
        # Moved only once the write is under way: one that fails to start leaves
        # its lease in _open, where discard() and close() give it back.
        del self._open[i]
        self._writes.append((fut, lease))
        self._written.add(i)
        self.counters["subgroups_written"] += 1

    def _settle_oldest(self) -> None:
        fut, lease = self._writes.popleft()
        try:
            fut.result()
        finally:
            if lease is not None:
                lease.release()

    def _settle(self) -> None:
        while self._writes:
            self._settle_oldest()

    # -- clipping --------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: Any = None
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``
        for the streamed gradients: the total norm (returned) and torch's
        clip coefficient, which the next step multiplies every gradient by.
        torch's arguments; `foreach` changes nothing (each norm was taken in
        its hook, per tensor, as torch takes a DTensor's)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"stream_gradients clips by the 2-norm only, got norm_type={norm_type}")
        norms = [self._norms[k] for k in self._order if k in self._norms]
        if not norms:
            return torch.tensor(0.0)
        first = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(  # torch's words and type
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the gradients by "
                "the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        clip_coef = float(max_norm) / (total + 1e-6)
        clamped = torch.clamp(clip_coef, max=1.0)
        # A DTensor (Replicate, or Partial until reduced): the value the grads' mul_ would use.
        self._scale = clamped.full_tensor() if is_dtensor(clamped) else clamped  # type: ignore[attr-defined]
        return total

    # -- the step (NVMeAdamW's, asking these: aio.optim.grad_source.GradientSource) -----------
    def local_grads(self) -> set[int] | None:
        """GradientSource: the parameters streamed this iteration (indices
        in the optimizer's layout), None when nothing was (the gradients,
        if any, are in ``p.grad``); a ValueError when some are missing."""
        if not self._got:
            return None
        missing = sorted(self._expected - self._got)
        if missing:
            raise ValueError(
                f"{self._names[missing[0]]} has no gradient while others have: NVMeAdamW steps every "
                "parameter it holds; leave frozen parameters out of the optimizer"
            )
        return set(self._got)

    def take_grads(self) -> None:
        """GradientSource: the gradients are on the drive already; wait for
        their writes and give the buffers back (the step needs them)."""
        self._settle()
        if self._micro:
            raise TierError(
                f"the last backward gave {len(self._micro)} of the optimizer's {len(self._expected)} "
                "parameters a gradient: each backward must give every one a gradient (or call discard())"
            )
        if self._open or len(self._written) != len(self._sizes):
            raise TierError(
                f"{len(self._sizes) - len(self._written)} optimizer sub-groups got no complete gradient "
                "this step: a backward was cut short (an exception in it); call stream.discard() or "
                "opt.zero_grad() and run the backward again"
            )

    def grad_scale(self) -> torch.Tensor | None:
        """GradientSource: the clip coefficient :meth:`clip_grad_norm_` made
        this iteration, or None (not clipped)."""
        return self._scale

    def step_done(self) -> None:
        """GradientSource: the step is over (or raised): this iteration's
        gradients are forgotten."""
        self._reset()

    # -- lifecycle -------------------------------------------------------------------------------
    def _release_leases(self) -> None:
        """Wait for the gradient writes under way (failed or not) and give
        every buffer back: the step, and the next backward, need them."""
        for _, lease, _ in self._open.values():
            if lease is not None:
                lease.release()
        for fut, lease in self._writes:
            fut.exception()
            if lease is not None:
                lease.release()
        self._open, self._writes = {}, collections.deque()

    def discard(self) -> None:
        """Drop this iteration's streamed gradients, and any ``p.grad`` (as
        ``zero_grad()`` drops them without a step; NVMeAdamW's zero_grad()
        calls this)."""
        self._sw.discard_gradients()
        self._reset()
        for p in self._params:  # a hook that raised left its p.grad: the next backward would add to it
            p.grad = None

    def stats(self) -> dict[str, Any]:
        """Bytes streamed, sub-groups written, buffers taken from ordinary
        memory, complete backwards (micro-batches) and the gradient bytes
        added to an earlier micro-batch's (read back from the drive)."""
        return {
            "bytes": self.counters["bytes"],
            "subgroups_written": self.counters["subgroups_written"],
            "unpinned_buffers": self.counters["unpinned_buffers"],
            "micro_batches": self.counters["micro_batches"],
            "accumulated_bytes": self.counters["accumulated_bytes"],
            "subgroups": len(self._sizes),
        }

    def close(self) -> None:
        """Remove the hooks and give the optimizer its own gradient path back. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.discard()
        finally:  # a failed gradient write still leaves the optimizer its own gradient path
            for h in self._hooks:
                h.remove()
            self._opt.detach_gradient_source(self)


def stream_gradients(model: torch.nn.Module, optimizer: Any, tier: Any = None) -> GradientStream:
    """Stream `model`'s FSDP2 gradients to `optimizer`'s gradient slots on the
    drive during backward (see :mod:`aio.fsdp.grads`): `optimizer` is an
    :class:`aio.optim.NVMeAdamW` built with ``gradients="nvme"``; `tier`, the
    model's :func:`aio.fsdp.offload_params` tier if it has one (made first).
    Clip with the returned stream's ``clip_grad_norm_``: ``p.grad`` is None
    after backward."""
    return GradientStream(model, optimizer, tier)
