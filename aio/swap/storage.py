"""Swap storage: a private per-user folder under ``nvme_path`` holding one
folder per job and rank, with preallocated swap files and aligned extents; and
the durable, atomic checkpoint folders the swappers and aio.zero write.

Layout: ``<nvme_path>/aio-swap-<uid>/<job>-rank<r>-<kind>-<pid>-<rand>/``.
The per-user folder is created mode 0700 and, before any use, checked to be
a real directory (not a symlink), owned by this user and closed to others:
on a drive shared by several users (a 1777 scratch folder) users never
collide, and nobody can plant a symlink that makes us write through it.
Every later access goes through descriptors held on what was verified
(``SwapFile.path`` is ``/proc/self/fd/<fd>``, the swap file's own
descriptor), so renaming a path component afterwards cannot redirect our
I/O either, and removing the folder (an ``rm -rf`` of the swap folder while
a job runs) does not take the job's state with it: the file lives on until
the swapper closes it.

Cleanup removes only folders that carry our marker: on close(), at
interpreter exit, and -- for jobs that were killed (SIGKILL, or SIGTERM,
which skips exit handlers) -- when the next job of the same user on the same
host starts and finds the marker's process gone.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import socket
import stat
import threading
import uuid
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from .._buffers import MAX_OFFSET as MAX_FILE_BYTES
from .._log import logger

ROOT_PREFIX = "aio-swap-"
MARKER = ".aio-swap-owner"
COMPLETE = "complete"  # written last into a checkpoint folder: the checkpoint is whole
ALIGN = 4096
_MARKER_MAX = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _job_id() -> str:
    for var in ("AIO_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LSB_JOBID", "PBS_JOBID"):
        v = os.environ.get(var)
        if v:
            return v
    return f"pid{os.getpid()}"


def _rank() -> int:
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        v = os.environ.get(var)
        if v and v.isdigit():
            return int(v)
    return 0


def root_name() -> str:
    """Name of this user's private swap folder inside an ``nvme_path``."""
    return f"{ROOT_PREFIX}{os.geteuid()}"


# -- the private per-user folder ----------------------------------------------------------
def _refuse(path: str, what: str) -> PermissionError:
    return PermissionError(
        errno.EACCES,
        f"refusing to use swap folder: it {what}; swap folders must be private to their user "
        "(remove it, or point nvme_path elsewhere)",
        path,
    )


