"""The offload trainer: a plain PyTorch model trained with its parameters and
optimizer state on the drive (or in CPU memory).

A coordinator over one module per job: :mod:`.placement` (checks, sub-group
layout), :mod:`.params` (where parameters live), :mod:`.hooks` (fetching them
around each module's forward/backward), :mod:`.grads` (gradient buffers),
:mod:`.scaler` (clipping, loss scaling), :mod:`.optimizer` (the step over
sub-groups) and :mod:`.checkpoint`.

Per step: forward/backward fetch each module's parameters just before use;
each parameter's gradient is added, in fp32, into its sub-group's gradient
buffer as soon as autograd has it and the buffer is stored when the sub-group
is complete; ``step()`` runs the optimizer sub-group by sub-group, applying
gradient clipping / loss-scale removal on the way, and writes the updated
low-precision parameters back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from .._interrupt import interrupts_held
from ..config import ConfigError, TrainConfig, load_train_config
from ..config.gradients import warn_if_over_budget
from ..optim import CPUAdam, OpenMPThrottle, fast_cpu_optimizer
from ..swap import SwapStateError
from . import checkpoint, export
from .grads import GradientAccumulator
from .hooks import Fetcher
from .init_guard import PlaceholderCheck
from .linear import install_linear, reset_uses, saved_tensor_guard
from .malloc import trim_if_fragmented, trim_malloc
from .mirror import mirror_group, mirror_master
from .optimizer import ZeroOptimizer, make_optimizer
from .params import ParamStore
from .placement import Plan, SubGroupLayout, place_gradients_for, plan_placement
from .scaler import GradScaling
from .state_dict import watch
from .torch_optimizer import OffloadOptimizer, attach_scheduler, backend_group_hyper
from .uploads import UploadPolicy

logger = logging.getLogger("aio.zero")


def initialize(
    model: Any, config: Any, optimizer: Any = None, device: Any = None, lr_scheduler: Any = None
) -> OffloadTrainer:
    """Wrap `model` for offloaded training (DeepSpeed's entry point name).

    `config`: a DeepSpeed-format dict or JSON path (see docs/zero.md).
    `optimizer`: a torch optimizer instance (its class and its param groups
    -- each group's parameters and hyper-parameters -- are used; it is never
    stepped itself, and its ``param_groups`` are read at every step, so a
    scheduler on it is honoured), a torch optimizer class (with
    ``optimizer.params`` from the config), or None (``optimizer.type`` from
    the config). `lr_scheduler`: a scheduler on that optimizer or on
    ``engine.optimizer``, or a callable building one from
    ``engine.optimizer``; stepped after each optimizer step, as DeepSpeed
    does. Every config problem is raised before anything is allocated.
    """
    return OffloadTrainer(model, config, optimizer=optimizer, device=device, lr_scheduler=lr_scheduler)


def resolve_optimizer(cfg: TrainConfig, optimizer: Any) -> tuple[Any, dict[str, Any]]:
    """The torch optimizer class and hyper-parameters to step with."""
    import torch

    if optimizer is None:
        if cfg.optimizer_type is None:
            raise ConfigError(
                [("optimizer", "no optimizer: pass optimizer= or set optimizer.type in the config")]
            )
        return cfg.optimizer_class(), dict(cfg.optimizer_params)
    if isinstance(optimizer, torch.optim.Optimizer):
        import inspect

        accepted = inspect.signature(type(optimizer).__init__).parameters
        hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params" and k in accepted}
        if isinstance(optimizer, CPUAdam):  # its options outside the param groups
            hyper["match_torch"] = optimizer.match_torch
            if optimizer.threads is not None:
                hyper["threads"] = optimizer.threads
        if cfg.optimizer_type is not None:
            warnings.warn(
                "both optimizer= and a config 'optimizer' block given; using optimizer=", stacklevel=3
            )
        return type(optimizer), hyper
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer, dict(cfg.optimizer_params)
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer instance or class, got {type(optimizer).__name__}"
    )


def stepping_optimizer(
    cfg: TrainConfig, optimizer_cls: Any, hyper: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """The class and hyper-parameters float32 CPU master weights step with
    under `cfg`: torch's Adam/AdamW through aio.optim's fused kernel (unless
    ``optimizer.params.torch_adam`` asks for torch's own class), with the
    square root ``aio_zero.adam_sqrt`` names; other classes as they are."""
    if cfg.torch_adam:
        return optimizer_cls, hyper
    match = cfg.aio_zero.adam_sqrt == "torch"
    cls, hyper = fast_cpu_optimizer(optimizer_cls, hyper, match_torch=match)
    if match and isinstance(cls, type) and issubclass(cls, CPUAdam):
        hyper = {**hyper, "match_torch": True}  # a CPUAdam class given as it is
    return cls, hyper


def stepping_class(
    cfg: TrainConfig, optimizer_cls: Any, hyper: dict[str, Any], groups: list[dict[str, Any]]
) -> tuple[Any, dict[str, Any]]:
    """:func:`stepping_optimizer` for every param group at once: the fused
    class only when it steps each group's options (one group with, say,
    ``amsgrad=True`` makes every group step with torch's own class, which
    then also steps the others exactly as torch does)."""
    cls, out = stepping_optimizer(cfg, optimizer_cls, hyper)
    if cls is optimizer_cls:
        return cls, out
    for g in groups:
        # The keys the class's constructor takes (`hyper`'s), each group's value.
        opts = {k: g[k] for k in hyper if k in g}
        if stepping_optimizer(cfg, optimizer_cls, {**hyper, **opts})[0] is not cls:
            return optimizer_cls, hyper
    return cls, out


def _warn_if_nothing_on_drive(store: ParamStore, params: list[Any], cfg: TrainConfig) -> None:
    """``offload_param.device: nvme`` that pages nothing: one warning line."""
    if store.swapper is None or store.on_drive_part_ids(params):
        return
    p = cfg.offload.offload_param
    if p is None:  # cannot be: the store swaps only with an offload_param block
        return
    total = sum(q.aio_numel for q in params)
    # The advice names the setting that kept them: parameters under the
    # persistence threshold never page, whatever max_in_cpu says.
    small = sum(q.aio_numel for q in params if q.aio_numel < cfg.persistence_threshold)
    if small == total:
        fix = (
            f"every parameter has fewer than stage3_param_persistence_threshold={cfg.persistence_threshold} "
            "elements; set zero_optimization.stage3_param_persistence_threshold lower (0: page them all)"
        )
    else:
        fix = (
            f"max_in_cpu={p.max_in_cpu} elements keep the {total - small} of the parameters above "
            "stage3_param_persistence_threshold; set zero_optimization.offload_param.max_in_cpu lower "
            "(0: everything on the drive)"
        )
    logger.warning(
        "offload_param.device is nvme but all %d parameter elements stay in CPU memory: %s", total, fix
    )


def _is_optimizer(optimizer: Any) -> bool:
    import torch

    return isinstance(optimizer, torch.optim.Optimizer)


def move_buffers(model: Any, device: Any) -> None:
    """Put every module buffer (BatchNorm statistics, position ids, rotary
    frequencies, masks) on the compute device, as ``model.to(device)`` would:
    only the parameters are the store's, and a buffer left on the host fails
    the first forward on a GPU ("expected all tensors on the same device")."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


class _Background:
    """Runs `fn` in a thread now; join() waits for it and raises what it raised."""

    def __init__(self, fn: Any) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="aio-setup", daemon=True)
        self._thread.start()

    def _run(self, fn: Any) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to join()
            self._error = e

    def join(self, raise_error: bool = True) -> None:
        self._thread.join()
        if raise_error and self._error is not None:
            raise self._error


