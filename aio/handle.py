"""AsyncIOHandle: DeepSpeed-compatible async file I/O on the native core."""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import os
import threading
import warnings
import weakref
from typing import Any

import numpy as np

from . import _C, pinned
from ._args import PathArg, check_bool, check_int, check_path
from ._buffers import (
    MAX_OFFSET,
    ResolvedBuffer,
    abandon_inflight,
    resolve,
    track_inflight,
    untrack_inflight,
    wait_sliced,
)
from ._errors import HandleStateError
from ._log import logger
from .future import AioFuture, collectable, first_untold_error, wait_all

__all__ = ["AioFuture", "AsyncIOHandle", "PathArg"]

_READ, _WRITE = 0, 1
# What the core raises when it refuses a request before queueing anything (its
# one error translator's OSError subclasses, and argument errors). Not
# MemoryError: the core can run out of memory between two pieces it queues.
_REFUSED = (OSError, ValueError, TypeError, OverflowError)


def _check_offsets(file_offsets: Any) -> np.ndarray:
    """File offsets as a contiguous int64 array: integers >= 0, at least one."""
    arr = np.asarray(file_offsets)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"file_offsets: expected a non-empty 1-D sequence, got shape {arr.shape}")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"file_offsets: expected integers, got {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > MAX_OFFSET:
        raise OverflowError("file_offsets: an offset exceeds 2**63-1")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if int(arr.min()) < 0:
        raise ValueError(f"file_offsets: offsets must be >= 0, got {int(arr.min())}")
    return arr


