"""FSDP2's sharded parameters on the drive between uses.

:func:`offload_params` gives each FSDP group of a ``fully_shard``-ed model
an extent in this rank's private swap folder. A group's local shards are
written there and their storage freed (``untyped_storage().resize_(0)``,
which keeps every view FSDP and autograd hold valid); before any all-gather
of the group they are read back (drive -> aio's pinned buffer -> FSDP's
storage) and after it they are freed again. Each rank reads only its own
1/N; FSDP's all-gather moves the rest.

Safety does not depend on the look-ahead: the group's ``unshard`` and
``wait_for_unshard`` -- the one place every all-gather passes -- first make
sure the shards are in memory, reading them synchronously if the look-ahead
missed (counted in ``stats()["sync_fetches"]``, logged once). The look-ahead
replays the order of the previous iteration's gathers and keeps up to
``window`` groups' reads in flight, in ``window`` pinned slots of the
largest group.

Everything else that reads or writes the shards -- the optimizer step,
``state_dict``/DCP, ``load_state_dict``, ``model.to`` -- needs them all in
memory: the optimizer's step is bracketed by hooks (pass it to
:func:`offload_params`), the rest goes inside ``with tier.resident():``
(a state_dict or load outside it raises :class:`TierError`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from .._log import logger
from ..pinned import Lease, PinnedPool
from ..swap.drives import SwapSpace
from ..swap.storage import align_up
from ._internals import Shard, TierError, check_torch, fsdp_groups, module_name, shards_of
from .master import Source, is_nvme_adam, master_sources, skip_released_write_back

_log = logger.getChild("fsdp")
DEFAULT_WINDOW = 2

RESIDENT, READING, RELEASED = "resident", "reading", "released"


class _Group:
    """One FSDPParamGroup: its shards, its extent, where its bytes are."""

    def __init__(self, index: int, pg: Any, shards: list[Shard], nbytes: int, space: SwapSpace) -> None:
        self.index = index
        self.pg = pg
        self.shards = shards
        self.nbytes = nbytes  # bytes of the shards laid out (16-byte aligned)
        self.io_bytes = align_up(max(nbytes, 1))  # one aligned direct I/O
        self.offset = space.allocate(self.io_bytes)
        # Its own extent: one read, a copy per shard.
        self.own = Source(
            [(space, self.offset, self.io_bytes, 0)],
            [(s.start, j, 0, s.nbytes) for j, s in enumerate(shards)],
        )
        self.master: Source | None = None  # set: read from the optimizer's master weights
        self.where = RESIDENT
        self.dirty = True  # the drive copy is not (yet) the shard's value
        self.read: tuple[Lease, list[Any]] | None = None  # READING: its slot and futures
        self.write: tuple[Lease, Any] | None = None  # a write of it in flight

    def resident_bytes(self) -> int:
        return sum(s.resident_bytes() for s in self.shards)


class ParamTier:
    """The parameter tier of one FSDP2 model on one rank (see the module
    docstring); made by :func:`offload_params`."""

    def __init__(
        self,
        model: torch.nn.Module,
        nvme_path: Any,
        optimizer: torch.optim.Optimizer | None = None,
        window: int = DEFAULT_WINDOW,
        pin_memory: bool = True,
        aio: dict[str, Any] | None = None,
        params_from_master: bool = True,
    ) -> None:
        check_torch()
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (groups read ahead), got {window!r}")
        pgs = fsdp_groups(model)
        if not pgs:
            raise TierError("offload_params: the model has no fully_shard-ed module; apply fully_shard first")
        if any("unshard" in pg.__dict__ for pg in pgs):  # our per-instance wrappers
            raise TierError("offload_params: this model already has a parameter tier; close() it first")
        self.window = window
        self.counters = collections.Counter[str]()
        self._space = SwapSpace(nvme_path, "fsdp-params", "params", aio=aio, rank=_rank())
        self._handles: list[Any] = []
        # With NVMeAdamW, shards are read from its master weights after its first step.
        self._master_opt: Any = optimizer if params_from_master and is_nvme_adam(optimizer) else None
        self._pin = pin_memory
        try:
            self.groups = self._lay_out(pgs)
            self._pool = PinnedPool(window, max(g.io_bytes for g in self.groups), lock=pin_memory)
            self._inflight: collections.deque[_Group] = collections.deque()
            self._trace: list[int] = []  # the previous iteration's gathers, in order
            self._current: list[int] = []
            self._on_trace = False  # this iteration has gathered as the previous one did
            self._resident_depth = 0
            self._miss_logged = False
            self.closed = False
            # The drive holds every shard from the start; they stay in memory until
            # their first gather, after FSDP's lazy init (which re-pads them).
            for g in self.groups:
                self._write_out(g)
            self._drain()
            self._attach(model, optimizer)
        except BaseException:
            self._space.close()
            raise

    # -- set-up --------------------------------------------------------------------------
    def _lay_out(self, pgs: list[Any]) -> list[_Group]:
        groups = []
        for i, pg in enumerate(pgs):
            shards, nbytes = shards_of(pg, f"FSDP group {module_name(pg)}")
            groups.append(_Group(i, pg, shards, nbytes, self._space))
        return groups

    def _attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        for g in self.groups:
            orig_unshard, orig_wait = g.pg.unshard, g.pg.wait_for_unshard
            # Instance attributes shadow the methods for every caller, FSDP's own included.
            g.pg.unshard = functools.partial(self._unshard, g, orig_unshard)
            g.pg.wait_for_unshard = functools.partial(self._wait_for_unshard, g, orig_wait)
            self._handles.append((g.pg, ("unshard", "wait_for_unshard")))
        # Registered after fully_shard with prepend=True: runs before FSDP's root pre-forward.
        self._handles.append(model.register_forward_pre_hook(self._iteration_start, prepend=True))
        self._handles.append(model.register_state_dict_pre_hook(self._guard("state_dict")))
        self._handles.append(model.register_load_state_dict_pre_hook(self._guard("load_state_dict")))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(lambda *_: self._before_step()))
            self._handles.append(optimizer.register_step_post_hook(lambda *_: self._after_step()))
        self._watch_other_optimizers(optimizer)
        if self._master_opt is not None:
            self._handles.append(skip_released_write_back(self._master_opt))

    def _watch_other_optimizers(self, attached: torch.optim.Optimizer | None) -> None:
        """An optimizer not given to offload_params (built after it, a second
        one) that steps these parameters gets the same bracket: the shards
        loaded before its step, written and freed after. Without it the step
        reads freed storage: a segfault, not an exception."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        mine = {id(s.fsdp_param.sharded_param) for g in self.groups for s in g.shards}
        stepping: set[int] = set()

        def pre(opt: Any, *_: Any) -> None:
            if opt is attached or self.closed:
                return
            if any(id(p) in mine for group in opt.param_groups for p in group["params"]):
                stepping.add(id(opt))
                self._before_step()

        def post(opt: Any, *_: Any) -> None:
            if id(opt) in stepping:
                stepping.discard(id(opt))
                self._after_step()

        self._handles.append(register_optimizer_step_pre_hook(pre))
        self._handles.append(register_optimizer_step_post_hook(post))

    def _guard(self, what: str) -> Any:
        def hook(*_: Any, **__: Any) -> None:
            if self._resident_depth == 0 and not self.closed:
                raise TierError(
                    f"{what}() with the parameter tier on: the shards may be on the drive; "
                    f"call it inside `with tier.resident():`"
                )

        return hook

    # -- FSDP's gathers ----------------------------------------------------------------------
    def _unshard(self, g: _Group, orig: Any, async_op: bool = False) -> Any:
        if g.pg.is_sharded and g.pg._all_gather_result is None:
            pos = len(self._current)
            self._current.append(g.index)
            self._on_trace = self._on_trace and pos < len(self._trace) and self._trace[pos] == g.index
            self._ensure(g)
            self._look_ahead(pos + 1)
        return orig(async_op)

    def _wait_for_unshard(self, g: _Group, orig: Any) -> Any:
        gathered = g.pg.is_sharded and g.pg._all_gather_result is not None
        if gathered:
            # One rank: the shards are copied here, not in unshard (else a no-op).
            self._ensure(g)
        out = orig()
        # The gather is complete (the copy-out waited for it): FSDP reads the shard
        # again only at its next gather; the optimizer step and resident() load it.
        if gathered and self._resident_depth == 0 and not self._needed_soon(g):
            self._release(g)
        return out

    def _needed_soon(self, g: _Group) -> bool:
        """Whether the replayed order gathers g again within the window (the
        last block: forward, then at once backward): kept, not re-read."""
        pos = len(self._current)
        return self._on_trace and g.index in self._trace[pos : pos + self.window]

    def _iteration_start(self, *_: Any) -> None:
        if self._current:
            self._trace, self._current = self._current, []
        self._on_trace = bool(self._trace)
        self._look_ahead(0)

    def _look_ahead(self, pos: int) -> None:
        """Start reads for the groups the previous iteration gathered next,
        while this iteration has followed it so far."""
        if not self._on_trace:
            return
        for index in self._trace[pos : pos + self.window]:
            g = self.groups[index]
            if g.where == RELEASED and not self._start_read(g, wait=False):
                return

    # -- reads, writes, releases ---------------------------------------------------------------
    def _slot(self, wait: bool) -> Lease | None:
        """A pinned slot; when none is free, finish the oldest I/O first
        (a read in flight is completed into its shards), unless `wait` is
        False and that would be a read: then None."""
        while self._pool.available() == 0:
            if not self._inflight:
                raise TierError("the tier's pinned slots are all leased with no I/O in flight (a bug)")
            oldest = self._inflight[0]
            if oldest.write is None and not wait:
                return None
            self._finish(oldest)
        return self._pool.acquire()

    def _finish(self, g: _Group) -> None:
        """Complete g's I/O in flight: its write, then its read into FSDP's storage."""
        if g.write is not None:
            lease, fut = g.write
            g.write = None
            self._inflight.remove(g)
            try:
                fut.result()
            finally:
                lease.release()
        if g.read is not None:
            lease, futs = g.read
            g.read = None
            self._inflight.remove(g)
            try:
                for fut in futs:
                    fut.result()
                self._fill(g, lease.tensor(torch.uint8))
            finally:
                lease.release()  # waits for every read on the slot, also after a failed one
            g.where = RESIDENT

    def _start_read(self, g: _Group, wait: bool) -> bool:
        if g.write is not None:
            self._finish(g)
        lease = self._slot(wait)
        if lease is None:
            return False
        src = g.master or g.own
        staging = lease.tensor(torch.uint8)
        futs: list[Any] = []
        try:
            for space, offset, nbytes, pos in src.reads:
                futs.append(space.read(staging[pos : pos + nbytes], offset))
        except BaseException:
            lease.release()
            raise
        g.read, g.where = (lease, futs), READING
        self._inflight.append(g)
        self.counters["reads"] += 1
        if g.master is not None:
            self.counters["master_bytes_read"] += src.staging_bytes
        return True

    @torch.no_grad()
    def _fill(self, g: _Group, staging: torch.Tensor) -> None:
        src = g.master or g.own
        for s in g.shards:
            s.data.untyped_storage().resize_(s.nbytes)
        for j, start in src.zero:  # FSDP's padding rows: zeros, as FSDP made them
            g.shards[j].data.view(torch.uint8)[start:].zero_()
        for pos, j, dst, nbytes in src.copies:
            g.shards[j].data.view(torch.uint8)[dst : dst + nbytes].copy_(staging[pos : pos + nbytes])

    def _ensure(self, g: _Group) -> None:
        """g's shards in memory now; a read the look-ahead did not start is
        made here, synchronously (counted; logged once)."""
        if g.where == RESIDENT:
            return
        if g.where == RELEASED:
            self._count_miss(g)
            self._start_read(g, wait=True)
        self._finish(g)

    def _count_miss(self, g: _Group) -> None:
        if not self._trace:
            self.counters["cold_fetches"] += 1  # the first iteration: nothing to replay yet
            return
        self.counters["sync_fetches"] += 1
        if not self._miss_logged:
            self._miss_logged = True
            _log.warning(
                "aio.fsdp: FSDP group %s was gathered before the look-ahead read it: read "
                "synchronously (the gather order changed, or window=%d is too small); counted "
                "in stats()['sync_fetches'], logged once",
                module_name(g.pg),
                self.window,
            )

    def _release(self, g: _Group) -> None:
        """Free g's shards, writing them out first if the drive copy is stale."""
        if g.where != RESIDENT or not getattr(g.pg, "_reset_sharded_params", True):
            # Before FSDP's lazy init, which re-pads every shard from memory: kept.
            return
        self._write_out(g)
        for s in g.shards:
            s.data.untyped_storage().resize_(0)
        g.where = RELEASED

    def _write_out(self, g: _Group) -> None:
        """Start writing g's shards (copied into a pinned slot) if the drive copy is stale."""
        if not g.dirty:
            return
        lease = self._slot(wait=True)
        if lease is None:
            raise TierError("no pinned slot for a write (a bug: a waiting _slot always returns one)")
        staging = lease.tensor(torch.uint8, g.io_bytes)
        with torch.no_grad():
            for s in g.shards:
                staging[s.start : s.start + s.nbytes].copy_(s.data.view(torch.uint8))
        try:
            fut = self._space.write(staging, g.offset)
        except BaseException:
            lease.release()
            raise
        g.write, g.dirty = (lease, fut), False
        self._inflight.append(g)
        self.counters["writes"] += 1

    def _drain(self) -> None:
        while self._inflight:
            self._finish(self._inflight[0])

    def _load_all(self, skip_master: bool = False) -> None:
        """Every shard in memory (but those read from the master weights, if
        `skip_master`), reading up to `window` groups ahead."""
        todo = [g for g in self.groups if not (skip_master and g.master is not None)]
        for i, g in enumerate(todo):
            for ahead in todo[i + 1 : i + 1 + self.window]:
                if ahead.where == RELEASED and not self._start_read(ahead, wait=False):
                    break
            self._ensure_quiet(g)

    def _ensure_quiet(self, g: _Group) -> None:
        if g.where == RELEASED:
            self._start_read(g, wait=True)
        if g.where == READING or g.write is not None:
            self._finish(g)

    # -- the optimizer step and resident() ---------------------------------------------------
    def _before_step(self) -> None:
        self._resident_depth += 1
        # A shard read from the master weights is not needed by the step, which
        # steps those; every other shard is (and the first step lays the master
        # out from the parameters).
        self._load_all(skip_master=True)

    def _after_step(self) -> None:
        self._resident_depth -= 1
        if self._master_opt is not None:
            self._master_opt.flush_master()  # the drive's master copy is current
            sources = master_sources(self._master_opt, self.groups)
            self._fit_pool(max((s.staging_bytes for s in sources.values()), default=0))
        else:
            sources = {}
        for g in self.groups:
            if g.where != RESIDENT and g.master is not None and g.index not in sources:
                # Its new values exist only in the optimizer, which no longer maps them.
                raise TierError(
                    f"FSDP group {module_name(g.pg)}: NVMeAdamW's master weights of its shards are no "
                    "longer on the drive after the step; the tier cannot read them"
                )
            g.master = sources.get(g.index)
            # The step wrote every shard; one read from the master has its new value there.
            g.dirty = g.master is None
        if self._resident_depth == 0:
            self.release_all()

    def _fit_pool(self, nbytes: int) -> None:
        """Slots big enough for reads from the master (a slice's aligned
        range can be a page more than the slice on each side)."""
        if nbytes <= self._pool.slot_bytes:
            return
        self._drain()
        self._pool = PinnedPool(self.window, nbytes, lock=self._pin)

    @contextlib.contextmanager
    def resident(self, modified: bool = True) -> Iterator[None]:
        """Every shard in memory inside the block (for state_dict, DCP
        save/load, ``load_state_dict``, ``full_tensor()``, ``model.to``);
        on exit they are written back (unless ``modified=False``: the block
        only read them) and freed."""
        self._resident_depth += 1
        try:
            self._load_all()
            yield
        finally:
            self._resident_depth -= 1
            if modified:
                for g in self.groups:
                    # Written to its own extent: the master may not hold the new values.
                    g.dirty, g.master = True, None
            if self._resident_depth == 0:
                self.release_all()

    def release_all(self) -> None:
        """Write out what changed and free every group's shards; waits for the writes."""
        for g in self.groups:
            self._release(g)
        self._drain()

    # -- reporting and lifecycle ---------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Bytes of shard storage in memory now, over all groups."""
        return sum(g.resident_bytes() for g in self.groups)

    def stats(self) -> dict[str, Any]:
        """Counters: groups, shard bytes (memory now / on the drive), pinned
        bytes, reads and writes (and bytes), synchronous and cold fetches."""
        drives = self._space.stats()
        return {
            "groups": len(self.groups),
            "window": self.window,
            "shard_bytes": sum(g.nbytes for g in self.groups),
            "resident_bytes": self.resident_bytes(),
            "pinned_bytes": self._pool.total_bytes,
            "slot_bytes": self._pool.slot_bytes,
            "drive_bytes": sum(d["drive_bytes"] for d in drives),
            "bytes_read": sum(d["bytes_read"] for d in drives) + self.counters["master_bytes_read"],
            "master_bytes_read": self.counters["master_bytes_read"],
            "params_from_master": sum(g.master is not None for g in self.groups),
            "bytes_written": sum(d["bytes_written"] for d in drives),
            "swap_dir": drives[0]["swap_dir"],
            "reads": self.counters["reads"],
            "writes": self.counters["writes"],
            "sync_fetches": self.counters["sync_fetches"],
            "cold_fetches": self.counters["cold_fetches"],
        }

    def close(self) -> None:
        """Read every shard back into memory, undo the hooks and remove the
        swap folder: the model is an ordinary FSDP2 model again. Idempotent."""
        if self.closed:
            return
        try:
            self._load_all()
            self._drain()
        finally:
            self.closed = True
            for h in self._handles:
                if callable(h):
                    h()
                elif isinstance(h, tuple):
                    for name in h[1]:
                        h[0].__dict__.pop(name, None)
                else:
                    h.remove()
            self._space.close()


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def offload_params(
    model: torch.nn.Module,
    nvme_path: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    window: int = DEFAULT_WINDOW,
    pin_memory: bool = True,
    aio: dict[str, Any] | None = None,
    params_from_master: bool = True,
) -> ParamTier:
    """Put the local shards of a ``fully_shard``-ed `model` on this rank's
    drive between uses (see :mod:`aio.fsdp.tier`); apply it after
    ``fully_shard`` (of every module) and after building `optimizer`, whose
    ``step()`` is then bracketed so it finds every shard in memory.

    ``nvme_path``: a directory or a list of them (one per drive, striped);
    ``window``: groups read ahead of FSDP's gathers (pinned memory is
    ``window`` x the largest group's shard bytes); ``pin_memory``: lock the
    staging buffers; ``aio``: AsyncIOHandle settings;
    ``params_from_master``: with :class:`aio.optim.NVMeAdamW` as `optimizer`,
    read the shards from its master weights after its first step and write
    none (see :mod:`aio.fsdp.master`). Returns the
    :class:`ParamTier` (``stats()``, ``resident()``, ``close()``).

    Between steps the shards' storage is freed: read or change parameters
    (state dicts, DCP, EMA, weight norms, ``full_tensor()``) only inside
    ``with tier.resident():`` -- ``state_dict()``/``load_state_dict()``
    outside it raise :class:`TierError`, but any other read of freed
    storage crashes the process (see docs/fsdp.md).
    """
    return ParamTier(
        model, nvme_path, optimizer, window=window, pin_memory=pin_memory, aio=aio,
        params_from_master=params_from_master,
    )  # fmt: skip
