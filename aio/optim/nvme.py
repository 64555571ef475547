"""NVMeAdam / NVMeAdamW: torch optimizers whose Adam moments live on the
drive, and their fp32 master weights with them or, when the parameters are
float32 in CPU memory, in the parameters themselves (``master=``, see
:mod:`aio.optim.nvme_master`), for PyTorch's own engines (FSDP2, FSDP1, DDP
and ZeRO-1, one process).

Each rank keeps the state of the parameters it is given -- for a DTensor
(FSDP2), its local shard -- in sub-groups (:mod:`aio.optim.layout`) paged
through aio's pipelined :class:`aio.swap.OptimizerSwapper` under its own
private swap folder, steps them with aio's fused CPU Adam and writes the new
weights back into the parameters (FSDP's sharded storage). Nothing here is
collective: the engine has already reduced the gradients.

Torch's semantics, so frameworks' helpers work unchanged: the layout is made
at the first step() (or load of a state) from the parameters
``param_groups`` holds then, and made again for the ones it holds later if
they are swapped for others, the state following them by position
(Accelerate and HF Trainer build the optimizer before FSDP2 shards the
model, load its empty state and then swap its parameters for the sharded
DTensors; see :meth:`NVMeAdam._relayout`); every group's hyper-parameters
are read at every step (LR schedulers); ``self.state[p]`` holds each
parameter's ``step`` and, as stand-ins for the moments on the drive,
``exp_avg`` and ``exp_avg_sq`` (:data:`ON_DRIVE`: torch's keys, so DCP's
flattened state -- torchtitan's -- finds them; never empty after a step, so
torch.distributed.checkpoint's helpers take no hidden step) and
``state_dict()``/``load_state_dict()`` are torch's AdamW format, the
moments DTensors for DTensor parameters (DCP saves, loads and reshards them).
A state written straight into ``self.state[p]`` in place of the stand-ins
(ZeroRedundancyOptimizer's load_state_dict does, never calling this one's)
is loaded to the drive at the next step() or state_dict()
(:meth:`NVMeAdam._adopt_written`).
"""

from __future__ import annotations

import collections
import contextlib
import operator
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .._interrupt import interrupts_held
from ..swap import SwapStateError
from ..swap.optimizer import OptimizerSwapper
from . import CPUAdam, _check_hyper, _unsupported
from .drive_moments import DriveMoments, DriveSource, drive_source, drive_tensor
from .dtensor import check_pair, is_dtensor, like, local_of, shard_of
from .grad_source import GradientSource
from .layout import Layout, SubGroup, layout_of, local_flat, local_view, pack, pieces_of
from .nvme_master import (
    TIER_WARNING,
    check_live,
    check_master,
    not_a_master,
    params_refused,
    resolve_master,
    user_stacklevel,
)
from .nvme_options import SwapOptions, check_pinned, resolve, sub_group_size

MOMENTS = ("exp_avg", "exp_avg_sq")
_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")


