"""Checkpoints of an :class:`aio.zero.OffloadTrainer`: parameters, optimizer
state, step counters and loss scale, written atomically and durably and
verified whole before anything is restored."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._args import mismatched
from .._interrupt import interrupts_held
from ..swap.storage import checkpoint_dir, load_plain, require_complete, save_plain, write_json_durably
from .export import hf_files, state_dict_layout

if TYPE_CHECKING:
    from .trainer import OffloadTrainer

CHECKPOINT_VERSION = 1
_COUNTERS = ("global_steps", "micro_steps", "skipped_steps")


def save(trainer: OffloadTrainer, save_dir: str, tag: str | None, client_state: dict | None) -> str:
    """See :meth:`aio.zero.OffloadTrainer.save_checkpoint`."""
    if trainer.micro_steps % trainer.gas != 0 or trainer.grads.touched or trainer.grads.has_open:
        raise ValueError(
            "save_checkpoint() in the middle of gradient accumulation (or after a backward() "
            "whose step() has not run) would lose the partial gradient; save right after a "
            "step() at an accumulation boundary"
        )
    tag = check_tag(f"global_step{trainer.global_steps}" if tag is None else tag)
    _make_dirs_durably(os.path.abspath(save_dir))
    trainer.store.synchronize()
    path = os.path.join(save_dir, tag)
    with checkpoint_dir(path) as tmp:
        save_plain(client_state or {}, os.path.join(tmp, "client_state.pt"), "client_state")
        trainer.store.export_checkpoint(os.path.join(tmp, "params"))
        trainer.zero_optimizer.export_checkpoint(os.path.join(tmp, "optimizer"))
        save_plain(
            _schedule_state(trainer), os.path.join(tmp, "schedule.pt"), "the param groups and lr scheduler"
        )
        save_plain(_buffers(trainer), os.path.join(tmp, "buffers.pt"), "the module buffers")
        for name, data in hf_files(trainer.module).items():  # for aio-export to write beside the weights
            _write_new(os.path.join(tmp, "hf", name), data)
        write_json_durably(os.path.join(tmp, "engine.json"), _meta(trainer))
    _point_latest(save_dir, tag)
    return path


def check_tag(tag: Any) -> str:
    """`tag` if it names a checkpoint folder exactly and safely, else
    ValueError (before anything is written): one path component, not
    ``latest`` (the pointer file), not hidden, no whitespace at either end
    and no control characters, since ``latest`` must read back as exactly
    the tag written."""
    if not isinstance(tag, str):
        raise TypeError(f"checkpoint tag must be a str, not {type(tag).__name__}")
    bad = (
        not tag
        or tag == "latest"
        or tag.startswith(".")
        or "/" in tag
        or tag != tag.strip()
        or any(ord(c) < 32 or ord(c) == 127 for c in tag)
    )
    if bad:
        raise ValueError(
            f"bad checkpoint tag {tag!r}: one folder name, not 'latest', not starting with '.', "
            "without '/', control characters or surrounding whitespace"
        )
    return tag


def _point_latest(save_dir: str, tag: str) -> None:
    """Point ``save_dir/latest`` at `tag`, atomically and durably. The new
    content goes through a file of unpredictable name created exclusively
    (mkstemp: O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600), so a name planted in a
    shared folder (a symlink to someone's file) is never written through;
    the rename replaces a planted ``latest`` itself, never its target."""
    fd, tmp = tempfile.mkstemp(prefix=".latest.", dir=save_dir)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(save_dir, "latest"))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(save_dir)


def resolve(directory: str, tag: str | None = None) -> str:
    """The checkpoint folder `directory` names: itself when it is one (holds
    ``engine.json``) and no `tag` is given, else ``directory/tag`` or the
    one ``directory/latest`` points at."""
    if tag is None and os.path.exists(os.path.join(directory, "engine.json")):
        return directory
    return os.path.join(directory, _read_latest(directory) if tag is None else check_tag(tag))


def _write_new(path: str, data: bytes) -> None:
    """A new file in a new checkpoint folder (its parent made here), fsynced."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read_latest(load_dir: str) -> str:
    """The tag ``load_dir/latest`` names, read exactly (a trailing newline
    aside, as an editor leaves one) and checked like a tag to save; the
    file itself is never a symlink."""
    latest = os.path.join(load_dir, "latest")
    try:
        fd = os.open(latest, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FileNotFoundError(2, "no 'latest' file: pass tag= or save a checkpoint first", latest) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(errno.ELOOP, "refusing a 'latest' that is a symlink", latest) from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{latest}: not a regular file")
        raw = f.read(4097)
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ValueError(f"{latest}: not a checkpoint tag (not UTF-8)") from None
    text = text[:-1] if text.endswith("\n") else text
    try:
        return check_tag(text)
    except ValueError as e:
        raise ValueError(f"{latest}: {e}") from None


def _meta(trainer: OffloadTrainer) -> dict[str, Any]:
    scaler = trainer.scaling.scaler
    return {
        "version": CHECKPOINT_VERSION,
        **{k: getattr(trainer, k) for k in _COUNTERS},
        "gradient_accumulation_steps": trainer.gas,
        "dtype": trainer.cfg.dtype,
        "optimizer": _optimizer_name(trainer),
        "params": _param_shapes(trainer),
        # What aio-export needs to write the weights without the model: each
        # state-dict key, the partition it holds (None: a buffer) and its shape.
        "state_dict": [
            [key, part, list(trainer.store.shape_of(part)) if part is not None else None]
            for key, part in state_dict_layout(trainer.module, trainer.store)
        ],
        "scaler": scaler.state_dict() if scaler else None,
    }


def _optimizer_name(trainer: OffloadTrainer) -> str:
    cls = trainer.optimizer_cls
    return f"{cls.__module__}.{cls.__qualname__}"


def _persistent_buffers(trainer: OffloadTrainer) -> Iterator[tuple[str, Any]]:
    """(state_dict key, buffer) of the module's persistent buffers."""
    for mod_name, mod in trainer.module.named_modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), b


def _buffers(trainer: OffloadTrainer) -> dict[str, Any]:
    """The module's persistent buffers (BatchNorm's running statistics...), as
    its state_dict() holds them, on the CPU."""
    return {k: b.detach().cpu().clone() for k, b in _persistent_buffers(trainer)}


def _verify_buffers(trainer: OffloadTrainer, path: str) -> dict[str, Any] | None:
    """The checkpoint's module buffers, checked against the model's (None in a
    checkpoint from before they were saved)."""
    f = os.path.join(path, "buffers.pt")
    if not os.path.exists(f):
        return None
    import torch

    saved = load_plain(f)

    def kinds(d: dict[str, Any]) -> dict[str, Any]:
        return {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else None for k, v in d.items()}

    if not isinstance(saved, dict) or kinds(saved) != kinds(_buffers(trainer)):
        raise ValueError(f"{path}: the module buffers saved (names, shapes, dtypes) do not fit the model")
    return dict(saved)


def _apply_buffers(trainer: OffloadTrainer, saved: dict[str, Any] | None) -> None:
    if saved is None:
        return
    import torch

    with torch.no_grad():
        for key, b in _persistent_buffers(trainer):
            b.copy_(saved[key])


def _schedule_state(trainer: OffloadTrainer) -> dict[str, Any]:
    """What an LR schedule changes: every param group's values (lr, weight
    decay... and a scheduler's own keys such as ``initial_lr``) and the
    scheduler's state."""
    groups = [{k: v for k, v in g.items() if _plain(v)} for g in trainer.optimizer.hyper()]
    sched = trainer.lr_scheduler
    return {"param_groups": groups, "lr_scheduler": sched.state_dict() if sched is not None else None}


def _plain(v: Any) -> bool:
    return (
        v is None
        or isinstance(v, (bool, int, float, str))
        or (isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float)) for x in v))
    )


