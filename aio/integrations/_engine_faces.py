"""What the training frameworks hold of an aio.zero engine, and the config
they share with it (used by :mod:`aio.integrations.transformers`,
:mod:`aio.integrations.lightning` and :mod:`aio.integrations.accelerate`).

A framework owns the loop: it calls a module, back-propagates, steps an
optimizer at the end of each accumulation window, clips at its own flag.
aio.zero's engine (:class:`aio.zero.OffloadTrainer`) does all of that
itself, so the integrations hand the framework

- :class:`EngineModule`: a module whose forward is the engine's (parameters
  fetched module by module);
- :class:`EngineOptimizer`: a ``torch.optim.Optimizer`` sharing the engine's
  param groups, whose ``step()`` is ``engine.step()``;

and build the engine with ``gradient_accumulation_steps: 1``: the framework
divides each micro-batch's loss itself and calls ``step()`` once per window,
and the engine adds every ``backward()`` before a step into the window's
gradients, as torch sums into ``.grad``. Clipping stays the engine's
(``gradient_clipping``, the framework's value), applied from the norms it
takes as gradients arrive: there is no ``.grad`` for the framework to clip.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..config import load_train_config
from ..config.load import read_config_data


def read_config(config: Any) -> dict[str, Any]:
    """A deep copy of the DeepSpeed-format `config` (a dict, a JSON path or
    JSON text) as a dict, to fill in without touching the caller's."""
    data, _where = read_config_data(config)
    return copy.deepcopy(dict(data))


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.strip().lower() == "auto"


def _same(a: Any, b: Any) -> bool:
    """Config value `a` equals the framework's `b` (a JSON list equals a tuple)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):  # true is not 1 here
        return a is b
    return bool(a == b)


class Settler:
    """Fills a config's keys from a framework's settings: an ``"auto"`` (or,
    where asked, an absent key) takes the framework's value; a value written
    in the config must equal it, else it is listed and :meth:`check` raises
    one ValueError naming every such key."""

    def __init__(self, data: dict[str, Any], framework: str) -> None:
        self.data = data
        self.framework = framework
        self.mismatches: list[str] = []

    def node(self, path: str, create: bool) -> tuple[dict[str, Any] | None, str]:
        """The dict holding the last key of dotted `path` (created when
        `create`, else None where a level is missing), and that key."""
        *parents, key = path.split(".")
        node: Any = self.data
        for p in parents:
            if not isinstance(node, dict):
                return None, key
            if p not in node and create:
                node[p] = {}
            node = node.get(p)
        return (node if isinstance(node, dict) else None), key

    def put(self, path: str, value: Any, source: str, absent: bool = True, match: bool = True) -> None:
        """Settle `path` on `value`, which the framework's `source` gives;
        `absent`: also write it where the config does not have the key;
        `match`: a value written there must equal it (else it stays)."""
        node, key = self.node(path, create=absent)
        if node is None:
            return
        if key not in node:
            if absent:
                node[key] = value
            return
        if _is_auto(node[key]):
            node[key] = value
        elif match and not _same(node[key], value):
            self.mismatches.append(f"{path}={node[key]!r} but {source}={value!r}")

    def check(self) -> None:
        """Raise the mismatches found, if any."""
        if self.mismatches:
            raise ValueError(
                f"the aio.zero config disagrees with {self.framework}: "
                + "; ".join(self.mismatches)
                + f'. {self.framework} decide these: write the same value in the config, or "auto"'
            )


def engine_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """The config the engine is built with under a framework: `data` (already
    settled) with ``gradient_accumulation_steps: 1`` (the framework runs the
    window, see the module docstring)."""
    out = copy.deepcopy(dict(data))
    out["gradient_accumulation_steps"] = 1
    return out


def default_torch_adam_bits(data: dict[str, Any]) -> None:
    """``aio_zero.adam_sqrt: torch`` unless the config says: a framework's
    optimizer is a torch class, so its step gives torch's bits (the same
    losses as the framework's run in memory; see docs/zero.md)."""
    block = data.setdefault("aio_zero", {})
    if isinstance(block, dict):
        block.setdefault("adam_sqrt", "torch")


