"""Lightning on aio.zero: :class:`AioZeroStrategy`.

``Trainer(strategy=AioZeroStrategy(ds_config), ...)`` trains a
LightningModule -- built under ``aio.zero.Init(ds_config)``, or in its
``configure_model`` hook, which the strategy runs under ``Init`` -- with its
parameters and optimizer state where the DeepSpeed-format config puts them
(the drive, or CPU memory), in this one process. Lightning keeps the loop:
``configure_optimizers`` (one optimizer, its param groups and LR
schedulers), ``max_steps``/``max_epochs``, ``accumulate_grad_batches``,
``gradient_clip_val`` (norm clipping), ``precision="bf16-mixed"``
autocast, validation, callbacks, manual optimization. In fp32 the losses are
the same Trainer's in memory, bit for bit
(tests/integrations/test_lightning_zero.py).

Checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint(path)``) are
directories, as DeepSpeed's: aio.zero's checkpoint (``global_stepN/`` and
``latest``; ``aio-export path out/`` writes the weights for
``from_pretrained``) beside Lightning's own state (loops, callbacks, LR
schedulers, hyper-parameters) in ``global_stepN.lightning.ckpt``. The model
is never gathered into memory to save it. ``trainer.fit(model,
ckpt_path=path)`` resumes from one. After training,
``strategy.engine.save_pretrained(dir)`` streams the weights out.

Written for Lightning 2.6. The Strategy methods overridden, and why:
``setup`` builds the engine from ``configure_optimizers``' optimizer and
hands Lightning an :class:`~aio.integrations._engine_faces.EngineOptimizer`
(its ``step(closure)`` runs the closure, then ``engine.step()``; Lightning
counts the step, so ``max_steps`` holds) and an
:class:`~aio.integrations._engine_faces.EngineModule` (training, validation
and test steps run through the engine's forward); ``backward`` is
``engine.backward`` (``LightningModule.backward`` is not called: gradients
go to the engine's buffers); ``model_to_device``/``teardown`` leave the
parameters to the engine; ``model_sharded_context`` is ``aio.zero.Init``;
the checkpoint methods save and load through the engine.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn

import aio.zero

from ..zero import checkpoint as zero_checkpoint
from ..zero import export as zero_export
from ._engine_faces import (
    EngineModule,
    EngineOptimizer,
    Settler,
    check_config,
    default_torch_adam_bits,
    engine_config,
    read_config,
    save_engine_checkpoint,
)

LIGHTNING_SUFFIX = ".lightning.ckpt"  # Lightning's own state beside each engine checkpoint tag


def resolve_config(config: Any, trainer: Any = None) -> dict[str, Any]:
    """The DeepSpeed-format `config` (dict, JSON path or JSON text) for a run
    of the Lightning `trainer`: ``gradient_accumulation_steps`` and
    ``gradient_clipping`` (``"auto"`` or absent) take its
    ``accumulate_grad_batches`` and ``gradient_clip_val``, and a number
    written there must equal a flag that is set; ``aio_zero.adam_sqrt``
    defaults to ``torch`` (torch's Adam bits). Without `trainer`, only the
    defaults (what ``aio.zero.Init`` needs)."""
    data = read_config(config)
    default_torch_adam_bits(data)
    if trainer is None:
        return data
    s = Settler(data, "the Lightning Trainer's flags")
    s.put("gradient_accumulation_steps", int(trainer.accumulate_grad_batches), "accumulate_grad_batches")
    clip = trainer.gradient_clip_val
    s.put("gradient_clipping", float(clip or 0.0), "gradient_clip_val", match=clip is not None)
    s.check()
    return data


class AioZeroStrategy(SingleDeviceStrategy):
    """A single-device Lightning strategy training on aio.zero (see the module
    docstring). `config`: the DeepSpeed-format config (dict, JSON path or
    JSON text). `device`: where the model computes (the engine's device).
    ``strategy.engine`` is the :class:`aio.zero.OffloadTrainer` once a
    stage has started; :meth:`close` lets its swap files and buffers go."""

    strategy_name = "aio_zero"

    def __init__(
        self,
        config: Any,
        device: Any = "cpu",
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            device=device,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.config = read_config(config)
        self.engine: Any = None
        # Gradients of an accumulation window wait in the engine since the last
        # backward (cleared by the optimizer step): no checkpoint then.
        self._window_open = False

    def _settled(self) -> dict[str, Any]:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return resolve_config(self.config, trainer)

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs under ``aio.zero.Init``: each layer's
        parameters go where the config puts them as it is built."""
        with aio.zero.Init(self._settled(), device=self.root_device):
            yield

    def model_to_device(self) -> None:
        """Nothing: the parameters are the engine's, and it moves the buffers."""

    def setup(self, trainer: Any) -> None:
        """The engine, built once from ``configure_optimizers``' optimizer, and
        what Lightning calls and steps in its place."""
        _check_precision(self.precision_plugin)
        if trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(
                f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}: aio.zero clips by the "
                "global norm only (gradient_clip_algorithm='norm')"
            )
        if self.accelerator is not None:
            self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting or self.engine is None:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(self._module())
            self._build_engine(optimizers)
            if fitting:
                self.optimizers = [EngineOptimizer(self.engine, optimizers[0], self._after_step)]
                self.lr_scheduler_configs = schedulers
        self.model = EngineModule(self.engine)
        self.setup_precision_plugin()

    def _build_engine(self, optimizers: list[Any]) -> None:
        if len(optimizers) != 1:
            raise ValueError(
                f"configure_optimizers returned {len(optimizers)} optimizers: aio.zero steps one (give it "
                "several param groups instead)"
            )
        opt = optimizers[0]
        if self.engine is not None:
            _adopt_groups(self.engine, opt)
            return
        module = self._module()
        if not any(g["params"] for g in opt.param_groups):  # configure_optimizers gave none
            params = [p for p in module.parameters() if p.requires_grad]
            opt = torch.optim.SGD(params, lr=0.0) if params else None
        config = engine_config(self._settled())
        check_config(config)
        self.engine = aio.zero.initialize(module, config, optimizer=opt, device=self.root_device)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``engine.backward`` between Lightning's backward hooks."""
        if args or kwargs:
            raise ValueError("aio.zero's backward takes no arguments (retain_graph, ...)")
        module = self._module()
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._window_open = True
        self._require_engine().backward(closure_loss)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _module(self) -> Any:
        module = self.lightning_module
        if module is None:
            raise ValueError("no LightningModule is connected to this AioZeroStrategy yet")
        return module

    def _after_step(self, skipped: bool) -> None:
        self._window_open = False

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise ValueError(
                "the AioZeroStrategy has no engine yet: it is built when fit/validate/test starts"
            )
        if self.engine.closed:
            raise ValueError("this AioZeroStrategy was closed: its engine's parameters are gone")
        return self.engine

    def teardown(self) -> None:
        """Lightning's teardown, but the parameters stay where they are (the
        engine's, for the next stage and for getting the weights out)."""
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def save_pretrained(
        self, save_directory: str, module: Any = None, dtype: Any = None, max_shard_size: int | str = "5GB"
    ) -> list[str]:
        """Write the trained weights to `save_directory` as safetensors shards,
        one tensor at a time (never the model in memory; see
        ``engine.save_pretrained``). `module`: the submodule to write; by
        default the LightningModule's one transformers model when it holds
        exactly one (with its ``config.json``: ``from_pretrained`` loads the
        folder), else the whole LightningModule."""
        engine = self._require_engine()
        if module is None:
            module = _hf_model_in(self.lightning_module)
        return zero_export.save_pretrained(engine, save_directory, dtype, max_shard_size, module=module)

    def close(self) -> None:
        """Close the engine: its swap files and pinned buffers go (save first)."""
        if self.engine is not None:
            self.engine.close()

    # -- checkpoints ----------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: a checkpoint loads into the engine, which setup builds."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """False: the optimizer state comes back with the engine's checkpoint."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the weights are in the engine's checkpoint, never gathered."""
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Empty: the optimizer state is in the engine's checkpoint."""
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A checkpoint directory at `filepath`: the engine's checkpoint and,
        for its tag, Lightning's state through this strategy's CheckpointIO."""
        if storage_options is not None:
            raise TypeError("AioZeroStrategy saves a checkpoint directory: storage_options is not used")
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        directory = os.fspath(filepath)
        if self._window_open:
            # aio.zero saves between optimizer steps (a window's gradients are not
            # checkpointed). ModelCheckpoint asks once mid-window after a resume:
            # the step it would save is the one resumed from.
            warnings.warn(
                f"AioZeroStrategy: no checkpoint written to {directory}: it was asked for in the middle of "
                f"gradient accumulation (global step {self._require_engine().global_steps}); aio.zero saves "
                "between optimizer steps",
                UserWarning,
                stacklevel=2,
            )
            return

        def companion(tag: str) -> None:
            self.checkpoint_io.save_checkpoint(rest, os.path.join(directory, tag + LIGHTNING_SUFFIX))

        save_engine_checkpoint(self._require_engine(), directory, companion, LIGHTNING_SUFFIX)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint directory :meth:`save_checkpoint` wrote into the
        engine (verified whole first) and return Lightning's state."""
        directory = os.fspath(checkpoint_path)
        if not os.path.isdir(directory) or not os.path.lexists(os.path.join(directory, "latest")):
            raise ValueError(
                f"{directory} is not an AioZeroStrategy checkpoint (a directory with a 'latest' file): "
                "resume from one that trainer.save_checkpoint or ModelCheckpoint wrote with this strategy"
            )
        tag = os.path.basename(zero_checkpoint.resolve(directory))
        companion = os.path.join(directory, tag + LIGHTNING_SUFFIX)
        if not os.path.isfile(companion):
            raise ValueError(f"{directory}: the checkpoint {tag} has no {tag + LIGHTNING_SUFFIX} beside it")
        state = self.checkpoint_io.load_checkpoint(companion, weights_only=weights_only)
        self._require_engine().load_checkpoint(directory, tag)
        return dict(state)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the weights into the engine."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the optimizer state."""


def _check_precision(plugin: Any) -> None:
    """32-bit and bf16 autocast work around aio.zero's parameters; the
    plugins that convert the module (bf16-true, 64) or scale the loss with
    torch's GradScaler (16-mixed) do not (fp16: ``fp16.enabled`` in the
    config, with precision 32)."""
    if type(plugin) is Precision:
        return
    if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
        return
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"precision {name!r} is not supported by AioZeroStrategy: use '32-true' or 'bf16-mixed' (the "
        'parameters\' dtype is the config\'s: "bf16"/"fp16": {"enabled": true}, fp16 with its loss scaling)'
    )


