"""The Hugging Face Trainer on aio.zero: :class:`AioZeroTrainer`.

``AioZeroTrainer(model=..., args=..., aio_config=ds_config, ...)`` is a
``transformers.Trainer`` whose model -- built under ``aio.zero.Init`` or
loaded with ``from_pretrained`` under it -- trains with its parameters and
optimizer state where the DeepSpeed-format config puts them (the drive, or
CPU memory), in this one process. Everything else is the Trainer's:
``TrainingArguments`` decide the optimizer (``optim``, ``learning_rate``,
the betas, ``weight_decay`` on every weight but biases and norms), the LR
schedule (``lr_scheduler_type``, warm-up), gradient accumulation, clipping
(``max_grad_norm``), bf16 autocast, logging, evaluation, ``save_steps``
checkpoints and ``resume_from_checkpoint``; ``save_model`` writes the
weights streamed (``engine.save_pretrained``: one tensor at a time, never
the model in memory) for ``from_pretrained``. In fp32 the losses are the
same Trainer's in memory, bit for bit (tests/integrations/test_hf_trainer.py).

Written for transformers 5.24 (accelerate 1.15). The Trainer methods
overridden, and why:

- ``create_accelerator_and_postprocess``: route ``accelerator.backward``
  (``training_step``'s one backward per micro-batch) to ``engine.backward``
  and drop torch's GradScaler: gradients go to aio's buffers, never
  ``.grad``, and fp16 loss scaling is the engine's (DeepSpeed's semantics);
- ``_move_model_to_device``: the parameters are the engine's (it puts module
  buffers on the device itself);
- ``create_optimizer``: the Trainer's optimizer (its param groups), then the
  engine built from it; the Trainer holds an
  :class:`~aio.integrations._engine_faces.EngineOptimizer` whose ``step()``
  is ``engine.step()`` (wrapped by Accelerate as usual); the LR scheduler
  stays the Trainer's, and a step the engine skips for fp16 overflow is
  reported where the Trainer looks before stepping it;
- ``_wrap_model``: the module the Trainer calls runs the engine's forward
  (Accelerate's autocast around it, as around a model in memory);
- ``_clip_grad_norm`` / ``_get_grad_norm``: the engine clips; the logged
  ``grad_norm`` is its norm;
- ``_save`` (what ``save_model`` calls), ``_save_optimizer_and_scheduler``,
  ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
  ``_load_best_model``: checkpoints hold the streamed weights
  (``model.safetensors``, loadable with ``from_pretrained``) and aio.zero's
  own checkpoint (``global_stepN/`` + ``latest``, DeepSpeed's layout;
  ``aio-export`` reads it) beside the Trainer's ``scheduler.pt``,
  ``rng_state.pth`` and ``trainer_state.json``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import transformers

import aio.zero

from ..config import load_train_config
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

SCHEDULER_NAME = "scheduler.pt"  # the Trainer's file names (transformers.trainer)
TRAINING_ARGS_NAME = "training_args.bin"

_HIDDEN_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


def _hidden_size(model: Any) -> int | None:
    """The model's hidden size as the Trainer's DeepSpeed integration reads it
    (`model`: a model or its config)."""
    cfg = getattr(model, "config", model)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if isinstance(getattr(c, "hidden_size", None), int):
            return int(c.hidden_size)
        if getattr(c, "hidden_sizes", None):
            return int(max(c.hidden_sizes))
    return None


def _fill_hidden_sizes(data: dict[str, Any], model: Any) -> None:
    """The three ZeRO keys the Trainer fills from the hidden size, as it does."""
    zero = data.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    autos = [k for k in _HIDDEN_KEYS if str(zero.get(k.split(".")[1], "")).strip().lower() == "auto"]
    if not autos:
        return
    h = _hidden_size(model) if model is not None else None
    if h is None:
        raise ValueError(
            f"{', '.join(autos)} are 'auto', filled from the model's hidden size: pass model= "
            "(the model or its config) to resolve_config, or write numbers there"
        )
    values = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h)}
    values["stage3_param_persistence_threshold"] = 10 * h
    for k in autos:
        zero[k.split(".")[1]] = values[k.split(".")[1]]


def resolve_config(config: Any, args: Any, model: Any = None) -> dict[str, Any]:
    """The DeepSpeed-format `config` (a dict, JSON path or JSON text) for an
    :class:`AioZeroTrainer` run with TrainingArguments `args`: every
    ``"auto"`` the Trainer fills for DeepSpeed filled the same way (batch
    sizes, ``gradient_accumulation_steps``, ``gradient_clipping`` from
    ``max_grad_norm``, the optimizer block's lr/betas/eps/weight decay,
    ``fp16``/``bf16.enabled`` from ``args.fp16``/``args.bf16``, and from
    `model`'s hidden size the three ZeRO bucket keys); absent accumulation
    and clipping keys take the arguments' values; ``aio_zero.adam_sqrt``
    defaults to ``torch`` (torch's Adam bits). A number that disagrees with
    the arguments is a ValueError naming both. Build the model under
    ``aio.zero.Init(resolve_config(...))``: the trainer resolves the same."""
    data = read_config(config)
    s = Settler(data, "the TrainingArguments")
    batch = args.per_device_train_batch_size
    s.put("train_micro_batch_size_per_gpu", batch, "per_device_train_batch_size", absent=False)
    total = args.world_size * batch * args.gradient_accumulation_steps
    s.put("train_batch_size", total, "world size x batch x accumulation", absent=False)
    s.put("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    s.put("gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm")
    if isinstance(data.get("optimizer"), dict):
        s.put("optimizer.params.lr", args.learning_rate, "learning_rate")
        s.put("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1, adam_beta2")
        s.put("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
        s.put("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    # The parameters' dtype: "auto" follows the arguments, as for DeepSpeed; a
    # dtype written there stands (the Trainer's bf16 autocast runs either way).
    s.put("fp16.enabled", bool(args.fp16), "fp16", absent=False, match=False)
    s.put("bf16.enabled", bool(args.bf16), "bf16", absent=False, match=False)
    s.check()
    _fill_hidden_sizes(data, model)
    if "scheduler" in data:
        raise ValueError(
            "the config has a 'scheduler' block: under AioZeroTrainer the LR schedule is the Trainer's "
            "(lr_scheduler_type, warmup_steps, lr_scheduler_kwargs in TrainingArguments); remove the block"
        )
    default_torch_adam_bits(data)
    return data


class AioZeroTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains on aio.zero (see the module
    docstring). `aio_config`: the DeepSpeed-format config (dict, JSON path or
    JSON text; its ``"auto"`` values are filled as :func:`resolve_config`
    does). Every other argument is the Trainer's. ``self.engine`` is the
    :class:`aio.zero.OffloadTrainer` once training (or evaluation) starts;
    :meth:`close` lets its swap files and buffers go."""

    def __init__(
        self, model: Any = None, args: Any = None, *rest: Any, aio_config: Any, **kwargs: Any
    ) -> None:
        if args is not None and getattr(args, "deepspeed", None):
            raise ValueError(
                "AioZeroTrainer trains with aio.zero, not DeepSpeed: pass the DeepSpeed-format config as "
                "aio_config= and leave TrainingArguments(deepspeed=...) unset"
            )
        if kwargs.get("model_init") is not None:
            raise ValueError(
                "AioZeroTrainer takes a built model: build it under aio.zero.Init (or load it with "
                "from_pretrained under Init) and pass model=, not model_init="
            )
        self.engine: Any = None
        self._engine_optimizer: EngineOptimizer | None = None
        self._engine_module: Any = None
        self._module_prepared = False
        self._grad_norm: torch.Tensor | None = None
        super().__init__(model, args, *rest, **kwargs)
        if self.args.world_size > 1:
            raise ValueError(
                f"AioZeroTrainer runs in one process (world size {self.args.world_size}); for several "
                "processes use DeepSpeed on aio's I/O (AIO_DEEPSPEED=1, docs/deepspeed.md)"
            )
        self.aio_config = resolve_config(aio_config, self.args, self.model)
        _check_precision(self.aio_config, self.args)
        check_config(self.aio_config)

    # -- the engine in the Trainer's loop ------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, with ``backward`` routed to the engine and
        no GradScaler (see the module docstring)."""
        super().create_accelerator_and_postprocess()
        self.accelerator.scaler = None
        self.accelerator.backward = self._engine_backward

    def _engine_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if kwargs.get("learning_rate") is not None:
            raise ValueError("LOMO optimizers step inside backward(), which aio.zero's engine does not do")
        steps = self.accelerator.gradient_accumulation_steps  # the Trainer sets 1: it divides itself
        self._require_engine().backward(loss / steps if steps != 1 else loss)

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """Nothing: the parameters are the engine's, and it moves the buffers."""

    def create_optimizer(self, model: Any = None) -> Any:
        """The Trainer's optimizer -- ``optim`` and its arguments, or the config's
        ``optimizer`` block's class -- over the Trainer's param groups (no
        weight decay on biases and norms), then the engine built from it."""
        if self.engine is not None:
            return self.optimizer
        if (
            self.optimizer is None
            and self.optimizer_cls_and_kwargs is None
            and "optimizer" in self.aio_config
        ):
            cfg = load_train_config(engine_config(self.aio_config))
            self.optimizer_cls_and_kwargs = (cfg.optimizer_class(), dict(cfg.optimizer_params))
        user = super().create_optimizer(self.model)
        with warnings.catch_warnings():
            # The config's optimizer block chose the class above; its values are the arguments'.
            warnings.filterwarnings("ignore", message="both optimizer= and a config 'optimizer' block")
            self.engine = aio.zero.initialize(
                self.model, engine_config(self.aio_config), optimizer=user, device=self.args.device
            )
        self._engine_optimizer = EngineOptimizer(self.engine, user, self._after_engine_step)
        # Wrapped for the Trainer now, without Accelerate's device placement,
        # which round-trips the state dict this optimizer refuses to give;
        # the Trainer's own prepare() then takes it as it is.
        self.optimizer = self.accelerator.prepare(self._engine_optimizer, device_placement=[False])
        self._engine_module = EngineModule(self.engine)
        return self.optimizer

    def _after_engine_step(self, skipped: bool) -> None:
        # The Trainer skips its scheduler step when Accelerate's optimizer says
        # its step was skipped (fp16 overflow); this is where it looks.
        wrapped: Any = self.optimizer
        if wrapped is not self._engine_optimizer and hasattr(wrapped, "_is_overflow"):
            wrapped._is_overflow = skipped
        if self._grad_norm is not None and self.engine.last_grad_norm is not None:
            self._grad_norm.fill_(self.engine.last_grad_norm)

    def _require_engine(self) -> Any:
        if self.engine is None:
            self.create_optimizer()
        if self.engine.closed:
            raise ValueError("this AioZeroTrainer was closed: its engine's parameters are gone")
        return self.engine

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        self._require_engine()
        if not self._module_prepared:
            # Autocast (bf16) and fp32 outputs as for a model in memory; no
            # device move (the engine's) and no DDP or compile (one process).
            self._engine_module = self.accelerator.prepare_model(
                self._engine_module, device_placement=False, evaluation_mode=True
            )
            self._module_prepared = True
        return self._engine_module

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        # The engine clips at its step, from the norms it took as gradients
        # arrived; the Trainer logs this tensor after the step, filled then.
        self._grad_norm = torch.full((), float("nan"))
        return self._grad_norm

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        return grad_norm  # None without clipping: the engine takes no norm then

    # -- checkpoints and the weights -------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        """``save_model``: the weights streamed in Hugging Face's layout (plus
        the processing class and the training arguments, as the Trainer)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if output_dir is None:
            raise ValueError("save_model() needs an output_dir (TrainingArguments.output_dir is None)")
        if not self.args.should_save:
            return
        if state_dict is not None:
            raise ValueError("AioZeroTrainer saves the engine's weights; it takes no state_dict")
        os.makedirs(output_dir, exist_ok=True)
        self._require_engine().save_pretrained(output_dir)
        tokenizer = getattr(self.data_collator, "tokenizer", None)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # output_dir/global_stepN and latest, DeepSpeed's layout (a resumed run
        # saving a step again replaces the folder's older one)
        save_engine_checkpoint(self._require_engine(), output_dir)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # train() calls this before the engine exists; the weights come back with
        # the optimizer state from the engine's checkpoint, in
        # _load_optimizer_and_scheduler, which it calls once the engine is built.
        if not os.path.isfile(os.path.join(resume_from_checkpoint, "latest")):
            raise ValueError(
                f"{resume_from_checkpoint} holds no aio.zero checkpoint (no 'latest' file): resume from a "
                "checkpoint an AioZeroTrainer saved with save_only_model=False"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._require_engine().load_checkpoint(checkpoint)  # verified whole before anything changes
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(sched) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        self._require_engine().load_checkpoint(best)

    def close(self) -> None:
        """Close the engine: its swap files and pinned buffers go (save first)."""
        if self.engine is not None:
            self.engine.close()


def _check_precision(data: dict[str, Any], args: Any) -> None:
    """fp16 autocast needs loss scaling, which aio.zero applies with fp16
    parameters (``fp16.enabled``); other mixes of the Trainer's autocast
    with the config's parameter dtype are fine."""
    fp16 = isinstance(data.get("fp16"), dict) and data["fp16"].get("enabled") is True
    bf16 = isinstance(data.get("bf16"), dict) and data["bf16"].get("enabled") is True
    if args.fp16 and not fp16:
        raise ValueError(
            "TrainingArguments(fp16=True) needs loss scaling, which aio.zero applies to fp16 parameters: "
            'set "fp16": {"enabled": true} (or "auto") in the config, or train with bf16=True'
        )
    if args.bf16 and fp16:
        raise ValueError(
            'TrainingArguments(bf16=True) with "fp16": {"enabled": true} in the config: pick one'
        )
    if args.fp16 and bf16:
        raise ValueError(
            'TrainingArguments(fp16=True) with "bf16": {"enabled": true} in the config: pick one'
        )
