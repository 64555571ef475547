"""Swap storage: a per-job, per-rank folder under ``nvme_path`` with
preallocated swap files and aligned slots.

Two jobs (or two ranks) sharing one ``nvme_path`` never collide: each gets
its own folder, created exclusively, with an owner marker. Cleanup removes
only folders that carry our marker, on close() and at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import socket
import threading
import uuid
import weakref
from collections.abc import Iterator

ROOT_NAME = "aio-swap"
MARKER = ".aio-swap-owner"
ALIGN = 4096

_live: weakref.WeakSet[SwapStorage] = weakref.WeakSet()


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


@contextlib.contextmanager
def checkpoint_dir(directory: str) -> Iterator[str]:
    """Yield a temporary folder beside `directory`; on success rename it to
    `directory`, on any failure remove it. A crash or error never leaves a
    half-written checkpoint under the final name. `directory` must not exist
    or be empty."""
    if os.path.exists(directory) and os.listdir(directory):
        raise FileExistsError(17, "checkpoint directory exists and is not empty", directory)
    parent = os.path.dirname(os.path.abspath(directory))
    tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        yield tmp
        if os.path.exists(directory):
            os.rmdir(directory)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_manifest(folder: str, manifest: dict) -> None:
    """manifest.json, flushed to the drive before the folder is renamed into place."""
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class SwapFile:
    """One file of slots; each slot starts on an ALIGN boundary, so a slot
    is one aligned direct I/O."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = 0
        self._lock = threading.Lock()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.close(fd)

    def allocate(self, nbytes: int) -> int:
        """Reserve an aligned slot of at least nbytes; returns its offset.

        The file is grown with fallocate right away: writing into allocated
        blocks is much faster than extending a file, and running out of space
        shows up here, at registration, not mid-training.
        """
        if nbytes <= 0:
            raise ValueError(f"slot size must be positive, got {nbytes}")
        with self._lock:
            off = self.size
            self.size = off + align_up(nbytes)
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            try:
                os.posix_fallocate(fd, off, self.size - off)
            except OSError as e:
                self.size = off
                raise OSError(
                    e.errno, f"cannot reserve {nbytes} bytes of swap space: {e.strerror}", self.path
                ) from None
            finally:
                os.close(fd)
            return off


class SwapStorage:
    """The folder of one swapper: ``<nvme_path>/aio-swap/<job>-rank<r>-<kind>-<pid>-<rand>``."""

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
        self.root = os.path.join(nvme_path, ROOT_NAME)
        os.makedirs(self.root, exist_ok=True)
        name = f"{job}-rank{r}-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.dir = os.path.join(self.root, name)
        os.mkdir(self.dir, 0o700)  # exclusive: fails rather than share a folder
        with open(os.path.join(self.dir, MARKER), "w") as f:
            f.write(f"pid={os.getpid()} host={socket.gethostname()} job={job} rank={r}\n")
        self.files: dict[str, SwapFile] = {}
        self.closed = False
        _live.add(self)

    def file(self, name: str) -> SwapFile:
        if self.closed:
            raise ValueError("swap storage is closed")
        if name not in self.files:
            self.files[name] = SwapFile(os.path.join(self.dir, name))
        return self.files[name]

    def bytes_reserved(self) -> int:
        return sum(f.size for f in self.files.values())

    def close(self) -> None:
        """Remove our folder (only if it carries our marker), and the shared
        root if it is left empty."""
        if self.closed:
            return
        self.closed = True
        if os.path.isfile(os.path.join(self.dir, MARKER)):
            shutil.rmtree(self.dir, ignore_errors=True)
        try:
            os.rmdir(self.root)  # only succeeds when no other job uses it
        except OSError:
            pass


@atexit.register
def _cleanup_at_exit() -> None:
    for s in list(_live):
        s.close()