def _check_private(st: os.stat_result, path: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, "is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise _refuse(path, f"has mode {stat.S_IMODE(st.st_mode):04o}, open to other users (want 0700)")


def _open_private_root(nvme_path: str) -> tuple[str, int]:
    """Create (exclusively) or reuse this user's folder; verify it and return
    (path, descriptor). Verified twice: lstat for a clear message, then fstat
    of the descriptor actually used (opened with O_NOFOLLOW), so a swap
    between the check and the open cannot slip through."""
    path = os.path.join(nvme_path, root_name())
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    _check_private(os.lstat(path), path)
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(path, "was replaced by a symbolic link or file") from None
        raise
    try:
        _check_private(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return path, fd


# -- owner markers and reclaiming killed jobs' folders --------------------------------------
def _read_small(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of a process, or None if
    it does not exist. Start time tells a reused pid from the original."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except FileNotFoundError:
        return None
    except OSError:
        return ("?", "?")  # cannot tell: treat as alive
    fields = raw[raw.rfind(")") + 2 :].split()
    if len(fields) < 20:
        return ("?", "?")
    return fields[0], fields[19]


def _identity() -> dict[str, Any]:
    st = _start_time(os.getpid())
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return {
        "pid": os.getpid(),
        "start": st[1] if st else "",
        "host": socket.gethostname(),
        "boot": _read_small("/proc/sys/kernel/random/boot_id"),
        "pidns": pidns,
    }


def _owner_is_dead(owner: dict[str, Any], me: dict[str, Any]) -> bool:
    """True only when we can be sure the owning process is gone: same host,
    same boot and same pid namespace as us, and its pid is free, a zombie, or
    now belongs to a process that started at another time. Anything else
    (another host, unreadable marker, unknown start time) counts as alive."""
    if owner.get("host") != me["host"] or not me["boot"] or not me["pidns"]:
        return False
    if owner.get("boot") != me["boot"] or owner.get("pidns") != me["pidns"]:
        return False
    pid, start = owner.get("pid"), owner.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not start:
        return False
    now = _start_time(pid)
    return now is None or now[0] in ("Z", "X") or (now[1] != "?" and now[1] != start)


def _open_own_folder(parent_fd: int, name: str) -> int | None:
    """A descriptor on the folder `name` in `parent_fd` if it is a real folder
    (never through a symlink) owned by this user, else None. The owner is
    read with fstat of the descriptor every later step goes through, so a
    folder swapped in under that name after the check is never touched."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return None
    try:
        mine = os.fstat(fd).st_uid == os.geteuid()
    except OSError:
        mine = False
    if not mine:
        os.close(fd)
        return None
    return fd


def _read_marker(dfd: int) -> dict[str, Any] | None:
    """The owner marker in the folder open as `dfd`, or None when it is
    missing, not a regular file or unreadable."""
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            owner = json.loads(os.read(fd, _MARKER_MAX))
        finally:
            os.close(fd)
    # RecursionError: 4 KiB of nested JSON lists ("[[[[...") is planted junk too.
    except (OSError, ValueError, RecursionError):
        return None
    return owner if isinstance(owner, dict) else None


def _rmdir_held(parent_fd: int, name: str, fd: int) -> bool:
    """Remove the (emptied) folder open as `fd` from `parent_fd`, where it was
    opened as `name`; False when `name` now is another folder (renamed in
    its place since: left alone)."""
    held, now = os.fstat(fd), os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino):
        return False
    os.rmdir(name, dir_fd=parent_fd)
    return True


def _remove_flat(root_fd: int, name: str, dfd: int) -> bool:
    """Remove a job folder (flat: marker and swap files) open as `dfd` without
    following any symlink: entries are unlinked relative to the descriptors."""
    for entry in os.listdir(dfd):
        with contextlib.suppress(OSError):
            os.unlink(entry, dir_fd=dfd)
    with contextlib.suppress(OSError):
        _rmdir_held(root_fd, name, dfd)
    return True


def _remove_folder(root_fd: int, name: str) -> None:
    """Remove this user's job folder `name` in `root_fd` (see _remove_flat)."""
    dfd = _open_own_folder(root_fd, name)
    if dfd is None:
        return
    try:
        _remove_flat(root_fd, name, dfd)
    finally:
        os.close(dfd)


def _reclaim_dead(
    root_fd: int,
    me: dict[str, Any],
    remove: Callable[[int, str, int], bool] = _remove_flat,
    match: Callable[[str], Any] | None = None,
) -> list[str]:
    """Remove the folders of this user in `root_fd` (those whose name passes
    `match`) whose owner marker names a process that died without cleaning
    up: by default job folders, flat. The folder is opened once: its owner,
    marker and removal all go through that descriptor (`remove(root_fd,
    name, dfd)`, True when it removed the folder)."""
    removed = []
    for name in os.listdir(root_fd):
        if match is not None and not match(name):
            continue
        dfd = _open_own_folder(root_fd, name)
        if dfd is None:  # not a folder, a symlink, or another user's: not ours to remove
            continue
        try:
            owner = _read_marker(dfd)
            if owner is not None and _owner_is_dead(owner, me) and remove(root_fd, name, dfd):
                removed.append(name)
        finally:
            os.close(dfd)
    return removed


# -- checkpoint folders -----------------------------------------------------------------------
def _fsync_path(path: str, flags: int) -> None:
    fd = os.open(path, flags | os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(top: str) -> dict[str, int]:
    """fsync every file and folder under `top` (folders after their files);
    returns {relative path: size} of the files."""
    sizes: dict[str, int] = {}
    for d, dirs, files in os.walk(top, topdown=False):
        for name in files:
            p = os.path.join(d, name)
            _fsync_path(p, 0)
            sizes[os.path.relpath(p, top)] = os.lstat(p).st_size
        for name in dirs:
            _fsync_path(os.path.join(d, name), os.O_DIRECTORY)
    return sizes


@contextlib.contextmanager
def checkpoint_dir(directory: str) -> Iterator[str]:
    """Yield a temporary folder beside `directory`; on success make it
    durable and rename it to `directory`, on any failure remove it.

    Durable means: every file and folder in it fsynced, then a ``complete``
    marker (listing every file, its size and, for all but the ``.bin`` data
    files that carry per-part checksums in their manifests, its CRC32)
    written and fsynced last, the
    folder fsynced, renamed, and the parent folder fsynced so the rename
    itself survives a power cut. A crash or error never leaves a
    half-written checkpoint under the final name, and loaders refuse a
    folder without the marker. `directory` must not exist or be empty."""
    # Checked before any work: the rename at the end replaces an empty
    # folder only, never a symbolic link (or a file) at that name.
    if os.path.islink(directory):
        raise FileExistsError(17, "checkpoint directory is a symbolic link; pass the real folder", directory)
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise FileExistsError(17, "checkpoint directory exists and is not a folder", directory)
    if os.path.exists(directory) and os.listdir(directory):
        raise FileExistsError(17, "checkpoint directory exists and is not empty", directory)
    parent = os.path.dirname(os.path.abspath(directory))
    reclaim_killed_saves(parent)
    tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{uuid.uuid4().hex[:8]}")
    # Private (0700 whatever the umask): nobody else can plant a file or a
    # symlink in it for a write to follow; the checkpoint keeps that mode.
    os.mkdir(tmp, 0o700)
    try:
        # Who is writing it: a save killed part-way leaves the folder, which
        # the next save beside it removes once this process is gone (not
        # fsynced: after a power cut the boot differs and the owner is unknown).
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(_identity(), f)
        yield tmp
        os.unlink(os.path.join(tmp, MARKER))
        sizes = _sync_tree(tmp)
        crcs = {rel: _crc32_file(os.path.join(tmp, rel)) for rel in sizes if not rel.endswith(".bin")}
        write_json_durably(os.path.join(tmp, COMPLETE), {"files": sizes, "crc32": crcs})
        _fsync_path(tmp, os.O_DIRECTORY)
        if os.path.exists(directory):
            os.rmdir(directory)
        os.rename(tmp, directory)
        _fsync_path(parent, os.O_DIRECTORY)
    except BaseException:
        _discard_save(tmp)
        raise


_SAVE_TMP = re.compile(r"^\..+\.tmp-[0-9a-f]{8}$")
# How far reclaiming goes into one save's folder before it gives up on it (a
# log line; the next save carries on): a save writes two levels (params/,
# optimizer/) and a file or two per sub-group. Anyone who may write to a
# shared checkpoint folder can plant a folder, so no tree may cost a save
# more than this, nor fail it.
RECLAIM_MAX_DEPTH = 32
RECLAIM_MAX_ENTRIES = 1 << 18
_PARENT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # the user's own path: a symlink is theirs


def _listed(fd: int) -> Iterator[str]:
    """The names in the folder open as `fd`; `fd` is closed if listing fails."""
    try:
        return iter(os.listdir(fd))
    except BaseException:
        os.close(fd)
        raise


def _empty_tree(top: int, max_entries: int | None) -> str | None:
    """Remove everything in the folder open as `top`, without recursion and
    relative to held descriptors (a symlink is unlinked, never followed; a
    sub-folder not of this user is not entered). Its owner marker goes
    last, so a folder given up on is still known to the next save. None when
    emptied, else why it stopped: past RECLAIM_MAX_DEPTH levels or
    `max_entries` entries."""
    frames: list[tuple[int, str, Iterator[str]]] = [(top, "", iter(os.listdir(top)))]
    budget = max_entries
    try:
        while frames:
            fd, name, names = frames[-1]
            entry = next(names, None)
            if entry is None:
                frames.pop()
                if frames:  # the top is the caller's to remove
                    try:
                        _rmdir_held(frames[-1][0], name, fd)
                    finally:
                        os.close(fd)
                continue
            if len(frames) == 1 and entry == MARKER:
                continue
            if budget is not None:
                budget -= 1
                if budget < 0:
                    return f"more than {max_entries} entries"
            try:
                os.unlink(entry, dir_fd=fd)
                continue
            except IsADirectoryError:
                pass
            if len(frames) > RECLAIM_MAX_DEPTH:
                return f"folders nested more than {RECLAIM_MAX_DEPTH} deep"
            child = _open_own_folder(fd, entry)
            if child is None:
                return f"{entry} is not a folder of this user"
            frames.append((child, entry, _listed(child)))
    finally:
        for fd, _, _ in frames[1:]:
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(MARKER, dir_fd=top)
    return None


def _remove_save(
    parent: str, parent_fd: int, name: str, dfd: int, max_entries: int | None = RECLAIM_MAX_ENTRIES
) -> bool:
    """Remove a save's temporary folder `name` in `parent` (open as
    `parent_fd`), itself open as `dfd` (see _empty_tree). Never raises: a
    folder it cannot remove is left with one log line, so reclaiming or
    cleaning up never fails a save."""
    try:
        why = _empty_tree(dfd, max_entries)
        if why is None:
            if _rmdir_held(parent_fd, name, dfd):
                return True
            why = "another folder was renamed to its name"
    # Anything (RecursionError, MemoryError, an OSError): cleaning up must not
    # be what fails the save, and the folder is only disk space.
    except Exception as e:
        why = " ".join(f"{type(e).__name__}: {e}".split())
    logger.getChild("swap").warning(
        "checkpoint save: left the temporary folder %s: %s; remove it by hand",
        os.path.join(parent, name),
        why,
    )
    return False


def reclaim_killed_saves(parent: str) -> list[str]:
    """Remove the temporary folders that checkpoint saves killed part-way
    (SIGKILL, a power cut) left in `parent`: only this user's folders whose
    owner marker says this host, boot and pid namespace and a process that
    is gone; a save still running, on another host, of another user or
    unknown is left alone. Never raises: what it cannot do is logged (one
    line) and the save goes on; see RECLAIM_MAX_DEPTH."""
    try:
        fd = os.open(parent, _PARENT_FLAGS)
    except OSError as e:
        logger.getChild("swap").warning("checkpoint save: cannot look for killed saves in %s: %s", parent, e)
        return []
    try:
        return _reclaim_dead(fd, _identity(), functools.partial(_remove_save, parent), _SAVE_TMP.match)
    except Exception as e:  # as in _remove_save: never what fails the save
        why = " ".join(f"{type(e).__name__}: {e}".split())
        logger.getChild("swap").warning("checkpoint save: looking for killed saves in %s: %s", parent, why)
        return []
    finally:
        os.close(fd)


def _discard_save(tmp: str) -> None:
    """Remove this save's own temporary folder `tmp` after a failure
    (bounded in depth only; never raises, as _remove_save)."""
    try:
        parent_fd = os.open(os.path.dirname(tmp), _PARENT_FLAGS)
    except OSError:
        return
    try:
        dfd = _open_own_folder(parent_fd, os.path.basename(tmp))
        if dfd is not None:
            try:
                _remove_save(os.path.dirname(tmp), parent_fd, os.path.basename(tmp), dfd, max_entries=None)
            finally:
                os.close(dfd)
    finally:
        os.close(parent_fd)


MAX_MARKER_BYTES = 64 << 20  # a marker lists file names and numbers: far below this


def _open_regular(path: str) -> int:
    """A descriptor on `path` if it is a regular file, never through a
    symbolic link and never blocking on a FIFO; else ValueError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link: a checkpoint holds regular files only") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file: a checkpoint holds regular files only")
    return fd


def _crc32_file(path: str) -> int:
    crc = 0
    with os.fdopen(_open_regular(path), "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


# Deeper than any checkpoint aio writes (two levels: params/, optimizer/): a
# deeper folder is refused, not walked (a recursive walk of a 2000-deep one
# raised RecursionError instead of saying the checkpoint is not one).
MAX_CHECKPOINT_DEPTH = 32


def _files_in(directory: str) -> dict[str, int]:
    """{relative path: size} of every file under `directory`; ValueError for
    anything but regular files and folders (a symbolic link, a FIFO, a
    device) and for folders nested past MAX_CHECKPOINT_DEPTH."""
    found: dict[str, int] = {}
    todo = [("", 0)]  # (folder relative to `directory`, its depth): no recursion
    while todo:
        folder, depth = todo.pop()
        for name in os.listdir(os.path.join(directory, folder)):
            rel = os.path.join(folder, name)
            st = os.lstat(os.path.join(directory, rel))
            if stat.S_ISDIR(st.st_mode):
                if depth >= MAX_CHECKPOINT_DEPTH:
                    raise ValueError(
                        f"{directory}: {folder} holds folders nested more than {MAX_CHECKPOINT_DEPTH} "
                        "deep: not a checkpoint aio writes; refusing it"
                    )
                todo.append((rel, depth + 1))
            elif not stat.S_ISREG(st.st_mode):
                kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise ValueError(f"{directory}: {rel} is {kind}: refusing it")
            else:
                found[rel] = st.st_size
    return found


def _read_complete(directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``complete`` marker's (sizes, crcs), read without following a link."""
    marker = os.path.join(directory, COMPLETE)
    try:
        with os.fdopen(_open_regular(marker), "rb") as f:
            raw = f.read(MAX_MARKER_BYTES + 1)
        if len(raw) > MAX_MARKER_BYTES:
            raise ValueError(f"larger than {MAX_MARKER_BYTES} bytes")
        listing = json.loads(raw)
        files, crcs = listing["files"], listing.get("crc32", {})
        if not isinstance(files, dict) or not isinstance(crcs, dict):
            raise ValueError("bad marker")
        if not all(isinstance(v, int) for v in [*files.values(), *crcs.values()]):
            raise ValueError("sizes and checksums must be integers")
    except FileNotFoundError:
        raise ValueError(
            f"{directory} is not a complete checkpoint: it has no '{COMPLETE}' marker (it was not "
            "fully written, or was written by an aio version without durable checkpoints)"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise ValueError(f"{directory}: unreadable '{COMPLETE}' marker ({e})") from None
    return files, crcs


def require_complete(directory: str) -> None:
    """Raise unless `directory` is a whole checkpoint: its ``complete``
    marker exists and lists exactly the files there besides hidden ones
    (regular files only: a symbolic link, a FIFO or a device is refused, as
    is a file the marker does not list), each with the listed size, and every
    file it has a CRC32 for still has that checksum."""
    files, crcs = _read_complete(directory)
    there = _files_in(directory)
    there.pop(COMPLETE, None)
    for rel, size in files.items():
        if rel not in there:
            raise ValueError(f"{directory} is incomplete: {rel} is missing")
        if there[rel] != size:
            raise ValueError(f"{directory} is damaged: {rel} has {there[rel]} bytes, {size} were written")
    # Hidden files are no part of a checkpoint (none is written, none read):
    # a file browser's .DS_Store or NFS's .nfsXXXX do not damage it.
    unlisted = sorted(r for r in set(there) - set(files) if not os.path.basename(r).startswith("."))
    if unlisted:
        raise ValueError(
            f"{directory} holds files its '{COMPLETE}' marker does not list: {', '.join(unlisted)}"
        )
    for rel, crc in crcs.items():
        if rel not in files:
            raise ValueError(
                f"{directory}: its '{COMPLETE}' marker has a checksum for {rel}, which it does not list"
            )
        if _crc32_file(os.path.join(directory, rel)) != crc:
            raise ValueError(f"{directory} is damaged: {rel} does not match the checksum it was written with")


def write_json_durably(path: str, obj: Any) -> None:
    """Write `obj` as JSON to `path` and fsync it before returning."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(folder: str, manifest: dict) -> None:
    """manifest.json, flushed to the drive before the folder is renamed into place."""
    write_json_durably(os.path.join(folder, "manifest.json"), manifest)


def _first_line(e: BaseException) -> str:
    """The first line of an unpickling error (torch's are long), or its type."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_plain(path: str, safe: tuple[Any, ...] = ()) -> Any:
    """torch.load with ``weights_only=True``: tensors and plain containers
    only (plus the classes in `safe`), so a tampered checkpoint cannot run
    code. Anything else is a ValueError naming the file."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(list(safe)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"refusing to load {path}: it holds something other than tensors and plain data "
            f"(a tampered or foreign file?): {_first_line(e)}"
        ) from None
    except (RuntimeError, EOFError) as e:  # torch's zip reader on a cut or corrupt file
        raise ValueError(f"cannot load {path}: not a whole torch file: {_first_line(e)}") from None


def save_plain(obj: Any, path: str, what: str) -> None:
    """torch.save `obj`, first checking that load_plain() will accept it:
    a TypeError naming `what` instead of a checkpoint that cannot be loaded."""
    import io
    import pickle

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise TypeError(
            f"{what} must hold only tensors and plain data (dict, list, tuple, str, int, float, "
            f"bool, None), so that loading it cannot run code: {_first_line(e)}"
        ) from None
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


def crc32_of(t: Any) -> int:
    """CRC32 of a contiguous CPU tensor's bytes."""
    import torch

    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def align_up(n: int, a: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `a` (the swap files' alignment by default)."""
    return (n + a - 1) // a * a


# -- swap files and folders -------------------------------------------------------------------
_PROC_FD = os.path.isdir("/proc/self/fd")


class SwapFile:
    """One file of extents (byte ranges handed out by allocate()); each starts
    on an ALIGN boundary, so an extent is one aligned direct I/O.

    ``path`` is what to hand to an AsyncIOHandle: ``/proc/self/fd/<fd>``,
    this file's own descriptor (created exclusively in our verified folder),
    so no path component can be swapped under us and the file stays usable
    if its folder is removed (an audit deleted a rank's swap folder between
    steps: the state kept in memory could then never be saved). ``real_path``
    is for people."""

    def __init__(self, dir_fd: int, name: str, real_path: str) -> None:
        self.real_path = real_path
        self.size = 0
        self._lock = threading.Lock()
        # O_EXCL|O_NOFOLLOW: a planted file or symlink is an error, never reused.
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        self.path = f"/proc/self/fd/{self._fd}" if _PROC_FD else real_path

    def allocate(self, nbytes: int) -> int:
        """Reserve an aligned extent of at least nbytes; returns its offset.

        The file is grown with fallocate right away: writing into allocated
        blocks is much faster than extending a file, and running out of space
        shows up here, at registration, not mid-training.
        """
        if nbytes <= 0:
            raise ValueError(f"extent size must be positive, got {nbytes}")
        with self._lock:
            if self._fd < 0:
                raise ValueError("swap storage is closed")
            off = self.size
            end = off + align_up(nbytes)
            if end > MAX_FILE_BYTES:  # what an off_t holds: fallocate would overflow, not fail
                raise ValueError(
                    f"cannot reserve {nbytes} bytes of swap space at offset {off}: past the "
                    f"largest file size ({MAX_FILE_BYTES} bytes)"
                )
            try:
                os.posix_fallocate(self._fd, off, end - off)
                self.size = end
            except OSError as e:
                # Out of space part-way: give back whatever it did reserve.
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, off)
                raise OSError(
                    e.errno, f"cannot reserve {nbytes} bytes of swap space: {e.strerror}", self.real_path
                ) from None
            return off

    def shrink_to(self, size: int) -> None:
        """Give back the space past `size` (an offset allocate() returned, or
        the size before it): undoes the last allocations when a multi-drive
        extent could not be reserved on every drive."""
        with self._lock:
            if self._fd < 0 or size > self.size:
                return
            os.ftruncate(self._fd, size)
            self.size = size

    def close(self) -> None:
        """Close the file's descriptor (the folder removal deletes it). Idempotent."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class SwapStorage:
    """The folder of one swapper:
    ``<nvme_path>/aio-swap-<uid>/<job>-rank<r>-<kind>-<pid>-<rand>``.

    Creating one first removes the folders of this user's killed jobs on
    this host (see the module docstring); a live job's folder, or another
    host's, is never touched."""

    def __init__(self, nvme_path: str, kind: str, job_id: str | None = None, rank: int | None = None) -> None:
        if not nvme_path:
            raise ValueError("nvme_path must be a directory path")
        nvme_path = os.path.abspath(os.fspath(nvme_path))
        if not os.path.isdir(nvme_path):
            raise FileNotFoundError(2, "nvme_path is not an existing directory", nvme_path)
        if not os.access(nvme_path, os.W_OK | os.X_OK):
            raise PermissionError(13, "nvme_path is not writable", nvme_path)
        job = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id or _job_id())[:64]
        r = _rank() if rank is None else rank
        me = _identity()
        name = f"{job}-rank{r}-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        for _attempt in range(8):
            try:
                self.root, self._root_fd = _open_private_root(nvme_path)
            except FileNotFoundError:
                # Another job of ours (another rank) removed the empty user folder
                # between our mkdir and its checks: redo.
                continue
            try:
                self.reclaimed = _reclaim_dead(self._root_fd, me)
                os.mkdir(name, 0o700, dir_fd=self._root_fd)  # exclusive: never share a folder
                break
            except FileNotFoundError:
                # Another job of ours removed the (empty) user folder just now: redo.
                os.close(self._root_fd)
            except BaseException:
                os.close(self._root_fd)
                raise
        else:
            raise FileNotFoundError(2, "swap folder keeps disappearing", os.path.join(nvme_path, root_name()))
        self.dir = os.path.join(self.root, name)
        self._name = name
        self._pid = os.getpid()
        self._dir_fd = -1
        try:
            self._dir_fd = os.open(name, _DIR_FLAGS, dir_fd=self._root_fd)
            self._write_marker({**me, "job": job, "rank": r, "kind": kind})
        except BaseException:
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
            _remove_folder(self._root_fd, name)
            os.close(self._root_fd)
            raise
        self.files: dict[str, SwapFile] = {}
        self.closed = False
        # Also without close() (a swapper garbage-collected, or still open at
        # exit): the folder goes when this is collected, or at exit.
        self._finalizer = weakref.finalize(
            self, _close_storage, self.files, self._root_fd, self._dir_fd, name, self.root, self._pid
        )

    def _write_marker(self, owner: dict[str, Any]) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(MARKER, flags, 0o600, dir_fd=self._dir_fd)
            with os.fdopen(fd, "w") as f:
                json.dump(owner, f)
        except BaseException:
            os.close(self._dir_fd)
            raise

    def file(self, name: str) -> SwapFile:
        """The swap file `name` in this folder, created (exclusively) on first request."""
        if self.closed:
            raise ValueError("swap storage is closed")
        if "/" in name or name in ("", ".", "..", MARKER):
            raise ValueError(f"bad swap file name {name!r}")
        if name not in self.files:
            self.files[name] = SwapFile(self._dir_fd, name, os.path.join(self.dir, name))
        return self.files[name]

    def close(self) -> None:
        """Remove our folder, and the user folder if it is left empty. In a
        forked child this only closes descriptors: the folder is the parent's."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()


def _close_storage(
    files: dict[str, SwapFile], root_fd: int, dir_fd: int, name: str, root: str, pid: int
) -> None:
    """SwapStorage.close(), from what it holds (also its finalizer's)."""
    for f in files.values():
        f.close()
    try:
        if os.getpid() == pid:
            _remove_folder(root_fd, name)
            with contextlib.suppress(OSError):
                os.rmdir(root)  # only succeeds when no other job of ours uses it
    finally:
        os.close(dir_fd)
        os.close(root_fd)