def _hf_model_in(module: Any) -> Any:
    """`module` if it is a transformers model, else its one outermost
    transformers submodule if it has exactly one, else `module`."""
    if hasattr(getattr(module, "config", None), "save_pretrained"):
        return module
    found: list[Any] = []

    def walk(m: Any) -> None:
        for child in m.children():
            if hasattr(getattr(child, "config", None), "save_pretrained"):
                found.append(child)
            else:
                walk(child)

    walk(module)
    return found[0] if len(found) == 1 else module


def _adopt_groups(engine: Any, optimizer: Any) -> None:
    """A later stage's ``configure_optimizers`` gave a new optimizer of the
    engine's (a validate before fit, a second fit): the engine reads its
    param groups from now on, so its schedulers apply. Its groups must hold
    the engine's parameters, group for group."""
    mine = engine.optimizer.param_groups
    theirs = optimizer.param_groups
    same = type(optimizer) is engine.optimizer_cls and len(mine) == len(theirs)
    same = same and all(
        len(a["params"]) == len(b["params"])
        and all(p is q for p, q in zip(a["params"], b["params"], strict=True))
        for a, b in zip(mine, theirs, strict=True)
    )
    if not same:
        raise ValueError(
            "configure_optimizers returned an optimizer unlike the one this AioZeroStrategy's engine was "
            "built from (its class or param groups differ): make a new Trainer and AioZeroStrategy"
        )
    engine.optimizer.share_groups(theirs)