class _OnDrive:
    """The value of ``exp_avg``/``exp_avg_sq`` in ``NVMeAdamW.state[p]``: the
    moment is on the drive, and :meth:`NVMeAdam.state_dict` reads it. The
    keys are there because DCP's flattened optimizer state (torchtitan's
    ``flatten_optimizer_state_dict=True``) rebuilds each parameter's state
    from the keys of ``optim.state[p]``; the value costs no memory. Not a
    tensor and without ``.to()``: a framework moving the state to a device
    (Lightning) leaves it alone, and code that would use it as a moment
    fails loudly instead of training on a stand-in."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<on the drive: NVMeAdamW.state_dict() reads it>"

    def __reduce__(self) -> str:
        return "ON_DRIVE"  # a copy or a pickle is this module's one instance


ON_DRIVE = _OnDrive()


class _Swapper(OptimizerSwapper):
    """The swapper with gradients held in memory (no room for them on the
    drive) unless ``gradients="nvme"``, and the master weights on the drive
    unless they are the parameters (``master="params"``)."""

    gradients_on_drive = False
    master_on_drive = True

    def gradient_slot(self) -> bool:
        return self.gradients_on_drive

    def master_slot(self) -> bool:
        return self.master_on_drive


class NVMeAdam(torch.optim.Optimizer):
    """``torch.optim.Adam`` with its moments on the drive and its fp32 master
    weights on the drive too or, float32 CPU parameters, in the parameters
    themselves (``master=``); ``decoupled_weight_decay=True``: AdamW (see
    :class:`NVMeAdamW`).

    Torch's arguments and state format, plus: ``nvme_path`` (a directory, a
    list of drives to stripe, ``{local_rank}``/``{rank}`` filled in per
    rank), ``match_torch`` (True: torch's ``foreach=False`` bits, as
    :class:`aio.optim.CPUAdamW`), ``sub_group_size``, ``buffer_count``,
    ``pipeline_read``, ``pipeline_write``, ``pin_memory`` (DeepSpeed's names,
    aio's defaults; or an ``offload_optimizer`` block in DeepSpeed's format),
    ``optimizer_states`` ("fp32" or "bf16" moments on the drive),
    ``gradients`` ("cpu": held in memory, "nvme": on the drive),
    ``host_memory_budget`` (of the node, divided among its
    ``LOCAL_WORLD_SIZE`` ranks) and ``master`` (where the fp32 master
    weights live: "drive", "params" -- the parameters themselves, float32 in
    CPU memory -- or "auto", the default; see :mod:`aio.optim.nvme_master`).
    Parameters must be float32 (a DTensor's local tensor contiguous); every
    parameter with elements on this rank needs a gradient at a step, or
    none does.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        nvme_path: Any = None,
        offload_optimizer: Mapping[str, Any] | None = None,
        match_torch: bool = False,
        threads: int | None = None,
        master: str = "auto",
        **swap: Any,
    ) -> None:
        defaults = {
            "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
            "amsgrad": amsgrad, "maximize": maximize, "foreach": foreach, "capturable": capturable,
            "differentiable": differentiable, "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
        }  # fmt: skip
        _check_group(defaults, "defaults")
        if not isinstance(match_torch, bool):
            raise TypeError(f"match_torch must be a bool, got {type(match_torch).__name__}")
        unknown = sorted(set(swap) - _SWAP_KEYS)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected keyword arguments {unknown}")
        self.match_torch = match_torch
        self.threads = threads
        self.master = check_master(master)
        self._master_mode: str | None = None  # "params" or "drive" once laid out
        self.options: SwapOptions = resolve({"nvme_path": nvme_path, **swap}, offload_optimizer)
        self._swapper: _Swapper | None = None
        self._subgroups: list[SubGroup] = []
        self._params: list[Any] = []
        self._numels: list[int] = []  # each parameter's local elements at the layout
        self._sizes: list[int] = []  # each param group's parameter count at the layout
        self._shapes: list[tuple[int, ...]] = []  # each parameter's local shape at the layout
        self._whole: list[bool] = []  # whether its local tensor was the whole tensor
        self._grads: dict[int, torch.Tensor] = {}
        super().__init__(params, defaults)

    # -- parameters and layout ---------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, until the first step (or load of a state)
        laid the sub-groups out; afterwards a ValueError."""
        if getattr(self, "_swapper", None) is not None:
            raise ValueError(
                f"{type(self).__name__}.add_param_group after the first step (or a load of a state): the "
                "sub-groups on the drive are laid out; add every param group before the first step()"
            )
        params = param_group.get("params")
        listed = [params] if isinstance(params, torch.Tensor) else list(params or [])
        if len({id(p) for p in listed}) != len(listed):
            # torch warns and steps such a parameter twice; one master copy cannot.
            raise ValueError(f"param group {len(self.param_groups)} lists a parameter twice")
        super().add_param_group(param_group)
        k = len(self.param_groups) - 1
        try:
            self._check_added(k)
        except BaseException:
            # Refused whole: a group left in param_groups would fail every later step.
            del self.param_groups[k]
            raise

    def _check_added(self, k: int) -> None:
        """TypeError/ValueError, naming it, when param group `k` (just
        added, its defaults filled in by torch) cannot be stepped."""
        group = self.param_groups[k]
        _check_group(group, f"param group {k}")
        names = group.get("param_names")  # torch keeps them for named_parameters()
        for j, p in enumerate(group["params"]):
            where = f"param group {k}, parameter {j}" + (f" ({names[j]!r})" if names else "")
            _check_param(p, where)
            why = not_a_master(p) if self.master == "params" else None
            if why is not None:  # said at construction, not at the first step
                raise params_refused(self.master, where, why)

    def lay_out(self) -> None:
        """Lay the sub-groups out now, as the first step() (or load of a
        state) would: from the parameters param_groups holds, their master
        weights taken from them as they are; laid out again if param_groups
        hold others than at the layout (the state following by position). A
        no-op once laid out for these parameters."""
        self._refuse_closed()
        self._ensure_layout()

    def _refuse_closed(self) -> None:
        if self._closed:  # a new layout would make a swap folder that nothing removes
            raise ValueError(
                f"{type(self).__name__} is closed (close() freed its buffers and removed its swap "
                "folder): build a new one, and load_state_dict() a state saved before close()"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad(), and an attached gradient source's gradients
        dropped too (its ``discard()``: aio.fsdp's stream holds them on the
        drive, not in ``p.grad``), so the next backward starts afresh as
        it would without the source."""
        super().zero_grad(set_to_none)
        if self._grad_source is not None:
            self._grad_source.discard()

    def layout(self) -> Layout:
        """The sub-group layout (:class:`aio.optim.layout.Layout`, a frozen
        view): the parameters in this optimizer's order, per parameter its
        pieces ``(subgroup, start, count, offset)`` and each sub-group's
        elements. ValueError before the layout (the first step(), a load of
        a state, or :meth:`lay_out`)."""
        if self._swapper is None:
            raise ValueError(
                f"{type(self).__name__}.layout(): the sub-groups are not laid out yet; call lay_out() (or "
                "step() / load_state_dict()) first"
            )
        return layout_of(self._params, self._subgroups)

    def _ensure_layout(self, adopt: bool = True) -> _Swapper:
        """The swapper, laid out for the parameters param_groups holds now:
        at the first need, and again (:meth:`_relayout`, the state following
        each position) when they are no longer the ones it was laid out for;
        with `adopt`, a state written into ``self.state`` by someone else
        moved to the drive first (:meth:`_adopt_written`)."""
        params = [p for g in self.param_groups for p in g["params"]]
        sw = self._swapper
        if sw is not None and not self._same_layout(params):
            return self._relayout(sw, params, None)  # carries a written state too
        if sw is None:
            sw = self._lay_out(params)
        if adopt:
            self._adopt_written(sw)
        return sw

    def _adopt_written(self, sw: _Swapper) -> None:
        """Load what someone else wrote into ``self.state[p]`` in place of
        the :data:`ON_DRIVE` stand-ins -- ZeroRedundancyOptimizer's
        load_state_dict assigns each parameter's loaded state there and
        never calls this optimizer's load_state_dict -- as load_state_dict
        would load it, before any step or state_dict() reads the drive: a
        step would otherwise train on the old (or fresh) moments in silence.
        The other parameters keep their state (read back from the drive, as
        ZeRO's load leaves the entries it is not given). A state that cannot
        be loaded is a ValueError at every step until it is replaced."""
        written = _written(self.state, self._params)
        if not written:
            return
        # Any other parameter with a state: all read back, written again beside the new.
        kept = any(self.state.get(p) for p in self._params if p not in written)
        state = {**(self._carried_state(sw, self._params) if kept else {}), **written}
        try:
            plan = self._plan_load(state)
        except ValueError as e:
            raise ValueError(
                f"{type(self).__name__}: the state written into its .state (by a wrapper that does not "
                f"call its load_state_dict, e.g. ZeroRedundancyOptimizer) cannot be loaded: {e}"
            ) from e
        with interrupts_held(f"{type(self).__name__} loading the state written into its .state"):
            self._apply_load(sw, plan, state)

    def _same_layout(self, params: list[Any]) -> bool:
        """Whether `params` (param_groups' now, in order) are the very
        tensors of the layout, in param groups of the same sizes."""
        return (
            len(params) == len(self._params)
            and all(map(operator.is_, params, self._params))
            and [len(g["params"]) for g in self.param_groups] == self._sizes
        )

    def _lay_out(self, params: list[Any]) -> _Swapper:
        """Lay the sub-groups out for `params` (masters copied from them)."""
        numels = [local_flat(p, _name(k)).numel() for k, p in enumerate(params)]
        # Decided before the swapper exists: a refused mode leaves no swap folder behind.
        mode = resolve_master(self.master, params, self.skip_freed_parameters, _name)
        per_group, k = [], 0
        for g in self.param_groups:
            per_group.append([(j, numels[j]) for j in range(k, k + len(g["params"]))])
            k += len(g["params"])
        total = max((sum(n for _, n in grp) for grp in per_group), default=0)
        size = sub_group_size(self.options, total)
        subgroups = pack(per_group, size)
        sw = self._new_swapper(size, mode)
        try:
            for i, sg in enumerate(subgroups):
                sw.register_subgroup(i, sg.numel, sg.group)
            if subgroups:
                check_pinned(self.options, sw.planned_pinned_bytes())
            self._params, self._subgroups, self._numels = params, subgroups, numels
            self._sizes = [len(g["params"]) for g in self.param_groups]
            self._shapes = [tuple(local_of(p).shape) for p in params]
            self._whole = [tuple(p.shape) == s for p, s in zip(params, self._shapes, strict=True)]
            self._grads = {}
            self._init_masters(sw, range(len(subgroups)))
        except BaseException:
            sw.close()
            raise
        self._swapper, self._master_mode = sw, mode
        return sw

    def _relayout(
        self, old_sw: _Swapper, params: list[Any], fill: Callable[[_Swapper], Any] | None
    ) -> _Swapper:
        """Lay the sub-groups out again for `params`, which replaced the
        parameters of the layout (Accelerate's and HF Trainer's FSDP2 swap
        after a load of a state), then `fill` the new layout: a load
        replacing the state, or (None) the old state carried over by
        position (:meth:`_carried_state`). All or nothing: on any error the
        old layout and state stay as they were, its swapper open."""
        if self._skip_freed or self._grad_source is not None:
            # aio.fsdp's tier and gradient stream hold this layout (its swapper, its pieces).
            raise ValueError(
                f"{type(self).__name__}: param_groups hold other parameters than when the sub-groups were "
                "laid out, and aio.fsdp (offload_params / stream_gradients: an attached gradient source) "
                "uses that layout; swap the parameters before attaching aio.fsdp, or give the optimizer its "
                "parameters back"
            )
        carried = self._carried_state(old_sw, params) if fill is None else None
        old_state = self.state
        old_groups = [dict(g) for g in self.param_groups]
        old = (self._params, self._subgroups, self._numels, self._sizes, self._shapes, self._whole)
        old_mode, old_grads = self._master_mode, self._grads
        self._swapper = None
        try:
            sw = self._lay_out(params)
            if fill is not None:
                fill(sw)
            else:
                # What someone else wrote for the parameters now held (ZeRO's load)
                # replaces what their positions carry.
                carried = {**(carried or {}), **_written(old_state, params)}
                self.state = collections.defaultdict(dict, carried)
                if carried:
                    self._apply_load(sw, self._plan_load())
        except BaseException:
            if self._swapper is not None:
                self._swapper.close()
            self._swapper, self.state, self._master_mode, self._grads = old_sw, old_state, old_mode, old_grads
            self._params, self._subgroups, self._numels, self._sizes, self._shapes, self._whole = old
            for g, saved in zip(self.param_groups, old_groups, strict=True):
                g.clear()
                g.update(saved)
            raise
        old_sw.close()
        return sw

    def _carried_state(self, sw: _Swapper, params: list[Any]) -> dict[Any, dict[str, Any]]:
        """The state of every position that has one (stepped or loaded), for
        the parameter now at that position: its step and its moments read
        from the drive (in memory until written again: 8 bytes per element,
        as state_dict()). ValueError, before anything changes, when the
        param groups' sizes changed or a position's state cannot be its
        new parameter's (:meth:`_moved`)."""
        sizes = [len(g["params"]) for g in self.param_groups]
        if sizes != self._sizes:
            raise ValueError(
                f"{type(self).__name__}: param_groups now hold {sizes} parameters, {self._sizes} when the "
                "sub-groups were laid out; the state follows the parameters by position, so swap each "
                "parameter for its replacement in place (as Accelerate's FSDP2 prepare does)"
            )
        steps: dict[int, float] = {}
        for i, pc in pieces_of(self._subgroups):
            scalars = sw.groups[i].scalars
            if scalars is not None:  # stepped, or loaded
                steps[pc.param] = float(scalars.get("step", 0.0))
        for k, p in enumerate(self._params):
            st = self.state.get(p)
            if not self._numels[k] and st and "step" in st:  # in no sub-group: counted in self.state
                steps[k] = float(st["step"])
        if not steps:
            return {}
        moments = self._read_moments(sw)
        return {
            params[k]: {
                "step": torch.tensor(step),
                **{n: like(params[k], self._moved(moments[k][n], k, params[k])) for n in MOMENTS},
            }
            for k, step in sorted(steps.items())
        }

    def _moved(self, flat: torch.Tensor, k: int, new: Any) -> torch.Tensor:
        """Position `k`'s moment (flat, its layout-time local tensor's) as
        the local tensor of `new`, the parameter now there: the same local
        shape as it is, or -- a whole tensor replaced by a DTensor of its
        shape (FSDP2's fully_shard) -- cut to this rank's shard."""
        shape, target = self._shapes[k], tuple(local_of(new).shape)
        t = flat.view(shape)
        if is_dtensor(new) and self._whole[k] and tuple(new.shape) == shape:
            part = shard_of(t, new)
            if part is not None and tuple(part.shape) == target:
                return part
        elif target == shape:
            return t
        whole = f", a DTensor of shape {tuple(new.shape)}" if is_dtensor(new) else ""
        raise ValueError(
            f"{_name(k)} was replaced by a tensor its state cannot follow (local shape {shape} at the "
            f"layout, {target} now{whole}): the state follows the parameters by position, each "
            "replaced by the same tensor or its shard"
        )

    def _new_swapper(self, size: int, mode: str) -> _Swapper:
        """The swapper for sub-groups of at most `size` elements, the master
        weights on the drive in `mode` "drive"."""
        o = self.options
        sw = _Swapper(
            o.nvme_path, CPUAdam, {"match_torch": self.match_torch, "threads": self.threads},
            buffer_count=o.buffer_count, pipeline_read=o.pipeline_read, pipeline_write=o.pipeline_write,
            pin_memory=o.pin_memory, sub_group_size=size, aio=o.aio, rank=o.rank.rank,
            state_dtype=o.state_dtype, group_hyper=[_hyper(g) for g in self.param_groups],
        )  # fmt: skip
        sw.gradients_on_drive = o.gradients == "nvme"
        sw.master_on_drive = mode == "drive"
        return sw

    def _init_masters(self, sw: _Swapper, indices: Iterable[int]) -> None:
        """Sub-groups `indices` start from the parameters as they are now:
        their master weights copied to the drive, or (the parameters being
        the master) stepped in the parameters themselves, piece by piece."""
        if sw.master_slot():
            sw.initialize_many((i, self._fill_master(i)) for i in indices)
            return
        for i in indices:
            sw.initialize_in_place(i, self._master_pieces(i))

    def _master_pieces(self, i: int) -> Callable[[], list[torch.Tensor]]:
        """Sub-group `i`'s master weights, the parameters' own elements
        (master="params"), resolved at each use: never copied."""

        def pieces() -> list[torch.Tensor]:
            return [self._flat(pc.param)[pc.start : pc.start + pc.count] for pc in self._subgroups[i].pieces]

        return pieces

    def _fill_master(self, i: int) -> Callable[[torch.Tensor], None]:
        def fill(out: torch.Tensor) -> None:
            for piece in self._subgroups[i].pieces:
                src = self._flat(piece.param)[piece.start : piece.start + piece.count]
                out[piece.offset : piece.offset + piece.count].copy_(src)

        return fill

    # Inside step(): each parameter's (flat local tensor, local shape) once
    # resolved, by index (None: not yet). A local tensor may be replaced
    # between steps -- FSDP's load_state_dict, aio.fsdp's tier putting its
    # stand-ins in and out, ``p.data = ...`` -- never inside one (after the
    # closure and the step pre-hooks), so a step resolves each once, not once
    # per use. None outside a step: every use resolves afresh.
    _step_locals: list[tuple[torch.Tensor, torch.Size] | None] | None = None

    def _flat(self, index: int) -> torch.Tensor:
        """Parameter `index`'s flattened local tensor, checked against the
        layout (its size then, looked up: this runs for every piece of every
        step)."""
        return self._local(index)[0]

    def _local(self, index: int) -> tuple[torch.Tensor, torch.Size]:
        """:meth:`_flat` of parameter `index` and its local tensor's shape
        (resolved once per step)."""
        cache = self._step_locals
        found = cache[index] if cache is not None else None
        if found is not None:
            return found
        found = local_view(self._params[index], _name(index))
        self._check_numel(index, found[0].numel())
        if cache is not None:
            cache[index] = found
        return found

    def _check_numel(self, index: int, numel: int) -> None:
        if numel != self._numels[index]:
            raise ValueError(
                f"{_name(index)} has {numel} local elements, {self._numels[index]} when the sub-groups "
                "were laid out (at the first step or load of a state); give it its size back"
            )

    # -- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW/Adam step over every parameter (all with a gradient, or
        none: then nothing happens). Everything is checked before anything
        changes. Ctrl-C (SIGINT, and SIGTERM where Python handles it) during
        the swapped step is held until the step is whole, then raised: the
        step is never cut part-way by one Ctrl-C (a warning says so; a second
        one stops at once). A failure during the swapped step (an I/O error,
        that second Ctrl-C) leaves the optimizer refusing to step or save
        until load_state_dict(), its message saying whether the model's
        weights need loading too (some parameters took the step's new
        weights)."""
        self._refuse_closed()
        self._settle_streamed()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for k, g in enumerate(self.param_groups):
            _check_group(g, f"param group {k}")
        sw = self._ensure_layout()
        self._step_locals = [None] * len(self._params)
        try:
            with interrupts_held(f"{type(self).__name__}.step()"):
                self._step_laid_out(sw)
        finally:
            self._step_locals = None
        return loss

    def _step_laid_out(self, sw: _Swapper) -> None:
        """step() once laid out and its groups checked: the gradients taken
        (nothing changed until every check passed), the swapped update,
        the steps counted."""
        src = self._grad_source
        sourced = src.local_grads() if src is not None else None  # checks only, as _local_grads
        grads: Mapping[int, Any] | None = dict.fromkeys(sourced) if sourced else self._local_grads()
        if grads is None:
            return
        if self._master_mode == "params":  # checked before anything changes
            for k in grads:
                check_live(self._flat(k), _name(k))
        sw.torch_groups.update(sw.optimizer, [_hyper(g) for g in self.param_groups])
        if src is not None and sourced:
            src.take_grads()
        else:
            self._take_grads(sw, grads)
        self._written_back = 0
        try:
            self._swapped_step(sw, src)
        except BaseException as e:
            self._refuse_after(sw, e)
            raise
        self._count_steps(sw, grads)

    def _swapped_step(self, sw: _Swapper, src: GradientSource | None) -> None:
        """The swapped update; with a gradient source, its scale applied and
        the source told the step is over, also when the update raised."""
        if src is None:
            sw.step(after=self._write_back)
            return
        try:
            sw.step(after=self._write_back, grad_scale=src.grad_scale())
        finally:
            src.step_done()

    # The source attach_gradient_source() gave, asked by step() instead of p.grad.
    _grad_source: GradientSource | None = None

    @property
    def gradient_source(self) -> GradientSource | None:
        """The attached :class:`aio.optim.grad_source.GradientSource`, or None."""
        return self._grad_source

    def attach_gradient_source(self, source: GradientSource) -> None:
        """Have step() take its gradients from `source` (see
        :mod:`aio.optim.grad_source` for when it asks what) until
        :meth:`detach_gradient_source`. Needs the layout (:meth:`lay_out`),
        which stays while `source` is attached (parameters swapped for
        others are a ValueError at the next step); one source at a time."""
        self._refuse_closed()
        if not isinstance(source, GradientSource):
            raise TypeError(
                f"attach_gradient_source: source must implement aio.optim.grad_source.GradientSource "
                f"(local_grads, take_grads, grad_scale, step_done, discard), got {type(source).__name__}"
            )
        if self._grad_source is not None:
            raise ValueError(
                f"{type(self).__name__} already has a gradient source ({type(self._grad_source).__name__}); "
                "detach_gradient_source() it (aio.fsdp's stream: close() it) first"
            )
        if self._swapper is None:
            raise ValueError(
                f"attach_gradient_source before the {type(self).__name__}'s sub-groups are laid out: call "
                "lay_out() first (the source works with layout())"
            )
        self._grad_source = source

    def detach_gradient_source(self, source: GradientSource) -> None:
        """Stop asking `source`: step() reads ``p.grad`` again. ValueError
        when `source` is not the attached one."""
        if self._grad_source is not source:
            raise ValueError(
                f"detach_gradient_source: {type(source).__name__} is not the gradient source attached to "
                f"this {type(self).__name__}"
            )
        self._grad_source = None

    def _local_grads(self) -> dict[int, torch.Tensor] | None:
        """Each parameter's local gradient, flattened; None when none has one."""
        out: dict[int, torch.Tensor] = {}
        missing = []
        for k, p in enumerate(self._params):
            # Every size and view checked before anything changes: the write-back
            # of a step would find a resized or non-contiguous one part-way.
            flat, shape = self._local(k)
            n = flat.numel()
            grad = p.grad
            if grad is None:
                if n:  # none on this rank: FSDP1 leaves its gradient None
                    missing.append(k)
                continue
            check_pair(p, grad, _name(k))
            g = local_of(grad)
            if g.is_sparse or g.dtype != torch.float32:
                raise TypeError(f"{_name(k)}: its gradient must be dense float32, got {g.dtype} ({g.layout})")
            if g.numel() != n:
                raise ValueError(
                    f"{_name(k)}: its gradient has {g.numel()} local elements, the parameter {n}"
                )
            if g.shape != shape:  # stepped flat, it would train on transposed values
                raise ValueError(
                    f"{_name(k)}: its gradient has shape {tuple(g.shape)}, the parameter {tuple(shape)}"
                )
            out[k] = g.reshape(-1)
        if not out:
            return None
        if missing:
            raise ValueError(
                f"{_name(missing[0])} has no gradient while others have: {type(self).__name__} steps every "
                "parameter it holds; leave frozen parameters out of the optimizer"
            )
        return out

    def _take_grads(self, sw: _Swapper, grads: Mapping[int, torch.Tensor]) -> None:
        """Give the swapper each sub-group's gradient: held in memory, the
        gradients' own elements (pieces, nothing packed); for the drive,
        packed into one buffer per sub-group first."""
        for i, sg in enumerate(self._subgroups):
            if not sw.gradients_on_drive:
                sw.hold_gradient(i, [grads[pc.param][pc.start : pc.start + pc.count] for pc in sg.pieces])
                continue
            buf = self._grads.get(i)
            if buf is None:
                buf = self._grads[i] = torch.empty(sg.numel, dtype=torch.float32)
            for pc in sg.pieces:
                buf[pc.offset : pc.offset + pc.count].copy_(grads[pc.param][pc.start : pc.start + pc.count])
            sw.write_gradient(i, buf, async_op=False)

    # Sub-groups of the running step whose new weights went into the parameters (_refuse_after).
    _written_back = 0
    _closed = False

    def _write_back(self, index: int, master: torch.Tensor | None) -> None:
        """The step's new master weights of sub-group `index` into the
        parameters; None: stepped in them already (master="params")."""
        self._written_back += 1  # first: a Ctrl-C in the copy leaves it part-written
        if master is None:
            return
        for pc in self._subgroups[index].pieces:
            flat = self._flat(pc.param)
            if self.skip_freed_parameters and flat.untyped_storage().nbytes() == 0:
                continue  # freed by an offload tier, which reads these values from the master
            flat[pc.start : pc.start + pc.count].copy_(master[pc.offset : pc.offset + pc.count])

    def _refuse_after(self, sw: _Swapper, e: BaseException) -> None:
        """After the swapped step raised (`e`) with the swapper refusing use:
        its reason, in this optimizer's terms, says what to load. The state
        saved before the step, alone while no parameter took new weights;
        the model's weights too once some did (load_state_dict() takes the
        master weights from the parameters: a mix of two steps taken as they
        are would train on in silence). Keeping the old weights to undo the
        mix would cost a copy of the model."""
        if not sw.broken:
            return
        if self._written_back:
            what = (
                f"{self._written_back} of {len(self._subgroups)} sub-groups' new weights went into the "
                "parameters (the others kept the last step's), the optimizer state on the drive is "
                "partly updated. Recover: load the model's weights, then load_state_dict() the "
                "optimizer state, both saved before this step"
            )
        else:
            what = (
                "the parameters are unchanged (the last step's values), the optimizer state on the "
                "drive partly updated. Recover: load_state_dict() a state saved before this step"
            )
        sw.broken = (
            f"{type(self).__name__}.step() failed part-way ({type(e).__name__}: {e}); {what}, "
            "before stepping or saving again"
        )

    # -- what a parameter tier reads (aio.fsdp) ----------------------------------------------
    _skip_freed = False

    @property
    def swapper(self) -> OptimizerSwapper | None:
        """The :class:`aio.swap.OptimizerSwapper` paging the sub-groups of
        the current layout (:meth:`layout`; its indices are the sub-groups'),
        None before the layout. For its public methods (a
        :mod:`gradient source <aio.optim.grad_source>` writes gradient slots
        and leases pinned buffers); stepping it, loading it or closing it is
        this optimizer's business."""
        return self._swapper

    @property
    def master_mode(self) -> str | None:
        """Where the fp32 master weights are: ``"drive"`` or ``"params"``
        (the ``master`` option resolved at the layout: the first step(), or
        an earlier load_state_dict() of a state or DCP state-dict call;
        fixed from then on, unless the parameters are swapped for others
        and laid out again); None before it."""
        return self._master_mode

    @property
    def skip_freed_parameters(self) -> bool:
        """Parameters freed by an offload tier (storage resized to 0) are
        skipped when a step writes the new master weights back into the
        parameters; set by aio.fsdp.offload_params with
        ``params_from_master=True`` (its default), which reads them from
        :meth:`master_slices`; ``master="auto"`` laid out while it is set
        keeps the master weights on the drive. With the master weights in
        the parameters there are none to read: a warning (pointing at the
        caller's line outside aio), and the tier keeps its own copy."""
        return self._skip_freed

    @skip_freed_parameters.setter
    def skip_freed_parameters(self, value: bool) -> None:
        if value and (self._master_mode or self.master) == "params":
            warnings.warn(TIER_WARNING, stacklevel=user_stacklevel())
        self._skip_freed = bool(value)

    def parameter_index(self) -> dict[int, int]:
        """``id(param) -> k``: each parameter's index in :meth:`master_slices`
        (empty before the first step or load laid the sub-groups out, and
        with the master weights in the parameters: none is on the drive)."""
        if self._swapper is None or self._master_mode == "params":
            return {}
        return {id(p): k for k, p in enumerate(self._params)}

    def master_slices(self) -> tuple[dict[int, list[tuple[Any, int, int, int]]], set[int]]:
        """Where each parameter's fp32 master weights are on the drive, by
        parameter index: ``(swap space, byte offset there, byte offset in
        the parameter's local tensor, bytes)`` slices; and the indices some
        of whose master is not on the drive yet (never stepped, or held in a
        buffer: call :meth:`flush_master` first) -- every one with the master
        weights in the parameters (``master_mode == "params"``)."""
        out: dict[int, list[tuple[Any, int, int, int]]] = {}
        missing: set[int] = set()
        sw = self._swapper
        for i, sg in enumerate(self._subgroups if sw is not None else []):
            ext = sw.master_extent(i) if sw is not None else None
            for pc in sg.pieces:
                if ext is None:
                    missing.add(pc.param)
                    continue
                space, base = ext
                out.setdefault(pc.param, []).append((space, base + 4 * pc.offset, 4 * pc.start, 4 * pc.count))
        return out, missing

    def flush_master(self) -> None:
        """Write the master weights the swapper still holds in buffers to
        the drive, so :meth:`master_slices` reads current values."""
        if self._swapper is not None:
            self._swapper.flush()

    def _set_step(self, p: Any, step: float) -> None:
        """`p`'s entry in self.state: its step, and torch's keys for its
        moments with :data:`ON_DRIVE` for values (DCP's flattened load reads
        the keys; the values are on the drive)."""
        # scalar_tensor: torch.tensor(step)'s 0-dim float32 at a third of the cost (each step, each parameter)
        self.state[p] = {"step": torch.scalar_tensor(step), "exp_avg": ON_DRIVE, "exp_avg_sq": ON_DRIVE}

    def _sync_steps(self, sw: _Swapper) -> set[int]:
        """Each parameter's ``step`` in self.state from its sub-groups'
        count on the drive; returns the parameter indices set."""
        steps: dict[int, float] = {}  # a parameter in several sub-groups: its last one's
        for i, sg in enumerate(self._subgroups):
            step = float((sw.groups[i].scalars or {}).get("step", 0.0))
            for pc in sg.pieces:
                steps[pc.param] = step
        for k, step in steps.items():
            self._set_step(self._params[k], step)
        return set(steps)

    def _count_steps(self, sw: _Swapper, grads: Mapping[int, Any]) -> None:
        """Each parameter's ``step`` in self.state: its sub-groups' count
        (one with no local elements counts on by itself, when it has a
        gradient: torch's AdamW skips a parameter without one)."""
        counted = self._sync_steps(sw)
        for k, p in enumerate(self._params):
            if k not in counted and k in grads:
                self._set_step(p, float(self.state[p].get("step", 0.0)) + 1.0)

    # -- state_dict ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's AdamW state_dict: per parameter ``step``, ``exp_avg`` and
        ``exp_avg_sq`` (DTensors laid out as DTensor parameters), read from
        the drive; this rank's moments are held in memory while it is used
        (8 bytes per local element in float32)."""
        self._refuse_closed()
        sw = self._swapper
        if sw is not None:
            # Parameters swapped since the layout: their state follows them
            # (torch's state_dict() would fail on the stale keys).
            sw = self._ensure_layout()
            # The swapper's own counts: a step interrupted after its update but
            # before self.state was counted (a Ctrl-C) must not save the old
            # step beside the new moments (a wrong bias correction on resume).
            self._sync_steps(sw)
        sd = super().state_dict()
        # In parameter order on every rank, as torch's own is after a first step
        # that stepped all: a full state dict gathers each DTensor moment in this
        # order, and a parameter with no elements on some rank was counted apart
        # from the sub-groups there (in another place of self.state): ranks would
        # pair different collectives (gloo aborts the job). Only torch's own
        # (int) keys: a post-hook's keys keep the order it gave them.
        if all(type(k) is int for k in sd["state"]):
            sd["state"] = dict(sorted(sd["state"].items()))
        if sw is None:
            return sd
        if self._streaming:
            sd["state"] = self._placeholders(sw, sd["state"])
            return sd
        if self._awaiting:
            raise SwapStateError(self._awaiting_message())
        moments = self._read_moments(sw)
        state = {}
        for k, st in sd["state"].items():
            p = self._params[k]
            shape = local_of(p).shape
            state[k] = {
                "step": st["step"].clone(),
                **{n: like(p, moments[k][n].view(shape)) for n in MOMENTS},
            }
        sd["state"] = state
        return sd

    # -- streamed DCP save and load (aio.optim.dcp) -------------------------------------------
    _streaming = False
    _moments: DriveMoments | None = None  # the placeholders' drive access, inside streamed_state()
    # The streamed load whose state dict load_state_dict() accepts: the one begun last, until a
    # step or a default load (an older one's moments may no longer be those on the drive).
    _pending: DriveMoments | None = None
    # A streamed load wrote moments to the drive, its steps are not loaded yet: steps and saves
    # refuse until load_state_dict() of its state dict or of another state (not swapper.broken:
    # a genuine swapper failure must never be cleared by a load of the moments alone).
    _awaiting = False

    @contextlib.contextmanager
    def streamed_state(self) -> Iterator[None]:
        """Inside it, state_dict() (and ``get_optimizer_state_dict``) gives
        each moment as a drive-backed placeholder
        (:class:`aio.optim.drive_moments.DriveTensor`, a DTensor over one
        for a DTensor parameter) instead of reading them all into memory:
        ``dcp.save(..., planner=aio.optim.DriveSavePlanner())`` reads each
        from the drive as DCP writes it, ``dcp.load(...,
        planner=aio.optim.DriveLoadPlanner())`` writes each to the drive
        as DCP reads it, and load_state_dict() (``set_optimizer_state_dict``)
        of that state dict loads the steps and hyper-parameters (from the
        load's first write to the drive until it does, or another state is
        loaded, the optimizer refuses to step or save; a failed dcp.load is
        retried with the same or a new state dict). The planners lease swap
        buffers and give them back after their last item (after a failure:
        at the next step, the next save or load, or the block's end); save
        and load inside the block: at its end the placeholders refuse. See
        docs/fsdp.md."""
        if self._streaming:
            raise ValueError(f"{type(self).__name__}.streamed_state() is already active")
        self._streaming = True
        try:
            yield
        finally:
            self._streaming = False
            self._end_moments()

    def _end_moments(self) -> None:
        """Close the current placeholders' drive access (giving back the
        swap buffers a failed save or load left leased, writing nothing)."""
        moments, self._moments = self._moments, None
        if moments is not None:
            moments.close()

    def _settle_streamed(self) -> None:
        """Before a step: the buffers a failed streamed save or load left
        leased go back (unwritten), and the step is refused while a
        streamed load's moments wait for their steps."""
        if self._moments is not None:
            self._moments.abandon()
        if self._awaiting:
            raise SwapStateError(self._awaiting_message())
        self._pending = None  # the moments change: no streamed state dict loaded before fits them

    def _awaiting_message(self) -> str:
        return (
            f"{type(self).__name__}: a streamed load (DriveLoadPlanner) wrote moments to the drive, but "
            "not yet their steps: call set_optimizer_state_dict (load_state_dict) with the state dict "
            "dcp.load filled; if that dcp.load failed, run it again first (in this or a new "
            "streamed_state() block), or load another state"
        )

    def _load_begun(self, moments: DriveMoments) -> None:
        self._pending = moments

    def _moments_written(self, moments: DriveMoments) -> None:
        self._pending, self._awaiting = moments, True

    def _save_refusal(self) -> str | None:
        return self._awaiting_message() if self._awaiting else None

    def _placeholders(self, sw: _Swapper, state: Mapping[int, Any]) -> dict[int, Any]:
        """`state` (torch's, by parameter index) with each moment a
        placeholder read from the drive when a planner asks for it."""
        self._end_moments()
        layout = layout_of(self._params, self._subgroups)
        moments = DriveMoments(sw, layout, self._load_begun, self._moments_written, self._save_refusal)
        self._moments = moments
        out = {}
        for k, st in state.items():
            p = self._params[k]
            shape = tuple(local_of(p).shape)
            out[k] = {
                "step": st["step"].clone(),
                **{n: like(p, drive_tensor(shape, DriveSource(moments, k, n))) for n in MOMENTS},
            }
        return out

    def _read_moments(self, sw: _Swapper) -> dict[int, dict[str, torch.Tensor]]:
        out = {k: {n: torch.zeros(numel) for n in MOMENTS} for k, numel in enumerate(self._numels)}
        for i, sg in enumerate(self._subgroups):
            for name in MOMENTS:
                flat = sw.read_state(i, name)
                for pc in sg.pieces:
                    out[pc.param][name][pc.start : pc.start + pc.count].copy_(
                        flat[pc.offset : pc.offset + pc.count]
                    )
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict (a checkpoint of torch's AdamW loads too),
        the moments written to the drive and the master weights taken from
        the parameters as they are now (load the model first, as DCP's
        set_state_dict does; with ``master_mode == "params"`` they are the
        parameters, whenever loaded). Checked whole before the drive
        changes: a bad state_dict is a ValueError naming the parameter,
        nothing changed. A state with no parameter's state in it (an
        optimizer never stepped: Accelerate loads its own before swapping
        the parameters) loads only the hyper-parameters before the layout,
        which it does not make; once laid out, it starts every parameter
        afresh, as torch's does. Ctrl-C is held until the load is whole, as
        in step()."""
        self._refuse_closed()
        with interrupts_held(f"{type(self).__name__}.load_state_dict()"):
            moments = _streamed_moments(state_dict)
            if moments is not None:
                self._load_streamed(moments, state_dict)
                return
            self._pending = None  # whatever this load writes, no earlier streamed state dict fits it
            self._load_default(state_dict)
            self._awaiting = False  # the whole state is loaded: no moments wait for their steps

    def _load_default(self, state_dict: dict[str, Any]) -> None:
        """load_state_dict() of a state dict holding its moments."""
        sw = self._swapper
        if sw is None and not any((state_dict.get("state") or {}).values()):
            self._load_groups(state_dict, lambda: None)
            return
        params = [p for g in self.param_groups for p in g["params"]]
        if sw is not None and not self._same_layout(params):
            # The old state is replaced: laid out afresh, not carried over.
            self._relayout(sw, params, lambda new: self._load_into(new, state_dict))
            return
        # Not adopt: what someone else wrote into self.state is replaced by this load.
        self._load_into(self._ensure_layout(adopt=False), state_dict)

    def _load_streamed(self, moments: DriveMoments, state_dict: dict[str, Any]) -> None:
        """load_state_dict() of a state dict whose moments DriveLoadPlanner
        wrote to the drive: the steps and hyper-parameters, the master
        weights taken from the parameters (with them on the drive). Only the
        streamed load begun last, with every moment on the drive, and no
        step or default load since."""
        sw = self._streamed_swapper(moments, state_dict)
        bare = {**state_dict, "state": {k: {**st, **dict.fromkeys(MOMENTS, ON_DRIVE)}
                                        for k, st in state_dict["state"].items()}}  # fmt: skip
        steps = self._load_groups(bare, self._plan_steps)
        # First: a failure below leaves some sub-groups' steps loaded; refused until loaded again.
        self._awaiting = True
        for i, step in enumerate(steps):
            sw.write_state(i, {}, {"step": torch.tensor(step)})
            if sw.master_slot():
                sw.update_master(i, self._fill_master(i))
        self._awaiting = False
        for k, p in enumerate(self._params):
            step = _loaded_step(self.state.get(p, {}), k)
            if step is not None:
                self._set_step(p, step)

    def _streamed_swapper(self, moments: DriveMoments, state_dict: dict[str, Any]) -> _Swapper:
        """The swapper, after a ValueError unless `moments` are the last
        streamed load's, all of them on the drive."""
        sw = self._swapper
        missing = [
            (k, n)
            for k, st in (state_dict.get("state") or {}).items()
            for n in MOMENTS
            if (src := drive_source(st.get(n))) is None or not src.moments.is_loaded(src.index, src.name)
        ]
        if sw is not None and moments is self._moments and (moments is not self._pending or missing):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: moments {missing[:4] or '(all)'} (parameter, name) "
                "were not loaded: load the state dict with dcp.load(..., planner="
                "aio.optim.DriveLoadPlanner()) first (again, if it failed)"
            )
        if sw is None or moments.swapper is not sw or moments is not self._pending or missing:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state dict's moments are placeholders of "
                "another streamed_state(), or of a streamed load since replaced (by a later streamed load, "
                "a step or another load), or not loaded: load the state dict that the last dcp.load(..., "
                "planner=aio.optim.DriveLoadPlanner()) filled, before stepping"
            )
        return sw

    def _plan_steps(self) -> list[float]:
        """Each sub-group's loaded step (self.state, after torch's load),
        checked as _plan_load checks it."""
        out = []
        for i, sg in enumerate(self._subgroups):
            steps = {_loaded_step(self.state.get(self._params[pc.param], {}), pc.param) for pc in sg.pieces}
            step = steps.pop()
            if steps or step is None:
                raise ValueError(
                    f"sub-group {i} holds parameters with different or missing step counts "
                    f"{sorted(map(str, steps | {step}))} ({_name(sg.pieces[0].param)} ...): a streamed load "
                    "needs every parameter's state"
                )
            out.append(step)
        return out

    def _load_into(self, sw: _Swapper, state_dict: dict[str, Any]) -> None:
        self._apply_load(sw, self._load_groups(state_dict, self._plan_load))

    def _load_groups(self, state_dict: dict[str, Any], plan: Callable[[], Any]) -> Any:
        """torch's load_state_dict into self.state and param_groups, the
        groups checked, then `plan()`'s result; on any error both restored."""
        old_state, old_groups = self.state, [dict(g) for g in self.param_groups]
        super().load_state_dict(state_dict)
        try:
            for k, g in enumerate(self.param_groups):
                _check_group(g, f"param group {k}")
            return plan()
        except BaseException:
            self.state = old_state
            for g, saved in zip(self.param_groups, old_groups, strict=True):
                g.clear()
                g.update(saved)
            raise

    def _plan_load(
        self, state: Mapping[Any, Mapping[str, Any]] | None = None
    ) -> list[tuple[dict[str, torch.Tensor], float | None]]:
        """Per sub-group: its tensors to write and step count (None: never
        stepped), from `state` (by parameter; default self.state)."""
        state = self.state if state is None else state
        plan = []
        # The master weights go to the drive only when they live there.
        names = ("param", *MOMENTS) if self._master_mode == "drive" else MOMENTS
        for i, sg in enumerate(self._subgroups):
            values = {n: torch.empty(sg.numel, dtype=torch.float32) for n in names}
            steps: dict[Any, int] = {}  # step count -> the first parameter with it
            for pc in sg.pieces:
                st = state.get(self._params[pc.param], {})
                steps.setdefault(_loaded_step(st, pc.param), pc.param)
                if "param" in values:
                    values["param"][pc.offset : pc.offset + pc.count].copy_(
                        self._flat(pc.param)[pc.start : pc.start + pc.count]
                    )
                for n in MOMENTS if st else ():
                    src = _loaded_moment(st, n, self._params[pc.param], pc.param)
                    values[n][pc.offset : pc.offset + pc.count].copy_(src[pc.start : pc.start + pc.count])
            if len(steps) > 1:
                each = ", ".join(f"{_name(k)}: {s}" for s, k in steps.items())
                raise ValueError(
                    f"sub-group {i} holds parameters with different step counts ({each}; None: no "
                    "state, as torch keeps for a parameter that never had a gradient): give them one "
                    "count, or put them in separate param groups"
                )
            plan.append((values, next(iter(steps)) if steps else None))
        return plan

    def _apply_load(
        self,
        sw: _Swapper,
        plan: list[tuple[dict[str, torch.Tensor], float | None]],
        state: Mapping[Any, Mapping[str, Any]] | None = None,
    ) -> None:
        """Write `plan` (:meth:`_plan_load`'s, from `state`: default
        self.state) to the drive, then each loaded step into self.state."""
        state = self.state if state is None else state
        if sw.broken:  # a failed step: every sub-group is rewritten below
            sw.drop_cached(write_back=False)
            sw.broken = None
        fresh = [i for i, (_, step) in enumerate(plan) if step is None]
        try:
            for i, (values, step) in enumerate(plan):
                if step is not None:
                    sw.write_state(i, values, {"step": torch.tensor(step)})
            if sw.master_slot():
                sw.initialize_many((i, _copier(plan[i][0]["param"])) for i in fresh)
            else:
                self._init_masters(sw, fresh)
        except BaseException:
            # Some sub-groups hold the loaded state, others the old one (a
            # Ctrl-C, a failed write): a step from that mix would train on
            # in silence. Refused until a load_state_dict() runs to its end.
            sw.broken = f"{type(self).__name__}.load_state_dict() was interrupted part-way; load it again"
            raise
        finally:
            # The loaded moments are on the drive now, or the swapper refuses
            # until a load: either way self.state holds stand-ins, not a state
            # the next step would take as written by someone else (and load).
            for k, p in enumerate(self._params):
                step = _loaded_step(state.get(p, {}), k)
                if step is not None:
                    self._set_step(p, step)

    # -- lifecycle ----------------------------------------------------------------------------
    def swap_stats(self) -> dict[str, Any]:
        """The swapper's counters (bytes read and written, sub-groups, swap
        folder, pinned and drive bytes) and ``master`` (:attr:`master_mode`);
        empty before the first step."""
        return {} if self._swapper is None else {**self._swapper.stats(), "master": self._master_mode}

    def close(self) -> None:
        """Free the buffers and remove this rank's swap folder (the optimizer
        is unusable afterwards). Idempotent; also at interpreter exit."""
        self._closed = True
        if self._swapper is not None:
            self._swapper.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            f"{type(self).__name__} keeps its state on the drive: save it with state_dict(), not pickle"
        )