def _verify_schedule(trainer: OffloadTrainer, path: str) -> dict[str, Any] | None:
    """The checkpoint's schedule state (None in a checkpoint from before it was saved)."""
    f = os.path.join(path, "schedule.pt")
    if not os.path.exists(f):
        return None
    state = load_plain(f)
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or len(groups) != len(trainer.optimizer.param_groups):
        raise ValueError(f"{path}: the checkpoint's param groups do not match this optimizer's")
    if not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{path}: the checkpoint's param groups are malformed")
    for k, (now, saved_group) in enumerate(zip(trainer.optimizer.param_groups, groups, strict=True)):
        if bad := mismatched(now, saved_group):
            raise ValueError(
                f"{path}: param group {k}'s {', '.join(map(repr, bad))} are not of the kind it has"
            )
    sched, saved = trainer.lr_scheduler, state.get("lr_scheduler")
    if sched is not None and saved is not None:
        # Loaded only after the parameters and the optimizer state: a scheduler
        # of another kind (or a malformed state) must be refused here, while
        # nothing has changed yet.
        mine = sched.state_dict()
        if not isinstance(saved, dict) or set(saved) != set(mine) or mismatched(mine, saved):
            raise ValueError(
                f"{path}: the checkpoint's lr scheduler state does not fit this trainer's "
                f"{type(sched).__name__} (saved with another kind of scheduler?)"
            )
    return state


