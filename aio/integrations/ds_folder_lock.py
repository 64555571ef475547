"""One job per DeepSpeed swap folder.

DeepSpeed names a rank's swap folder after the rank alone
(``<nvme_path>/zero_stage_3/<dtype>params/rank<r>`` for parameters,
``.../optimizer/rank<r>`` for the optimizer state), deletes the parameter
folder when a swapper starts and writes the same file names in every job.
Two jobs given one ``nvme_path`` (two experiments on one ``/local_nvme``)
therefore delete and overwrite each other's swapped tensors: with DeepSpeed's
own op the job hit asserted, on aio's handle it could train on in silence on
the other job's bytes (audit, DeepSpeed 0.19.8).

With aio enabled, each rank's swap folder is locked (``flock`` on a file
beside it, ``rank<r>.aio-lock``) by the process that uses it, before
DeepSpeed deletes or writes anything there; a second job gets an
``OSError`` (EBUSY) naming the folder and the process that holds it. The
lock is the kernel's: it goes when that process exits, crashed or not.
Swappers in one process share it (an engine built again in the same
process takes its folders over, as before); it goes with the swapper (the
optimizer's at ``engine.destroy()``), never from a forked child.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_held: dict[str, list[int]] = {}  # lock file -> [descriptor, holders in this process]


def lock_path(folder: str) -> str:
    """The lock file of DeepSpeed's swap folder `folder` (beside it)."""
    return os.path.abspath(folder).rstrip(os.sep) + ".aio-lock"


def hold(folder: str) -> Callable[[], None]:
    """Lock swap folder `folder` for this process and return the function
    that lets it go (idempotent). OSError (EBUSY) if another process holds it."""
    path = lock_path(folder)
    with _lock:
        entry = _held.get(path)
        if entry is None:
            entry = _held[path] = [_take(path, folder), 0]
        entry[1] += 1
    released, pid = threading.Event(), os.getpid()

    def release() -> None:
        # A forked child (a DataLoader worker) shares the parent's lock: its
        # copy of a swapper going must not let the parent's folder go.
        if released.is_set() or os.getpid() != pid:
            return
        released.set()
        with _lock:
            entry[1] -= 1
            if entry[1] == 0 and _held.get(path) is entry:
                del _held[path]
                # Unlinked while still locked: a process that opened this file
                # meanwhile finds it gone when it checks (see _take).
                with contextlib.suppress(OSError):
                    os.unlink(path)
                os.close(entry[0])

    return release


def _take(path: str, folder: str) -> int:
    """Open, lock and stamp `path`; the descriptor (closed on exec)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for _ in range(8):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OSError(
                errno.EBUSY,
                f"DeepSpeed's swap folder is in use by another process{holder}: DeepSpeed deletes and "
                "rewrites the files there by rank alone, so two jobs on one nvme_path corrupt each other; "
                "give each job its own nvme_path",
                folder,
            ) from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)  # unlinked by its last holder between our open and lock: again
    raise OSError(errno.EBUSY, "could not lock DeepSpeed's swap folder (its lock file kept changing)", folder)


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _holder(fd: int) -> str:
    """' (pid N)' from the lock file's stamp, or ''."""
    try:
        pid = int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return ""
    return f" (pid {pid})"


def _rank() -> int:
    from deepspeed import comm  # what DeepSpeed names the folder by

    return int(comm.get_rank())


def patch() -> list[tuple[Any, str, Any]]:
    """Lock each rank's parameter and optimizer swap folders before DeepSpeed
    touches them; the (owner, attribute, original) entries to undo."""
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    out = []
    for owner, attr, folder_of in (
        (AsyncPartitionedParameterSwapper, "_configure_aio", _param_folder),
        (DeepSpeedZeroOptimizer_Stage3, "_configure_tensor_swapping", _optimizer_folder),
    ):
        orig = getattr(owner, attr)
        if getattr(orig, "_aio_wrapped", False):
            continue
        setattr(owner, attr, _locking(orig, folder_of))
        out.append((owner, attr, orig))
    return out


def _param_folder(swapper: Any, ds_config: Any, *_: Any, **__: Any) -> str:
    # DeepSpeed 0.19's AsyncPartitionedParameterSwapper._configure_aio.
    dtype = str(swapper.dtype).split(".")[1]
    nvme_path = ds_config.zero_config.offload_param.nvme_path
    return os.path.join(str(nvme_path), "zero_stage_3", f"{dtype}params", f"rank{_rank()}")


def _optimizer_folder(_opt: Any, offload_optimizer_config: Any, *_: Any, **__: Any) -> str:
    # DeepSpeed 0.19's _configure_tensor_swapping and OptimizerSwapper.__init__.
    base = os.path.join(str(offload_optimizer_config.nvme_path), "zero_stage_3")
    return os.path.join(base, "optimizer", f"rank{_rank()}")


def _locking(orig: Callable[..., Any], folder_of: Callable[..., str]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def configure(self: Any, *args: Any, **kwargs: Any) -> Any:
        release = hold(folder_of(self, *args, **kwargs))
        try:
            result = orig(self, *args, **kwargs)
        except BaseException:
            release()
            raise
        weakref.finalize(self, release)
        self._aio_folder_release = release  # engine.destroy() lets the optimizer's go
        return result

    configure._aio_wrapped = True  # type: ignore[attr-defined]
    return configure
