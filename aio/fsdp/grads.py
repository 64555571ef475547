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

``p.grad`` is therefore None after backward, so
``torch.nn.utils.clip_grad_norm_`` would find nothing to clip: call
:meth:`GradientStream.clip_grad_norm_` instead. Each gradient's DTensor
norm is taken in its hook, and the total and torch's clip coefficient are
made exactly as ``clip_grad_norm_`` makes them (parameters() order); the
step multiplies every gradient by it as it reads it (``grad_scale``). So
losses and parameters stay bit-identical to FSDP2 with
``clip_grad_norm_`` and ``torch.optim.AdamW(foreach=False)``.

This module and :mod:`aio.fsdp.master` are where aio.fsdp uses
NVMeAdamW's internals (its layout and swapper); the optimizer's
``_local_grads`` and ``_take_grads`` are replaced per instance while the
stream is attached (:meth:`GradientStream.close` restores them).
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch

from .._log import logger
from ..optim.dtensor import is_dtensor, local_of
from ._internals import TierError
from .master import is_laid_out, is_nvme_adam, lay_out, optimizer_layout

_log = logger.getChild("fsdp")


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
        if "_take_grads" in optimizer.__dict__:
            raise TierError("this optimizer already has a gradient stream; close() it first")
        if tier is not None:
            tier.prepare_optimizer()  # reads the shards `window` groups at a time
        if not is_laid_out(optimizer):
            lay_out(optimizer)  # the parameters are in memory (no tier)
        self._opt = optimizer
        self._sw, params, self._pieces, sizes = optimizer_layout(optimizer)
        self._sizes = sizes
        self._index = {id(p): k for k, p in enumerate(params)}
        names = {id(p): n for n, p in model.named_parameters()}
        self._names = [names.get(id(p), f"parameter {k}") for k, p in enumerate(params)]
        # clip_grad_norm_(model.parameters()) takes the norms in this order.
        self._order = [self._index[id(p)] for p in model.parameters() if id(p) in self._index]
        # Local elements per parameter, from the layout: an op on a parameter could read its shard.
        self._numel = [sum(piece[2] for piece in ps) for ps in self._pieces]
        self._expected = {k for k, p in enumerate(params) if p.requires_grad and self._numel[k]}
        self.counters = collections.Counter[str]()
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params if p.requires_grad]
        optimizer.__dict__["_local_grads"] = functools.partial(self._local_grads, optimizer._local_grads)
        optimizer.__dict__["_take_grads"] = functools.partial(self._take_grads, optimizer._take_grads)
        self._sw.__dict__["step"] = functools.partial(self._swapper_step, self._sw.step)
        self.closed = False

    def _reset(self) -> None:
        """Forget this iteration's gradients (after the step, or discard())."""
        self._got: set[int] = set()
        self._left = dict(enumerate(self._sizes))  # elements still to come per sub-group
        self._open: dict[int, tuple[torch.Tensor, Any]] = {}  # filling: buffer, lease (or None)
        self._writes: collections.deque[tuple[Any, Any]] = collections.deque()  # future, lease
        self._written: set[int] = set()
        self._norms: dict[int, torch.Tensor] = {}
        self._scale: torch.Tensor | None = None

    # -- backward --------------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        k = self._index.get(id(p))
        if k is None or p.grad is None:
            return
        if k in self._got:
            raise TierError(
                f"{self._names[k]}: a second gradient before the optimizer step; gradient accumulation "
                "is not supported with stream_gradients (step after each backward, or call discard())"
            )
        grad = p.grad
        flat = local_of(grad).reshape(-1)
        if flat.dtype != torch.float32 or flat.numel() != self._numel[k]:
            raise TierError(f"{self._names[k]}: its gradient must be float32 and shaped like the parameter")
        self._norms[k] = torch.linalg.vector_norm(grad, 2.0)  # as clip_grad_norm_ takes it
        for i, start, count, offset in self._pieces[k]:
            self._buffer(i)[offset : offset + count].copy_(flat[start : start + count])
            self._left[i] -= count
            if self._left[i] == 0:
                self._write(i)
        self._got.add(k)
        p.grad = None  # FSDP's reduce-scatter output is freed with the group's last gradient
        self.counters["bytes"] += 4 * flat.numel()

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
        self._open[i] = (buf, lease)
        return buf

    def _write(self, i: int) -> None:
        buf, lease = self._open.pop(i)
        self._writes.append((self._sw.write_gradient(i, buf, async_op=True), lease))
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
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``
        for the streamed gradients: the total norm (returned) and torch's
        clip coefficient, which the next step multiplies every gradient by."""
        if float(norm_type) != 2.0:
            raise ValueError(f"stream_gradients clips by the 2-norm only, got norm_type={norm_type}")
        norms = [self._norms[k] for k in self._order if k in self._norms]
        if not norms:
            return torch.tensor(0.0)
        first = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
        clip_coef = float(max_norm) / (total + 1e-6)
        clamped = torch.clamp(clip_coef, max=1.0)
        # A DTensor (Replicate, or Partial until reduced): the value the grads' mul_ would use.
        self._scale = clamped.full_tensor() if is_dtensor(clamped) else clamped  # type: ignore[attr-defined]
        return total

    # -- the step (NVMeAdamW's, with these in place of its own) ---------------------------------
    def _local_grads(self, orig: Any) -> dict[int, Any] | None:
        if not self._got:
            return orig()  # nothing streamed: the gradients, if any, are in p.grad
        missing = sorted(self._expected - self._got)
        if missing:
            raise ValueError(
                f"{self._names[missing[0]]} has no gradient while others have: NVMeAdamW steps every "
                "parameter it holds; leave frozen parameters out of the optimizer"
            )
        return dict.fromkeys(self._got)

    def _take_grads(self, orig: Any, sw: Any, grads: Any) -> None:
        """The gradients are on the drive already: wait for their writes and
        give the buffers back (the step needs them). Nothing streamed: the
        optimizer's own path (gradients in p.grad)."""
        if not self._got:
            orig(sw, grads)
            return
        self._settle()
        if self._open or len(self._written) != len(self._sizes):
            raise TierError(
                f"{len(self._sizes) - len(self._written)} optimizer sub-groups got no complete gradient "
                "this step (a bug)"
            )

    def _swapper_step(self, orig: Any, *args: Any, **kwargs: Any) -> Any:
        if self._scale is not None and kwargs.get("grad_scale") is None:
            kwargs["grad_scale"] = self._scale
        try:
            return orig(*args, **kwargs)
        finally:
            self._reset()

    # -- lifecycle -------------------------------------------------------------------------------
    def discard(self) -> None:
        """Drop this iteration's streamed gradients (as ``zero_grad()`` drops
        ``p.grad`` without a step)."""
        for _, lease in self._open.values():
            if lease is not None:
                lease.release()
        for fut, lease in self._writes:
            fut.exception()
            if lease is not None:
                lease.release()
        self._sw.discard_gradients()
        self._reset()

    def stats(self) -> dict[str, Any]:
        """Bytes streamed, sub-groups written, buffers taken from ordinary memory."""
        return {
            "bytes": self.counters["bytes"],
            "subgroups_written": self.counters["subgroups_written"],
            "unpinned_buffers": self.counters["unpinned_buffers"],
            "subgroups": len(self._sizes),
        }

    def close(self) -> None:
        """Remove the hooks and give the optimizer its own gradient path back. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.discard()
        for h in self._hooks:
            h.remove()
        for name in ("_local_grads", "_take_grads"):
            self._opt.__dict__.pop(name, None)
        self._sw.__dict__.pop("step", None)


def stream_gradients(model: torch.nn.Module, optimizer: Any, tier: Any = None) -> GradientStream:
    """Stream `model`'s FSDP2 gradients to `optimizer`'s gradient slots on the
    drive during backward (see :mod:`aio.fsdp.grads`): `optimizer` is an
    :class:`aio.optim.NVMeAdamW` built with ``gradients="nvme"``; `tier`, the
    model's :func:`aio.fsdp.offload_params` tier if it has one (made first).
    Clip with the returned stream's ``clip_grad_norm_``: ``p.grad`` is None
    after backward."""
    return GradientStream(model, optimizer, tier)
