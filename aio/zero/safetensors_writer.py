"""Safetensors shards written one tensor at a time.

:func:`write_shards` takes the tensors as :class:`Source` entries -- a name,
a shape, a dtype and a function that produces the values when their turn
comes -- so a model far larger than memory is written with at most one
tensor in memory. The header of each shard is known before any value is
read (the format puts it first), which is what makes streaming possible.

The files are Hugging Face's layout: ``model.safetensors`` when one shard
holds everything, else ``model-00001-of-0000N.safetensors`` plus
``model.safetensors.index.json``. Every file is written under a temporary
name created exclusively (never through a planted symbolic link), fsynced,
and renamed into place only once all of them are whole; shards of an
earlier save in the folder that this save does not replace are removed, as
``save_pretrained`` does. A failure (a read, a full drive, Ctrl-C) removes
the temporary files and leaves the folder as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip


@dataclass(frozen=True)
class Source:
    """One tensor to write: `read()` returns its values (any device, contiguous
    or not) with exactly `shape` and `dtype`, when its turn comes."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype
    read: Callable[[], Any]

    @property
    def nbytes(self) -> int:
        """Bytes of the values in the file."""
        import math

        import torch

        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"``, ``"500MiB"`` (the
    ``max_shard_size`` of ``save_pretrained``); ValueError otherwise."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*", size.upper())
        if m is None:
            raise ValueError(f"max_shard_size {size!r}: a number of bytes, or e.g. '5GB', '500MiB'")
        base = 1024 if m.group(3) == "IB" else 1000
        n = int(float(m.group(1)) * base ** "_KMGT".index(m.group(2) or "_"))
    else:
        raise TypeError(f"max_shard_size must be an int or a str like '5GB', not {type(size).__name__}")
    if n <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return n