def _apply_schedule(trainer: OffloadTrainer, state: dict[str, Any] | None) -> None:
    if state is None:
        return
    for g, saved in zip(trainer.optimizer.param_groups, state["param_groups"], strict=True):
        g.update({k: v for k, v in saved.items() if k in g or k == "initial_lr"})
    trainer.zero_optimizer.set_group_hyper(trainer.optimizer.hyper())
    if trainer.lr_scheduler is not None and state["lr_scheduler"] is not None:
        trainer.lr_scheduler.load_state_dict(state["lr_scheduler"])


def _param_shapes(trainer: OffloadTrainer) -> list[list[Any]]:
    return [[s.param.aio_name, list(s.param.aio_shape)] for s in trainer.layout.ordered()]


def _same_params(saved: Any, trainer: OffloadTrainer) -> bool:
    """Whether the checkpoint's trainable parameters (names and shapes, in
    order) are the trainer's. A checkpoint from before the model's own
    names were kept names parameters built under Init by their build
    name ("Linear.weight"): accepted for those."""
    places = trainer.layout.ordered()
    if not isinstance(saved, list) or len(saved) != len(places):
        return False
    for entry, s in zip(saved, places, strict=True):
        names = {s.param.aio_name, getattr(s.param, "aio_build_name", s.param.aio_name)}
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in names):
            return False
        if entry[1] != list(s.param.aio_shape):
            return False
    return True


def _part_ids(trainer: OffloadTrainer, meta: dict[str, Any], path: str) -> dict[int, int]:
    """The checkpoint's parameter partition ids mapped to the trainer's, by
    state-dict key (each partition's first key). A checkpoint without keys
    (older aio) maps ids to themselves: they are the adoption order of the
    same code; partitions it holds that the store gave back since (a
    parameter replaced by a tied one) are left out."""
    mine = state_dict_layout(trainer.module, trainer.store)
    saved = meta.get("state_dict")
    if saved is None:
        return {part: part for _key, part in mine if part is not None}
    if not isinstance(saved, list) or not all(isinstance(e, list) and len(e) == 3 for e in saved):
        raise ValueError(f"{path}: engine.json has a malformed state_dict list")
    saved_part = {key: part for key, part, _shape in saved}
    out: dict[int, int] = {}
    for key, part in mine:
        if part is None or part in out.values():
            continue
        theirs = saved_part.get(key)
        if not isinstance(theirs, int) or theirs in out:
            raise ValueError(f"{path}: the checkpoint holds no parameter {key!r} of its own")
        out[theirs] = part
    return out


