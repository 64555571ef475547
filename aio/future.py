"""AioFuture: one pending read or write, and the buffer it owns until done."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from ._buffers import (
    ResolvedBuffer,
    attach_request,
    deadline,
    untrack_inflight,
    wait_sliced,
)
from ._errors import HandleStateError


class AioFuture:
    """A pending read or write.

    The future owns the buffer's memory (for a tensor, its storage; for a GPU
    tensor, the pinned bounce buffer) until the I/O is done, so dropping the
    caller's reference early, ``t.set_()`` or ``free_cpu_locked_tensor(t)``
    are safe. Waits can be interrupted with Ctrl-C; the I/O and the buffer
    then stay as they were (still pending, still owned).
    """

    __slots__ = (
        "_req",
        "_buf",
        "_finalize",
        "_settled",
        "_exc",
        "_observed",
        "_lock",
        "_pid",
        "_token",
        "_tid",
        "_told",
        "__weakref__",
    )

    def __init__(
        self, req: Any, buf: ResolvedBuffer, finalize: Callable[[], None] | None, token: int
    ) -> None:
        """`token`: buf's entry in the in-flight registry (track_inflight(), made
        before `req` was submitted); the future attaches `req` to it and
        untracks it once settled."""
        attach_request(token, req)
        self._req = req
        self._buf: ResolvedBuffer | None = buf
        self._finalize = finalize
        self._settled = False
        self._exc: BaseException | None = None
        self._observed = False  # the caller has seen the outcome via result()/exception()
        self._lock = threading.Lock()  # one settle; every caller sees its outcome
        self._pid = os.getpid()
        self._token = token
        self._tid = threading.get_ident()  # the submitting thread (see AsyncIOHandle.wait)
        self._told: set[int] = set()  # threads a wait() has raised this error to

    @property
    def nbytes(self) -> int:
        """Bytes the request moves (the whole buffer)."""
        return int(self._req.nbytes)

    @property
    def offset(self) -> int:
        """File offset of the request's first byte."""
        return int(self._req.offset)

    def done(self) -> bool:
        """True once the I/O has finished (successfully or not). A read into a
        CUDA tensor lands in host memory first: done() copies it to the device
        before saying True, so the tensor holds the data once done() is."""
        if not self._req.done():
            return False
        if self._finalize is not None and os.getpid() == self._pid:
            self._settle()  # the read's last step; an error is kept for result()
        return True

    def _wait_until(self, until: float | None) -> bool:
        if self._req.done():
            return True
        if os.getpid() != self._pid:
            # The workers that would finish it live in the parent only.
            raise HandleStateError(
                "this I/O was submitted by another process (before fork) and cannot "
                "finish here; wait for it in the process that submitted it"
            )
        return wait_sliced(self._req.wait, until)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or `timeout` seconds pass (None or inf: no limit); return done().

        Ctrl-C interrupts the wait; the I/O goes on and the future keeps its buffer.
        """
        return self._wait_until(deadline(timeout))

    def _settle(self) -> None:
        with self._lock:
            if self._settled:
                return
            try:
                self._req.result()
                if self._finalize is not None:
                    self._finalize()
            except BaseException as e:  # noqa: BLE001 - stored and re-raised to the caller
                self._exc = e
            finally:
                self._buf = None
                self._finalize = None
                untrack_inflight(self._token)
                # Last: another thread that sees _settled also sees _exc.
                self._settled = True

    def _outcome(self, timeout: float | None) -> BaseException | None:
        if not self._wait_until(deadline(timeout)):
            raise TimeoutError(f"I/O not done after {timeout} s")
        self._settle()
        self._observed = True
        return self._exc

    def result(self, timeout: float | None = None) -> int:
        """Wait, then return the number of bytes moved or raise the I/O error."""
        exc = self._outcome(timeout)
        if exc is not None:
            raise exc
        return self.nbytes

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait, then return the error (or None) without raising it."""
        return self._outcome(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        kind = "write" if self._req.is_write else "read"
        return f"<AioFuture {kind} {self.nbytes} bytes at {self.offset} ({state})>"


def wait_all(futures: list[AioFuture]) -> None:
    """Block until every future is done (Ctrl-C interrupts; nothing changes then)."""
    for f in futures:
        f.wait()


def first_untold_error(futures: list[AioFuture]) -> BaseException | None:
    """Settle every finished future and return the first error that neither
    its own result()/exception() nor an earlier call from this thread has
    reported; each error is reported once per thread."""
    me = threading.get_ident()
    first: BaseException | None = None
    for f in futures:
        f._settle()
        if f._exc is not None and not f._observed and me not in f._told:
            f._told.add(me)
            if first is None:
                first = f._exc
    return first


def collectable(f: AioFuture) -> bool:
    """Whether wait() may forget a settled future: it succeeded, or its error
    reached its submitter (result()/exception(), or a wait() in that thread),
    or the submitting thread has ended and another wait() raised it."""
    if f._exc is None or f._observed or f._tid in f._told:
        return True
    return bool(f._told) and not any(t.ident == f._tid for t in threading.enumerate())
