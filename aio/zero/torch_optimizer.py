"""``engine.optimizer``: the torch optimizer face of an aio.zero trainer.

The optimizer that really steps lives with the offloaded master weights
(:mod:`.optimizer`, a backend over sub-groups). Users and libraries expect a
``torch.optim.Optimizer`` with ``param_groups``: LR schedulers
(``torch.optim.lr_scheduler``, transformers' ``get_scheduler``) change
``lr`` there, HF scripts read it. :class:`OffloadOptimizer` is that object:
its param groups are the user's (the very list of the optimizer instance
given to ``initialize``, so a scheduler built on either works), and the
trainer copies every group's hyper-parameters into the backend before each
step -- the way torchao's ``CPUOffloadOptimizer`` keeps its param groups.
Anything else asked of it (``stats()``, ``master``...) is the backend's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class OffloadOptimizer(torch.optim.Optimizer):
    """See the module docstring. `param_groups`: the groups to share (an
    optimizer's ``param_groups`` list) or to start from; `defaults`: the
    hyper-parameters of the class that steps; `backend`: the trainer's
    :class:`aio.zero.optimizer.ZeroOptimizer`."""

    def __init__(self, param_groups: list[dict[str, Any]], defaults: dict[str, Any], backend: Any) -> None:
        super().__init__([dict(g) for g in param_groups], dict(defaults))
        self._backend = backend
        self._run_step: Callable[[], None] | None = None

    def share_groups(self, groups: list[dict[str, Any]]) -> None:
        """Use `groups` (another optimizer's ``param_groups`` list) as this one's."""
        self.param_groups = groups

    def hyper(self) -> list[dict[str, Any]]:
        """Every group's values but its parameters, as the backend takes them."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The optimizer step, as ``engine.step()`` runs it at an accumulation
        boundary (calling it directly is an error: there is no gradient to
        step outside the engine's window)."""
        if self._run_step is None:
            raise RuntimeError(
                "aio.zero steps the optimizer inside engine.step() at accumulation boundaries; "
                "call engine.step() instead of engine.optimizer.step()"
            )
        if closure is not None:
            raise ValueError("aio.zero's optimizer takes no closure")
        self._run_step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients never stay on the parameters."""

    def state_dict(self) -> dict[str, Any]:
        """Refused: the optimizer state lives with the offloaded master weights,
        not here; a state dict of this object would silently lack it."""
        raise RuntimeError(
            "engine.optimizer.state_dict() cannot hold aio.zero's offloaded optimizer state; "
            "save it with engine.save_checkpoint() (and load with engine.load_checkpoint())"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refused, as :meth:`state_dict` (it would also stop sharing the param
        groups with the user's optimizer, and its scheduler)."""
        raise RuntimeError(
            "engine.optimizer.load_state_dict() cannot restore aio.zero's offloaded optimizer "
            "state; use engine.load_checkpoint()"
        )

    def __getattr__(self, name: str) -> Any:
        backend = self.__dict__.get("_backend")
        if backend is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(backend, name)


def backend_group_hyper(
    cls: Any, hyper: dict[str, Any], groups: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each group's hyper-parameters for the class that steps (`cls` with
    `hyper`): every key a param group of that class has, with the group's own
    value where the group has one (the user's lr, weight decay, betas... per
    group) and the class's otherwise."""
    probe = cls([torch.zeros(1, requires_grad=True)], **hyper)
    base = {k: v for k, v in probe.param_groups[0].items() if k != "params"}
    return [{k: g.get(k, v) for k, v in base.items()} for g in groups]


def attach_scheduler(scheduler: Any, facade: OffloadOptimizer, user_optimizer: Any) -> Any:
    """The LR scheduler ``initialize(lr_scheduler=...)`` was given, checked:
    one built on `facade` or on the user's optimizer (whose param groups the
    facade shares), or a callable building one from `facade`; None stays None."""
    if scheduler is None:
        return None
    if callable(scheduler) and not hasattr(scheduler, "step"):
        scheduler = scheduler(facade)
    if not hasattr(scheduler, "step") or not hasattr(scheduler, "state_dict"):
        raise TypeError(
            "lr_scheduler must be a torch LR scheduler or a callable building one, "
            f"got {type(scheduler).__name__}"
        )
    on = getattr(scheduler, "optimizer", None)
    if on is not facade and (user_optimizer is None or on is not user_optimizer):
        raise ValueError(
            "lr_scheduler is built on another optimizer: build it on the optimizer passed to "
            "initialize(), on engine.optimizer, or pass a callable taking engine.optimizer"
        )
    return scheduler
