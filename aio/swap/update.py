"""SubGroupUpdater: the torch optimizer applied to one sub-group in its buffers.

An :class:`~aio.swap.OptimizerSwapper` steps its sub-groups one at a time,
each one's tensors in pinned buffers (:mod:`aio.swap.step_io` reads and
writes them); this module is the update itself. One torch optimizer spans
every sub-group's proxy parameter (a sub-group's ``proxy``, in the param
group of its torch group: :class:`~aio.swap.param_groups.TorchGroups`); for
a sub-group's update its proxy is pointed at the buffer views -- master
weights as its data, gradient as its grad, the optimizer's state tensors as
its state -- stepped, and emptied again, its scalar state (Adam's ``step``)
kept on the sub-group. What else the update handles:

- bfloat16 states (``state_dtype="bf16"``): widened to float32 in their
  buffers before the update and rounded back after (:mod:`aio.swap.lowp`),
  except with aio's Adam, whose kernel steps them as bfloat16 itself;
- master weights or a gradient given as pieces (:mod:`aio.swap.pieces`):
  stepped where they live as segments, each its own proxy, in one step of
  an optimizer made for them with the sub-group's hyper-parameters now;
- ``grad_scale`` and ``lowp`` (the weights rounded to bfloat16/float16 in
  the update's own pass): :func:`aio.optim.step_scaled`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..pinned import Lease
from .param import SwapStateError
from .param_groups import TorchGroups
from .pieces import Pieces, is_pieces, segments
from .pool import BufferPool
from .subgroup import SubGroup


class SubGroupUpdater:
    """Applies ``optimizer_cls`` to one sub-group at a time, on its buffers.

    `hyper`, `spec` ((name, dtype) of each state tensor), `narrowed` (the
    float32 states kept as bfloat16 on the drive) and `torch_groups` are
    its owner's: the same objects, so a change made in place (an LR
    schedule's ``set_lr``) reaches the next update. :attr:`optimizer` is
    the torch optimizer over the proxies, made by :meth:`ensure_optimizer`.
    """

    def __init__(
        self,
        optimizer_cls: Any,
        hyper: dict[str, Any],
        spec: list[tuple[str, Any]],
        narrowed: list[str],
        torch_groups: TorchGroups,
    ) -> None:
        self.optimizer_cls = optimizer_cls
        self.hyper = hyper
        self.spec = spec
        self.narrowed = narrowed
        self.torch_groups = torch_groups
        self.optimizer: Any = None

    def ensure_optimizer(self, groups: Mapping[int, SubGroup]) -> None:
        """The torch optimizer over `groups`' proxies (made at first need),
        none of them holding a gradient: a step cut short in the update
        (Ctrl-C) left its proxy one, and the optimizer would step it again,
        into a buffer another sub-group holds by then."""
        if self.optimizer is None:
            proxies = {i: groups[i].proxy for i in groups}
            self.optimizer = self.optimizer_cls(self.torch_groups.build(proxies), **self.hyper)
        for g in groups.values():
            g.proxy.grad = None

    def step(
        self,
        g: SubGroup,
        leases: dict[str, Lease],
        after: Callable[[int, Any], None] | None,
        grad_scale: Any,
        lowp: Any = None,
        in_place: Pieces | None = None,
    ) -> Any:
        """Update sub-group `g` in its buffers (`leases`: tensor name -> its
        buffer, the master weights' holding them already), its gradient
        from there or, without a buffer for it, from ``g.grad_mem``; its
        bfloat16 states are left as the drive holds them. `in_place`: its
        master weights' pieces, stepped where they are, `after` told (with
        None) before the update changes them. `grad_scale` and `lowp` as
        :meth:`aio.swap.OptimizerSwapper.step` takes them. Sets
        ``g.scalars``; returns the new master weights (a view of their
        buffer), None when stepped in place."""
        import torch

        from ..optim import CPUAdam
        from .lowp import narrow_bf16, widen_bf16

        # aio's Adam kernel steps bfloat16 moments itself (widening and rounding
        # each block in its one pass); any other optimizer gets them widened to
        # float32 in their buffers, and rounded back after: the same bits.
        widen = bool(self.narrowed) and not isinstance(self.optimizer, CPUAdam)
        for name in self.narrowed if widen else []:
            widen_bf16(leases[name].tensor(torch.uint8), g.numel)
        views = self._views(g, leases, widened=widen)
        if in_place is not None:
            views["param"] = in_place
        if "grad" not in views:
            views["grad"] = g.grad_mem
        if in_place is not None and after is not None:
            # Told before the update, which changes the parameters themselves: a
            # Ctrl-C right after the kernel returns must not leave them counted
            # unchanged (the owner's recovery advice depends on it).
            after(g.index, None)
        self._update(g, views, grad_scale, lowp)
        for name in self.narrowed if widen else []:  # as the drive holds them
            raw = leases[name].tensor(torch.uint8)
            narrow_bf16(raw, g.numel)
            raw[2 * g.numel : g.part_io(name)[1]].zero_()  # padding: no float32 leftovers
        return None if in_place is not None else views["param"]

    def _views(self, g: SubGroup, leases: dict[str, Lease], widened: bool) -> dict[str, Any]:
        """Each leased buffer as a tensor of `g`'s size, in the dtype it
        holds (a narrowed state: float32 once `widened`)."""
        import torch

        def dtype(name: str) -> Any:
            if name not in g.parts:  # master weights kept off the drive (master_slot): float32
                return torch.float32
            return torch.float32 if widened and name in self.narrowed else g.parts[name][1]

        return {name: BufferPool.view(leases[name], dtype(name), g.numel) for name in leases}

    def _update(self, g: SubGroup, views: dict[str, Any], grad_scale: Any = None, lowp: Any = None) -> None:
        """Step sub-group `g` on `views` (name -> its tensor; the master
        weights and the gradient may be pieces: then stepped as segments,
        each a proxy of one optimizer step, :mod:`aio.swap.pieces`)."""
        import torch

        from ..optim import step_scaled

        if is_pieces(views["param"]) or is_pieces(views["grad"]):
            segs = segments(g.numel, {**views, "lowp": lowp})
            proxies = [torch.nn.Parameter(torch.empty(0)) for _ in segs]
            opt = self._segment_optimizer(g, proxies)
        else:
            segs, proxies, opt = [{**views, "lowp": lowp}], [g.proxy], self.optimizer
        for proxy, seg in zip(proxies, segs, strict=True):
            proxy.data = seg["param"]
            proxy.grad = seg["grad"]
            self._start_state(opt, g, proxy, seg)
        lows: dict[Any, Any] | None = None
        if lowp is not None:
            lows = {p: seg["lowp"] for p, seg in zip(proxies, segs, strict=True)}
        step_scaled(opt, [seg["grad"] for seg in segs], grad_scale, lows)
        scalars = [self._end_state(opt, g, proxy, seg) for proxy, seg in zip(proxies, segs, strict=True)]
        g.scalars = scalars[0]  # every segment counted from the same values, once

    def _segment_optimizer(self, g: SubGroup, proxies: list[Any]) -> Any:
        """A torch optimizer over `proxies` (sub-group `g`'s segments) with
        the hyper-parameters of `g`'s param group now: one step() for all."""
        pg = self.optimizer.param_groups[self.torch_groups.torch_index[self.torch_groups.of.get(g.index, 0)]]
        return self.optimizer_cls(
            [{**{k: v for k, v in pg.items() if k != "params"}, "params": proxies}], **self.hyper
        )

    def _start_state(self, opt: Any, g: SubGroup, proxy: Any, views: dict[str, Any]) -> None:
        """`proxy`'s state in `opt` before its update: `g`'s scalars and its
        state tensors' `views`, or the optimizer's first state."""
        import torch

        from ..optim import CPUAdam

        st = opt.state[proxy]
        st.clear()
        if g.scalars is not None:
            # A copy each: the update counts a proxy's step on in place.
            st.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.scalars.items()})
            for name, _ in self.spec:
                st[name] = views[name]
        elif isinstance(opt, CPUAdam):
            # Its first state is a zero step and zero moments, which the buffers
            # hold already (StepIO zeroes them instead of reading them): stepped in place, not
            # made in fresh memory and copied over (16 GB at 2B in step 1:
            # seconds of page faults on the dev box's VM).
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            for name, _ in self.spec:
                st[name] = views[name]
        else:
            # First step of this sub-group: start from the state the optimizer
            # makes in its constructor, as it would in memory. Some optimizers
            # (Adagrad before torch 2.13) create state only there and fail on a
            # parameter without it; lazy ones create nothing here and make it
            # in step(). Either way it is copied into the buffer below.
            st.update(self.optimizer_cls([proxy], **self.hyper).state.get(proxy, {}))

    def _end_state(self, opt: Any, g: SubGroup, proxy: Any, views: dict[str, Any]) -> dict[str, Any]:
        """After the update: `proxy`'s state tensors in their `views`, its
        state forgotten by `opt`; returns its scalars (copies)."""
        import torch

        st = opt.state[proxy]
        names = {n for n, _ in self.spec}
        for name in names:
            t = st.get(name)
            if t is None:
                raise SwapStateError(f"optimizer did not produce state '{name}' for sub-group {g.index}")
            if t.data_ptr() != views[name].data_ptr():
                views[name].copy_(t)
        scalars = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items() if k not in names}
        st.clear()
        proxy.grad = None
        proxy.data = torch.empty(0)
        return scalars
