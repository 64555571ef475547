"""Checkpoint copies at drive speed: bytes go drive to drive through pinned
buffers by the aio handle (O_DIRECT where the file system has it, so not
through the page cache), the next chunk read while the last is written, and
a CRC32 taken of every chunk as it passes (zlib releases the GIL for it).

A copy is a list of :class:`Chunk`: where to read it from (a future-returning
call into a buffer, or bytes already in memory) and where to write it (or
nowhere: a verify pass). :func:`copy_chunks` runs them through the buffers it
is given, two or more for overlap. :func:`land_all` waits for a batch of
I/O before its buffers are reused.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .drives import IOFuture


@dataclass
class Chunk:
    """One piece of a copy, at most one buffer long.

    ``read(view)`` starts reading ``nbytes`` into `view` and returns its
    future; or ``data`` holds the bytes already (a contiguous CPU tensor or
    buffer: no read, no buffer). ``write(src)`` starts writing `src` (the
    buffer view or ``data``) and returns its future; None only checksums.
    CRCs chain per ``key``, in chunk order."""

    nbytes: int
    key: Hashable
    read: Callable[[Any], IOFuture] | None = None
    data: Any = None
    write: Callable[[Any], IOFuture] | None = None


@contextlib.contextmanager
def free_buffers(pool: Any, most: int = 2) -> Iterator[list[memoryview]]:
    """Up to `most` buffers of a BufferPool that are free right now (none if
    all are in use: a copy never waits for one, nothing in the calling thread
    would give it back); given back on exit."""
    leases = []
    try:
        for _ in range(most):
            lease = pool.try_acquire()
            if lease is None:
                break
            leases.append(lease)
        yield [lease.buffer() for lease in leases]
    finally:
        for lease in leases:
            lease.release()


def _crc(src: Any, crc: int) -> int:
    import torch

    if isinstance(src, torch.Tensor):
        src = src.contiguous().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(src, crc)


def copy_chunks(chunks: Sequence[Chunk], buffers: Sequence[memoryview]) -> dict[Hashable, int]:
    """Run every chunk; returns the CRC32 of each key's bytes. With two or
    more buffers, chunk k + 1 is read while chunk k is written. The first
    I/O error is raised once nothing is in flight any more (the buffers are
    the caller's to reuse then), Ctrl-C included."""
    if not buffers:
        raise ValueError("copy_chunks needs at least one buffer")
    crcs: dict[Hashable, int] = {}
    writes: list[IOFuture | None] = [None] * len(buffers)
    reads: dict[int, tuple[Any, IOFuture | None]] = {}  # chunk -> (source, read in flight)
    direct: list[IOFuture] = []  # a write from the caller's memory, while it is waited for
    # Every future stays in one of these until it has settled, so the except
    # branch waits for it even when a wait is interrupted (Ctrl-C).
    try:
        for k, c in enumerate(chunks):
            for j in range(k, min(len(chunks), k + len(buffers))):  # keep the reads ahead started
                if j not in reads:
                    reads[j] = _start_read(chunks[j], buffers, writes, j)
            src, fut = reads[k]
            if fut is not None:
                fut.result()
            del reads[k]
            crcs[c.key] = _crc(src, crcs.get(c.key, 0))
            if c.write is None:
                continue
            if c.read is None:  # the source is the caller's memory: done before we return
                direct.append(c.write(src))
                direct[-1].result()
                direct.clear()
            else:
                writes[k % len(buffers)] = c.write(src)
    except BaseException:
        in_flight: list[IOFuture | None] = [f for _, f in reads.values()]
        in_flight.extend(writes)
        in_flight.extend(direct)
        land_all(in_flight, quiet=True)
        raise
    land_all(writes)
    return crcs


def _start_read(c: Chunk, buffers: Sequence[memoryview], writes: list[IOFuture | None], j: int) -> Any:
    if c.read is None:
        return c.data, None
    b = j % len(buffers)
    pending = writes[b]
    if pending is not None:
        pending.result()  # the buffer is free once its last write has landed
        writes[b] = None
    if c.nbytes > len(buffers[b]):
        raise ValueError(f"chunk of {c.nbytes} bytes does not fit a {len(buffers[b])}-byte buffer")
    view = buffers[b][: c.nbytes]
    return view, c.read(view)


def land_all(futures: Iterable[IOFuture | None], quiet: bool = False) -> None:
    """Wait for every future (None: no I/O there), then raise the first
    failure, unless `quiet` (an error is already on its way up): none is
    left in flight, so the buffers they read into or wrote from are free to
    reuse. The copies here and the optimizer's step (:mod:`aio.swap.step_io`)
    both land their I/O with it."""
    errors = [f.exception() for f in futures if f is not None]
    for e in errors:
        if e is not None and not quiet:
            raise e
