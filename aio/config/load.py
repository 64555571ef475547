"""Loading configs: dicts, JSON files, JSON text, whole DeepSpeed configs.

Every problem is reported at once, each line naming the key path and what is
accepted, e.g. ``zero_optimization.offload_param.nvme_path: required when
device is 'nvme'``.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from typing import Any, Union

from pydantic import BaseModel, ValidationError

from .models import AioConfig, OffloadConfig, OffloadOptimizerConfig, OffloadParamConfig

ConfigSource = Union[Mapping[str, Any], str, "os.PathLike[str]", OffloadConfig]

_BLOCK_FIELDS: dict[str, type[BaseModel]] = {
    "aio": AioConfig,
    "offload_param": OffloadParamConfig,
    "offload_optimizer": OffloadOptimizerConfig,
}


class ConfigError(ValueError):
    """A configuration that cannot be used; ``problems`` lists (key path, message)."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "") -> None:
        self.problems = problems
        head = f"invalid aio/DeepSpeed config{f' ({source})' if source else ''}:"
        super().__init__("\n".join([head] + [f"  {p}: {m}" if p else f"  {m}" for p, m in problems]))


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    """Field names (and aliases) accepted by the block at `loc`."""
    last = next((str(x) for x in reversed(loc) if str(x) in _BLOCK_FIELDS), None)
    if last is None:
        return []
    model = _BLOCK_FIELDS[last]
    keys = list(model.model_fields)
    if model is AioConfig:
        keys.append("thread_count")
    return keys


def _translate(err: ValidationError) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(x) for x in loc)
        msg = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            key = str(loc[-1])
            known = _known_keys(loc[:-1])
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            msg = f"unknown key{hint}. Accepted: {', '.join(sorted(known))}"
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {e.get('input')!r})"
        elif e["type"] in (
            "greater_than",
            "greater_than_equal",
            "less_than_equal",
            "bool_type",
            "int_type",
            "float_type",
            "float_parsing",
            "int_parsing",
        ):
            msg = f"{msg} (got {e.get('input')!r})"
        # Errors raised by a validator on a block name their field first
        # ("nvme_path: required ..."): move that into the path.
        head, sep, rest = msg.partition(": ")
        if sep and head.replace("_", "").isalnum() and head == head.lower() and " " not in head:
            path = f"{path}.{head}" if path else head
            msg = rest
        problems.append((path, msg))
    return problems


def _read_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            [("", f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}")], where
        ) from None


def load_config(source: ConfigSource) -> OffloadConfig:
    """Build an :class:`OffloadConfig` from a dict, a JSON file path, JSON
    text, or a whole DeepSpeed config (other keys are ignored).

    Raises :class:`ConfigError` (a ValueError) listing every problem with its
    key path.
    """
    if isinstance(source, OffloadConfig):
        return source
    where = ""
    data: Any
    if isinstance(source, (str, os.PathLike)):
        s = os.fspath(source)
        if isinstance(s, str) and s.lstrip().startswith("{"):
            data = _read_json(s, "JSON text")
        else:
            where = str(s)
            try:
                with open(s, encoding="utf-8") as f:
                    data = _read_json(f.read(), where)
            except FileNotFoundError:
                raise ConfigError([("", f"config file not found: {s}")]) from None
    elif isinstance(source, Mapping):
        data = source
    else:
        raise TypeError(
            "config must be a dict, a JSON file path, JSON text or an OffloadConfig, "
            f"got {type(source).__name__}"
        )
    if not isinstance(data, Mapping):
        raise ConfigError([("", f"the top level must be a JSON object, got {type(data).__name__}")], where)
    picked: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for key in ("aio", "zero_optimization"):
        if key in data and data[key] is not None:
            v = data[key]
            if isinstance(v, bool) and key == "zero_optimization":
                problems.append((key, "the boolean form is deprecated; use an object with 'stage'"))
                continue
            if not isinstance(v, Mapping):
                problems.append((key, f"must be an object, got {type(v).__name__}"))
                continue
            picked[key] = dict(v)
    if problems:
        raise ConfigError(problems, where)
    try:
        cfg = OffloadConfig.model_validate(picked)
    except ValidationError as e:
        raise ConfigError(_translate(e), where) from None
    if cfg.aio.use_gds:
        import warnings

        warnings.warn(
            "aio.use_gds=true: aio has no GPUDirect Storage engine and uses its own "
            "pinned-buffer path; DeepSpeed itself still reads the key",
            UserWarning,
            stacklevel=2,
        )
    return cfg
