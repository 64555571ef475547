"""Getting the weights out of aio.zero, streamed: safetensors shards written
one tensor at a time, so peak memory is the largest tensor (plus the
trainer's own buffers), never the model.

- :func:`save_pretrained` (``engine.save_pretrained(dir)``): from a live
  trainer, in Hugging Face's layout (weights, and ``config.json`` /
  ``generation_config.json`` for a transformers model): ``from_pretrained``
  loads the folder.
- :func:`export_checkpoint` (the ``aio-export`` command): from a checkpoint
  written by ``engine.save_checkpoint()``, without building the model --
  the counterpart of DeepSpeed's ``zero_to_fp32.py``. Every partition's
  checksum is verified as it is read; nothing is renamed into place unless
  all of them held.

The state-dict keys are the model's own (``model.state_dict()``'s, with
persistent buffers and without non-persistent ones). A parameter tied under
several keys is written once, under its first key, for a transformers model
(as its ``save_pretrained`` does; ``from_pretrained`` ties it again), and
under every key for any other model (``load_state_dict`` wants them all). `dtype` converts floating-point
tensors (default: the training dtype); integer buffers keep theirs.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .safetensors_writer import Source, byte_view, write_shards

if TYPE_CHECKING:
    from .trainer import OffloadTrainer

logger = logging.getLogger("aio.zero")

_HF_FILES = ("config.json", "generation_config.json")
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}  # fmt: skip


def torch_dtype(dtype: Any) -> Any:
    """A torch floating dtype from a torch dtype, ``"fp32"``, ``"bf16"``,
    ``"fp16"`` (or their long names), or None (keep)."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return getattr(torch, DTYPES[dtype.lower()])
    raise ValueError(f"dtype {dtype!r}: one of fp32, bf16, fp16 (or a torch floating dtype)")


def state_dict_layout(module: Any, store: Any, state: Any = None) -> list[tuple[str, int | None]]:
    """``module.state_dict()``'s keys in order, each with the part id of the
    store's parameter it holds (None for a buffer or a parameter the store
    does not own). Nothing is read; `state`: that state_dict(keep_vars=True)
    when the caller has it already. Entries that are no tensors (a module's
    ``get_extra_state()``) have no place in safetensors: left out, said once."""
    import torch

    out: list[tuple[str, int | None]] = []
    skipped = []
    state = module.state_dict(keep_vars=True) if state is None else state
    for key, v in state.items():
        if not isinstance(v, torch.Tensor):
            skipped.append(key)
            continue
        part = getattr(v, "aio_id", None) if getattr(v, "_aio_store", None) is store else None
        out.append((key, part))
    if skipped:
        logger.warning(
            "weights export: left out state-dict entries that are no tensors: %s", ", ".join(skipped)
        )
    return out


def _held(key: str, t: Any) -> Source:
    """A tensor already in memory (a buffer) as a Source."""
    return Source(key, tuple(t.shape), t.dtype, lambda: t)


def _convert(read: Callable[[], Any], dtype: Any) -> Callable[[], Any]:
    return lambda: read().to(dtype)


def _sources(
    layout: list[tuple[str, int | None]],
    param: Callable[[int], Source],
    other: Callable[[str], Any],
    dtype: Any,
    tie_once: bool,
) -> list[Source]:
    """One Source per key of `layout`; with `tie_once` a tied parameter's later
    keys are left out (transformers ties them again at load), else its values
    are written under every key (``load_state_dict`` wants them all)."""
    seen: set[int] = set()
    out = []
    for key, part in layout:
        if part is not None:
            if part in seen and tie_once:
                continue
            seen.add(part)
            s = param(part)
            s = Source(key, s.shape, s.dtype, s.read)
        else:
            s = _held(key, other(key))
        if dtype is not None and s.dtype.is_floating_point and s.dtype != dtype:
            s = Source(s.name, s.shape, dtype, _convert(s.read, dtype))
        out.append(s)
    return out