def check_config(data: Mapping[str, Any]) -> None:
    """Every problem of the engine's config now (a ConfigError naming its
    keys), before the framework starts a run that would fail at its first step."""
    load_train_config(engine_config(data))


class EngineModule(torch.nn.Module):
    """The module a framework calls in place of the model: its forward is the
    engine's, which fetches each module's parameters as it runs. The model
    is its submodule ``module`` (``train()``/``eval()`` reach it)."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.module = engine.module
        self.engine = engine  # not a Module: a plain attribute

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward through the engine."""
        return self.engine(*args, **kwargs)

    def _get_name(self) -> str:
        # What frameworks show and test (transformers picks the causal-LM
        # label smoothing by it): the model's name, not this wrapper's.
        name: str = self.module._get_name()
        return name


class EngineOptimizer(torch.optim.Optimizer):
    """The optimizer a framework steps: ``step(closure)`` runs the closure
    (forward and backward, as torch's optimizers do), then ``engine.step()``,
    the optimizer step over the window's gradients. Its ``param_groups`` are
    the engine's (the user's optimizer's list), so schedulers on either are
    read at every step. `user_optimizer`: the optimizer the engine was built
    from (a scheduler built on it is told its optimizer stepped).
    `after_step(skipped)`: called after each step, with whether fp16
    overflow skipped it."""

    def __init__(
        self, engine: Any, user_optimizer: Any = None, after_step: Callable[[bool], None] | None = None
    ) -> None:
        groups = engine.optimizer.param_groups
        super().__init__([{"params": list(g["params"])} for g in groups], dict(engine.optimizer.defaults))
        self.param_groups = groups
        self.engine = engine
        self.user_optimizer = user_optimizer
        self.after_step = after_step
        self.step_was_skipped = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The closure (if any), then the engine's optimizer step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skipped = self.engine.skipped_steps
        self.engine.step()
        self.step_was_skipped = self.engine.skipped_steps != skipped
        if self.user_optimizer is not None:
            # torch's schedulers warn unless their optimizer's step() ran; it
            # never does (the engine stepped for it), as in engine.step().
            self.user_optimizer._opt_called = True
        if self.after_step is not None:
            self.after_step(self.step_was_skipped)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine keeps no gradient on the parameters."""

    def state_dict(self) -> dict[str, Any]:
        """Refused, as ``engine.optimizer.state_dict()``: the state lives with
        the engine's offloaded master weights, and a state dict of this
        object would silently lack it (the integrations save the engine's
        checkpoint instead; Accelerate wraps this optimizer without asking)."""
        raise RuntimeError(
            "the optimizer state of aio.zero is offloaded, not in this optimizer's state_dict(): save it "
            "with engine.save_checkpoint() and load it with engine.load_checkpoint() (the Trainer and "
            "Lightning integrations' checkpoints do)"
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Refused, as :meth:`state_dict`."""
        raise RuntimeError(
            "aio.zero's optimizer state loads with engine.load_checkpoint(), not load_state_dict()"
        )


_TAG = re.compile(r"global_step\d+(?:-\d+)?")


def save_engine_checkpoint(
    engine: Any, directory: str, companion: Callable[[str], None] | None = None, suffix: str = ""
) -> str:
    """Save `engine`'s checkpoint in `directory` (DeepSpeed's layout:
    ``global_stepN/`` and ``latest``) under a tag no entry there has yet
    (``global_stepN``, else ``global_stepN-1``...); `companion(tag)` first
    writes a framework's own file for it (named tag + `suffix`). Then the
    older tags' folders and files go: a folder saved to again (Lightning's
    ``last.ckpt``, a resumed run's ``checkpoint-N``) keeps one checkpoint,
    and ``latest`` always names a complete one. Returns the tag."""
    os.makedirs(directory, exist_ok=True)
    base = tag = f"global_step{engine.global_steps}"
    k = 0
    while os.path.lexists(os.path.join(directory, tag)) or os.path.lexists(
        os.path.join(directory, tag + suffix)
    ):
        k += 1
        tag = f"{base}-{k}"
    if companion is not None:
        companion(tag)
    engine.save_checkpoint(directory, tag)
    for name in os.listdir(directory):
        m = _TAG.match(name)
        if m is None or m.group(0) == tag or name not in (m.group(0), m.group(0) + suffix):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    return tag
