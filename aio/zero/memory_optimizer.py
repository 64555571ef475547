"""The optimizer side of the trainer when ``offload_optimizer.device`` is
``cpu`` or ``none``: the same sub-group layout and step as
:class:`aio.swap.OptimizerSwapper`, with everything in CPU memory."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from .._args import mismatched
from ..swap.param_groups import TorchGroups
from ..swap.storage import checkpoint_dir, load_plain, require_complete, save_plain
from .malloc import long_lived_zeros
from .optimizer import GradientBuffer, PendingWrite, set_lr


class MemoryOptimizer:
    """A :class:`aio.zero.optimizer.ZeroOptimizer` with master weights,
    gradients and optimizer state in CPU memory."""

    def __init__(
        self, optimizer_cls: Any, hyper: dict[str, Any], group_hyper: list[dict[str, Any]] | None = None
    ) -> None:
        self.optimizer_cls = optimizer_cls
        self.hyper = dict(hyper)
        self.torch_groups = TorchGroups(group_hyper)
        self.master: dict[int, Any] = {}
        self.grads: dict[int, Any] = {}
        self.proxies: dict[int, Any] = {}
        self.optimizer: Any = None
        self.steps = 0

    def register_subgroup(self, index: int, numel: int, group: int = 0) -> None:
        """Allocate sub-group `index`: `numel` fp32 master weights (zeros) and a
        gradient buffer of the same size; it steps with param group `group`."""
        import torch

        self.torch_groups.add(index, group)
        self.master[index] = long_lived_zeros(numel)
        self.grads[index] = long_lived_zeros(numel)
        self.proxies[index] = torch.nn.Parameter(self.master[index])

    def initialize(self, index: int, master: Any) -> None:
        """Set sub-group `index`'s master weights from `master` (copied, flattened, converted to fp32)."""
        self.master[index].copy_(master.detach().reshape(-1))

    def initialize_many(self, fills: Iterable[tuple[int, Callable[[Any], Any]]]) -> None:
        """For each (index, fill): ``fill(master)`` writes sub-group `index`'s
        fp32 master weights into its tensor in place."""
        for index, fill in fills:
            fill(self.master[index])

    def initialize_from(self, index: int, source: Callable[[Any], list[Any]]) -> bool:
        """False: master weights in memory are set at once (initialize_many())."""
        return False

    def reserve_memory(self, background: bool = False) -> None:
        """Nothing to do: register_subgroup() allocated every gradient."""

    def update_master(self, index: int, edit: Callable[[Any], Any]) -> None:
        """``edit(master)`` changes sub-group `index`'s fp32 master weights in place."""
        edit(self.master[index])

    def try_open_gradient(self, index: int, numel: int, resume: bool) -> GradientBuffer | None:
        """open_gradient(): a buffer in memory is always free, so never None."""
        return self.open_gradient(index, numel, resume)

    def open_gradient(self, index: int, numel: int, resume: bool) -> GradientBuffer:
        """The sub-group's own gradient tensor, accumulated into in place (its
        contents unspecified unless `resume`: the caller writes every element)."""
        return GradientBuffer(self.grads[index])

    def close_gradient(self, index: int, buf: GradientBuffer) -> PendingWrite | None:
        """Nothing to store: the gradient already is where step() reads it; always None."""
        return None  # already where step() reads it

    def discard_gradients(self) -> None:
        """Nothing in flight: the next window writes every buffer afresh."""

    def master_extent(self, index: int) -> None:
        """None: the master weights are in memory, on no drive."""
        return None

    def flush(self) -> None:
        """Nothing to write: the state is in memory."""

    def set_lr(self, lr: float) -> None:
        """The learning rate of every param group from the next step on."""
        set_lr(self.hyper, self.optimizer, lr, self.torch_groups)

    def set_group_hyper(self, values: list[dict[str, Any]]) -> None:
        """Param group k's hyper-parameters from `values[k]` from the next step on."""
        self.torch_groups.update(self.optimizer, values)

    def io_bytes(self) -> int:
        """Always 0: nothing goes to a drive."""
        return 0

    def io_bytes_by_part(self) -> dict[str, dict[str, int]]:
        """Nothing per part either: nothing goes to a drive."""
        return {"read": {}, "written": {}}

    def _ensure_optimizer(self) -> None:
        if self.optimizer is None:
            self.optimizer = self.optimizer_cls(self.torch_groups.build(self.proxies), **self.hyper)

    def step(
        self,
        after: Callable[[int, Any], None] | None = None,
        grad_scale: Any = None,
        lowp: dict[int, Any] | None = None,
    ) -> None:
        """One optimizer step over every sub-group at once. Each gradient is first
        multiplied by `grad_scale` (when given; in the update's pass with
        aio.optim's Adam, else in place); each sub-group index in `lowp` gets
        its updated master weights rounded into that bfloat16/float16 tensor
        (in the same pass with aio.optim's Adam, else copied); then `after(index,
        master)` runs for each sub-group, in index order, with its updated fp32
        master weights (the live tensor: copy it to keep it). The torch optimizer is
        created at the first step."""
        from ..optim import step_scaled

        self._ensure_optimizer()
        order = sorted(self.proxies)
        for i in order:
            self.proxies[i].grad = self.grads[i]
        lowp_out = {self.proxies[i]: t for i, t in (lowp or {}).items()}
        step_scaled(self.optimizer, [self.grads[i] for i in order], grad_scale, lowp_out)
        self.steps += 1  # stepped, whatever `after` then raises
        for i in order:
            self.proxies[i].grad = None
        if after is not None:
            for i in order:
                after(i, self.master[i])

    def export_checkpoint(self, directory: str) -> None:
        """Write the master weights, the torch optimizer state and the step count to
        ``directory/optimizer.pt``, durably, with a ``complete`` marker; `directory`
        must not exist or be empty (FileExistsError)."""
        self._ensure_optimizer()
        with checkpoint_dir(directory) as tmp:
            save_plain(
                {"master": self.master, "optimizer": self.optimizer.state_dict(), "steps": self.steps},
                os.path.join(tmp, "optimizer.pt"),
                "the optimizer state",
            )

    def verify_checkpoint(self, directory: str) -> dict[str, Any]:
        """Load and check a checkpoint without changing anything (tensors and
        plain data only: a tampered file cannot run code)."""
        import torch

        require_complete(directory)
        saved = load_plain(os.path.join(directory, "optimizer.pt"))
        if not isinstance(saved, dict) or not isinstance(saved.get("master"), dict):
            raise ValueError(f"{directory}: optimizer.pt is not an aio.zero optimizer checkpoint")
        masters = saved["master"]
        if set(masters) != set(self.master) or any(
            not torch.is_tensor(masters[i]) or masters[i].dtype != t.dtype or masters[i].shape != t.shape
            for i, t in self.master.items()
        ):
            raise ValueError(f"{directory}: optimizer sub-groups do not match this model")
        opt_state = saved.get("optimizer")
        if (
            not isinstance(opt_state, dict)
            or not isinstance(opt_state.get("param_groups"), list)
            or not all(isinstance(g, dict) for g in opt_state["param_groups"])
            or not isinstance(opt_state.get("state"), dict)
            or not isinstance(saved.get("steps"), int)
        ):
            raise ValueError(f"{directory}: optimizer.pt has no optimizer state or step count")
        self._check_optimizer_state(directory, opt_state)
        return saved

    def _check_optimizer_state(self, directory: str, opt_state: dict[str, Any]) -> None:
        """ValueError unless the saved torch optimizer state fits this one: its
        groups' parameter counts and hyper-parameters' kinds, and each state
        entry a dict of scalars and tensors (of its parameter's shape) by name."""
        import torch

        current = self._optimizer().param_groups
        groups = opt_state["param_groups"]
        if [len(pg.get("params", ())) for pg in groups] != [len(pg["params"]) for pg in current]:
            raise ValueError(f"{directory}: the optimizer's parameter groups do not match this model")
        shapes: dict[Any, Any] = {}
        for now, got in zip(current, groups, strict=True):
            if mismatched(now, got):
                raise ValueError(f"{directory}: a parameter group's hyper-parameters are of another kind")
            shapes.update(zip(got["params"], (p.shape for p in now["params"]), strict=True))
        for key, st in opt_state["state"].items():
            ok = key in shapes and isinstance(st, dict)
            ok = ok and all(
                isinstance(v, (int, float))
                or (torch.is_tensor(v) and (v.dim() == 0 or v.shape == shapes[key]))
                for v in st.values()
            )
            if not ok:
                raise ValueError(f"{directory}: optimizer.pt's state for parameter {key!r} does not fit it")

    def apply_checkpoint(self, directory: str, verified: dict[str, Any]) -> None:
        """Load a checkpoint verify_checkpoint() accepted."""
        self._optimizer().load_state_dict(verified["optimizer"])
        for i, t in verified["master"].items():
            self.master[i].copy_(t)
        self.steps = verified["steps"]

    def _optimizer(self) -> Any:
        self._ensure_optimizer()
        return self.optimizer

    def pinned_bytes(self) -> int:
        """Always 0: nothing here is page-locked."""
        return 0

    def memory_bytes(self) -> int:
        """CPU bytes held: fp32 master weights and gradients (8 bytes per element)
        plus the torch optimizer's state tensors (none before the first step)."""
        n = sum(t.numel() for t in self.master.values())
        states = sum(
            t.numel() * t.element_size()
            for st in (self.optimizer.state.values() if self.optimizer else [])
            for t in st.values()
            if hasattr(t, "numel")
        )
        return n * 8 + states

    def stats(self) -> dict[str, Any]:
        """``subgroups``, ``steps`` taken and ``memory_bytes``."""
        return {"subgroups": len(self.master), "steps": self.steps, "memory_bytes": self.memory_bytes()}

    def close(self) -> None:
        """Drop every tensor and the torch optimizer; no use afterwards."""
        self.master.clear()
        self.grads.clear()
        self.proxies.clear()
        self.optimizer = None
