"""OptimizerSwapper: optimizer sub-groups paged through pinned buffers.

The unit is a sub-group of ``sub_group_size`` elements. Its fp32 gradient,
fp32 master weights and every optimizer state tensor live back to back in one
aligned extent of the swap file::

    [ grad | master | state_0 | state_1 | ... ]

so reading a sub-group is one I/O and writing it back (everything but the
gradient, which the step consumes) is one I/O. The optimizer's state tensors
are discovered by stepping the optimizer once on a probe parameter, not
hard-coded, so any elementwise torch optimizer works (Adam's two moments,
SGD's momentum, Adagrad's sum...). Scalar state such as Adam's ``step`` stays
in CPU memory.

Pipelined (``pipeline_read``/``pipeline_write``): the read of sub-group i+1
and the write of sub-group i-1 run on separate handles while sub-group i is
stepped, so a step costs about max(I/O, compute), not their sum.
"""

from __future__ import annotations

import collections
import json
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..handle import AioFuture, AsyncIOHandle
from ..pinned import Lease
from .param import SwapStateError
from .pool import BufferPool
from .storage import (
    SwapStorage,
    align_up,
    checkpoint_dir,
    load_plain,
    require_complete,
    save_plain,
    write_manifest,
)

CHECKPOINT_VERSION = 1


def discover_state_spec(optimizer_cls: Any, **hyper: Any) -> list[tuple[str, Any]]:
    """(name, dtype) of the per-element state tensors `optimizer_cls` keeps,
    found by stepping it once on a small probe parameter."""
    import torch

    p = torch.nn.Parameter(torch.zeros(8))
    p.grad = torch.full((8,), 1e-3)
    opt = optimizer_cls([p], **hyper)
    opt.step()
    spec = []
    for name, v in opt.state[p].items():
        if torch.is_tensor(v) and v.shape == p.shape:
            spec.append((str(name), v.dtype))
    return spec


@dataclass
class _SubGroup:
    index: int
    numel: int
    offset: int  # of its extent in the swap file
    parts: dict[str, tuple[int, Any]]  # name -> (byte offset in the extent, dtype)
    nbytes: int  # of its extent
    scalars: dict[str, Any] | None = None  # None until its first step
    valid: bool = False  # drive copy holds a complete state
    grad_future: AioFuture | None = None
    proxy: Any = None
    history: list[str] = field(default_factory=list)