def _refuse_append(fd: int) -> None:
    """ValueError for a write through a descriptor opened with O_APPEND: the
    kernel puts every such write at the end of the file, whatever offset it
    names, so the bytes would land elsewhere than asked."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        return  # not a descriptor: the core raises with its errno
    if flags & os.O_APPEND:
        raise ValueError(
            f"fd {fd} is open with O_APPEND: every write through it would go to the end of "
            "the file, not to file_offset; pass a descriptor opened without O_APPEND (or the path)"
        )


# Whether this process has logged why io_uring refused pinned-buffer
# registrations (one line per process, however many handles see it).
_refusal_logged = False
_refusal_lock = threading.Lock()


def _log_fixed_refusal(c: Any) -> None:
    """Log once per process why the core handle `c`'s rings were refused
    pinned-buffer registrations (stats()["fixed_refused"] counts them): the
    I/O still works, as plain READ/WRITE, so nothing else would say so."""
    global _refusal_logged
    if _refusal_logged:
        return
    why = c.fixed_refusal()
    if not why:
        return
    with _refusal_lock:
        if _refusal_logged:
            return
        _refusal_logged = True
    logger.warning("%s", why)


_live_handles: weakref.WeakSet[AsyncIOHandle] = weakref.WeakSet()


class AsyncIOHandle:
    """Reads and writes buffers at file offsets with direct, asynchronous I/O.

    Settings have DeepSpeed's meanings: ``block_size`` bytes per submitted I/O,
    ``queue_depth`` I/Os in flight per worker, ``thread_count`` workers (each
    request is split into that many contiguous slices), ``single_submit`` one
    ``io_submit`` per I/O, ``overlap_events`` keep the queue full rather than
    draining each batch. ``engine`` is ``"auto"`` (io_uring, else kernel AIO,
    else posix threads, with a warning when it comes to posix;
    ``stats()["engine_reason"]`` says which and why),
    ``"kernel_aio"``, ``"io_uring"`` (Linux 5.6+; an ``OSError`` says why
    where it is unavailable) or ``"posix"``.

    Any size and offset work: the aligned middle of a request goes O_DIRECT,
    unaligned edges go through the page cache, and memory that is not aligned
    is staged through an aligned bounce buffer.
    """

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 8,
        single_submit: bool = False,
        overlap_events: bool = True,
        thread_count: int = 1,
        engine: str = "auto",
        *,
        intra_op_parallelism: int | None = None,
    ) -> None:
        if intra_op_parallelism is not None:
            thread_count = intra_op_parallelism
        self._block_size = check_int("block_size", block_size)
        self._queue_depth = check_int("queue_depth", queue_depth)
        self._thread_count = check_int("thread_count", thread_count)
        if self._queue_depth > 65536:
            raise ValueError(f"queue_depth must be <= 65536, got {queue_depth}")
        if self._thread_count > 1024:
            raise ValueError(f"thread_count must be <= 1024, got {thread_count}")
        self._single_submit = check_bool("single_submit", single_submit)
        self._overlap_events = check_bool("overlap_events", overlap_events)
        if not isinstance(engine, str):
            raise TypeError(f"engine must be a str, got {type(engine).__name__}")
        known = ["auto", *_C.engines()]
        if engine not in known:
            raise ValueError(f"engine must be one of {known}, got {engine!r}")
        self._c: Any = _C.Handle(
            block_size=self._block_size,
            queue_depth=self._queue_depth,
            single_submit=self._single_submit,
            overlap_events=self._overlap_events,
            thread_count=self._thread_count,
            engine=engine,
        )
        if engine == "auto" and self._c.engine == "posix":
            # Neither kernel queue works here: every I/O blocks a thread.
            warnings.warn(self._c.engine_reason, RuntimeWarning, stacklevel=2)
        _log_fixed_refusal(self._c)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pending: list[AioFuture] = []
        self._prune_at = 64
        # Futures already collected through result() and dropped from
        # _pending; wait() still counts them.
        self._pruned = 0
        self._closed = False
        _live_handles.add(self)

    # -- settings (DeepSpeed names) ------------------------------------------
    def get_block_size(self) -> int:
        """Bytes per submitted I/O (DeepSpeed name)."""
        return self._block_size

    def get_queue_depth(self) -> int:
        """I/Os in flight per worker (DeepSpeed name)."""
        return self._queue_depth

    def get_single_submit(self) -> bool:
        """Whether each I/O is submitted with its own ``io_submit`` (DeepSpeed name)."""
        return self._single_submit

    def get_overlap_events(self) -> bool:
        """Whether the queue is kept full rather than drained per batch (DeepSpeed name)."""
        return self._overlap_events

    def get_thread_count(self) -> int:
        """Number of workers; each request is split into that many slices."""
        return self._thread_count

    def get_intra_op_parallelism(self) -> int:
        """DeepSpeed's name for get_thread_count()."""
        return self._thread_count

    def get_alignment(self) -> int:
        """Granularity at which requests take the zero-copy O_DIRECT path
        (page size at least; larger if a file needed more)."""
        return int(self._live().alignment())

    @property
    def engine(self) -> str:
        """The I/O engine in use: ``"kernel_aio"``, ``"io_uring"`` or ``"posix"``."""
        return str(self._live().engine)

    # -- I/O -----------------------------------------------------------------
    def _live(self) -> Any:
        if self._closed:
            raise HandleStateError("AsyncIOHandle is closed")
        if os.getpid() != self._pid:
            raise HandleStateError(
                "this AsyncIOHandle was created in another process (before fork); "
                "create a new one in this process"
            )
        return self._c

    def _submit(self, op: int, buffer: Any, path: PathArg, file_offset: int) -> AioFuture:
        c = self._live()
        file_offset = check_int("file_offset", file_offset, minimum=0)
        spath, fd = check_path(path)
        if op == _WRITE and fd >= 0:
            _refuse_append(fd)
        buf = resolve(buffer, writable=(op == _READ))
        if file_offset + buf.nbytes > MAX_OFFSET:
            raise OverflowError(
                f"file_offset + buffer size must be <= 2**63-1, got {file_offset} + {buf.nbytes}"
            )
        finalize = None
        if buf.cuda_tensor is not None and op == _READ:
            host, dev = buf.keepalive, buf.cuda_tensor

            def finalize() -> None:
                dev.view(-1).copy_(host)

        return self._started(
            c, buf, finalize, lambda: c.submit(op, buf.ptr, buf.nbytes, spath, fd, file_offset)
        )

    @staticmethod
    def _started(c: Any, buf: ResolvedBuffer, finalize: Any, submit: Any) -> AioFuture:
        """``submit()`` the core's request for `buf` and wrap it in a future. The
        in-flight registry owns the memory from before the submit (see
        track_inflight), so no interruption in between can free it under a
        worker, and until the future attaches the request, waiting for the
        memory waits for the handle `c` to be idle; a submit the core refused
        gives the memory back."""
        token = track_inflight(buf.ptr, buf.nbytes, buf.keepalive, c)
        try:
            req = submit()
        except BaseException as e:
            # Only a refusal by the core means nothing was queued. A signal
            # handler's exception (Ctrl-C) can come right after the core's
            # submit returned, and a MemoryError part-way through
            # submit_pieces comes after earlier pieces were queued: the entry
            # keeps the memory, and a release waits for the handle's I/O.
            if isinstance(e, _REFUSED):
                untrack_inflight(token)
            else:
                abandon_inflight(token)
            raise
        try:
            fut = AioFuture(req, buf, finalize, token)
        except BaseException:
            abandon_inflight(token)  # Ctrl-C before or after attaching: kept all the same
            raise
        for note in c.take_notices():
            warnings.warn(note, RuntimeWarning, stacklevel=4)
        _log_fixed_refusal(c)
        return fut

    def _track(self, fut: AioFuture) -> AioFuture:
        with self._lock:
            # The list keeps unfinished futures (and their buffers) alive until
            # wait(). Futures the caller already collected with result() are
            # dropped here, so futures-only code never grows it without bound.
            # The threshold doubles with what stays (at least 64), so keeping
            # many futures in flight costs O(1) per submit, not a scan each.
            if len(self._pending) >= self._prune_at:
                keep = [f for f in self._pending if not (f._observed and f.done())]
                self._pruned += len(self._pending) - len(keep)
                self._pending = keep
                self._prune_at = max(64, 2 * len(keep))
            self._pending.append(fut)
        return fut

    def sync_pread(self, buffer: Any, path: PathArg, file_offset: int = 0) -> int:
        """Read len(buffer) bytes at `file_offset` into `buffer`; return bytes read."""
        return self._submit(_READ, buffer, path, file_offset).result()

    def sync_pwrite(self, buffer: Any, path: PathArg, file_offset: int = 0) -> int:
        """Write `buffer` at `file_offset` (file created if missing, never truncated)."""
        return self._submit(_WRITE, buffer, path, file_offset).result()

    def async_pread(self, buffer: Any, path: PathArg, file_offset: int = 0) -> AioFuture:
        """Start a read; returns a future. ``wait()`` also collects it."""
        return self._track(self._submit(_READ, buffer, path, file_offset))

    def async_pwrite(self, buffer: Any, path: PathArg, file_offset: int = 0) -> AioFuture:
        """Start a write; returns a future. ``wait()`` also collects it."""
        return self._track(self._submit(_WRITE, buffer, path, file_offset))

    def async_pread_pieces(self, buffer: Any, path: PathArg, file_offsets: Any) -> AioFuture:
        """Read ``len(file_offsets)`` equal pieces with one call: piece i of
        ``buffer`` (its bytes / the number of offsets) from ``file_offsets[i]``.

        Each piece is its own request, so ``queue_depth`` of them are in
        flight at once (4 KiB random reads at fio's iodepth), while the
        per-call work (buffer checks, opening the file, the future) is paid
        once. One future for all; it raises the error of the first failed
        piece (in piece order). Overlapping pieces follow the usual ordering
        (a piece overlapping an earlier write waits for it).
        """
        return self._track(self._submit_pieces(_READ, buffer, path, file_offsets))

    def async_pwrite_pieces(self, buffer: Any, path: PathArg, file_offsets: Any) -> AioFuture:
        """Write piece i of ``buffer`` at ``file_offsets[i]``; see :meth:`async_pread_pieces`."""
        return self._track(self._submit_pieces(_WRITE, buffer, path, file_offsets))

    def _submit_pieces(self, op: int, buffer: Any, path: PathArg, file_offsets: Any) -> AioFuture:
        c = self._live()
        offs = _check_offsets(file_offsets)
        spath, fd = check_path(path)
        if op == _WRITE and fd >= 0:
            _refuse_append(fd)
        buf = resolve(buffer, writable=(op == _READ))
        if buf.cuda_tensor is not None:
            raise ValueError("buffer: pieces of a CUDA tensor are not supported; use a host tensor")
        n = len(offs)
        if buf.nbytes % n:
            raise ValueError(f"buffer: {buf.nbytes} bytes do not split into {n} equal pieces")
        piece = buf.nbytes // n
        if int(offs.max()) + piece > MAX_OFFSET:
            raise OverflowError(f"file_offsets: an offset + piece size ({piece}) exceeds 2**63-1")
        return self._started(
            c, buf, None, lambda: c.submit_pieces(op, buf.ptr, piece, offs.ctypes.data, n, spath, fd)
        )

    def pread(
        self,
        buffer: Any,
        path: PathArg,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
    ) -> Any:
        """DeepSpeed-style read: bytes read, or a future when ``async_op``.

        ``validate`` re-reads the range with plain buffered I/O and raises
        ``OSError(EIO)`` if the bytes differ.
        """
        if validate and async_op:
            raise ValueError("validate=True needs async_op=False")
        if async_op:
            return self.async_pread(buffer, path, file_offset)
        n = self.sync_pread(buffer, path, file_offset)
        if validate:
            self.verify(buffer, path, file_offset, "read")
        return n

    def pwrite(
        self,
        buffer: Any,
        path: PathArg,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
    ) -> Any:
        """DeepSpeed-style write: bytes written, or a future when ``async_op``."""
        if validate and async_op:
            raise ValueError("validate=True needs async_op=False")
        if async_op:
            return self.async_pwrite(buffer, path, file_offset)
        n = self.sync_pwrite(buffer, path, file_offset)
        if validate:
            self.verify(buffer, path, file_offset, "write")
        return n

    def read(self, buffer: Any, path: PathArg, validate: bool = False) -> int:
        """Older DeepSpeed name: synchronous read at offset 0."""
        return int(self.pread(buffer, path, validate=validate))

    def write(self, buffer: Any, path: PathArg, validate: bool = False) -> int:
        """Older DeepSpeed name: synchronous write at offset 0."""
        return int(self.pwrite(buffer, path, validate=validate))

    def verify(self, buffer: Any, path: PathArg, offset: int = 0, what: str = "read") -> None:
        """Re-read ``len(buffer)`` bytes at `offset` with plain buffered I/O and
        raise ``OSError(EIO)`` naming `what` (the operation being checked) if
        they differ from `buffer`. What ``validate=True`` does after a read or
        write."""
        import numpy as np

        b = resolve(buffer, writable=False)
        if b.cuda_tensor is not None:
            mine = b.keepalive.numpy().view(np.uint8).reshape(-1)
        else:
            mine = np.ctypeslib.as_array((ctypes.c_uint8 * b.nbytes).from_address(b.ptr))
        if not _matches_file(mine, path, offset):
            import errno

            raise OSError(
                errno.EIO,
                f"validation after {what} failed: bytes at offset {offset}, length {b.nbytes} "
                "differ from a buffered read of the file",
                os.fspath(path) if not isinstance(path, int) else None,
            )

    def wait(self) -> int:
        """Wait for every async request; return how many completed since the last wait().

        Returns 0 when nothing was pending. If any failed, all are still
        waited for and the first error not yet seen by this thread (and not
        yet observed through the future's own ``result()``/``exception()``)
        is raised. Ctrl-C interrupts the wait; nothing is collected then and
        every request keeps its buffer until its I/O ends.
        """
        self._live()
        with self._lock:
            futs = list(self._pending)
        # Wait before taking anything out of _pending: an interrupted wait
        # must leave every in-flight buffer owned by a tracked future.
        wait_all(futs)
        first = first_untold_error(futs)
        with self._lock:
            gone = {id(f) for f in futs if collectable(f)}
            before = len(self._pending)
            self._pending = [f for f in self._pending if id(f) not in gone]
            n = before - len(self._pending) + self._pruned
            self._pruned = 0
        if first is not None:
            raise first
        return n

    def pending(self) -> int:
        """Number of async requests submitted and not yet collected by wait()."""
        with self._lock:
            return sum(1 for f in self._pending if not f.done())

    # -- pinned memory ---------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any) -> Any:
        """A pinned 1-D CPU tensor of `num_elem` elements with example_tensor's dtype."""
        return pinned.new_locked_tensor(num_elem, example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Release a tensor from new_cpu_locked_tensor (safe against stale views)."""
        return pinned.free_locked_tensor(tensor)

    def is_pinned(self, tensor: Any) -> bool:
        """True if the tensor's memory is pinned (by aio or by CUDA)."""
        return pinned.is_locked(tensor)

    # -- lifecycle -------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters: requests, bytes, I/Os, io_submit calls, retries, resumed
        short transfers, bounce/edge bytes, buffered fallback, engine and why."""
        s = dict(self._live().stats())
        s.update(
            block_size=self._block_size,
            queue_depth=self._queue_depth,
            thread_count=self._thread_count,
            single_submit=self._single_submit,
            overlap_events=self._overlap_events,
            pending=self.pending(),
            locked_bytes=pinned.locked_bytes(),
        )
        return s

    def _drain(self) -> None:
        if not self._closed and os.getpid() == self._pid:
            self._c.drain()

    def close(self) -> None:
        """Wait for in-flight I/O, then stop the workers. Idempotent.

        Like a file's close() after a failed flush, it raises the first error
        of an async request that nobody has seen (no result(), exception() or
        wait() reported it) once the handle is closed: a failed write is never
        lost silently."""
        if self._closed:
            return
        first = None
        if os.getpid() == self._pid:
            # Interruptible: Ctrl-C here leaves the handle open and intact.
            with self._lock:
                futs = list(self._pending)
            wait_all(futs)
            first = first_untold_error(futs)
            # Requests whose futures were dropped too (a sync call Ctrl-C'd on a
            # hung file system): waited for interruptibly as well.
            wait_sliced(self._c.drain_for, None)
        self._closed = True
        if os.getpid() == self._pid:
            self._c = None
        if first is not None:
            raise first

    def __enter__(self) -> AsyncIOHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Buffers of dropped futures are held by self._pending; drain before
        # they can be freed so no worker writes into released memory.
        try:
            self._drain()
        except Exception:
            pass

    def __repr__(self) -> str:
        eng = "closed" if self._closed else self._c.engine
        return (
            f"AsyncIOHandle(block_size={self._block_size}, queue_depth={self._queue_depth}, "
            f"single_submit={self._single_submit}, overlap_events={self._overlap_events}, "
            f"thread_count={self._thread_count}, engine={eng!r})"
        )


def _after_fork_in_child() -> None:
    # The child has copies of the parent's core handles but none of their
    # worker threads: destroying one would join or detach threads that do
    # not exist here. Keep them (one reference each, never dropped) for the
    # life of the child; the Python objects refuse use via their pid check.
    # The child's own rings log their own refusals.
    global _refusal_logged
    _refusal_logged = False
    for h in list(_live_handles):
        if h._c is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(h._c))


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _drain_all_at_exit() -> None:
    # I/O still in flight at interpreter exit completes before modules and
    # buffers are torn down.
    for h in list(_live_handles):
        try:
            h._drain()
        except Exception:
            pass


_VERIFY_CHUNK = 64 << 20


def _matches_file(mine: Any, path: PathArg, offset: int) -> bool:
    """Whether the file holds the bytes of `mine` (a flat uint8 array) at
    `offset`, read back in chunks with buffered I/O (one pread returns at most
    2 GiB on Linux, and a copy of a whole large buffer would double it)."""
    import numpy as np

    chunk = bytearray(min(_VERIFY_CHUNK, max(1, mine.size)))
    fd = path if isinstance(path, int) else os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = 0
        while done < mine.size:
            want = memoryview(chunk)[: min(len(chunk), mine.size - done)]
            got = os.preadv(fd, [want], offset + done)
            if got == 0:
                return False  # the file ends first
            if not np.array_equal(mine[done : done + got], np.frombuffer(want[:got], dtype=np.uint8)):
                return False
            done += got
        return True
    finally:
        if not isinstance(path, int):
            os.close(fd)
