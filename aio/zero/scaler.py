"""fp16 loss scaling, DeepSpeed's semantics: a static scale, or a dynamic one
that halves on overflow (after `hysteresis` overflows) and doubles after
`window` clean steps, never below `min_scale`."""

from __future__ import annotations

from typing import Any

from .config import LossScaleConfig


class LossScaler:
    def __init__(self, cfg: LossScaleConfig) -> None:
        self.cfg = cfg
        self.dynamic = cfg.static == 0
        self.scale = float(cfg.static) if not self.dynamic else float(2**cfg.initial_scale_power)
        self.good_steps = 0
        self.hysteresis_left = cfg.hysteresis

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2, self.cfg.min_scale)
                self.hysteresis_left = self.cfg.hysteresis
            return
        self.good_steps += 1
        if self.good_steps % self.cfg.window == 0:
            self.scale *= 2
            self.hysteresis_left = self.cfg.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.scale = float(d["scale"])
        self.good_steps = int(d["good_steps"])
        self.hysteresis_left = int(d["hysteresis_left"])