class OptimizerSwapper:
    """Swaps optimizer sub-groups to files under ``nvme_path``.

    ``optimizer_cls``/``hyper``: the torch optimizer applied per sub-group
    (e.g. ``torch.optim.Adam, {"lr": 1e-3}``). ``buffer_count`` pinned buffers
    each hold one whole sub-group.
    """

    def __init__(
        self,
        nvme_path: str,
        optimizer_cls: Any,
        hyper: dict[str, Any] | None = None,
        *,
        buffer_count: int = 4,
        pipeline_read: bool = False,
        pipeline_write: bool = False,
        pin_memory: bool = True,
        sub_group_size: int | None = None,
        aio: dict[str, Any] | None = None,
        job_id: str | None = None,
        rank: int | None = None,
    ) -> None:
        need = 1 + int(pipeline_read) + int(pipeline_write)
        if buffer_count < need:
            modes = " and ".join(
                m for m, on in (("pipeline_read", pipeline_read), ("pipeline_write", pipeline_write)) if on
            )
            raise ValueError(
                f"zero_optimization.offload_optimizer.buffer_count={buffer_count} is too small for "
                f"{modes or 'swapping'}: the pipeline holds one sub-group being stepped"
                f"{', one being read ahead' if pipeline_read else ''}"
                f"{', one being written back' if pipeline_write else ''}; "
                f"set buffer_count to at least {need}"
            )
        self.optimizer_cls = optimizer_cls
        self.hyper = dict(hyper or {})
        self.spec = discover_state_spec(optimizer_cls, **self.hyper)
        self.buffer_count = buffer_count
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        self.pin_memory = pin_memory
        self.sub_group_size = sub_group_size
        self.storage = SwapStorage(nvme_path, "optimizer", job_id, rank)
        self.file = self.storage.file("optimizer.swp")
        kw = dict(aio or {})
        self.reader = AsyncIOHandle(**kw)
        self.writer = AsyncIOHandle(**kw)
        self.groups: dict[int, _SubGroup] = {}
        self.pool: BufferPool | None = None
        self.optimizer: Any = None
        self.broken: str | None = None
        self.steps = 0
        self.counters = {"bytes_read": 0, "bytes_written": 0, "subgroup_steps": 0}
        self.closed = False

    @classmethod
    def from_config(
        cls, config: Any, optimizer_cls: Any, hyper: dict[str, Any] | None = None, **kw: Any
    ) -> OptimizerSwapper:
        """From a DeepSpeed-style config (anything aio.config.load_config takes);
        `kw` (job_id, rank) goes to the constructor. Needs offload_optimizer.device 'nvme'."""
        from ..config import load_config

        cfg = load_config(config)
        o = cfg.offload_optimizer
        if o is None or o.device != "nvme":
            raise ValueError(
                "zero_optimization.offload_optimizer.device must be 'nvme' for an OptimizerSwapper"
            )
        return cls(
            str(o.nvme_path),
            optimizer_cls,
            hyper,
            buffer_count=o.buffer_count,
            pipeline_read=o.pipeline_read,
            pipeline_write=o.pipeline_write,
            pin_memory=o.pin_memory,
            sub_group_size=cfg.zero_optimization.sub_group_size,
            aio=cfg.aio.handle_kwargs(),
            **kw,
        )

    # -- layout --------------------------------------------------------------------
    def _layout(self, numel: int) -> tuple[dict[str, tuple[int, Any]], int]:
        import torch

        parts: dict[str, tuple[int, Any]] = {}
        off = 0
        for name, dtype in [("grad", torch.float32), ("param", torch.float32), *self.spec]:
            parts[name] = (off, dtype)
            off = align_up(off + numel * torch.empty(0, dtype=dtype).element_size())
        return parts, off

    def register_subgroup(self, index: int, numel: int) -> None:
        """Reserve the drive extent for sub-group `index` of `numel` elements."""
        self._check_usable()
        import torch

        if index in self.groups:
            raise ValueError(f"sub-group {index} is already registered")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise ValueError(f"sub-group {index}: numel must be a positive int, got {numel!r}")
        if self.sub_group_size is not None and numel > self.sub_group_size:
            raise ValueError(
                f"sub-group {index} has {numel} elements, more than "
                f"zero_optimization.sub_group_size={self.sub_group_size}; raise sub_group_size "
                f"to at least {numel} or split the group"
            )
        parts, nbytes = self._layout(numel)
        if self.pool is not None and nbytes > self.pool.slot_bytes:
            if self.optimizer is not None or self.pool.available() != self.pool.count:
                raise ValueError(
                    f"sub-group {index} ({numel} elements) is larger than the swap buffers, which "
                    "were sized at the first step; register every sub-group before stepping"
                )
            self.pool = None  # still setting up and idle: re-size on next use
        off = self.file.allocate(nbytes)
        g = _SubGroup(index, numel, off, parts, nbytes)
        g.proxy = torch.nn.Parameter(torch.empty(0))
        self.groups[index] = g

    def _pool(self) -> BufferPool:
        if self.pool is None:
            if not self.groups:
                raise ValueError("no sub-groups registered")
            slot_bytes = max(g.nbytes for g in self.groups.values())
            self.pool = BufferPool(
                self.buffer_count,
                slot_bytes,
                self.pin_memory,
                "zero_optimization.offload_optimizer.buffer_count",
                "zero_optimization.sub_group_size",
            )
        return self.pool

    def acquire_buffer(self, timeout: float | None = None) -> Lease:
        """Lease one of the swapper's pinned sub-group buffers (e.g. to gather
        a gradient in); give it back before step(), which needs them all."""
        self._check_usable()
        return self._pool().acquire(timeout)

    def try_acquire_buffer(self) -> Lease | None:
        """acquire_buffer() without waiting: None when all are in use."""
        self._check_usable()
        return self._pool().try_acquire()

    def _views(self, g: _SubGroup, lease: Lease) -> dict[str, Any]:
        return {name: BufferPool.view(lease, dt, g.numel, off) for name, (off, dt) in g.parts.items()}

    def pinned_bytes(self) -> int:
        """Bytes of pinned sub-group buffers this swapper holds (or will hold at first use)."""
        return self._pool().pinned_bytes if self.groups else 0

    # -- initial state and gradients -------------------------------------------------
    def initialize(self, index: int, master: Any) -> None:
        """Write a sub-group's fp32 master weights, with zero gradient and
        state, to the drive (synchronously)."""
        import torch

        self._check_usable()
        g = self.groups[index]
        src = master.detach().reshape(-1)
        if src.numel() != g.numel:
            raise ValueError(f"sub-group {index}: expected {g.numel} elements, got {src.numel()}")
        lease = self._pool().acquire()
        try:
            views = self._views(g, lease)
            for v in views.values():
                v.zero_()
            views["param"].copy_(src.to(torch.float32))
            self.writer.sync_pwrite(lease.buffer()[: g.nbytes], self.file.path, g.offset)
            self.counters["bytes_written"] += g.nbytes
        finally:
            lease.release()
        g.scalars = None
        g.valid = True

    def write_gradient(self, index: int, grad: Any, async_op: bool = True) -> AioFuture:
        """Write a sub-group's fp32 gradient (e.g. during backward). The
        future keeps `grad` alive; the next step waits for it."""
        import torch

        self._check_usable()
        g = self.groups[index]
        src = grad.detach().reshape(-1)
        if src.numel() != g.numel or src.dtype != torch.float32:
            raise ValueError(
                f"sub-group {index}: gradient must be {g.numel} fp32 elements, "
                f"got {src.numel()} of {src.dtype}"
            )
        if g.grad_future is not None:
            g.grad_future.result()
        fut = self.writer.async_pwrite(src.contiguous(), self.file.path, g.offset + g.parts["grad"][0])
        self.counters["bytes_written"] += g.numel * 4
        g.grad_future = fut
        if not async_op:
            self._settle_grad(g)
        return fut

    def read_gradient(self, index: int, out: Any) -> None:
        """Read a sub-group's stored fp32 gradient into `out` (e.g. to add the
        next micro-batch's gradient to it); waits for its pending write first."""
        import torch

        self._check_usable()
        g = self.groups[index]
        if out.numel() != g.numel or out.dtype != torch.float32:
            raise ValueError(
                f"sub-group {index}: gradient buffer must be {g.numel} fp32 elements, "
                f"got {out.numel()} of {out.dtype}"
            )
        self._settle_grad(g)
        self.reader.sync_pread(out, self.file.path, g.offset + g.parts["grad"][0])
        self.counters["bytes_read"] += g.numel * 4

    def discard_gradients(self) -> None:
        """Wait for every pending gradient write and forget it, failed or not
        (the caller is abandoning this step's gradients)."""
        for g in self.groups.values():
            fut, g.grad_future = g.grad_future, None
            if fut is not None:
                fut.exception()

    def _settle_grad(self, g: _SubGroup) -> None:
        fut, g.grad_future = g.grad_future, None
        if fut is not None:
            fut.result()

    # -- the step ----------------------------------------------------------------------
    def _ensure_optimizer(self) -> None:
        if self.optimizer is None:
            proxies = [self.groups[i].proxy for i in sorted(self.groups)]
            self.optimizer = self.optimizer_cls(proxies, **self.hyper)

    def _apply(self, g: _SubGroup, views: dict[str, Any], grad_scale: Any = None) -> None:
        import torch

        if grad_scale is not None:
            views["grad"].mul_(grad_scale)
        proxy = g.proxy
        proxy.data = views["param"]
        proxy.grad = views["grad"]
        st = self.optimizer.state[proxy]
        st.clear()
        if g.scalars is not None:
            st.update(g.scalars)
            for name, _ in self.spec:
                st[name] = views[name]
        else:
            # First step of this sub-group: start from the state the optimizer
            # makes in its constructor, as it would in memory. Some optimizers
            # (Adagrad before torch 2.13) create state only there and fail on a
            # parameter without it; lazy ones create nothing here and make it
            # in step(). Either way it is copied into the buffer below.
            st.update(self.optimizer_cls([proxy], **self.hyper).state.get(proxy, {}))
        self.optimizer.step()
        names = {n for n, _ in self.spec}
        for name in names:
            t = st.get(name)
            if t is None:
                raise SwapStateError(f"optimizer did not produce state '{name}' for sub-group {g.index}")
            if t.data_ptr() != views[name].data_ptr():
                views[name].copy_(t)
        g.scalars = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items() if k not in names}
        st.clear()
        proxy.grad = None
        proxy.data = torch.empty(0)

    def step(self, after: Callable[[int, Any], None] | None = None, grad_scale: Any = None) -> None:
        """One optimizer step over every sub-group, in index order.

        `after(index, master_view)` runs right after each sub-group's update
        (e.g. to copy the new weights into the model's low-precision params).
        `grad_scale` (a number or 0-dim tensor) multiplies every gradient
        first: gradient clipping and loss-scale removal.
        Pipelined per pipeline_read / pipeline_write.

        If anything fails, every I/O still in flight is drained, sub-groups
        whose write did not land are marked invalid, the swapper refuses
        further steps (the optimizer state is now partly stepped), and the
        error is raised; import_checkpoint() restores a consistent state.
        """
        self._check_usable()
        order = sorted(self.groups)
        for i in order:
            if not self.groups[i].valid:
                raise SwapStateError(f"sub-group {i} has no valid state on the drive; initialize() it first")
        self._ensure_optimizer()
        io = _StepIO(self, self._pool())
        try:
            for k, i in enumerate(order):
                if i not in io.reads:
                    io.start_read(i)
                if self.pipeline_read and k + 1 < len(order):
                    io.start_read(order[k + 1])
                lease = io.take_read(i)
                self._step_subgroup(self.groups[i], lease, after, grad_scale)
                io.start_write(i, lease)
            io.finish_writes()
            self.steps += 1
        except BaseException as e:
            io.abort()
            self.broken = (
                f"optimizer step {self.steps + 1} failed ({type(e).__name__}: {e}); the swapped "
                "optimizer state is partly updated. Restore it with import_checkpoint()"
            )
            raise

    def _step_subgroup(
        self, g: _SubGroup, lease: Lease, after: Callable[[int, Any], None] | None, grad_scale: Any
    ) -> None:
        views = self._views(g, lease)
        self._apply(g, views, grad_scale)
        # The drive copy is stale from here until the write lands.
        g.valid = False
        self.counters["subgroup_steps"] += 1
        if after is not None:
            after(g.index, views["param"])

    def read_master(self, index: int) -> Any:
        """A CPU copy of a sub-group's fp32 master weights."""
        import torch

        g = self.groups[index]
        out = torch.empty(g.numel, dtype=torch.float32)
        self.reader.sync_pread(out, self.file.path, g.offset + g.parts["param"][0])
        return out

    # -- checkpoint ----------------------------------------------------------------------
    def export_checkpoint(self, directory: str) -> None:
        """Write every sub-group's master weights and optimizer state, plus a
        manifest with checksums, to `directory` (created atomically: a crash
        leaves no half-written checkpoint under that name)."""

        self._check_usable()
        with checkpoint_dir(directory) as tmp:
            manifest: dict[str, Any] = {
                "version": CHECKPOINT_VERSION,
                "optimizer": f"{self.optimizer_cls.__module__}.{self.optimizer_cls.__qualname__}",
                "spec": [[n, str(d)] for n, d in self.spec],
                "steps": self.steps,
                "groups": {},
            }
            scalars = {}
            pool = self._pool()
            for i in sorted(self.groups):
                g = self.groups[i]
                self._settle_grad(g)
                p_off = g.parts["param"][0]
                with pool.acquire() as lease:
                    buf = lease.buffer()[p_off : g.nbytes]
                    self.reader.sync_pread(buf, self.file.path, g.offset + p_off)
                    path = os.path.join(tmp, f"subgroup_{i}.bin")
                    self.writer.sync_pwrite(buf, path, 0)
                    crc = zlib.crc32(buf)
                manifest["groups"][str(i)] = {
                    "numel": g.numel,
                    "bytes": g.nbytes - p_off,
                    "crc32": crc,
                }
                scalars[i] = g.scalars
            save_plain(
                {"scalars": scalars, "param_groups": self._param_groups()},
                os.path.join(tmp, "scalars.pt"),
                "the optimizer's scalar state",
            )
            write_manifest(tmp, manifest)

    def _param_groups(self) -> list[dict[str, Any]]:
        if self.optimizer is None:
            return []
        return [{k: v for k, v in pg.items() if k != "params"} for pg in self.optimizer.param_groups]

    def verify_checkpoint(self, directory: str) -> dict[str, Any]:
        """Check a checkpoint from export_checkpoint() completely -- completeness
        marker, manifest, layout, every sub-group's checksum, the scalar state --
        without changing anything. Returns what apply_checkpoint() needs."""
        self._check_open()
        require_complete(directory)
        with open(os.path.join(directory, "manifest.json")) as f:
            manifest = json.load(f)
        if manifest.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"unsupported checkpoint version {manifest.get('version')!r}")
        spec = [[n, str(d)] for n, d in self.spec]
        if manifest["spec"] != spec:
            raise ValueError(
                f"checkpoint optimizer state {manifest['spec']} does not match this optimizer's {spec}"
            )
        if sorted(int(i) for i in manifest["groups"]) != sorted(self.groups):
            raise ValueError("checkpoint sub-groups do not match the registered sub-groups")
        extra = load_plain(os.path.join(directory, "scalars.pt"))
        if (
            not isinstance(extra, dict)
            or not isinstance(extra.get("scalars"), dict)
            or set(extra["scalars"]) != set(self.groups)
            or not isinstance(extra.get("param_groups"), list)
            or not isinstance(manifest.get("steps"), int)
        ):
            raise ValueError(f"{directory}: scalars.pt or the manifest does not describe these sub-groups")
        for i in sorted(self.groups):
            g = self.groups[i]
            meta = manifest["groups"][str(i)]
            if meta["numel"] != g.numel or meta["bytes"] != g.nbytes - g.parts["param"][0]:
                raise ValueError(f"checkpoint sub-group {i} has a different size")
            with self._pool().acquire() as lease:
                self._read_verified(directory, g, meta, lease)
        return {"manifest": manifest, "extra": extra}

    def _read_verified(self, directory: str, g: _SubGroup, meta: dict[str, Any], lease: Lease) -> Any:
        p_off = g.parts["param"][0]
        buf = lease.buffer()[p_off : g.nbytes]
        self.reader.sync_pread(buf, os.path.join(directory, f"subgroup_{g.index}.bin"), 0)
        if zlib.crc32(buf) != meta["crc32"]:
            raise OSError(5, f"checkpoint sub-group {g.index} fails its checksum", directory)
        return buf

    def apply_checkpoint(self, directory: str, verified: dict[str, Any]) -> None:
        """Load a checkpoint that verify_checkpoint() accepted into the swap
        files. Only an I/O error can still fail here; then the swapper refuses
        further use (and export) until a checkpoint is imported again."""
        self._check_open()
        manifest, extra = verified["manifest"], verified["extra"]
        try:
            for i in sorted(self.groups):
                g = self.groups[i]
                g.valid = False
                with self._pool().acquire() as lease:
                    buf = self._read_verified(directory, g, manifest["groups"][str(i)], lease)
                    self.writer.sync_pwrite(buf, self.file.path, g.offset + g.parts["param"][0])
                g.valid = True
        except BaseException as e:
            self.broken = (
                f"importing checkpoint {directory} failed part-way ({type(e).__name__}: {e}); the "
                "swapped optimizer state is a mix. Import a checkpoint again"
            )
            raise
        for i, g in self.groups.items():
            g.scalars = extra["scalars"][i]
        self._ensure_optimizer()
        for pg, saved in zip(self.optimizer.param_groups, extra["param_groups"], strict=False):
            pg.update(saved)
        self.steps = manifest["steps"]
        self.broken = None

    def import_checkpoint(self, directory: str) -> None:
        """Load a checkpoint from export_checkpoint() into the swap files.
        Everything is verified (marker, sizes, every checksum) before anything
        changes: a bad checkpoint leaves the current state intact."""
        self.apply_checkpoint(directory, self.verify_checkpoint(directory))

    # -- lifecycle -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters (bytes read/written, sub-group steps), steps, state tensor names,
        pinned and drive bytes, why it is broken (or None), swap folder."""
        return {
            **self.counters,
            "subgroups": len(self.groups),
            "steps": self.steps,
            "state_tensors": [n for n, _ in self.spec],
            "pinned_buffer_bytes": self.pool.pinned_bytes if self.pool else 0,
            "drive_bytes": self.file.size,
            "broken": self.broken,
            "swap_dir": self.storage.dir,
        }

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("OptimizerSwapper is closed")

    def _check_usable(self) -> None:
        self._check_open()
        if self.broken:
            raise SwapStateError(self.broken)

    def close(self) -> None:
        """Finish I/O, free the buffers and remove the swap folder. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for g in self.groups.values():
            if g.grad_future is not None:
                g.grad_future.exception()
        self.reader.close()
        self.writer.close()
        self.storage.close()

    def __enter__(self) -> OptimizerSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StepIO:
    """The buffers and I/Os of one OptimizerSwapper.step(): reads ahead,
    write-backs behind, and every lease held, so a failure can drain them all."""

    def __init__(self, sw: OptimizerSwapper, pool: BufferPool) -> None:
        self.sw = sw
        self.pool = pool
        self.reads: dict[int, tuple[Lease, AioFuture]] = {}
        self.writes: collections.deque[tuple[int, Lease, AioFuture]] = collections.deque()
        self.held: list[Lease] = []

    def _finish_write(self, entry: tuple[int, Lease, AioFuture]) -> None:
        i, lease, fut = entry
        try:
            fut.result()
            self.sw.groups[i].valid = True
        finally:
            lease.release()
            self.held.remove(lease)

    def finish_writes(self) -> None:
        """Wait for every write-back still in flight."""
        while self.writes:
            self._finish_write(self.writes.popleft())

    def start_read(self, i: int) -> None:
        """Lease a buffer (finishing write-backs to free one) and start reading sub-group i."""
        sw, g = self.sw, self.sw.groups[i]
        lease = self.pool.try_acquire()
        while lease is None and self.writes:
            self._finish_write(self.writes.popleft())
            lease = self.pool.try_acquire()
        if lease is None:  # cannot happen with the construction-time check
            raise SwapStateError("no free optimizer swap buffer")
        self.held.append(lease)
        sw._settle_grad(g)
        fut = sw.reader.async_pread(lease.buffer()[: g.nbytes], sw.file.path, g.offset)
        sw.counters["bytes_read"] += g.nbytes
        self.reads[i] = (lease, fut)

    def take_read(self, i: int) -> Lease:
        """Wait for sub-group i's read; return the buffer holding it."""
        lease, fut = self.reads.pop(i)
        fut.result()
        return lease

    def start_write(self, i: int, lease: Lease) -> None:
        """Write sub-group i back (all but its gradient), pipelined or at once."""
        sw, g = self.sw, self.sw.groups[i]
        p_off = g.parts["param"][0]
        fut = sw.writer.async_pwrite(lease.buffer()[p_off : g.nbytes], sw.file.path, g.offset + p_off)
        sw.counters["bytes_written"] += g.nbytes - p_off
        if not sw.pipeline_write:
            self._finish_write((i, lease, fut))
            return
        self.writes.append((i, lease, fut))
        while self.writes and self.writes[0][2].done():
            self._finish_write(self.writes.popleft())

    def abort(self) -> None:
        """After a failure: drain so nothing still reads into or writes from a
        buffer, keep the sub-groups whose write landed valid, release every lease."""
        for _lease, fut in self.reads.values():
            fut.exception()
        while self.writes:
            i, lease, fut = self.writes.popleft()
            if fut.exception() is None:
                self.sw.groups[i].valid = True
            lease.release()
            self.held.remove(lease)
        for lease in self.held:
            lease.release()
