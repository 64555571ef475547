"""Accelerate on aio.zero: :func:`prepare`, for ``accelerate launch`` jobs of
one process.

An Accelerate loop stays as it is; only ``accelerator.prepare`` of the model
and its optimizer becomes ``aio.integrations.accelerate.prepare``::

    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4)
    with aio.zero.Init(config):
        model = AutoModelForCausalLM.from_pretrained(...)  # streamed to the drive
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    scheduler = get_linear_schedule_with_warmup(optimizer, 10, 100)
    model, optimizer, loader, scheduler = prepare(accelerator, config, model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # = the config's gradient_clipping
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    model.engine.save_pretrained("out")  # streamed; model.engine is the aio.zero engine

The model comes back as a module running the engine's forward (Accelerate's
autocast around it), the optimizer as one whose ``step()`` is
``engine.step()``, and this `accelerator`'s ``backward`` and
``clip_grad_norm_`` are the engine's (gradients go to its buffers, never
``.grad``; it clips at its step, by the config's ``gradient_clipping``).
Checkpoints: ``model.engine.save_checkpoint(dir, client_state={...})``
(``accelerator.save_state`` cannot hold the offloaded optimizer state; the
optimizer refuses its ``state_dict()``). Written for Accelerate 1.15.
"""

from __future__ import annotations

from typing import Any

import torch

import aio.zero

from ._engine_faces import (
    EngineModule,
    EngineOptimizer,
    Settler,
    check_config,
    default_torch_adam_bits,
    engine_config,
    read_config,
)


def resolve_config(config: Any, accelerator: Any) -> dict[str, Any]:
    """The DeepSpeed-format `config` for a run of `accelerator`:
    ``gradient_accumulation_steps`` (``"auto"`` or absent) takes its
    ``gradient_accumulation_steps`` and a number written there must equal
    it; ``aio_zero.adam_sqrt`` defaults to ``torch`` (torch's Adam bits)."""
    data = read_config(config)
    s = Settler(data, "the Accelerator")
    steps = int(accelerator.gradient_accumulation_steps)
    s.put("gradient_accumulation_steps", steps, "gradient_accumulation_steps")
    s.check()
    default_torch_adam_bits(data)
    return data


def prepare(accelerator: Any, config: Any, model: Any, optimizer: Any, *rest: Any) -> tuple[Any, ...]:
    """Build the aio.zero engine of `model` (built under ``aio.zero.Init``, or
    in memory) and `optimizer` (a torch optimizer over its parameters; its
    param groups and any scheduler on it are honoured) from the
    DeepSpeed-format `config`, and wire it into `accelerator` (see the module
    docstring). Returns ``(model, optimizer, *accelerator.prepare(*rest))``:
    pass the data loaders and LR schedulers as `rest`."""
    if accelerator.num_processes != 1 or getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        raise ValueError(
            "aio.zero trains in one process without DeepSpeed: accelerate launch --num_processes 1 "
            "(for several processes, DeepSpeed on aio's I/O: AIO_DEEPSPEED=1, docs/deepspeed.md)"
        )
    data = resolve_config(config, accelerator)
    check_config(data)
    engine = aio.zero.initialize(model, engine_config(data), optimizer=optimizer, device=accelerator.device)
    wired = _Wiring(accelerator, engine)
    face = EngineOptimizer(engine, optimizer, wired.after_step)
    # Not placed: Accelerate's placement round-trips a state dict this optimizer refuses to give.
    wired.optimizer = accelerator.prepare(face, device_placement=[False])
    module = accelerator.prepare_model(EngineModule(engine), device_placement=False, evaluation_mode=True)
    others = accelerator.prepare(*rest) if rest else ()
    others = others if isinstance(others, tuple) else (others,)
    return (module, wired.optimizer, *others)


class _Wiring:
    """What `prepare` changes on the user's Accelerator: backward and
    clip_grad_norm_ go to the engine, and a step skipped for fp16 overflow
    is reported where Accelerate's scheduler looks (its optimizer)."""

    def __init__(self, accelerator: Any, engine: Any) -> None:
        self.accelerator = accelerator
        self.engine = engine
        self.optimizer: Any = None
        self.norm: torch.Tensor | None = None
        accelerator.scaler = None  # the engine scales fp16 losses itself (DeepSpeed's scaler)
        accelerator.backward = self.backward
        accelerator.clip_grad_norm_ = self.clip_grad_norm_

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if kwargs:
            raise ValueError(f"aio.zero's backward takes no arguments, got {sorted(kwargs)}")
        steps = self.accelerator.gradient_accumulation_steps  # as Accelerate divides the loss
        self.engine.backward(loss / steps if steps != 1 else loss)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        clip = self.engine.cfg.gradient_clipping
        if float(norm_type) != 2.0 or float(max_norm) != clip:
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}): aio.zero clips by the 2-norm "
                f"at its step, by the config's gradient_clipping ({clip}); set gradient_clipping: {max_norm}"
            )
        # The norm is known once the engine has stepped: filled in then.
        self.norm = torch.full((), float("nan"))
        return self.norm

    def after_step(self, skipped: bool) -> None:
        if self.optimizer is not None and hasattr(self.optimizer, "_is_overflow"):
            self.optimizer._is_overflow = skipped  # AcceleratedScheduler skips its step then
        if self.norm is not None and self.engine.last_grad_norm is not None:
            self.norm.fill_(self.engine.last_grad_norm)
            self.norm = None
