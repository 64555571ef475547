"""SwapSpace: one swapper's swap file spread over one or more drives.

Offload training is bound by drive bandwidth, and it scales with the number
of drives. DeepSpeed takes one ``nvme_path`` and leaves users to build a
RAID-0 (root only); aio takes a list of directories, one per drive, and
stripes over them itself, as RAID-0 does. The swapper sees one logical byte
range of extents; each extent is cut into stripes of ``stripe_bytes`` (less
for a small extent, so that it still reaches every drive), dealt out over the
drives in turn. A request longer than a stripe is split over the drives, so
all of them work on every read or write whatever the access pattern, and each
drive has its own folder, file and pair of handles (its own queue).

One directory is the plain case: one piece per request at its own offset, the
same I/O as a single swap file. Per drive, the folder is private
(:class:`~aio.swap.storage.SwapStorage`) and the file is reserved with
``fallocate`` as extents are allocated, so running out of space on any drive
shows up at registration, naming that drive's file.
"""

from __future__ import annotations

import bisect
import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._log import log_swap_handle, logger
from .._paths import repeated_directory
from ..handle import AioFuture, AsyncIOHandle
from .storage import ALIGN, SwapFile, SwapStorage, align_up

# Stripe unit: a whole aligned direct I/O per piece. Large enough that the
# per-request cost (a few microseconds of Python) is small next to the time
# the drive spends on it, small enough that a sub-group or parameter
# partition of a few MiB keeps every drive busy.
STRIPE_BYTES = 1 << 20


def nvme_path_items(nvme_path: Any) -> list[Any]:
    """What ``nvme_path`` names, as a list: one directory path (str or
    os.PathLike), or a list or tuple of them; TypeError for anything else
    (bytes, a set, a generator: every swapper takes the same forms)."""
    if isinstance(nvme_path, (str, os.PathLike)):
        return [nvme_path]
    if isinstance(nvme_path, (list, tuple)):
        return list(nvme_path)
    raise TypeError(f"nvme_path must be a directory path or a list of them, got {type(nvme_path).__name__}")


def nvme_path_list(nvme_path: str | os.PathLike[str] | Sequence[Any]) -> list[str]:
    """``nvme_path`` as a list of absolute directory paths (one string or a
    list of them: :func:`nvme_path_items`); ValueError for an empty list or
    a directory given twice (two paths to one folder would stripe a drive
    against itself)."""
    items = nvme_path_items(nvme_path)
    if not items:
        raise ValueError("nvme_path: give a directory, or a list of directories (one per drive)")
    for p in items:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"nvme_path: {p!r} is not a directory path")
        if not os.fspath(p):
            # abspath("") is the current directory: never swap there by accident.
            raise ValueError("nvme_path: an empty path; give the directory on the drive to swap to")
    paths = [os.path.abspath(os.fspath(p)) for p in items]
    twice = repeated_directory(paths)
    if twice is not None:
        raise ValueError(
            f"nvme_path: {twice[0]!r} and {twice[1]!r} are the same directory; list each drive once"
        )
    return paths