def plan_shards(sources: list[Source], max_shard_bytes: int) -> list[list[Source]]:
    """Consecutive groups of `sources` of at most `max_shard_bytes` each (a
    tensor larger than that gets a shard of its own), in order."""
    shards: list[list[Source]] = [[]]
    size = 0
    for s in sources:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def header_bytes(shard: list[Source], metadata: dict[str, str]) -> bytes:
    """The shard's length-prefixed JSON header, padded to 8 bytes as the format asks."""
    head: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for s in shard:
        name = str(s.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"{s.name}: safetensors has no dtype for {s.dtype}")
        head[s.name] = {"dtype": _DTYPES[name], "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_shards(
    out_dir: str,
    sources: list[Source],
    max_shard_size: int | str = "5GB",
    metadata: dict[str, str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> list[str]:
    """Write `sources` as safetensors shards into `out_dir` (created if
    needed; see the module docstring); returns the weight files' names.
    `progress(bytes_done, bytes_total)` is called after each tensor.
    `extra_files` (name -> bytes: a model's config.json) are written and
    renamed into place with the shards, all or nothing."""
    extra = dict(extra_files or {})
    for name in extra:
        if (
            not name
            or "/" in name
            or name.startswith(".")
            or name in (WEIGHTS, INDEX)
            or _SHARD.fullmatch(name)
        ):
            raise ValueError(f"extra file name {name!r}: one plain file name, not a weight file's")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(
            "two tensors with one name: " + ", ".join(sorted({n for n in names if names.count(n) > 1}))
        )
    shards = plan_shards(sources, parse_size(max_shard_size))
    files = (
        [WEIGHTS]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    os.makedirs(out_dir, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    done = _Progress(sum(s.nbytes for s in sources), progress)
    temps: list[str] = []
    try:
        for shard in shards:
            _write_one(out_dir, shard, meta, done, temps)
        if len(shards) > 1:
            weight_map = {s.name: f for f, shard in zip(files, shards, strict=True) for s in shard}
            index = {"metadata": {"total_size": done.total}, "weight_map": dict(sorted(weight_map.items()))}
            _write_file(out_dir, json.dumps(index, indent=2).encode() + b"\n", temps)
            files.append(INDEX)
        for data in extra.values():
            _write_file(out_dir, data, temps)
        _rename_all(out_dir, temps, [*files, *extra])
        temps = []
        _remove_stale(out_dir, set(files))
        _fsync_dir(out_dir)
    finally:
        for tmp in temps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return files


def _rename_all(out_dir: str, temps: list[str], names: list[str]) -> None:
    """Every file into place, a Ctrl-C held until the last rename: a folder
    with some new shards and some old ones would load as neither save."""
    import errno
    import stat

    from .._cli import signals_deferred

    for name in names:  # a rename that would fail on a folder in the way: before any
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(os.path.join(out_dir, name)).st_mode):
                raise IsADirectoryError(
                    errno.EISDIR, "a folder is in the way of a file to write", os.path.join(out_dir, name)
                )
    with signals_deferred():
        for tmp, name in zip(temps, names, strict=True):
            os.replace(tmp, os.path.join(out_dir, name))


class _Progress:
    def __init__(self, total: int, report: Callable[[int, int], None] | None) -> None:
        self.total, self.done, self.report = total, 0, report
        self.start = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        if self.report is not None:
            self.report(self.done, self.total)


def _write_one(
    out_dir: str, shard: list[Source], meta: dict[str, str], done: _Progress, temps: list[str]
) -> None:
    """One shard under a temporary name (appended to `temps`), whole and fsynced."""

    def write(fd: int, tmp: str) -> None:
        _write_all(fd, header_bytes(shard, meta), tmp)
        for s in shard:
            _write_all(fd, _raw(s), tmp)
            done.add(s.nbytes)

    _new_file(out_dir, write, temps)


def _new_file(out_dir: str, write: Callable[[int, str], None], temps: list[str]) -> None:
    """A file made by `write(fd, path)` under a temporary name, fsynced. The
    name goes into `temps` as the file is made, under the CLI's deferred
    Ctrl-C (aio-export): one landing between the two left the file behind
    (the caller removes what `temps` names when anything fails)."""
    from .._cli import signals_deferred

    fd = -1
    try:
        with signals_deferred():
            fd, tmp = _create(out_dir)
            temps.append(tmp)
        write(fd, tmp)
        os.fsync(fd)
    finally:
        if fd >= 0:
            os.close(fd)


def _raw(s: Source) -> memoryview:
    """`s`'s values as bytes in the file's (little-endian, C) order, checked."""
    import torch

    t = s.read()
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(s.shape) or t.dtype != s.dtype:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{s.name}: expected {tuple(s.shape)} {s.dtype}, read {got}")
    return byte_view(t.detach().to("cpu").contiguous())


def byte_view(t: Any) -> memoryview:
    """A contiguous CPU tensor's memory as a flat byte memoryview (shared, not copied)."""
    import torch

    if t.numel() == 0:
        return memoryview(bytearray())
    arr: Any = t.reshape(-1).view(torch.uint8).numpy()  # numpy's stubs do not type memoryview(ndarray)
    return memoryview(arr)


def _write_file(out_dir: str, data: bytes, temps: list[str]) -> None:
    _new_file(out_dir, lambda fd, tmp: _write_all(fd, data, tmp), temps)


def _create(out_dir: str) -> tuple[int, str]:
    """A new file of unpredictable name (O_EXCL, O_NOFOLLOW: nothing planted is
    written through), with the permissions a plain ``open()`` would give."""
    fd, tmp = tempfile.mkstemp(prefix=".aio-export-", suffix=".tmp", dir=out_dir)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


def _write_all(fd: int, data: bytes | memoryview, path: str) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view[: 1 << 30])
        if n <= 0:
            raise OSError(f"{path}: write returned {n}")
        view = view[n:]


def _remove_stale(out_dir: str, keep: set[str]) -> None:
    """Remove the weight files of an earlier save that this one did not
    replace (a folder saved with more shards before): loading would see two
    sets. Only regular files with those names; a link is unlinked, never followed."""
    import stat

    for name in os.listdir(out_dir):
        if name in keep or not (name in (WEIGHTS, INDEX) or _SHARD.fullmatch(name)):
            continue
        path = os.path.join(out_dir, name)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(path).st_mode) or stat.S_ISLNK(os.lstat(path).st_mode):
                os.unlink(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
