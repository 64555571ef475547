"""ParamSwapper: parameter partitions paged between the drive and a fixed
pool of pinned buffers.

Life of a partition: ``register`` (extent reserved on the drive, or kept in CPU
memory when it is small or among the first ``max_in_cpu`` elements) -> ``write`` (its values
go to the drive) -> ``prefetch``/``swap_in`` (read into a pool buffer; the
returned tensor is a view of that buffer) -> ``release`` (buffer back to the
pool, no write-back: parameters are read-only between steps) -> after the
optimizer step, ``write`` again, or ``swap_out`` of a modified buffer.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..pinned import Lease, Register, locked_nbytes, new_locked_tensor, registered_tensor
from .copy import Chunk, copy_chunks, free_buffers
from .drives import IOFuture, SwapSpace
from .pool import BufferPool, PoolExhaustedError
from .storage import ALIGN, checkpoint_dir, crc32_of, require_complete, write_manifest


class SwapStateError(RuntimeError):
    """A partition or sub-group whose on-drive copy cannot be trusted (a
    write to it failed), or that is used in a state that does not allow it."""


class State(enum.Enum):
    """Where a partition's values are, and which I/O (if any) is in flight on them."""

    RESIDENT = "resident"  # kept in CPU memory, never on the drive
    ON_DRIVE = "on_drive"  # only on the drive
    IN_FLIGHT = "in_flight"  # being read into a buffer
    AVAILABLE = "available"  # in a buffer, readable
    WRITING = "writing"  # being written to the drive
    INVALID = "invalid"  # a write failed: the drive copy is not trustworthy


@dataclass
class _Partition:
    part_id: Any
    numel: int
    dtype: Any
    nbytes: int
    state: State
    offset: int = -1
    lease: Lease | None = None
    tensor: Any = None  # resident tensor, or view of the leased buffer
    future: IOFuture | None = None
    written: bool = False  # has the drive copy ever been written?
    releasing: bool = False  # release the buffer once the pending write lands
    # Read from another swapper's range instead of `offset` (see ParamSwapper.alias).
    alias: tuple[SwapSpace, int] | None = None
    locked: int = 0  # bytes page-locked for a resident tensor (pinned_bytes)


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty(0, dtype=dtype).element_size()