class OffloadTrainer:
    """See :func:`initialize`. DeepSpeed-style loop::

    for batch in data:
        loss = loss_fn(trainer(batch))
        trainer.backward(loss)
        trainer.step()   # steps the optimizer at accumulation boundaries
    """

    def __init__(
        self, model: Any, config: Any, optimizer: Any = None, device: Any = None, lr_scheduler: Any = None
    ) -> None:
        self.closed = True  # until fully built: close() must not touch missing parts
        self.cfg = cfg = load_train_config(config)
        self.optimizer_cls, self.hyper = resolve_optimizer(cfg, optimizer)
        self.module = model
        self._user_optimizer = optimizer if _is_optimizer(optimizer) else None
        groups = None if self._user_optimizer is None else [g["params"] for g in optimizer.param_groups]
        plan = plan_placement(model, cfg, device, groups)  # every check, before any allocation
        self._torch_opt: OffloadOptimizer | None = None
        self.lr_scheduler: Any = None
        self.device = plan.device
        self.store = plan.store if plan.store is not None else ParamStore(cfg, self.device)
        self.opt: ZeroOptimizer | None = None
        self.fetcher: Fetcher | None = None
        self._grad_hooks: list[Any] = []
        self._omp: OpenMPThrottle | None = None
        self.mirrored = 0  # parameters read from the master weights (see _mirror)
        # Sub-groups whose parameters are mirrored once their master weights are
        # first written (see _initialize_masters): in _store_params.
        self._mirror_later: set[int] = set()
        try:
            nvme = "nvme" in (cfg.param_device, cfg.optimizer_device)
            if cfg.aio_zero.short_openmp_spin(nvme):
                self._omp = OpenMPThrottle()
            self._build(plan)
            self.lr_scheduler = attach_scheduler(lr_scheduler, self.optimizer, self._user_optimizer)
        except BaseException:
            self.closed = False
            self.close()
            raise
        self.closed = False
        trim_malloc()
        self.global_steps = 0
        self.skipped_steps = 0
        self.abandoned_windows = 0
        self.last_grad_norm: float | None = None
        self._param_writes: list[Any] = []
        # Gradients of this window that came from a plain loss.backward() (not
        # through backward(), which scales the loss); see _check_plain_backward.
        self._in_backward_call = False
        self._plain_backward = False
        self._updated = False  # this step's optimizer update has (partly) happened

    def _build(self, plan: Plan) -> None:
        """Allocate: parameters into the store, the optimizer's sub-groups with
        their master weights, the gradient hooks and the fetcher."""
        cfg = self.cfg
        self.store.uploads.policy = UploadPolicy(cfg.aio_zero.modules_ahead)  # Init's store too
        for n, p in plan.named:
            self.store.adopt(p, n)
        self.store.finish_adoption()
        if orphans := self.store.forget_orphans():
            logger.info("gave back %d stored partitions of parameters that were replaced", len(orphans))
        for m in self.module.modules():
            watch(self.store, m)  # state_dict() gives values, not placeholders
        self.store.trained = True
        _warn_if_nothing_on_drive(self.store, [p for _n, p in plan.named], cfg)
        move_buffers(self.module, self.device)
        self.layout = layout = SubGroupLayout(plan.packed, plan.order)
        groups = self._param_groups(plan)
        cls, hyper = stepping_class(cfg, self.optimizer_cls, self.hyper, groups)
        group_hyper = backend_group_hyper(cls, hyper, groups)
        self.gradient_placement = place = place_gradients_for(cfg, plan.named, layout)
        warn_if_over_budget(place, stacklevel=4)  # the caller of initialize()
        logger.info("fp32 gradients: %s (%s)", place.where, place.reason)
        self.opt = opt = make_optimizer(
            cfg, cls, hyper, self.store.copies.register_host, group_hyper, gradients=place.where
        )
        self._torch_opt = OffloadOptimizer(
            [{"params": g["params"], **h} for g, h in zip(groups, group_hyper, strict=True)], hyper, opt
        )
        if self._user_optimizer is not None:  # a scheduler on the user's optimizer reaches us
            self._torch_opt.share_groups(self._user_optimizer.param_groups)
        for gi, numel in enumerate(layout.group_numel):
            opt.register_subgroup(gi, numel, plan.group_of[gi])
        self._initialize_masters(opt, layout)
        self.store.pack([[s.param for s in group] for group in layout.groups])
        self._mirror()
        for s in layout.places.values():
            self._grad_hooks.append(s.param.register_post_accumulate_grad_hook(self._on_grad))
        if self.store.swapper is not None or self.device.type != "cpu":
            install_linear()
            self.fetcher = Fetcher(self.store, list(self.module.modules()), cfg.prefetch_bucket_size)
        self.scaling = GradScaling(cfg)
        self.grads = GradientAccumulator(
            opt, layout, cfg.gradient_accumulation_steps, self.scaling.needs_norms, self.store.copies
        )
        # aio.zero.linear computes weight gradients straight into their buffers
        # through this (weakly: a parameter does not keep its trainer alive),
        # when they are computed on the CPU.
        target = weakref.WeakMethod(self.grads.target)
        for s in layout.places.values() if self.device.type == "cpu" else ():
            s.param.aio_grad_target = target

    def _initialize_masters(self, opt: ZeroOptimizer, layout: SubGroupLayout) -> None:
        """Set every sub-group's master weights. Where they are its float32 or
        bfloat16 parameters (widened), the optimizer reads them from where
        the store keeps them when its first step needs them
        (``initialize_from``): set-up reads and writes none of them. Any other
        sub-group's parameters are read into the buffer its master weights
        are written from, while the previous sub-groups' writes land; a
        thread meanwhile allocates the swap buffers and the gradients kept in
        memory, which the first step would otherwise wait for (fresh memory
        is slow: 0.5-3 s per GiB on the dev box's VM). With nothing to write,
        the swap buffers are allocated now and the gradients while the first
        forward runs (``reserve_memory(background=True)``)."""
        swapper = self.store.swapper
        reserve: list[_Background] = []

        def allocate(background: bool = False) -> None:
            if swapper is not None:
                swapper.reserve_buffers()
            opt.reserve_memory(background)

        eager = [gi for gi in range(len(layout.groups)) if not self._initialize_in_place(opt, layout, gi)]
        read, dtype = self.store.start_read_into, self.store.dtype

        def fills() -> Iterator[tuple[int, Any]]:
            for k, gi in enumerate(eager):
                # From the second sub-group on, the optimizer's buffers exist:
                # two allocations at once took longer than one after the other.
                if k == 1:
                    reserve.append(_Background(allocate))
                yield gi, functools.partial(layout.fill_master, gi, read, dtype=dtype)

        try:
            opt.initialize_many(fills())
        except BaseException:
            for r in reserve:
                r.join(raise_error=False)  # the first error is the one to see
            raise
        for r in reserve:
            r.join()
        if not reserve:  # nothing to overlap here: the first forward does
            allocate(background=True)

    def _initialize_in_place(self, opt: ZeroOptimizer, layout: SubGroupLayout, gi: int) -> bool:
        """Let sub-group `gi`'s master weights start as its parameters where the
        store keeps them, if those are float32 (read there by the first step;
        the parameters are mirrored once it has written them, see
        _store_params) or bfloat16 (read and widened by the first step:
        set-up then reads and writes none of them, 12 GB at 2B, and the
        first step reads 4 GB less). False: initialize it from them now.
        (2B bf16 on the dev box, with the gradients allocated while the first
        forward runs: set-up's trainer part 4.3-4.6 s against 6.9-7.3, step 1
        / step 2 1.06-1.09; earlier, set-up's I/O only overlapped that
        allocation, which took as long.)"""
        import torch

        if self.store.dtype == torch.float32:
            start = layout.start_master_reads
        elif self.store.dtype == torch.bfloat16:
            start = layout.start_widened_reads
        else:
            return False
        if not opt.initialize_from(gi, functools.partial(start, gi, self.store.start_read_into)):
            return False
        if self.cfg.aio_zero.params_from_master and self.store.dtype == torch.float32:
            self._mirror_later.add(gi)
        return True

    def _mirror(self) -> None:
        """Read float32 drive parameters from the master weights (see
        :mod:`aio.zero.mirror`), unless ``aio_zero.params_from_master`` is off;
        those of a sub-group whose master weights are not written yet, once
        they are (``_mirror_later``)."""
        self.mirrored = 0
        if self.cfg.aio_zero.params_from_master and self.opt is not None:
            opt = self.opt
            try:
                self.mirrored = mirror_master(self.store, opt, self.layout)
            except BaseException:
                # Some are aliased already: a step must flush for them, or they refuse.
                self.mirrored = 1
                self._lose_mirrors()
                raise
            self._mirror_later = {gi for gi in self._mirror_later if opt.master_extent(gi) is None}
            logger.info("parameters read from the master weights: %d", self.mirrored)

    @property
    def gas(self) -> int:
        """``gradient_accumulation_steps``."""
        return self.cfg.gradient_accumulation_steps

    @property
    def micro_steps(self) -> int:
        """Micro-steps completed (step() calls) so far; an abandoned window's are
        taken back. Settable, for restoring a checkpoint."""
        return self.grads.micro_steps

    @micro_steps.setter
    def micro_steps(self, n: int) -> None:
        self.grads.micro_steps = n

    @property
    def scaler(self) -> Any:
        """The fp16 :class:`aio.zero.scaler.LossScaler`, or None."""
        return self.scaling.scaler

    def _param_groups(self, plan: Plan) -> list[dict[str, Any]]:
        """The torch param groups: the user's optimizer's, or one of every
        trainable parameter."""
        if self._user_optimizer is not None:
            return list(self._user_optimizer.param_groups)
        return [{"params": [p for _n, p in plan.named if p.requires_grad]}]

    @property
    def optimizer(self) -> OffloadOptimizer:
        """The torch optimizer face (:class:`aio.zero.torch_optimizer.OffloadOptimizer`):
        ``param_groups`` read at every step (LR schedulers work on it); other
        attributes are the backend's (:attr:`zero_optimizer`)."""
        if self._torch_opt is None:
            raise ValueError("this aio.zero trainer was not built")
        return self._torch_opt

    @property
    def zero_optimizer(self) -> ZeroOptimizer:
        """The optimizer backend (a :class:`aio.zero.optimizer.ZeroOptimizer`)."""
        if self.opt is None:
            raise ValueError("this aio.zero trainer was not built")
        return self.opt

    # -- the loop --------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward, its parameters fetched module by module."""
        self._check_open()
        self.store.begin_training()
        if self.fetcher is None:
            return self.module(*args, **kwargs)
        self.fetcher.begin_forward()
        with saved_tensor_guard(self.store.buffer_ptrs, self.fetcher.counters), PlaceholderCheck(self.store):
            return self.module(*args, **kwargs)

    __call__ = forward

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next step() runs the optimizer."""
        return self.grads.is_boundary()

    def backward(self, loss: Any) -> Any:
        """Back-propagate `loss` (scaled by 1/gradient_accumulation_steps, and
        by the loss scale in fp16); gradients go to the sub-group buffers."""
        self._check_open()
        self._in_backward_call = True
        try:
            self.scaling.scale_loss(loss, self.gas).backward()
            self._finish_backward()
        except BaseException:
            self._abandon_window()
            raise
        finally:
            self._in_backward_call = False
        return loss

    def get_lr(self) -> float:
        """The learning rate of the next step (param group 0's; see
        ``optimizer.param_groups`` for every group's)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Change every param group's learning rate from the next step on."""
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr < 0:
            raise ValueError(f"lr must be a number >= 0, got {lr!r}")
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.zero_optimizer.set_lr(lr)

    def zero_grad(self) -> None:
        """Nothing to do: gradients never stay on the parameters (kept for API compatibility)."""

    def _on_grad(self, param: Any) -> None:
        self._plain_backward = self._plain_backward or not self._in_backward_call
        g = param.grad
        param.grad = None
        reset_uses(param)
        if self.fetcher is not None:
            self.fetcher.release_after_backward(param)
        self.grads.add(param, g)

    def _finish_backward(self) -> None:
        if self.fetcher is not None:
            self.fetcher.end_backward()
        self.grads.finish_backward()
        trim_if_fragmented()  # the activations' holes, so RSS does not creep up step after step

    def _settle_writes(self) -> None:
        self.grads.settle_writes()

    def step(self) -> None:
        """End of a micro-step: at an accumulation boundary, one optimizer
        step over every sub-group, then the new parameters are stored."""
        self._check_open()
        if self.fetcher is not None:
            self.fetcher.end_backward()
        if self.grads.in_backward:  # loss.backward() ran without engine.backward()
            self._finish_backward()
        self._check_plain_backward()
        if not self.grads.is_boundary():
            self.grads.end_micro_step()
            return
        try:
            self.grads.settle_writes()
        except BaseException:
            self._abandon_window()
            raise
        if not self.grads.touched:
            raise RuntimeError("step() without a backward() since the last step")
        scale = self.scaling.for_step(self.grads.boundary_norms())
        if scale.norm is not None:
            self.last_grad_norm = scale.norm
        if scale.skip:
            # Counted as a step, as DeepSpeed counts it (global_stepN tags of
            # checkpoints saved around it stay distinct); skipped_steps says which.
            self.skipped_steps += 1
            self.global_steps += 1
        else:
            stepped = self.global_steps
            try:
                # One Ctrl-C waits for the whole step: cut part-way, it would
                # refuse until a checkpoint is loaded.
                with interrupts_held("aio.zero's optimizer step"):
                    self._step_through_torch_optimizer(scale.grad_scale)
            except BaseException:
                if self.global_steps != stepped:
                    # The update happened and what failed came after it (storing
                    # the parameters): its gradients are spent, never applied twice.
                    self.grads.end_window()
                raise
        self.grads.end_window()

    def _check_plain_backward(self) -> None:
        """A plain ``loss.backward()`` is the caller's to scale, as in PyTorch
        (``(loss / gradient_accumulation_steps).backward()``), except under
        fp16's loss scale, which only backward() knows: its gradients would
        never be unscaled right, so the window is dropped with a ValueError
        saying what to call."""
        plain, self._plain_backward = self._plain_backward, False
        if not plain or self.scaling.scaler is None:
            return
        self._abandon_window()
        raise ValueError(
            "gradients came from a plain loss.backward() under fp16 loss scaling: call "
            "engine.backward(loss) instead, which multiplies the loss by the current loss scale (and "
            "divides it by gradient_accumulation_steps); this accumulation window's gradients were dropped"
        )

    def _step_through_torch_optimizer(self, grad_scale: Any) -> None:
        """The step goes through ``optimizer.step()`` (a scheduler built on it
        sees the step), with every param group's current hyper-parameters;
        then the scheduler steps, as in DeepSpeed."""
        opt = self.optimizer
        self.zero_optimizer.set_group_hyper(opt.hyper())
        opt._run_step = lambda: self._optimizer_step(grad_scale)
        stepped = self.global_steps
        try:
            opt.step()
        finally:
            opt._run_step = None
            if self.global_steps != stepped:  # also when storing the parameters failed after the update
                self._step_scheduler()

    def _step_scheduler(self) -> None:
        """Step the LR scheduler after an optimizer step, as DeepSpeed does."""
        if self.lr_scheduler is not None:
            # A scheduler on the user's optimizer watches that optimizer's
            # step() (never called: this one stepped); say it ran, as torch's
            # own wrapper would, so it does not warn about the order.
            self.lr_scheduler.optimizer._opt_called = True
            self.lr_scheduler.step()

    def _optimizer_step(self, grad_scale: Any) -> None:
        self._param_writes = []
        # Packed sub-groups (memory backend, low precision) get their new
        # parameters written by the update itself.
        lowp = {gi: flat for gi, (flat, _) in self.store.packed.items()}
        self._updated = False  # set by _store_params: some sub-group's update is in
        try:
            self.zero_optimizer.step(after=self._store_params, grad_scale=grad_scale, lowp=lowp)
            self._updated = True
            if self.mirrored:  # the next forward reads parameters from the drive's master weights
                self.zero_optimizer.flush()
        except BaseException:
            # The master weights on the drive may be partly written: parameters
            # read from them refuse until a checkpoint is loaded, as the optimizer does.
            self._lose_mirrors()
            raise
        finally:
            try:
                self.store.settle(self._param_writes)
            finally:
                self._param_writes = []
                # Once the optimizer has stepped the step happened, whatever fails
                # after it (a parameter not stored refuses to be read until a
                # checkpoint is loaded); step() then spends its gradients.
                if self._updated:
                    self.global_steps += 1

    def _abandon_window(self) -> None:
        """A backward or a gradient write failed: drop this accumulation
        window's gradients (the optimizer state is untouched), give every
        buffer back and start the window again at the next backward()."""
        self.reset_window()
        self.abandoned_windows += 1

    def reset_window(self) -> None:
        """Drop the gradients of the current accumulation window."""
        self._plain_backward = False
        if self.fetcher is not None:
            self.fetcher.end_backward()
        self.grads.reset()
        for s in self.layout.places.values():
            s.param.grad = None

    def _store_params(self, gi: int, master: Any) -> None:
        self._updated = True
        # The previous sub-group's parameter writes had this sub-group's step
        # to land; wait for them now, so at most two sub-groups of parameter
        # copies are ever held (not the whole model until the next forward).
        self.store.settle(self._param_writes)
        self._param_writes = []
        packed = gi in self.store.packed
        if gi in self._mirror_later:  # its master weights are written from this step on
            self._mirror_later.discard(gi)
            try:
                self.mirrored += mirror_group(self.store, self.zero_optimizer, self.layout, gi)
            except BaseException:
                self.mirrored = max(self.mirrored, 1)  # some are aliased: the failed step loses them
                raise
        for s in self.layout.groups[gi]:
            if packed:
                self.store.wrote_packed(s.param)
                continue
            if self.store.mirrors(s.param):  # the optimizer writes these bytes itself
                self.store.refresh(s.param, master[s.offset : s.offset + s.numel])
                continue
            self.store.write(s.param, master[s.offset : s.offset + s.numel])
            self._param_writes.append(s.param)

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
        """Write parameters, optimizer state and counters to ``save_dir/tag``
        (default tag ``global_stepN``), atomically and durably, and point
        ``save_dir/latest`` at it. Only between optimizer steps (not
        mid-accumulation). `client_state` must be plain data (dicts, lists,
        numbers, strings, tensors): loading it can then never run code; a
        TypeError says so at save time otherwise.

        Every file and folder is fsynced; the checkpoint's ``complete`` marker
        is written last, and load_checkpoint() refuses a checkpoint without it."""
        self._check_open()
        return checkpoint.save(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> tuple[str, dict]:
        """Restore a checkpoint from save_checkpoint() (``latest`` when no tag).
        Returns (path, client_state). The whole checkpoint is verified --
        completeness marker, model match, every checksum -- before anything
        changes: a failed load leaves the trainer exactly as it was. One
        Ctrl-C waits for the load to be whole (as a step does); a second
        one, or an I/O error, while it is applied leaves the trainer
        refusing use (SwapStateError) until a load runs to its end."""
        if self.closed:  # not _check_open(): a load cut part-way is retried here
            raise ValueError("this aio.zero trainer is closed")
        # _mirror: loading stored the parameters in their own copies.
        return checkpoint.load(self, load_dir, tag, then=self._mirror)

    def save_pretrained(
        self,
        save_directory: str,
        dtype: Any = None,
        max_shard_size: int | str = "5GB",
        progress: Any = None,
    ) -> list[str]:
        """Write the model's weights to `save_directory` as safetensors shards
        in Hugging Face's layout, one tensor at a time (peak memory: the
        largest tensor, not the model), plus ``config.json`` and
        ``generation_config.json`` for a transformers model, so
        ``from_pretrained(save_directory)`` loads it. Keys are
        ``model.state_dict()``'s (persistent buffers included, a tied
        parameter once). `dtype`: ``"fp32"``, ``"bf16"``, ``"fp16"`` or a
        torch dtype for the floating-point tensors (default: the training
        dtype). `max_shard_size`: bytes or e.g. ``"5GB"``. `progress(done,
        total)` is called with bytes after each tensor. Returns the weight
        files written; a failure leaves the folder as it was."""
        self._check_open()
        return export.save_pretrained(self, save_directory, dtype, max_shard_size, progress)

    # -- access and accounting -------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, params: Any = None, modify: bool = False) -> Iterator[None]:
        """Context manager materialising `params` (default: all) outside
        forward/backward, e.g. to inspect or export weights. With `modify`,
        the values the block leaves in them are stored -- as the parameters
        and, for trainable ones, as their fp32 master weights, so the next
        step goes on from them -- unless the block raises."""
        self._check_open()
        params = list(self.module.parameters()) if params is None else list(params)
        if modify:
            # Gradient writes in flight (mid-window, or before step()) hold
            # optimizer buffers the master weights' update needs.
            try:
                self.grads.settle_writes()
            except BaseException:
                self._abandon_window()
                raise
        with self.store.gathered(params, modify=modify):
            yield
        if modify:
            self._masters_from(params)

    def _masters_from(self, params: list[Any]) -> None:
        """Set the master weights of trainable `params` to their stored values
        where those differ from the master weights rounded to the training
        dtype (elsewhere the master keeps its fp32 precision)."""
        places: dict[int, list[Any]] = {}
        for p in params:
            s = self.layout.places.get(getattr(p, "aio_id", -1))
            if s is not None:
                places.setdefault(s.group, []).append(s)
        try:
            for gi, group in places.items():
                self.zero_optimizer.update_master(gi, functools.partial(self._edit_master, group))
        except BaseException:
            # Master weights partly written: parameters read from them refuse
            # until a checkpoint is loaded, as after a failed step.
            self._lose_mirrors()
            raise
        if places:
            self._mirror()  # the parameters stored above are the master weights again

    def _edit_master(self, group: list[Any], master: Any) -> None:
        for s in group:
            new = self.store.read(s.param).reshape(-1)
            old = master[s.offset : s.offset + s.numel]
            changed = new != old.to(new.dtype)
            old[changed] = new[changed].to(old.dtype)

    def _lose_mirrors(self) -> None:
        if self.mirrored:
            self.store.lose_mirrors()
            self.mirrored = 0

    def state_dict(self) -> dict[str, Any]:
        """The model's ``state_dict()`` as CPU tensors of their own (parameters
        read one at a time; persistent buffers copied; the keys are torch's)."""
        self._check_open()
        out: dict[str, Any] = {}
        for key, v in self.module.state_dict(keep_vars=True).items():
            if getattr(v, "_aio_store", None) is self.store:
                out[key] = self.store.read(v).view(v.aio_shape)
            else:
                out[key] = v.detach().cpu().clone()
        return out

    def pinned_bytes(self) -> int:
        """Page-locked bytes held: the parameter store (with its upload staging),
        the gradient download staging and the optimizer."""
        opt = self.opt.pinned_bytes() if self.opt is not None else 0
        return self.store.pinned_bytes() + self.grads.pinned_bytes() + opt

    def stats(self) -> dict[str, Any]:
        """Step counters, loss scale, pinned bytes and the parts' own counters."""
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "abandoned_windows": self.abandoned_windows,
            "loss_scale": self.scaler.scale if self.scaler else None,
            "pinned_bytes": self.pinned_bytes(),
            "params": self.store.stats(),
            "optimizer": self.zero_optimizer.stats(),
            "fetcher": dict(self.fetcher.counters) if self.fetcher else None,
            "grads": self.grads.stats(),
            "gradients": self.gradient_placement.as_dict(),
        }

    def io_bytes(self) -> int:
        """Bytes read and written by the parameter and optimizer swappers so far
        (the sum of :meth:`io_bytes_by_category`)."""
        return sum(sum(parts.values()) for parts in self.io_bytes_by_category().values())

    def io_bytes_by_category(self) -> dict[str, dict[str, int]]:
        """Bytes read and written so far, ``{"read": {...}, "written": {...}}``,
        by category: "parameters" (the parameter swapper: fetches for forward
        and backward, write-backs), "master" (fp32 master weights),
        "gradients" (fp32 gradients through the drive) and each optimizer
        state by name."""
        out: dict[str, dict[str, int]] = {"read": {}, "written": {}}
        if self.store.swapper is not None:
            c = self.store.swapper.counters
            out["read"]["parameters"] = int(c["bytes_read"])
            out["written"]["parameters"] = int(c["bytes_written"])
        names = {"param": "master", "grad": "gradients"}
        for direction, parts in self.zero_optimizer.io_bytes_by_part().items():
            for part, n in parts.items():
                out[direction][names.get(part, part)] = int(n)
        return out

    def train(self, mode: bool = True) -> OffloadTrainer:
        """The model's train(mode); returns the trainer."""
        self.module.train(mode)
        return self

    def eval(self) -> OffloadTrainer:
        """The model's eval(); returns the trainer."""
        return self.train(False)

    def parameters(self) -> Any:
        """The model's parameters (placeholders between uses)."""
        return self.module.parameters()

    # Why the trainer refuses until a checkpoint loads whole (a load cut part-way), or None.
    load_cut: str | None = None

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this aio.zero trainer is closed")
        if self.load_cut is not None:
            raise SwapStateError(self.load_cut)

    def close(self) -> None:
        """Finish I/O, remove hooks and swap files. Parameters become unusable."""
        if self.closed:
            return
        self.closed = True
        for h in self._grad_hooks:
            h.remove()
        layout = getattr(self, "layout", None)
        for s in layout.places.values() if layout is not None else ():
            s.param.__dict__.pop("aio_grad_target", None)
        if self.fetcher is not None:
            self.fetcher.remove()
        try:
            if hasattr(self, "grads"):
                self.grads.close()
        finally:
            if self._omp is not None:
                self._omp.close()
            try:
                self.store.quiesce()  # parameter reads from the optimizer's files end first
            finally:
                try:
                    if self.opt is not None:
                        self.opt.close()
                finally:
                    self.store.close()  # also when the optimizer's close failed: close() runs once

    def __enter__(self) -> OffloadTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
