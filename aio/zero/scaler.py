"""Clipping and loss scaling. fp16 loss scaling has DeepSpeed's semantics
(its DynamicLossScaler, step for step): a static scale, or a dynamic one that
halves on an overflow once `hysteresis` overflows have used up the
hysteresis (and then at every overflow until the scale grows again), and
doubles after `loss_scale_window` clean steps since the last overflow,
never below `min_loss_scale`. Gradient clipping scales the step's gradients
so that their global norm is at most ``gradient_clipping``."""

from __future__ import annotations

from typing import Any

from ..config import Fp16Config, TrainConfig


class LossScaler:
    """The loss scale of an fp16 run (``fp16`` config block)."""

    def __init__(self, cfg: Fp16Config) -> None:
        self.cfg = cfg
        self.dynamic = cfg.loss_scale == 0
        self.scale = float(cfg.loss_scale) if not self.dynamic else float(2**cfg.initial_scale_power)
        self.good_steps = 0
        self.hysteresis_left = cfg.hysteresis

    def update(self, overflow: bool) -> None:
        """Record one step's outcome, as DeepSpeed's DynamicLossScaler does; a
        static scale never changes. An overflow halves the scale (not below
        `min_loss_scale`) when the hysteresis left is 1, else uses one up;
        it stays at 1 after halving, so the next overflow halves again. A clean
        step with `loss_scale_window` clean steps before it since the last
        overflow (a multiple of them) doubles the scale and restores the
        hysteresis (every clean step restores it with `consecutive_hysteresis`)."""
        if not self.dynamic:
            return
        cfg = self.cfg
        if overflow:
            if cfg.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2, cfg.min_loss_scale)
            else:
                self.hysteresis_left -= 1
            self.good_steps = 0
            return
        if cfg.consecutive_hysteresis:
            self.hysteresis_left = cfg.hysteresis
        if self.good_steps > 0 and self.good_steps % cfg.loss_scale_window == 0:
            self.hysteresis_left = cfg.hysteresis
            self.scale *= 2
        self.good_steps += 1

    def state_dict(self) -> dict[str, Any]:
        """The scale, clean steps since the last overflow and hysteresis left, as
        plain data for a checkpoint."""
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore a state_dict(); the ``fp16`` settings themselves come from the config."""
        self.scale = float(d["scale"])
        self.good_steps = int(d["good_steps"])
        self.hysteresis_left = int(d["hysteresis_left"])


class StepScale:
    """What one optimizer step applies: `skip` (fp16 overflow), the factor the
    gradients are multiplied by (None: 1), and the unscaled gradient norm."""

    __slots__ = ("skip", "grad_scale", "norm")

    def __init__(self, skip: bool, grad_scale: Any = None, norm: float | None = None) -> None:
        self.skip, self.grad_scale, self.norm = skip, grad_scale, norm


class GradScaling:
    """Gradient clipping (``gradient_clipping``) and fp16 loss scaling."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.clip = cfg.gradient_clipping
        self.scaler = LossScaler(cfg.loss_scale) if cfg.dtype == "fp16" else None

    @property
    def needs_norms(self) -> bool:
        """Whether the step needs the gradients' norm."""
        return self.clip > 0 or self.scaler is not None

    def scale_loss(self, loss: Any, gas: int) -> Any:
        """The loss to back-propagate: times the loss scale, over the accumulation steps."""
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        return loss / gas if gas > 1 else loss

    def for_step(self, norms: list[Any]) -> StepScale:
        """The step's scaling from the per-parameter gradient norms (model order);
        updates the loss scale."""
        import torch

        grad_scale = None
        norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else None
        if self.scaler is not None:
            inv = 1.0 / self.scaler.scale
            overflow = norm is not None and not bool(torch.isfinite(norm))
            self.scaler.update(overflow)
            if overflow:
                return StepScale(True, None, float("inf"))
            if norm is not None:
                norm = norm * inv
            grad_scale = torch.tensor(inv, dtype=torch.float32)
        if self.clip > 0 and norm is not None:
            coef = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
            grad_scale = coef if grad_scale is None else grad_scale * coef
        return StepScale(False, grad_scale, None if norm is None else float(norm))