class ParamSwapper:
    """Pages parameter partitions through ``buffer_count`` pinned buffers of
    ``buffer_size`` elements (of ``dtype``) to files under ``nvme_path``.

    Partitions smaller than ``min_swap_bytes`` stay in CPU memory (an I/O
    would cost more than it saves), as do the partitions registered first, up
    to ``max_in_cpu`` elements in all: the first partition that would go past
    it, and every one after it, goes to the drive (DeepSpeed's prefix rule).
    CPU-resident partitions are page-locked when ``pin_memory``; so are the
    buffers, allocated at first use.
    """

    def __init__(
        self,
        nvme_path: str | Sequence[str],
        *,
        dtype: Any,
        buffer_count: int = 5,
        buffer_size: int = 100_000_000,
        max_in_cpu: int = 1_000_000_000,
        pin_memory: bool = True,
        aio: dict[str, Any] | None = None,
        min_swap_bytes: int = 64 * 1024,
        job_id: str | None = None,
        rank: int | None = None,
        register_host: Register | None = None,
    ) -> None:
        if max_in_cpu < 0:
            raise ValueError(f"zero_optimization.offload_param.max_in_cpu must be >= 0, got {max_in_cpu}")
        self.dtype = dtype
        self.buffer_size = int(buffer_size)
        self.max_in_cpu = int(max_in_cpu)
        self.pin_memory = pin_memory
        self.min_swap_bytes = min_swap_bytes
        self.register_host = register_host
        self.pool = BufferPool(
            int(buffer_count),
            self.buffer_size * _itemsize(dtype),
            pin_memory,
            "zero_optimization.offload_param.buffer_count",
            "zero_optimization.offload_param.buffer_size",
            register=register_host,
        )
        self.space = SwapSpace(nvme_path, "param", "params.swp", aio, job_id, rank)
        self.parts: dict[Any, _Partition] = {}
        self.resident_numel = 0
        self._cpu_full = False  # a partition went past max_in_cpu: the rest go to the drive
        self._resident_locked = 0  # bytes locked for CPU-resident partitions
        self.counters = {
            "swap_in": 0,
            "prefetch": 0,
            "hits": 0,
            "release": 0,
            "writes": 0,
            "bytes_read": 0,
            "bytes_written": 0,
            "resident_bytes": 0,
        }
        self.closed = False

    @classmethod
    def from_config(cls, config: Any, dtype: Any, **kw: Any) -> ParamSwapper:
        """From an OffloadConfig (or anything aio.config.load_config takes)."""
        from ..config import load_config

        cfg = load_config(config)
        p = cfg.offload_param
        if p is None or p.device != "nvme":
            raise ValueError("zero_optimization.offload_param.device must be 'nvme' for a ParamSwapper")
        return cls(
            p.nvme_dirs(),
            dtype=dtype,
            buffer_count=p.buffer_count,
            buffer_size=p.buffer_size,
            max_in_cpu=p.max_in_cpu,
            pin_memory=p.pin_memory,
            aio=cfg.aio.handle_kwargs(),
            **kw,
        )

    # -- registration ------------------------------------------------------------
    def _resident_tensor(self, numel: int, dtype: Any) -> Any:
        """Memory for a CPU-resident partition and the bytes it locks: pinned
        through `register_host` when given (a GPU's registration), else
        locked, or pageable without ``pin_memory``."""
        if not self.pin_memory:
            return _empty(numel, dtype), 0
        if self.register_host is not None:
            t, registered = registered_tensor(numel, dtype, self.register_host)
            if registered:
                self._resident_locked += registered
                return t, registered
        t = new_locked_tensor(numel, dtype)
        self._resident_locked += locked_nbytes(t)
        return t, locked_nbytes(t)

    def register(self, part_id: Any, numel: int, dtype: Any | None = None) -> State:
        """Declare a partition; returns where it will live (RESIDENT or ON_DRIVE)."""
        self._check_open()
        if part_id in self.parts:
            raise ValueError(f"partition {part_id!r} is already registered")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"partition {part_id!r}: numel must be a non-negative int, got {numel!r}")
        dtype = dtype or self.dtype
        nbytes = numel * _itemsize(dtype)
        small = nbytes < self.min_swap_bytes or numel == 0  # an empty tensor: nothing to page
        if not small and not self._cpu_full and self.resident_numel + numel > self.max_in_cpu:
            self._cpu_full = True
        if small or not self._cpu_full:
            t, locked = self._resident_tensor(numel, dtype)
            if not small:
                self.resident_numel += numel
            self.counters["resident_bytes"] += nbytes
            self.parts[part_id] = _Partition(
                part_id, numel, dtype, nbytes, State.RESIDENT, tensor=t, locked=locked
            )
            return State.RESIDENT
        if nbytes > self.pool.slot_bytes:
            need = -(-nbytes // _itemsize(self.dtype))
            raise ValueError(
                f"partition {part_id!r} has {numel} elements ({nbytes} bytes), more than one swap "
                f"buffer holds ({self.buffer_size} elements of {self.dtype}); raise "
                f"zero_optimization.offload_param.buffer_size to at least {need}"
            )
        off = self.space.allocate(nbytes)
        self.parts[part_id] = _Partition(part_id, numel, dtype, nbytes, State.ON_DRIVE, offset=off)
        return State.ON_DRIVE

    def unregister(self, part_id: Any) -> None:
        """Forget a partition nobody uses any more (a parameter replaced by a
        tied one): its I/O is waited for (a failure is moot: nothing reads
        it again), its buffer or resident memory given back. Its drive
        extent stays allocated, unread, until the swapper closes."""
        self._check_open()
        p = self._part(part_id)
        with contextlib.suppress(Exception):
            self._settle(p)
        if p.state == State.RESIDENT:
            self._resident_locked -= p.locked
            self.counters["resident_bytes"] -= p.nbytes
            if p.nbytes >= self.min_swap_bytes and p.numel:
                self.resident_numel -= p.numel
            p.tensor = None
        else:
            self._drop_buffer(p)
        del self.parts[part_id]

    # -- aliases -------------------------------------------------------------------
    def alias(self, part_id: Any, space: SwapSpace, offset: int) -> bool:
        """Read drive partition `part_id` from logical `offset` of `space` from
        now on: another swapper's range that holds the same bytes, e.g. the
        optimizer's float32 master weights of a float32 parameter. That range's
        owner writes it: after a step the caller only refreshes a buffered copy
        (:meth:`owner_wrote`) instead of writing the partition, which saves its
        bytes. The partition's own extent is not read while aliased; write(),
        swap_out() and apply_checkpoint() store to it and end the alias.

        False (nothing changes) for a CPU-resident partition, or one that a
        buffer cannot hold at that offset's alignment (each is read into its
        buffer at ``offset % 4096``, so the drive's aligned middle goes direct)."""
        self._check_open()
        p = self._part(part_id)
        if p.state == State.RESIDENT or offset % ALIGN + p.nbytes > self.pool.slot_bytes:
            return False
        self._settle(p)
        if p.state == State.INVALID:
            raise SwapStateError(f"partition {part_id!r} is invalid; cannot alias it")
        p.alias = (space, offset)
        p.written = True
        return True

    def is_aliased(self, part_id: Any) -> bool:
        """Whether the partition is read from another swapper's range (:meth:`alias`)."""
        return self._part(part_id).alias is not None

    def owner_wrote(self, part_id: Any, values: Any) -> None:
        """An aliased partition's owner has new values for it (`values`, flat,
        any float dtype), written to its range before the partition is next
        read: only a copy held in a buffer is refreshed, nothing is written."""
        p = self._part(part_id)
        if p.alias is None:
            raise ValueError(f"partition {part_id!r} is not aliased; write() it")
        self._settle(p)  # a read may still land in its buffer
        if p.lease is not None:
            p.tensor.copy_(values.detach().reshape(-1))

    def invalidate_aliased(self) -> int:
        """The owner's range of every aliased partition can no longer be
        trusted (a write to it failed part-way): each becomes invalid --
        reads refuse -- until new values are written (write(),
        apply_checkpoint()). Returns how many."""
        lost = [p for p in self.parts.values() if p.alias is not None]
        for p in lost:
            with contextlib.suppress(BaseException):  # a read into its buffer ends first
                self._settle(p)
            p.alias = None
            p.state, p.written = State.INVALID, False
        return len(lost)

    def read_into(self, part_id: Any, out: Any) -> None:
        """Read a drive partition's stored values into `out` (a contiguous CPU
        tensor of its bytes) from wherever they live; waits for its I/O first."""
        fut = self.start_read_into(part_id, out)
        if fut is not None:
            fut.result()

    def start_read_into(self, part_id: Any, out: Any) -> IOFuture | None:
        """read_into() that leaves the drive read in flight: its future (`out`
        must stay untouched until it is done), or None when the values were
        copied from memory at once (a CPU-resident partition, one in a buffer)."""
        p = self._part(part_id)
        self._settle(p)
        if p.state in (State.RESIDENT, State.AVAILABLE):
            out.copy_(p.tensor)
            return None
        if p.state == State.INVALID or not p.written:
            raise SwapStateError(f"partition {part_id!r} has no valid stored copy to read")
        space, offset = _where(self.space, p)
        return space.read(out, offset)

    # -- moving data ----------------------------------------------------------------
    def write(self, part_id: Any, tensor: Any, async_op: bool = False) -> None:
        """Store new values for a partition (initial values, or after a step)."""
        p = self._part(part_id)
        src = tensor.detach().reshape(-1)
        if src.numel() != p.numel or src.dtype != p.dtype:
            raise ValueError(
                f"partition {part_id!r}: expected {p.numel} elements of {p.dtype}, "
                f"got {src.numel()} of {src.dtype}"
            )
        if p.state == State.RESIDENT:
            p.tensor.copy_(src)
            return
        self._settle(p)
        p.alias = None  # new values of its own: its extent holds them from here on
        if p.lease is not None:
            p.tensor.copy_(src)  # keep the buffered copy coherent; write from it
            src = p.tensor
        # The future holds `src` alive until the write lands.
        p.future = self._start_write(p, src.contiguous())
        p.state = State.WRITING
        p.releasing = False
        self.counters["writes"] += 1
        self.counters["bytes_written"] += p.nbytes
        if not async_op:
            self._settle(p)

    def swap_in(self, part_ids: list[Any], async_op: bool = False) -> list[Any]:
        """Make partitions available; returns their tensors (views of pool
        buffers for partitions on the drive). With async_op the reads are only
        started: call synchronize() (or swap_in again) before using them."""
        self._check_open()
        parts = [self._part(part_id) for part_id in part_ids]
        need = sum(1 for p in parts if p.lease is None and p.state != State.RESIDENT)
        if need > self.pool.count:
            raise PoolExhaustedError(
                f"{need} partitions requested at once but only {self.pool.count} swap buffers "
                f"exist; raise zero_optimization.offload_param.buffer_count to at least {need}"
            )
        for p in parts:
            self._start_read(p, must=True)
        if not async_op:
            for p in parts:
                self._settle(p)
        return [p.tensor for p in parts]

    def prefetch(self, part_ids: list[Any]) -> int:
        """Start reading partitions that will be needed soon, as far as free
        buffers allow; returns how many reads were started."""
        started = 0
        for part_id in part_ids:
            p = self._part(part_id)
            if p.state == State.ON_DRIVE:
                if not self._start_read(p, must=False):
                    break
                started += 1
                self.counters["prefetch"] += 1
        return started

    def _start_read(self, p: _Partition, must: bool) -> bool:
        if p.state == State.INVALID:
            raise SwapStateError(
                f"partition {p.part_id!r}: its drive copy is invalid after a failed write; "
                "write() it again (or load a checkpoint) before reading"
            )
        if p.state in (State.RESIDENT, State.AVAILABLE, State.IN_FLIGHT):
            self.counters["hits"] += 1
            return True
        if p.state == State.WRITING:
            self._settle(p)
            if p.state == State.AVAILABLE:  # written from its buffer, which it keeps
                self.counters["hits"] += 1
                return True
        if not p.written:
            raise SwapStateError(f"partition {p.part_id!r} was never written; write() it first")
        lease = self.pool.try_acquire()
        while lease is None:
            if not self._free_one_buffer():
                if not must:
                    return False
                held = [q.part_id for q in self.parts.values() if q.lease is not None]
                raise PoolExhaustedError(
                    f"no free parameter swap buffer: all {self.pool.count} hold available "
                    f"partitions ({held[:8]}{'...' if len(held) > 8 else ''}); release() them "
                    f"after use or raise zero_optimization.offload_param.buffer_count"
                )
            lease = self.pool.try_acquire()
        p.lease = lease
        space, offset = _where(self.space, p)
        # At the offset's alignment in the buffer: the file's aligned middle then
        # meets aligned memory and goes direct (not through a bounce buffer).
        p.tensor = BufferPool.view(lease, p.dtype, p.numel, offset % ALIGN)
        p.future = space.read(p.tensor, offset)
        p.state = State.IN_FLIGHT
        self.counters["swap_in"] += 1
        self.counters["bytes_read"] += p.nbytes
        return True

    def _free_one_buffer(self) -> bool:
        """Wait for a buffered partition that is being written back to finish
        and release its buffer; False if no buffer can come back this way."""
        for q in self.parts.values():
            if q.lease is not None and q.future is not None and q.releasing:
                self._settle(q)
                return True
        return False

    def release(self, part_ids: list[Any]) -> None:
        """Give buffers back without writing (parameters are read-only between steps)."""
        for part_id in part_ids:
            p = self._part(part_id)
            if p.state == State.RESIDENT or p.lease is None:
                continue
            self._settle(p)
            if p.lease is not None:
                self._drop_buffer(p)
                self.counters["release"] += 1

    def swap_out(self, part_ids: list[Any], async_op: bool = False) -> None:
        """Write modified buffered partitions back, then release their buffers."""
        for part_id in part_ids:
            p = self._part(part_id)
            if p.state == State.RESIDENT:
                continue
            self._settle(p)
            if p.state != State.AVAILABLE:
                raise SwapStateError(
                    f"partition {part_id!r} is {p.state.value}, not available; nothing to swap out"
                )
            p.alias = None  # modified: its own extent holds it from here on
            p.future = self._start_write(p, p.tensor)
            p.state = State.WRITING
            p.releasing = True
            self.counters["writes"] += 1
            self.counters["bytes_written"] += p.nbytes
        if not async_op:
            for part_id in part_ids:
                self._settle(self._part(part_id))

    def _start_write(self, p: _Partition, src: Any) -> IOFuture:
        """Start writing `src` to p's extent. If starting it fails part-way (a
        striped write with some pieces out, or Ctrl-C between them), the
        extent may hold a mix of old and new bytes: p is invalid from then on."""
        try:
            return self.space.write(src, p.offset)
        except BaseException:
            p.state, p.written = State.INVALID, False
            raise

    def _drop_buffer(self, p: _Partition) -> None:
        if p.lease is not None:
            p.lease.release()
        p.lease = None
        p.tensor = None
        if p.state != State.INVALID:
            p.state = State.ON_DRIVE

    def _settle(self, p: _Partition) -> None:
        """Wait for p's I/O and apply the resulting state transition."""
        fut = p.future
        if fut is None:
            return
        # Cleared only once waited for: a Ctrl-C in the wait leaves it for the
        # next settle, which then applies its outcome (a failed write must
        # not be read back, its buffer must go back).
        exc = fut.exception()
        p.future = None
        is_write = p.state == State.WRITING
        releasing, p.releasing = p.releasing, False
        if is_write:
            if exc is not None:
                p.state = State.INVALID
                p.written = False
                if p.lease is not None and releasing:
                    p.lease.release()
                    p.lease, p.tensor = None, None
                raise SwapStateError(
                    f"writing partition {p.part_id!r} failed; its drive copy is now invalid"
                ) from exc
            p.written = True
            if releasing:
                self._drop_buffer(p)
            elif p.lease is None:
                p.state = State.ON_DRIVE
            else:
                p.state = State.AVAILABLE
            return
        if exc is not None:
            self._drop_buffer(p)  # the drive copy is still good; just not read
            raise exc
        p.state = State.AVAILABLE

    def wait(self, part_ids: list[Any]) -> None:
        """Wait for these partitions' pending reads and writes (raises a failed one)."""
        for part_id in part_ids:
            self._settle(self._part(part_id))

    def synchronize(self) -> None:
        """Wait for every read and write; raises the first failure after all finished."""
        first: BaseException | None = None
        for p in list(self.parts.values()):
            try:
                self._settle(p)
            except BaseException as e:  # noqa: BLE001 - collected, first re-raised
                first = first or e
        if first is not None:
            raise first

    # -- checkpoint ----------------------------------------------------------------------
    def export_checkpoint(self, directory: str) -> None:
        """Write every partition's values (resident or on the drive) to
        `directory`: one data file at aligned offsets plus a manifest with
        CRC32s, created under a temporary name and renamed into place. Drive
        partitions go drive to drive through two pinned buffers (the next
        read while the last is written)."""
        import os

        self._check_open()
        self.synchronize()
        with checkpoint_dir(directory) as tmp:
            data = os.path.join(tmp, "params.bin")
            entries, chunks = [], []
            off = 0
            for p in self.parts.values():
                if p.state == State.INVALID:
                    raise SwapStateError(f"partition {p.part_id!r} is invalid; cannot checkpoint it")
                if not isinstance(p.part_id, (int, str)):
                    raise TypeError(
                        f"checkpoint needs int or str partition ids, got {type(p.part_id).__name__}"
                    )
                write = functools.partial(self.space.handle.async_pwrite, path=data, file_offset=off)
                if p.state == State.RESIDENT or p.lease is not None:
                    chunks.append(Chunk(p.nbytes, p.part_id, data=p.tensor.contiguous(), write=write))
                else:
                    space, offset = _where(self.space, p)
                    read = functools.partial(space.read, offset=offset)
                    chunks.append(Chunk(p.nbytes, p.part_id, read=read, write=write))
                entries.append(
                    {
                        "id": p.part_id,
                        "numel": p.numel,
                        "dtype": str(p.dtype).removeprefix("torch."),
                        "offset": off,
                    }
                )
                off += -(-p.nbytes // 4096) * 4096
            crcs = self._copy(chunks)
            for e in entries:
                e["crc32"] = crcs[e["id"]]
            write_manifest(tmp, {"version": 1, "kind": "aio-params", "partitions": entries})

    def _copy(self, chunks: list[Chunk]) -> dict[Any, int]:
        """copy_chunks() through up to two free pool buffers (a scratch
        buffer when every one is in use). Not counted in the swap counters."""
        if not any(c.read is not None for c in chunks):  # all in memory: no buffer, nothing pinned
            return copy_chunks(chunks, [memoryview(bytearray(1))])
        with free_buffers(self.pool) as buffers:
            if not buffers:
                buffers = [memoryview(bytearray(max((c.nbytes for c in chunks), default=1)))]
            return copy_chunks(chunks, buffers)

    def verify_checkpoint(self, directory: str, ids: dict[Any, Any] | None = None) -> dict[Any, Any]:
        """Check a checkpoint from export_checkpoint() completely -- marker,
        manifest, ids, sizes, dtypes, every checksum -- without changing
        anything. `ids` maps the checkpoint's partition ids to this
        swapper's (default: the same ids; partitions it leaves out are not
        loaded). Returns what apply_checkpoint() needs (the values of
        resident partitions, already read; drive partitions are read again)."""
        import json
        import os

        self._check_open()
        require_complete(directory)
        with open(os.path.join(directory, "manifest.json")) as f:
            manifest = json.load(f)
        if manifest.get("kind") != "aio-params" or manifest.get("version") != 1:
            raise ValueError(f"{directory} is not an aio parameter checkpoint (version 1)")
        if ids is None:
            ids = {part_id: part_id for part_id in self.parts}
        entries = {ids[e["id"]]: e for e in manifest["partitions"] if e["id"] in ids}
        # Partitions the mapping leaves out (a replaced parameter still alive
        # somewhere) keep their values.
        if set(entries) != set(ids.values()) or not set(entries) <= set(self.parts):
            raise ValueError("checkpoint partitions do not match the registered partitions")
        plan: dict[Any, Any] = {}
        on_drive = []
        for part_id, e in entries.items():
            p = self.parts[part_id]
            if e["numel"] != p.numel or e["dtype"] != str(p.dtype).removeprefix("torch."):
                raise ValueError(f"checkpoint partition {part_id!r} has a different size or dtype")
            if p.state == State.RESIDENT:
                plan[part_id] = (e, self._read_verified(directory, p, e))
            else:
                plan[part_id] = (e, None)
                on_drive.append(self._from_checkpoint(directory, p, e, into_swap=False))
        self._check_crcs(directory, plan, self._copy(on_drive))
        return plan

    def _from_checkpoint(self, directory: str, p: _Partition, e: dict[str, Any], into_swap: bool) -> Chunk:
        import os

        path = os.path.join(directory, "params.bin")
        read = functools.partial(self.space.handle.async_pread, path=path, file_offset=e["offset"])
        write = functools.partial(self.space.write, offset=p.offset) if into_swap else None
        return Chunk(p.nbytes, p.part_id, read=read, write=write)

    def _check_crcs(self, directory: str, plan: dict[Any, Any], crcs: dict[Any, int]) -> None:
        for part_id, got in crcs.items():
            if got != plan[part_id][0]["crc32"]:
                raise OSError(5, f"checkpoint partition {part_id!r} fails its checksum", directory)

    def _read_verified(self, directory: str, p: _Partition, e: dict[str, Any]) -> Any:
        import os

        t = _empty(p.numel, p.dtype)
        self.space.handle.sync_pread(t, os.path.join(directory, "params.bin"), e["offset"])
        if crc32_of(t) != e["crc32"]:
            raise OSError(5, f"checkpoint partition {p.part_id!r} fails its checksum", directory)
        return t

    def apply_checkpoint(self, directory: str, verified: dict[Any, Any]) -> None:
        """Load a checkpoint that verify_checkpoint() accepted. Only an I/O
        error can still fail here; then every drive partition is marked
        invalid (no mix of old and new values is ever read or exported)."""
        self._check_open()
        try:
            self.synchronize()
            chunks = []
            for part_id, (e, t) in verified.items():
                p = self.parts[part_id]
                if t is not None:
                    continue
                if p.lease is not None:  # in a buffer too: keep that copy coherent
                    self.write(part_id, self._read_verified(directory, p, e))
                    continue
                chunks.append(self._from_checkpoint(directory, p, e, into_swap=True))
                p.state, p.written = State.INVALID, False  # until its copy has landed
                p.alias = None  # the checkpoint's values go to its own extent
            # The file was verified; a checksum failing now means it changed since.
            self._check_crcs(directory, verified, self._copy(chunks))
            for c in chunks:
                p = self.parts[c.key]
                p.state, p.written = State.ON_DRIVE, True
        except BaseException:
            self._invalidate_drive_partitions()
            raise
        for part_id, (_e, t) in verified.items():
            if t is not None:
                self.write(part_id, t)

    def _invalidate_drive_partitions(self) -> None:
        for p in self.parts.values():
            if p.state == State.RESIDENT:
                continue
            with contextlib.suppress(BaseException):
                self._settle(p)
            p.state = State.INVALID
            p.written = False

    def import_checkpoint(self, directory: str) -> None:
        """Load values written by export_checkpoint() into the registered
        partitions (same ids, sizes and dtypes). Everything is verified first:
        a bad checkpoint leaves the current values intact."""
        self.apply_checkpoint(directory, self.verify_checkpoint(directory))

    # -- introspection ----------------------------------------------------------------
    def pinned_bytes(self) -> int:
        """Bytes this swapper has page-locked right now: its buffers (once
        allocated, when ``pin_memory``) and its CPU-resident partitions (when
        ``pin_memory``), whole pages, as counted by aio.locked_bytes()."""
        return self.pool.pinned_bytes + self._resident_locked

    def reserve_buffers(self) -> bool:
        """Allocate the swap buffers now when a partition lives on the drive
        (else the first swap_in allocates them, in the first forward); returns
        whether it did. Thread-safe: set-up runs it beside its own I/O."""
        if all(p.state == State.RESIDENT for p in self.parts.values()):
            return False
        self.pool.allocate()
        return True

    def status(self, part_id: Any) -> str:
        """The partition's State, as its string value (e.g. ``"on_drive"``)."""
        return self._part(part_id).state.value

    def stats(self) -> dict[str, Any]:
        """Counters, partitions per state, free buffers, pinned and drive bytes, swap folder."""
        by_state: dict[str, int] = {}
        for p in self.parts.values():
            by_state[p.state.value] = by_state.get(p.state.value, 0) + 1
        return {
            **self.counters,
            "partitions": len(self.parts),
            "aliased": sum(1 for p in self.parts.values() if p.alias is not None),
            "by_state": by_state,
            "buffers_free": self.pool.available(),
            "pinned_buffer_bytes": self.pool.pinned_bytes,
            "pinned_bytes": self.pinned_bytes(),
            "drive_bytes": self.space.size,
            "swap_dir": self.space.dirs[0],
            "drives": self.space.stats(),
        }

    def _part(self, part_id: Any) -> _Partition:
        try:
            return self.parts[part_id]
        except KeyError:
            raise KeyError(f"partition {part_id!r} is not registered") from None

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("ParamSwapper is closed")

    def close(self, free_buffers: bool = True) -> None:
        """Finish I/O, free the buffers and remove the swap folder. With
        `free_buffers` false the buffers are left to go with this swapper (a
        device copy from them may still be queued)."""
        if self.closed:
            return
        try:
            for p in self.parts.values():
                try:
                    self._settle(p)
                except BaseException:  # noqa: BLE001 - closing anyway
                    pass
        finally:
            self.closed = True
            try:
                if free_buffers:
                    self._let_buffers_go()
            finally:
                self.space.close()

    def _let_buffers_go(self) -> None:
        """The pool goes now, not when this swapper is collected (see
        BufferPool.close): the partitions' views and leases of it first."""
        for p in self.parts.values():
            if p.state != State.RESIDENT:
                if p.lease is not None:
                    p.lease.release()
                p.lease, p.tensor = None, None
        self.pool.close()

    def __enter__(self) -> ParamSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _where(own: SwapSpace, p: _Partition) -> tuple[SwapSpace, int]:
    """The space and logical offset partition `p`'s drive copy is read from."""
    return p.alias if p.alias is not None else (own, p.offset)


def _empty(numel: int, dtype: Any) -> Any:
    import torch

    return torch.empty(numel, dtype=dtype)
