"""Loading configs: dicts, JSON files, JSON text, whole DeepSpeed configs.

Every problem is reported at once, each line naming the key path and what is
accepted, e.g. ``zero_optimization.offload_param.nvme_path: required when
device is 'nvme'``.
"""

from __future__ import annotations

import difflib
import json
import os
import typing
from collections.abc import Mapping
from typing import Any, TypeVar, Union

from pydantic import AliasChoices, BaseModel, ValidationError

from .models import (
    AioConfig,
    OffloadConfig,
    UnresolvedAuto,
    auto_message,
)

M = TypeVar("M", bound=BaseModel)

ConfigSource = Union[Mapping[str, Any], str, "os.PathLike[str]", OffloadConfig]


class ConfigError(ValueError):
    """A configuration that cannot be used; ``problems`` lists (key path, message)."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "") -> None:
        self.problems = problems
        self.source = source
        head = f"invalid aio/DeepSpeed config{f' ({source})' if source else ''}:"
        super().__init__("\n".join([head] + [f"  {p}: {m}" if p else f"  {m}" for p, m in problems]))

    def one_line(self) -> str:
        """The same report on one line, for command-line tools."""
        where = f" ({self.source})" if self.source else ""
        items = "; ".join(f"{p}: {m}" if p else m for p, m in self.problems)
        return " ".join(f"invalid aio/DeepSpeed config{where}: {items}".split())


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field's annotation holds (``X``, ``X | None``,
    ``Annotated[X | None, ...]``), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names (and input aliases) of the block at `loc` inside `model`."""
    block: type[BaseModel] | None = model
    for part in loc:
        field = block.model_fields.get(str(part)) if block is not None else None
        block = _model_in(field.annotation) if field is not None else None
    if block is None:
        return []
    keys = list(block.model_fields)
    for field in block.model_fields.values():
        if isinstance(field.validation_alias, AliasChoices):
            keys += [c for c in field.validation_alias.choices if isinstance(c, str) and c not in keys]
    return keys


def similar_key(model: type[BaseModel], path: str) -> str | None:
    """The dotted key of `model` that unknown key `path` (dotted) looks like
    misspelt, or None: a field name or input alias of the same block."""
    *where, key = path.split(".")
    close = difflib.get_close_matches(key, _known_keys(model, tuple(where)), n=1, cutoff=0.6)
    return ".".join([*where, close[0]]) if close else None


def _translate(err: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(x) for x in loc)
        msg = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            key = str(loc[-1])
            known = _known_keys(model, loc[:-1])
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else "."
            msg = f"unknown key{hint} Accepted: {', '.join(sorted(known))}"
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
        # ("nvme_path: required ...", "params.lr: ..."): move that into the path.
        head, sep, rest = msg.partition(": ")
        if sep and head.replace("_", "").replace(".", "").isalnum() and head == head.lower():
            path = f"{path}.{head}" if path else head
            msg = rest
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, UnresolvedAuto):  # who fills this key depends on its path
            msg = auto_message(path, cause.want)
        problems.append((path, msg))
    return problems


# A DeepSpeed config is a few KiB; anything past this is not one (and reading
# a device such as /dev/zero would never end).
MAX_CONFIG_BYTES = 4 << 20


def read_config_file(path: str) -> str:
    """The text of a config file; a missing, unreadable or binary file, or one
    that is not a regular file (a device, a FIFO) or is larger than
    :data:`MAX_CONFIG_BYTES`, is a ConfigError naming `path`."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; no effect on regular files.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError([("", f"config file not found: {path}")]) from None
    except IsADirectoryError:
        raise ConfigError([("", f"{path} is a directory, not a config file")]) from None
    except OSError as e:
        raise ConfigError([("", f"cannot read config file {path}: {e.strerror}")]) from None
    try:
        _check_regular(os.fstat(fd), path)
        raw = _read_at_most(fd, MAX_CONFIG_BYTES + 1)  # the file can grow after fstat
    except OSError as e:
        raise ConfigError([("", f"cannot read config file {path}: {e.strerror}")]) from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([("", _too_large(path))])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([("", f"{path} is not UTF-8 text (byte {e.start}); expected JSON")]) from None


def _read_at_most(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes of `fd`, to its end."""
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _check_regular(st: os.stat_result, path: str) -> None:
    """A ConfigError unless `st` is a regular file of at most MAX_CONFIG_BYTES."""
    import stat

    if stat.S_ISDIR(st.st_mode):
        raise ConfigError([("", f"{path} is a directory, not a config file")])
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
        )
        raise ConfigError([("", f"{path} is {kind}, not a config file (expected a regular JSON file)")])
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError([("", _too_large(path))])