def save_pretrained(
    trainer: OffloadTrainer,
    save_directory: str,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    progress: Callable[[int, int], None] | None = None,
    module: Any = None,
) -> list[str]:
    """See :meth:`aio.zero.OffloadTrainer.save_pretrained`. `module`: a
    submodule of the trainer's model to write instead of the whole model
    (the transformers model inside a LightningModule: its keys, its config)."""
    dtype = torch_dtype(dtype)
    module = trainer.module if module is None else module
    store = trainer.store
    store.synchronize()  # writes of the last step land before anything is read
    params = {p.aio_id: p for p in module.parameters() if getattr(p, "_aio_store", None) is store}
    state = module.state_dict(keep_vars=True)

    def param(part: int) -> Source:
        p = params[part]
        return Source("", tuple(p.aio_shape), p.dtype, lambda: store.read(p).view(p.aio_shape))

    layout = state_dict_layout(module, store, state)
    sources = _sources(layout, param, lambda key: state[key].detach(), dtype, tie_once=_is_hf(module))
    extra = hf_files(module, dtype or store.dtype)
    return write_shards(save_directory, sources, max_shard_size, progress=progress, extra_files=extra)


def _is_hf(module: Any) -> bool:
    """Whether `module` is a transformers model (has a config it can save)."""
    return hasattr(getattr(module, "config", None), "save_pretrained")


def _save_hf_config(module: Any, save_directory: str, dtype: Any) -> None:
    """A transformers model's config (and generation config): what
    ``from_pretrained`` needs beside the weights, as its save_pretrained writes them."""
    if not _is_hf(module):
        return
    config = module.config
    config.architectures = [type(module).__name__]
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(save_directory)
    can_generate = getattr(module, "can_generate", None)
    gen = getattr(module, "generation_config", None)
    if gen is not None and callable(can_generate) and can_generate():
        gen.save_pretrained(save_directory)


def hf_files(module: Any, dtype: Any = None) -> dict[str, bytes]:
    """The JSON files a transformers model's save_pretrained writes beside its
    weights (config, generation config; `dtype` written as the weights'
    dtype, default the parameters'), written by transformers into a private
    folder and read back; empty for any other model."""
    import tempfile

    if not _is_hf(module):
        return {}
    if dtype is None:
        dtype = next((p.dtype for p in module.parameters()), None)
    with tempfile.TemporaryDirectory() as tmp:
        _save_hf_config(module, tmp, dtype)
        out = {}
        for name in _HF_FILES:
            path = os.path.join(tmp, name)
            if os.path.exists(path):
                with open(path, "rb") as f:
                    out[name] = f.read()
        return out


# -- from a checkpoint ------------------------------------------------------------------------