def load(
    trainer: OffloadTrainer, load_dir: str, tag: str | None, then: Callable[[], None] | None = None
) -> tuple[str, dict]:
    """See :meth:`aio.zero.OffloadTrainer.load_checkpoint`: the whole
    checkpoint verified, then applied (and `then` run) under one Ctrl-C."""
    tag = _read_latest(load_dir) if tag is None else check_tag(tag)
    path = os.path.join(load_dir, tag)
    require_complete(path)
    meta = verify_meta(trainer, path)
    client = load_plain(os.path.join(path, "client_state.pt"))
    params = trainer.store.verify_checkpoint(os.path.join(path, "params"), _part_ids(trainer, meta, path))
    opt = trainer.zero_optimizer.verify_checkpoint(os.path.join(path, "optimizer"))
    schedule = _verify_schedule(trainer, path)
    buffers = _verify_buffers(trainer, path)
    # Cut part-way, the parameters would be loaded beside the old optimizer
    # state and counters, and trained on from that mix.
    with interrupts_held("aio.zero's load_checkpoint()"):
        try:
            _apply(trainer, path, meta, (params, opt, schedule, buffers))
            if then is not None:
                then()
        except BaseException as e:
            trainer.load_cut = (
                f"load_checkpoint({path!r}) was cut part-way ({type(e).__name__}: {e}): the parameters, "
                "optimizer state and counters may be a mix of two steps; load a checkpoint again"
            )
            raise
        trainer.load_cut = None
    return path, client


def _apply(trainer: OffloadTrainer, path: str, meta: dict[str, Any], verified: tuple[Any, ...]) -> None:
    """What load() verified, into `trainer`."""
    params, opt, schedule, buffers = verified
    # Verified: only I/O errors can fail from here, and the swappers then
    # refuse to be used or exported until a checkpoint loads.
    trainer.reset_window()
    trainer.store.synchronize()
    trainer.store.apply_checkpoint(os.path.join(path, "params"), params)
    trainer.zero_optimizer.apply_checkpoint(os.path.join(path, "optimizer"), opt)
    _apply_schedule(trainer, schedule)
    _apply_buffers(trainer, buffers)
    for k in _COUNTERS:
        setattr(trainer, k, meta[k])
    # Saved at a window's end; with another gradient_accumulation_steps the
    # next micro-step must still open a window (zeroed gradients, the loss
    # divided by the new count), not continue one.
    trainer.micro_steps = -(-meta["micro_steps"] // trainer.gas) * trainer.gas
    scaler = trainer.scaling.scaler
    if scaler is not None and meta["scaler"]:
        scaler.load_state_dict(meta["scaler"])


def verify_meta(trainer: OffloadTrainer, path: str) -> dict[str, Any]:
    """The checkpoint's ``engine.json``, checked against `trainer`."""
    with open(os.path.join(path, "engine.json")) as f:
        meta = json.load(f)
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: engine.json is not an aio.zero checkpoint's")
    if meta.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: unsupported aio.zero checkpoint version {meta.get('version')!r}")
    if meta.get("optimizer", _optimizer_name(trainer)) != _optimizer_name(trainer):
        raise ValueError(
            f"{path}: saved with optimizer {meta.get('optimizer')}, this trainer steps with "
            f"{_optimizer_name(trainer)}: its state would not fit"
        )
    if not _same_params(meta.get("params"), trainer):
        raise ValueError(f"{path}: the checkpoint's parameters (names and shapes) do not match this model")
    dtype = trainer.cfg.dtype
    if meta.get("dtype") != dtype:
        raise ValueError(f"{path}: saved in {meta.get('dtype')}, this trainer trains in {dtype}")
    if not all(isinstance(meta.get(k), int) for k in _COUNTERS):
        raise ValueError(f"{path}: engine.json lacks its step counters")
    sc = meta.get("scaler")
    scaler = trainer.scaling.scaler
    if scaler is not None and sc:
        mine = scaler.state_dict()
        if not (isinstance(sc, dict) and set(mine) <= set(sc) and not mismatched(mine, sc)):
            raise ValueError(f"{path}: engine.json has a malformed loss-scaler state")
    return meta


def fsync_dir(path: str) -> None:
    """Make a folder's entries (a new file, a rename) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs_durably(path: str) -> None:
    """os.makedirs(path), and each folder it creates fsynced into its parent
    (a crash must not lose the entry of a new folder above a checkpoint)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for p in reversed(missing):
        os.makedirs(p, exist_ok=True)
        fsync_dir(os.path.dirname(p))