class NVMeAdamW(NVMeAdam):
    """``torch.optim.AdamW`` with its moments on the drive and its fp32
    master weights there or in the parameters (``master=``, see
    :class:`NVMeAdam`): :class:`NVMeAdam` with decoupled weight decay
    (default 1e-2)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        **kwargs: Any,
    ) -> None:
        if "decoupled_weight_decay" in kwargs:
            raise TypeError("NVMeAdamW always decouples weight decay; use NVMeAdam to choose")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, decoupled_weight_decay=True, **kwargs)


_SWAP_KEYS = {
    "sub_group_size", "buffer_count", "pipeline_read", "pipeline_write", "pin_memory",
    "optimizer_states", "gradients", "host_memory_budget", "aio",
}  # fmt: skip


def _copier(src: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    return lambda out: out.copy_(src)


def _name(index: int) -> str:
    return f"parameter {index} (in param_groups order)"


def _check_param(p: Any, where: str) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where}: params must be tensors, got {type(p).__name__}")
    if p.dtype != torch.float32 or p.is_sparse:
        raise TypeError(
            f"{where}: NVMeAdam/NVMeAdamW take dense float32 parameters, got {p.dtype} ({p.layout})"
        )


def _check_group(group: Mapping[str, Any], where: str) -> None:
    why = _unsupported(dict(group))
    if why is not None:
        raise ValueError(f"{where}: NVMeAdam/NVMeAdamW do not support {why}; use torch.optim.Adam/AdamW")
    try:
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    except ValueError as e:  # set mid-run (a scheduler): say which group
        raise ValueError(f"{where}: {e}") from None


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: group[k] for k in _HYPER_KEYS if k in group}
    out["betas"] = tuple(out["betas"])
    return out


def _written(state: Mapping[Any, Any], params: Iterable[Any]) -> dict[Any, Any]:
    """The entries of `params` in `state` (an optimizer's ``self.state``)
    that someone else wrote there: a state whose moments are not both
    :data:`ON_DRIVE`, which every entry this optimizer makes has."""
    out = {}
    for p in params:
        st = state.get(p)
        if st and not (st.get("exp_avg") is ON_DRIVE and st.get("exp_avg_sq") is ON_DRIVE):
            out[p] = st
    return out


def _streamed_moments(state_dict: Mapping[str, Any]) -> DriveMoments | None:
    """The drive access of a state dict whose moments are placeholders
    (made inside streamed_state()), else None; ValueError for a mix."""
    found = {
        id(src.moments): src.moments
        for st in (state_dict.get("state") or {}).values()
        if isinstance(st, Mapping)
        for n in MOMENTS
        if (src := drive_source(st.get(n))) is not None
    }
    if len(found) > 1:
        raise ValueError(
            "load_state_dict: the state dict mixes placeholders of several streamed_state() calls"
        )
    return next(iter(found.values()), None)


def _loaded_step(st: Mapping[str, Any], index: int) -> float | None:
    if not st:
        return None
    step = st.get("step")
    if step is None or (isinstance(step, torch.Tensor) and step.numel() != 1):
        raise ValueError(f"state of {_name(index)}: 'step' must be a number or a one-element tensor")
    return float(step)


def _loaded_moment(st: Mapping[str, Any], name: str, p: Any, index: int) -> torch.Tensor:
    t = st.get(name)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"state of {_name(index)}: no tensor {name!r} (not an Adam/AdamW state)")
    check_pair(p, t, f"state {name!r} of {_name(index)}")
    local = local_of(t).detach()
    if local.shape != local_of(p).shape:
        raise ValueError(
            f"state {name!r} of {_name(index)} has local shape {tuple(local.shape)}, the parameter "
            f"{tuple(local_of(p).shape)}"
        )
    return local.reshape(-1).to(torch.float32)