def _takes_o_direct(path: str) -> bool:
    """Whether the swap file at `path` (just created) opens with O_DIRECT."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flag)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    return True


def _bytes_of(buf: Any, write: bool) -> Any:
    """A byte-indexed view of a contiguous tensor or buffer (no copy): slices
    of it are the pieces handed to each drive's handle. The pieces are plain
    bytes, so what the handle refuses in the whole buffer (Python object
    pointers, a read into read-only memory) is refused here, first."""
    import torch

    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError("swap I/O needs a contiguous tensor")
        return buf.reshape(-1).view(torch.uint8)
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"swap I/O needs a tensor or buffer object, got {type(buf).__name__}") from None
    if "O" in mv.format:
        raise TypeError(f"swap I/O: buffer holds Python object pointers (format {mv.format!r})")
    if not mv.c_contiguous:
        raise ValueError("swap I/O needs a C-contiguous buffer")
    if not write and mv.readonly:
        raise ValueError("swap I/O: a read needs a writable buffer")
    return mv.cast("B")


@dataclass
class _Extent:
    """One allocated extent: logical bytes [start, start + size), cut into
    stripes of `unit` bytes; stripe k is on drive k % n at that drive's
    offset bases[drive] + (k // n) * unit. `unit` is the space's stripe, or
    less for an extent too small to give every drive a whole stripe."""

    start: int
    size: int
    unit: int
    bases: list[int]


@dataclass
class _Drive:
    """One directory of the set: its private folder, swap file and handles."""

    nvme_path: str
    storage: SwapStorage
    file: SwapFile
    reader: AsyncIOHandle
    writer: AsyncIOHandle
    direct: bool  # the file system takes O_DIRECT (else I/O is buffered)
    bytes_read: int = 0
    bytes_written: int = 0

    def close(self) -> None:
        """Close both handles and remove the folder, whatever fails; the first error is raised."""
        try:
            self.reader.close()
        finally:
            try:
                self.writer.close()
            finally:
                self.storage.close()


@dataclass
class StripedFuture:
    """The pieces of one request on several drives, seen as one future: done
    when all are, its error the first piece's error (after every piece has
    finished, so the buffer is never handed back while a piece still uses it)."""

    pieces: list[AioFuture]
    offset: int
    nbytes: int
    _exc: BaseException | None = field(default=None, repr=False)

    def done(self) -> bool:
        """True once every piece has finished (successfully or not)."""
        return all(f.done() for f in self.pieces)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every piece is done or `timeout` seconds pass; return done()."""
        import time

        end = None if timeout is None else time.monotonic() + timeout
        for f in self.pieces:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not f.wait(left):
                return False
        return True

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for every piece; the first error, or None."""
        if not self.wait(timeout):
            raise TimeoutError(f"I/O not done after {timeout} s")
        first = None
        for f in self.pieces:
            e = f.exception()
            first = first or e
        return first

    def result(self, timeout: float | None = None) -> int:
        """Wait for every piece; the bytes moved, or the first error raised."""
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return self.nbytes


# What SwapSpace.read/write return: the handle's own future for a request on
# one drive, a StripedFuture for one split over several.
IOFuture = AioFuture | StripedFuture


class SwapSpace:
    """A logical swap file of extents, striped over the drives of
    ``nvme_path`` (one directory or a list, one per drive).

    ``kind`` names the swapper ("param", "optimizer"), ``name`` the file in
    each drive's private folder; ``aio`` the handle settings (each drive gets
    a reader and a writer with them).
    """

    def __init__(
        self,
        nvme_path: str | Sequence[str],
        kind: str,
        name: str,
        aio: dict[str, Any] | None = None,
        job_id: str | None = None,
        rank: int | None = None,
        stripe_bytes: int = STRIPE_BYTES,
    ) -> None:
        if stripe_bytes <= 0 or stripe_bytes % ALIGN:
            raise ValueError(f"stripe_bytes must be a positive multiple of {ALIGN}, got {stripe_bytes}")
        self.stripe = stripe_bytes
        self.size = 0  # logical bytes allocated
        self._extents: list[_Extent] = []
        self._starts: list[int] = []  # of each extent, ascending (for bisect)
        self.drives: list[_Drive] = []
        try:
            for path in nvme_path_list(nvme_path):
                self.drives.append(self._open_drive(path, kind, name, aio, job_id, rank))
        except BaseException:
            self.close()
            raise
        log_swap_handle(self.drives[0].reader, ", ".join(d.storage.dir for d in self.drives))

    @staticmethod
    def _open_drive(
        path: str, kind: str, name: str, aio: dict[str, Any] | None, job_id: str | None, rank: int | None
    ) -> _Drive:
        storage = SwapStorage(path, kind, job_id, rank)
        try:
            f = storage.file(name)
            direct = _takes_o_direct(f.path)
            if not direct:
                logger.getChild("swap").warning(
                    "swap drive %s: the file system has no O_DIRECT; its swap I/O is buffered "
                    "(through the page cache)",
                    path,
                )
            kw = dict(aio or {})
            reader = AsyncIOHandle(**kw)
            try:
                return _Drive(path, storage, f, reader, AsyncIOHandle(**kw), direct)
            except BaseException:
                reader.close()
                raise
        except BaseException:
            storage.close()
            raise

    # -- layout -----------------------------------------------------------------------
    @property
    def dirs(self) -> list[str]:
        """Each drive's private swap folder."""
        return [d.storage.dir for d in self.drives]

    def allocate(self, nbytes: int) -> int:
        """Reserve an aligned extent of at least `nbytes`; returns its logical
        offset. The extent is cut into stripes spread over every drive (see
        _Extent); each drive's file grows by its share right away (fallocate:
        no space on a drive is an OSError naming that drive's file, here)."""
        if nbytes <= 0:
            raise ValueError(f"extent size must be positive, got {nbytes}")
        size = align_up(nbytes)
        n = len(self.drives)
        # Small extents still go to every drive, in smaller stripes.
        unit = min(self.stripe, align_up(-(-size // n)))
        stripes = -(-size // unit)
        short = stripes * unit - size  # the last stripe is only partly used
        bases: list[int] = []
        try:
            for i, d in enumerate(self.drives):
                share = -(-(stripes - i) // n) * unit  # drive i holds stripes i, i + n, ...
                if (stripes - 1) % n == i:
                    share -= short
                bases.append(d.file.allocate(share) if share > 0 else d.file.size)
        except BaseException:
            for d, base in zip(self.drives, bases, strict=False):
                d.file.shrink_to(base)  # the drives that grew give their share back
            raise
        ext = _Extent(self.size, size, unit, bases)
        self._extents.append(ext)
        self._starts.append(ext.start)
        self.size += size
        return ext.start

    def _extent(self, offset: int, nbytes: int) -> _Extent:
        i = bisect.bisect_right(self._starts, offset) - 1
        ext = self._extents[i] if i >= 0 else None
        if ext is None or offset + nbytes > ext.start + ext.size:
            raise ValueError(f"swap I/O of {nbytes} bytes at {offset} is not inside one allocated extent")
        return ext

    def pieces(self, offset: int, nbytes: int) -> list[tuple[int, int, int, int]]:
        """(drive index, offset on that drive, start in the buffer, length) of
        the logical byte range [offset, offset + nbytes), in order. The range
        must lie in one extent (ValueError otherwise)."""
        ext = self._extent(offset, nbytes)
        n = len(self.drives)
        rel = offset - ext.start
        if n == 1:
            return [(0, ext.bases[0] + rel, 0, nbytes)]
        out = []
        pos = rel
        while pos < rel + nbytes:
            k, within = divmod(pos, ext.unit)
            length = min(ext.unit - within, rel + nbytes - pos)
            drive = k % n
            out.append((drive, ext.bases[drive] + (k // n) * ext.unit + within, pos - rel, length))
            pos += length
        return out

    # -- I/O ------------------------------------------------------------------------
    def _submit(self, write: bool, buf: Any, offset: int) -> IOFuture:
        raw = _bytes_of(buf, write)
        nbytes = len(raw)
        parts = self.pieces(offset, nbytes)
        if len(parts) == 1:
            i, phys, _, _ = parts[0]
            return self._piece(write, i, buf, phys, nbytes)
        futs = []
        try:
            for i, phys, start, length in parts:
                futs.append(self._piece(write, i, raw[start : start + length], phys, length))
        except BaseException:
            for f in futs:  # settle what was submitted before raising
                f.exception()
            raise
        return StripedFuture(futs, offset, nbytes)

    def _piece(self, write: bool, i: int, buf: Any, phys: int, length: int) -> AioFuture:
        d = self.drives[i]
        if write:
            fut = d.writer.async_pwrite(buf, d.file.path, phys)
            d.bytes_written += length
        else:
            fut = d.reader.async_pread(buf, d.file.path, phys)
            d.bytes_read += length
        return fut

    def read(self, buf: Any, offset: int) -> IOFuture:
        """Start reading len(buf) bytes at logical `offset` into `buf` (a
        contiguous CPU tensor or a writable buffer); returns a future."""
        return self._submit(False, buf, offset)

    def write(self, buf: Any, offset: int) -> IOFuture:
        """Start writing `buf` (a contiguous CPU tensor or a buffer) at
        logical `offset`; returns a future (it keeps `buf` alive until done)."""
        return self._submit(True, buf, offset)

    def sync_read(self, buf: Any, offset: int) -> int:
        """read(), waited for: bytes read, or the I/O error raised."""
        return self.read(buf, offset).result()

    def sync_write(self, buf: Any, offset: int) -> int:
        """write(), waited for: bytes written, or the I/O error raised."""
        return self.write(buf, offset).result()

    @property
    def handle(self) -> AsyncIOHandle:
        """A handle for I/O on other files (checkpoints): the first drive's writer."""
        return self.drives[0].writer

    # -- reporting and lifecycle ----------------------------------------------------
    def stats(self) -> list[dict[str, Any]]:
        """Per drive: directory, swap folder, bytes on the drive, bytes read
        and written through it so far."""
        return [
            {
                "nvme_path": d.nvme_path,
                "swap_dir": d.storage.dir,
                "drive_bytes": d.file.size,
                "o_direct": d.direct,
                "bytes_read": d.bytes_read,
                "bytes_written": d.bytes_written,
            }
            for d in self.drives
        ]

    def close(self) -> None:
        """Wait for in-flight I/O, close the handles, remove every drive's
        folder. Idempotent; the first error is raised after all are closed."""
        first: BaseException | None = None
        for d in self.drives:
            try:
                d.close()
            except BaseException as e:  # noqa: BLE001 - every drive is closed, first error re-raised
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> SwapSpace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