def _too_large(path: str) -> str:
    return f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB; a config file is a few KiB of JSON"


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict; a key given twice is refused (json keeps the last
    silently, so an edit that adds a block again would lose the first)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _read_json(text: str, where: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise ConfigError(
            [("", f"key {e.args[0]!r} is given twice in one object (DeepSpeed refuses that too); keep one")],
            where,
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            [("", f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}")], where
        ) from None
    except RecursionError:
        raise ConfigError([("", "not usable JSON: nested too deeply")], where) from None


def read_config_data(source: Any) -> tuple[Mapping[str, Any], str]:
    """The JSON object a config source holds, and where it came from.

    `source`: a dict, a JSON file path or JSON text (starting with ``{``).
    Returns ``(data, where)``; `where` is the file path ('' otherwise), for
    error reports. A missing or unreadable file, bad JSON or a top level that
    is not an object is a :class:`ConfigError`; any other type a TypeError.
    """
    where = ""
    data: Any
    if isinstance(source, (str, os.PathLike)):
        s = os.fspath(source)
        if isinstance(s, str) and s.lstrip().startswith("{"):
            data = _read_json(s, "JSON text")
        else:
            where = str(s)
            data = _read_json(read_config_file(where), where)
    elif isinstance(source, Mapping):
        data = source
    else:
        raise TypeError(
            "config must be a dict, a JSON file path, JSON text or an OffloadConfig, "
            f"got {type(source).__name__}"
        )
    if not isinstance(data, Mapping):
        raise ConfigError([("", f"the top level must be a JSON object, got {type(data).__name__}")], where)
    return data, where


def pick_blocks(
    data: Mapping[str, Any], keys: tuple[str, ...]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The blocks `keys` of a config that are given (null means absent), and
    the problems of those that are not objects."""
    picked: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for key in keys:
        if key in data and data[key] is not None:
            v = data[key]
            if isinstance(v, bool) and key == "zero_optimization":
                problems.append((key, "the boolean form is deprecated; use an object with 'stage'"))
                continue
            if not isinstance(v, Mapping):
                problems.append((key, f"must be an object, got {type(v).__name__}"))
                continue
            picked[key] = dict(v)
    return picked, problems


def validate(model: type[M], data: Mapping[str, Any], where: str = "") -> M:
    """`model` validated from `data`; every problem raised at once as a
    :class:`ConfigError` naming its key path."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_translate(e, model), where) from None


def load_config(source: ConfigSource) -> OffloadConfig:
    """Build an :class:`OffloadConfig` from a dict, a JSON file path, JSON
    text, or a whole DeepSpeed config (other keys are ignored).

    Raises :class:`ConfigError` (a ValueError) listing every problem with its
    key path.
    """
    if isinstance(source, OffloadConfig):
        return source
    data, where = read_config_data(source)
    picked, problems = pick_blocks(data, ("aio", "zero_optimization"))
    if problems:
        raise ConfigError(problems, where)
    cfg = validate(OffloadConfig, picked, where)
    warn_use_gds(cfg.aio, stacklevel=3)
    return cfg


def warn_use_gds(aio: AioConfig, stacklevel: int = 2) -> None:
    """One notice when ``aio.use_gds`` is set: DeepSpeed reads it, aio does not."""
    if aio.use_gds:
        import warnings

        warnings.warn(
            "aio.use_gds=true: aio has no GPUDirect Storage engine and uses its own "
            "pinned-buffer path; DeepSpeed itself still reads the key",
            UserWarning,
            stacklevel=stacklevel,
        )
