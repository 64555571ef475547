"""The optimizer side of the engine when ``offload_optimizer.device`` is
``cpu`` or ``none``: the same sub-group layout and step as
:class:`aio.swap.OptimizerSwapper`, with everything in CPU memory."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..swap.storage import checkpoint_dir


class MemoryOptimizer:
    def __init__(self, optimizer_cls: Any, hyper: dict[str, Any]) -> None:
        self.optimizer_cls = optimizer_cls
        self.hyper = dict(hyper)
        self.master: dict[int, Any] = {}
        self.grads: dict[int, Any] = {}
        self.proxies: dict[int, Any] = {}
        self.optimizer: Any = None
        self.steps = 0

    def register_subgroup(self, index: int, numel: int) -> None:
        import torch

        self.master[index] = torch.zeros(numel, dtype=torch.float32)
        self.grads[index] = torch.zeros(numel, dtype=torch.float32)
        self.proxies[index] = torch.nn.Parameter(self.master[index])

    def initialize(self, index: int, master: Any) -> None:
        self.master[index].copy_(master.detach().reshape(-1))

    def _ensure_optimizer(self) -> None:
        if self.optimizer is None:
            self.optimizer = self.optimizer_cls([self.proxies[i] for i in sorted(self.proxies)], **self.hyper)

    def step(self, after: Callable[[int, Any], None] | None = None, grad_scale: Any = None) -> None:
        self._ensure_optimizer()
        for i in sorted(self.proxies):
            if grad_scale is not None:
                self.grads[i].mul_(grad_scale)
            self.proxies[i].grad = self.grads[i]
        self.optimizer.step()
        for i in sorted(self.proxies):
            self.proxies[i].grad = None
            if after is not None:
                after(i, self.master[i])
        self.steps += 1

    def read_master(self, index: int) -> Any:
        return self.master[index].clone()

    def export_checkpoint(self, directory: str) -> None:
        import torch

        self._ensure_optimizer()
        with checkpoint_dir(directory) as tmp:
            torch.save(
                {"master": self.master, "optimizer": self.optimizer.state_dict(), "steps": self.steps},
                os.path.join(tmp, "optimizer.pt"),
            )

    def import_checkpoint(self, directory: str) -> None:
        import torch

        saved = torch.load(os.path.join(directory, "optimizer.pt"), weights_only=False)
        if set(saved["master"]) != set(self.master) or any(
            saved["master"][i].shape != self.master[i].shape for i in self.master
        ):
            raise ValueError(f"{directory}: optimizer sub-groups do not match this model")
        for i, t in saved["master"].items():
            self.master[i].copy_(t)
        self._ensure_optimizer()
        self.optimizer.load_state_dict(saved["optimizer"])
        self.steps = saved["steps"]

    def pinned_bytes(self) -> int:
        return 0

    def memory_bytes(self) -> int:
        n = sum(t.numel() for t in self.master.values())
        states = sum(
            t.numel() * t.element_size()
            for st in (self.optimizer.state.values() if self.optimizer else [])
            for t in st.values()
            if hasattr(t, "numel")
        )
        return n * 8 + states

    def stats(self) -> dict[str, Any]:
        return {"subgroups": len(self.master), "steps": self.steps, "memory_bytes": self.memory_bytes()}

    def close(self) -> None:
        self.master.clear()
        self.grads.clear()
        self.proxies.clear()
        self.optimizer = None