def _open_regular(path: str) -> int:
    """`path` opened for reading, never through a symbolic link, and only if
    it is a regular file (a FIFO would block the read forever)."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path}: not a regular file")
    return fd


class _SavedParams:
    """The parameter partitions of a checkpoint's ``params`` folder, read one at
    a time and checked against their CRC32 (a drive checkpoint), or loaded
    from ``params.pt`` (the memory backend's, a model that fits in memory)."""

    def __init__(self, folder: str) -> None:
        from ..swap.storage import load_plain

        self.folder = folder
        manifest = os.path.join(folder, "manifest.json")
        self.plain: dict[int, Any] | None = None
        self.entries: dict[int, dict[str, Any]] = {}
        if os.path.exists(manifest):
            with open(manifest) as f:
                m = json.load(f)
            if not isinstance(m, dict) or m.get("kind") != "aio-params" or m.get("version") != 1:
                raise ValueError(f"{folder}: not an aio parameter checkpoint (version 1)")
            self.entries = {e["id"]: e for e in m["partitions"]}
        else:
            saved = load_plain(os.path.join(folder, "params.pt"))
            if not isinstance(saved, dict):
                raise ValueError(f"{folder}/params.pt: not an aio.zero parameter checkpoint")
            self.plain = saved

    def source(self, part: int, shape: tuple[int, ...]) -> Source:
        """The partition `part`, to be viewed as `shape`."""
        import math

        import torch

        if self.plain is not None:
            t = self.plain.get(part)
            if t is None or not isinstance(t, torch.Tensor) or t.numel() != math.prod(shape):
                raise ValueError(f"{self.folder}: parameter partition {part} is missing or of another size")
            return Source("", shape, t.dtype, lambda: t.view(shape))
        e = self.entries.get(part)
        if e is None or e.get("numel") != math.prod(shape):
            raise ValueError(f"{self.folder}: parameter partition {part} is missing or of another size")
        dtype = getattr(torch, str(e.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{self.folder}: partition {part} has an unknown dtype {e.get('dtype')!r}")
        return Source("", shape, dtype, lambda: self._read(e, dtype).view(shape))

    def _read(self, e: dict[str, Any], dtype: Any) -> Any:
        import torch

        out = torch.empty(e["numel"], dtype=dtype)
        view = byte_view(out)
        path = os.path.join(self.folder, "params.bin")
        fd = _open_regular(path)
        try:
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], e["offset"] + got)
                if n == 0:
                    raise ValueError(f"{path} is damaged: partition {e['id']} runs past its end")
                got += n
        finally:
            os.close(fd)
        if zlib.crc32(view) != e.get("crc32"):
            raise ValueError(f"{path} is damaged: partition {e['id']} does not match its checksum")
        return out


def export_checkpoint(
    checkpoint: str,
    out_dir: str,
    tag: str | None = None,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Write the model weights of an aio.zero checkpoint as safetensors shards
    (see the module docstring). `checkpoint`: the folder given to
    ``save_checkpoint()`` (its ``latest``, or `tag`) or one checkpoint folder
    itself. Returns the files written into `out_dir`."""
    from ..swap.storage import load_plain, require_complete
    from .checkpoint import resolve

    dtype = torch_dtype(dtype)
    path = resolve(checkpoint, tag)
    inside = os.path.realpath(out_dir) + os.sep
    if inside.startswith(os.path.realpath(path) + os.sep):
        raise ValueError(f"{out_dir} is inside the checkpoint {path}: files there would make it unloadable")
    require_complete(path)
    with open(os.path.join(path, "engine.json")) as f:
        meta = json.load(f)
    layout = meta.get("state_dict") if isinstance(meta, dict) else None
    if not isinstance(layout, list):
        raise ValueError(
            f"{path}: this checkpoint does not record its model's state-dict keys (written by an older "
            "aio); load it with engine.load_checkpoint() and write the weights with engine.save_pretrained()"
        )
    shapes = {int(part): tuple(shape) for _key, part, shape in layout if part is not None}
    saved = _SavedParams(os.path.join(path, "params"))
    buffers_file = os.path.join(path, "buffers.pt")
    buffers = load_plain(buffers_file) if os.path.exists(buffers_file) else {}

    def other(key: str) -> Any:
        if key not in buffers:
            raise ValueError(f"{path}: buffer {key!r} is in the model's keys but not in buffers.pt")
        return buffers[key]

    keys = [(key, None if part is None else int(part)) for key, part, _shape in layout]
    hf = os.path.exists(os.path.join(path, "hf", "config.json"))
    sources = _sources(keys, lambda part: saved.source(part, shapes[part]), other, dtype, tie_once=hf)
    extra = _saved_hf_files(path, dtype or torch_dtype(meta.get("dtype")))
    return write_shards(out_dir, sources, max_shard_size, progress=progress, extra_files=extra)


def _saved_hf_files(path: str, dtype: Any) -> dict[str, bytes]:
    """The model's config files the checkpoint kept, with the dtype written."""
    out = {}
    for name in _HF_FILES:
        src = os.path.join(path, "hf", name)
        if not os.path.exists(src):
            continue
        with open(src) as f:
            data = json.load(f)
        if name == "config.json" and dtype is not None:
            data["dtype"] = str(dtype).removeprefix("torch.")
        out[name] = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    return out
