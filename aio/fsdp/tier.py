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
(a state_dict, load or ``model.to()`` outside it raises :class:`TierError`).

Any other op on a parameter between steps (a weight norm, an EMA,
``to_local()``, ``full_tensor()``, ``torch.save(p)``, ``p.mul_()``) finds a
stand-in for the freed shard in the parameter's DTensor (:mod:`aio.fsdp.guard`):
its group is read synchronously (``stats()["user_fetches"]``, logged once),
the op runs on the real shard, and at most ``window`` groups so read stay in
memory. Such an op never reads freed storage.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .._log import logger
from ..pinned import Lease, PinnedPool
from ..swap.drives import SwapSpace, nvme_path_items
from ..swap.storage import align_up
from ._internals import Shard, TierError, check_torch, fsdp_groups, lazy_init, module_name, shards_of
from .guard import ShardStandIn
from .master import Source, is_laid_out, is_nvme_adam, master_sources, skip_released_write_back
from .upload import ShardUploader, Upload

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
        self.blank = False  # no values anywhere yet (empty_shards): made in memory, not read
        self.read: tuple[Lease, list[Any]] | None = None  # READING: its slot and futures
        self.write: tuple[Lease, Any] | None = None  # a write of it in flight
        self.upload: Upload | None = None  # device shards: copies up not yet waited for (upload.py)
        # Per shard while stood in for (guard.py): its real local tensor and the stand-in.
        self.locals: list[torch.Tensor | None] = [None] * len(shards)
        self.stand_ins: list[ShardStandIn | None] = [None] * len(shards)

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
        empty_shards: bool = False,
    ) -> None:
        check_torch()
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (groups read ahead), got {window!r}")
        _check_types(nvme_path, optimizer, aio, pin_memory, params_from_master, empty_shards)
        pgs = fsdp_groups(model)
        if not pgs:
            raise TierError("offload_params: the model has no fully_shard-ed module; apply fully_shard first")
        if any("unshard" in pg.__dict__ for pg in pgs):  # our per-instance wrappers
            raise TierError("offload_params: this model already has a parameter tier; close() it first")
        if empty_shards:
            lazy_init(model)  # before any shard is freed: it re-pads them from memory
        self.window = window
        self.counters = collections.Counter[str]()
        self._space = SwapSpace(nvme_path, "fsdp-params", "params", aio=aio, rank=_rank())
        self._handles: list[Any] = []
        # With NVMeAdamW, shards are read from its master weights after its first step.
        self._master_opt: Any = optimizer if params_from_master and is_nvme_adam(optimizer) else None
        self._pin = pin_memory
        try:
            self.groups = self._lay_out(pgs)
            self._pgs = [g.pg for g in self.groups]  # compared by identity: never hashed
            self._dropped = False
            # Shards in GPU memory go up on a side stream (upload.py); CPU shards touch no stream.
            self._up = self._uploader()
            self._pool = self._new_pool(max(g.io_bytes for g in self.groups))
            self._inflight: collections.deque[_Group] = collections.deque()
            self._trace: list[int] = []  # the previous iteration's gathers, in order
            self._current: list[int] = []
            self._on_trace = False  # this iteration has gathered as the previous one did
            self._resident_depth = 0
            self._open: list[int] = []  # id() of each optimizer whose step bracket is open
            self._miss_logged = False
            self._user_logged = False
            # > 0: reads through the stand-ins are set-up's, not a user's (no warning): the
            # optimizer's layout, and with empty_shards the init until the first forward or step.
            self._quiet = int(empty_shards)
            self._filling = empty_shards
            # Groups read for ops outside the step (guard.py), oldest first; at most `window` kept.
            self._user: collections.OrderedDict[int, _Group] = collections.OrderedDict()
            self.closed = False
            if empty_shards:
                self._free_blank()
            else:
                # The drive holds every shard from the start; they stay in memory until
                # their first gather, after FSDP's lazy init (which re-pads them).
                for g in self.groups:
                    self._write_out(g)
                self._drain()
            self._attach(model, optimizer)
        except BaseException:
            # Nothing left half-done: what _attach installed comes off (the shards
            # are still in memory: written, not freed), the uploader and folder go.
            try:
                if self._handles:
                    self._unhook()
                up = getattr(self, "_up", None)
                if up is not None:
                    up.close()
            finally:
                self._space.close()
            raise

    # -- set-up --------------------------------------------------------------------------
    def _free_blank(self) -> None:
        """empty_shards: every shard freed unwritten (it holds no values yet);
        a group is made in memory at its first use, e.g. by an init function
        writing through the stand-ins, and written when freed after it."""
        for g in self.groups:
            g.blank, g.dirty = True, False
            self._release(g)

    def _uploader(self) -> ShardUploader | None:
        device = next((s.data.device for g in self.groups for s in g.shards), torch.device("cpu"))
        if device.type == "cpu":
            return None
        return ShardUploader(device)

    def _new_pool(self, slot_bytes: int) -> PinnedPool:
        """`window` staging slots. Pinned for device shards: registered with CUDA
        (a DMA source; no mlock, so RLIMIT_MEMLOCK does not apply and
        aio.pinned.locked_bytes() counts it once) and made an io_uring fixed
        buffer, as aio.swap.pool does; mlock-ed if CUDA refuses (copies from it
        are then pageable). CPU shards: mlock-ed (with pin_memory)."""
        self.counters["staging_registered"] = 0
        if self._pin and self._up is not None:
            pool = PinnedPool(self.window, slot_bytes, lock=False)
            if self._up.register(pool):
                pool.make_fixed()
                self.counters["staging_registered"] = 1
                return pool
        return PinnedPool(self.window, slot_bytes, lock=self._pin)

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
        for m in model.modules():
            if hasattr(m, "_get_fsdp_state"):
                # model.to()/.float()/.cuda(): FSDP re-pads every shard from its local tensor.
                m.__dict__["_apply"] = functools.partial(self._guarded_apply, m._apply)
                self._handles.append((m, ("_apply",)))
            if hasattr(m, "_get_fsdp_state") or m is model:
                # On each FSDP module, not only the root: `model[1].load_state_dict(sd)`
                # would write through the stand-ins, then FSDP re-pads from freed shards.
                self._handles.append(m.register_state_dict_pre_hook(self._guard("state_dict")))
                self._handles.append(m.register_load_state_dict_pre_hook(self._guard("load_state_dict")))
        # Registered after fully_shard with prepend=True: runs before FSDP's root pre-forward.
        self._handles.append(model.register_forward_pre_hook(self._iteration_start, prepend=True))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(lambda opt, *_: self._before_step(opt)))
            self._handles.append(optimizer.register_step_post_hook(lambda opt, *_: self._after_step(opt)))
            self._wrap_step(optimizer)
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

        def pre(opt: Any, *_: Any) -> None:
            if opt is attached or self.closed:
                return
            if id(opt) in self._open:
                # Its previous step raised before this tier wrapped it: that bracket is still open.
                while self._open and id(opt) in self._open:
                    self._abort_step()
            if any(id(p) in mine for group in opt.param_groups for p in group["params"]):
                self._wrap_step(opt)  # its later steps: the bracket closes also when they raise
                self._before_step(opt)

        def post(opt: Any, *_: Any) -> None:
            if opt is not attached and id(opt) in self._open:
                self._after_step(opt)

        self._handles.append(register_optimizer_step_pre_hook(pre))
        self._handles.append(register_optimizer_step_post_hook(post))

    def _wrap_step(self, opt: Any) -> None:
        """opt.step per instance: torch skips the step post-hooks when the
        step raises, so a step that raises closes its bracket here (else the
        shards stay in memory unguarded and are never freed again)."""
        if getattr(opt.__dict__.get("step"), "_aio_tier", None) is self:
            return
        orig = opt.step

        def step(_opt: Any, *args: Any, **kwargs: Any) -> Any:
            depth = len(self._open)
            try:
                # NVMeAdamW's hold of a Ctrl-C lasts until torch's step wrapper
                # returns (aio._interrupt): the post-hook closes the bracket of
                # a whole step first, never this except.
                return orig(*args, **kwargs)
            except BaseException:
                while len(self._open) > depth and not self.closed:
                    self._abort_step()
                raise

        step._aio_tier = self  # type: ignore[attr-defined]
        # A bound method, as torch's own: an LR scheduler built later wraps
        # `opt.step.__func__` (a plain function has none: AttributeError).
        bound = types.MethodType(step, opt)
        opt.__dict__["step"] = bound
        # Undone only if still on top (an LR scheduler may have wrapped it since).
        self._handles.append(lambda: opt.__dict__.get("step") is bound and opt.__dict__.pop("step"))

    def _guard(self, what: str) -> Any:
        def hook(*_: Any, **__: Any) -> None:
            if self._resident_depth == 0 and not self.closed:
                raise TierError(
                    f"{what}() with the parameter tier on: the shards may be on the drive; "
                    f"call it inside `with tier.resident():`"
                )

        return hook

    def _guarded_apply(self, orig: Any, *args: Any, **kwargs: Any) -> Any:
        if self._resident_depth == 0 and not self.closed:
            raise TierError(
                "model.to()/.float()/.cuda() (nn.Module._apply) with the parameter tier on: FSDP re-pads "
                "every shard from memory; call it inside `with tier.resident():`"
            )
        return orig(*args, **kwargs)

    # -- FSDP's gathers ----------------------------------------------------------------------
    def _unshard(self, g: _Group, orig: Any, async_op: bool = False) -> Any:
        self._check_open()
        if g.pg.is_sharded and g.pg._all_gather_result is None:
            self._user.pop(g.index, None)  # FSDP's gather frees it from here on
            pos = len(self._current)
            self._current.append(g.index)
            self._on_trace = self._on_trace and pos < len(self._trace) and self._trace[pos] == g.index
            self._ensure(g)
            self._look_ahead(pos + 1)
            self._advance()
        return orig(async_op)

    def _wait_for_unshard(self, g: _Group, orig: Any) -> Any:
        self._check_open()
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
        self._end_fill()
        if self._resident_depth == 0:
            for g in list(self._user.values()):
                self._release(g)  # read for an op between steps: not kept into training
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

    def _advance(self) -> None:
        """Device shards: start the copies up of the reads that have landed,
        a window ahead of their gather, so that its wait (upload.py) finds
        them done."""
        if self._up is None:
            return
        for g in list(self._inflight):
            if g.write is None and g.read is not None and all(f.done() for f in g.read[1]):
                self._finish(g)

    # -- reads, writes, releases ---------------------------------------------------------------
    def _slot(self, wait: bool) -> Lease | None:
        """A pinned slot; when none is free, finish the oldest I/O first
        (a read in flight is completed into its shards), unless `wait` is
        False and that would be a read: then None. Device shards: a slot an
        upload still reads is given back once its copies are done; not
        waiting, the slots held by uploads whose copies are still queued
        (behind the compute stream's work) are theirs until then: None."""
        while self._pool.available() == 0:
            # A copy up is shorter than a drive read: waited for first.
            if self._up is not None and self._up.reclaim(block=wait):
                continue
            if not self._inflight:
                if not wait and self._up is not None and self._up.pending():
                    return None
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
                self._fill(g, lease)
            except BaseException:
                # Left READING with no read attached it would pass as loaded (freed
                # storage read: a SIGSEGV): freed and RELEASED, a later use re-reads it.
                self._free(g)
                g.where = RELEASED
                raise
            finally:
                # The slot is an upload's once the uploader holds it (its copies still
                # read it); else given back here, whatever raised where (Ctrl-C too).
                if self._up is None or not self._up.holds(lease):
                    lease.release()  # waits for every read on the slot, also after a failed one
            g.where = RESIDENT

    def _start_read(self, g: _Group, wait: bool) -> bool:
        if g.blank:
            self._materialize(g)
            return True
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

    def _materialize(self, g: _Group) -> None:
        """A blank group's shards in memory (uninitialised, as ``to_empty``
        leaves them): nothing to read; written when next freed."""
        for s in g.shards:
            s.data.untyped_storage().resize_(s.nbytes)
        g.blank, g.where, g.dirty = False, RESIDENT, True
        self.counters["materialized"] += 1

    @torch.no_grad()
    def _fill(self, g: _Group, lease: Lease) -> None:
        """g's shards from the slot `lease`. The caller gives it back unless
        the uploader holds it (device shards: until the copies up are done)."""
        src = g.master or g.own
        staging = lease.tensor(torch.uint8)
        if self._up is not None:
            shards = [(s.data, s.nbytes) for s in g.shards]
            g.upload = self._up.fill(shards, src.zero, src.copies, staging, lease)
            return
        for s in g.shards:
            s.data.untyped_storage().resize_(s.nbytes)
        for j, start in src.zero:  # FSDP's padding rows: zeros, as FSDP made them
            g.shards[j].data.view(torch.uint8)[start:].zero_()
        for pos, j, dst, nbytes in src.copies:
            g.shards[j].data.view(torch.uint8)[dst : dst + nbytes].copy_(staging[pos : pos + nbytes])

    def _land(self, g: _Group) -> None:
        """Device shards: the host waits for g's copies up before anything
        reads them (FSDP's copy-in stream included; upload.py says why)."""
        if g.upload is not None and self._up is not None:
            # Cleared only once the host waited: interrupted before (Ctrl-C, an error), the
            # group keeps its record and the next gather waits again.
            self._up.land(g.upload)
            g.upload = None

    def _free(self, g: _Group) -> None:
        """Free g's shard storage (device shards: after the side stream is
        ordered after the compute stream; upload.py)."""
        g.upload = None  # its slot stays held by the uploader until its copies are done
        if self._up is not None:
            self._up.free([s.data for s in g.shards])
            return
        for s in g.shards:
            s.data.untyped_storage().resize_(0)

    def _ensure(self, g: _Group) -> None:
        """g's shards in memory now; a read the look-ahead did not start is
        made here, synchronously (counted; logged once)."""
        if g.where == RESIDENT:
            self._land(g)
            return
        if g.where == RELEASED:
            if not g.blank:
                self._count_miss(g)
            self._start_read(g, wait=True)
        self._finish(g)
        self._land(g)

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
        """Free g's shards, writing them out first if the drive copy is stale;
        its parameters' local tensors become stand-ins (guard.py)."""
        self._user.pop(g.index, None)
        if not getattr(g.pg, "_reset_sharded_params", True):
            # Before FSDP's lazy init, which re-pads every shard from memory: kept.
            return
        if g.where == RESIDENT and self._up is not None and g.pg._all_gather_result is not None:
            # Device shards whose all-gather FSDP issued and nothing waited for (an iteration
            # that raised in between): FSDP's private copy-in stream may still read them, and
            # no public event orders a free after it. Kept (and its stand-ins' tensors real)
            # until its gather is waited for: its next wait_for_unshard releases it.
            return
        if g.where == RESIDENT:
            for s in g.shards:
                if s.data.numel() * s.data.element_size() != s.nbytes:
                    raise TierError(
                        f"FSDP group {module_name(g.pg)}: a shard changed size or dtype ({s.fsdp_param}); "
                        "the tier cannot keep it: close() the tier before changing the model"
                    )
            if g.dirty:
                self._land(g)  # the write-out's copy reads the shards
            self._write_out(g)
            self._free(g)
            g.where = RELEASED
        self._stand_in(g)

    def _write_out(self, g: _Group) -> None:
        """Start writing g's shards (copied into a pinned slot) if the drive copy is stale."""
        if not g.dirty:
            return
        lease = self._slot(wait=True)
        if lease is None:
            raise TierError("no pinned slot for a write (a bug: a waiting _slot always returns one)")
        staging = lease.tensor(torch.uint8, g.io_bytes)
        # Device shards: a synchronous copy on the compute stream (upload.py says why), so
        # the drive write below starts after it landed and the free after it needs no event.
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
        if self._up is not None:
            self._up.drain()  # every slot back (the pool may be replaced next)

    def _load_all(self, skip_master: bool = False) -> None:
        """Every shard in memory (but those read from the master weights, if
        `skip_master`), reading up to `window` groups ahead."""
        todo = [g for g in self.groups if not (skip_master and g.master is not None)]
        for i, g in enumerate(todo):
            for ahead in todo[i + 1 : i + 1 + self.window]:
                if ahead.where == RELEASED and not self._start_read(ahead, wait=False):
                    break
            self._advance()
            self._ensure_quiet(g)

    def _ensure_quiet(self, g: _Group) -> None:
        if g.where == RELEASED:
            self._start_read(g, wait=True)
        if g.where == READING or g.write is not None:
            self._finish(g)
        self._land(g)

    # -- the optimizer step and resident() ---------------------------------------------------
    def prepare_optimizer(self) -> None:
        """Lay NVMeAdamW's sub-groups out now, as its first step would,
        reading the shards through their stand-ins (``window`` groups in
        memory at a time); its master weights on the drive then hold every
        group's values and the tier reads the shards from them. So neither
        the first step nor a gradient stream needs every shard in memory at
        once. A no-op without NVMeAdamW (``params_from_master``) or once it
        is laid out; the first step calls it."""
        opt = self._master_opt
        if opt is None or is_laid_out(opt) or self._resident_depth or self.closed:
            return
        self._quiet += 1
        try:
            opt.lay_out()
            self._take_masters()
        finally:
            self._quiet -= 1
            for g in list(self._user.values()):  # read for the layout: not kept
                self._release(g)

    def _take_masters(self) -> None:
        """Right after the layout the master weights are every shard's
        value: each group is read from them from now on, and not written."""
        opt = self._master_opt
        if opt is None or opt.master_mode != "drive":
            return
        sources = master_sources(opt, self.groups)
        self._fit_pool(max((s.staging_bytes for s in sources.values()), default=0))
        for g in self.groups:
            src = sources.get(g.index)
            if src is not None:
                g.master, g.dirty = src, False

    def _end_fill(self) -> None:
        """empty_shards: the init is over once training starts (reads warn again)."""
        if self._filling:
            self._filling, self._quiet = False, self._quiet - 1

    def _before_step(self, opt: Any) -> None:
        self._end_fill()
        self.prepare_optimizer()
        self._drop_master_reads()
        self._resident_depth += 1
        try:
            # A shard read from the master weights is not needed by the step, which
            # steps those; every other shard is (and the first step lays the master
            # out from the parameters). The skipped ones keep their stand-ins: a read
            # inside the step (a closure, a hook) is served, and NVMeAdamW sees their
            # empty storage and does not write them back.
            self._restore_locals(skip_master=True)
            self._load_all(skip_master=True)
        except BaseException:
            # The step will not run (nor its post-hook): shards not read stay behind stand-ins.
            self._resident_depth -= 1
            for g in self.groups:
                if g.where != RESIDENT:
                    self._stand_in(g)
            raise
        self._open.append(id(opt))

    def _drop_master_reads(self) -> None:
        """Reads from the master weights still in flight as a step begins
        land now and are dropped, their group released: they hold the
        step's input, not its output, and the step writes the master they
        read. (A look-ahead at a forward that gathered nothing -- the root
        still unsharded after a no_grad forward -- leaves one; filled after
        the step, its stale values trained on in silence.)"""
        for g in [g for g in self._inflight if g.master is not None and g.read is not None]:
            self._finish(g)
            self._free(g)
            g.where = RELEASED
            self._stand_in(g)

    def _abort_step(self) -> None:
        """Close the newest step bracket of a step that raised: what it may
        have written is written back, and the shards are freed as after a step."""
        self._open.pop()
        self._resident_depth -= 1
        for g in self.groups:
            if g.where == RESIDENT:
                g.dirty, g.master = True, None  # the step may have written part of it
        if self._resident_depth == 0:
            self.release_all()

    def _after_step(self, opt: Any) -> None:
        if id(opt) in self._open:
            self._open.reverse()
            self._open.remove(id(opt))  # its newest bracket
            self._open.reverse()
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
        self._pool = self._new_pool(nbytes)

    @contextlib.contextmanager
    def resident(self, modified: bool = True) -> Iterator[None]:
        """Every shard in memory inside the block (for state_dict, DCP
        save/load, ``load_state_dict``, ``full_tensor()``, ``model.to``);
        on exit they are written back (unless ``modified=False``: the block
        only read them) and freed. TierError once the tier is closed (the
        model is an ordinary FSDP2 model again: no block is needed)."""
        if self.closed:
            raise TierError(
                "tier.resident() after close(): the tier is closed and the model's shards are back in "
                "memory (unless close(restore=False)); use the model without it"
            )
        self._resident_depth += 1
        loaded = False
        try:
            self._restore_locals()
            self._load_all()
            loaded = True
            yield
        finally:
            self._resident_depth -= 1
            # A failed load ran no block: nothing written, and a group not read may
            # have its values only in the optimizer's master (kept as its source).
            if modified and loaded:
                for g in self.groups:
                    if g.where == RESIDENT:
                        # Written to its own extent: the master may not hold the new values.
                        g.dirty, g.master = True, None
            if self._resident_depth == 0:
                self.release_all()

    def release_all(self) -> None:
        """Write out what changed and free every group's shards; waits for the writes."""
        for g in self.groups:
            self._release(g)
        self._drain()

    # -- ops outside the step on parameters (guard.py's stand-ins) ---------------------------
    def _stand_in(self, g: _Group) -> None:
        """Each of g's parameters runs its ops on a stand-in, not on the freed shard."""
        for j, s in enumerate(g.shards):
            p = s.fsdp_param.sharded_param
            cur = p._local_tensor
            if isinstance(cur, ShardStandIn):
                continue
            if g.stand_ins[j] is None or g.locals[j] is not cur:
                g.locals[j], g.stand_ins[j] = cur, ShardStandIn(cur, self, g, j)
            p._local_tensor = g.stand_ins[j]

    def _restore_locals(self, skip_master: bool = False) -> None:
        """The real local tensors back in every parameter (the step, resident());
        with `skip_master`, not in those of groups read from the master weights."""
        for g in self.groups:
            if skip_master and g.master is not None:
                continue
            self._user.pop(g.index, None)
            for j, s in enumerate(g.shards):
                p = s.fsdp_param.sharded_param
                if isinstance(p._local_tensor, ShardStandIn) and g.locals[j] is not None:
                    p._local_tensor = g.locals[j]

    def real_local(self, g: _Group, j: int) -> torch.Tensor:
        """Shard j's real local tensor (for a stand-in: guard.py)."""
        cur = g.shards[j].fsdp_param.sharded_param._local_tensor
        if isinstance(cur, ShardStandIn):
            local = g.locals[j]
            if local is None:
                raise TierError(f"FSDP group {module_name(g.pg)}: a stand-in with no local tensor (a bug)")
            return local
        return cur

    def user_hold(self, g: _Group, what: Any) -> None:
        """g's shards in memory for an op outside the step (`what`): read now
        if on the drive (counted in stats()['user_fetches'], logged once)."""
        if self.closed:
            if g.where != RESIDENT:  # close() failed part-way: this shard was not read back
                raise TierError(
                    f"FSDP group {module_name(g.pg)}: the tier was closed with its shards on the drive"
                )
            return
        if self._resident_depth == 0:
            self._user[g.index] = g
            self._user.move_to_end(g.index)
        if g.where == RELEASED and self._quiet:
            self.counters["setup_fetches"] += 0 if g.blank else 1
        elif g.where == RELEASED and not g.blank:
            self.counters["user_fetches"] += 1
            if not self._user_logged:
                self._user_logged = True
                _log.warning(
                    "aio.fsdp: %s used a parameter of FSDP group %s outside the training step while its "
                    "shard was on the drive: read synchronously. Wrap such reads in `with "
                    "tier.resident(modified=False):` to read every shard once; counted in "
                    "stats()['user_fetches'], logged once",
                    what,
                    module_name(g.pg),
                )
        self._ensure_quiet(g)

    def user_wrote(self, g: _Group) -> None:
        """An op outside the step wrote g's shards: written to its own extent
        at its release (the optimizer's master may not hold the new values)."""
        g.dirty, g.master = True, None

    def user_settle(self) -> None:
        """Free the groups read for ops outside the step beyond the `window` latest."""
        while self._resident_depth == 0 and not self.closed and len(self._user) > self.window:
            _, g = self._user.popitem(last=False)
            self._release(g)

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
            "user_fetches": self.counters["user_fetches"],
            "setup_fetches": self.counters["setup_fetches"],
            "materialized": self.counters["materialized"],
            # Device shards (upload.py): groups copied up on the side stream, their bytes, the
            # host waits for a copy that had not landed yet, whether the staging is CUDA-pinned.
            "uploads": self._up.counters["uploads"] if self._up is not None else 0,
            "upload_bytes": self._up.counters["upload_bytes"] if self._up is not None else 0,
            "upload_waits": self._up.counters["upload_waits"] if self._up is not None else 0,
            "staging_registered": bool(self.counters["staging_registered"]),
        }

    def close(self, restore: bool = True) -> None:
        """Read every shard back into memory, undo the hooks and remove the
        swap folder: the model is an ordinary FSDP2 model again. Idempotent.
        ``restore=False`` (the end of a job) reads nothing back, so memory
        does not grow to the whole shard: the model is done with, and any
        later use of it -- a forward, an op on a parameter -- raises
        :class:`TierError`."""
        if self.closed:
            return
        self._dropped = not restore
        try:
            if restore:
                self._load_all()
            self._drain()
            if restore:
                self._restore_locals()
        finally:
            self.closed = True
            try:
                if self._up is not None:
                    self._up.close()  # may raise (a sticky CUDA error, Ctrl-C in its wait)
            finally:
                # Unhooked and the swap folder removed whatever the uploader raised (its
                # error propagates after this, chained to one the load above raised).
                try:
                    self._unhook()
                finally:
                    self._space.close()

    def _unhook(self) -> None:
        """Remove every hook and per-instance wrapper the tier installed."""
        for h in self._handles:
            if callable(h):
                h()
            elif isinstance(h, tuple) and not (self._dropped and any(h[0] is pg for pg in self._pgs)):
                for name in h[1]:
                    h[0].__dict__.pop(name, None)
            elif not isinstance(h, tuple):
                h.remove()

    def _check_open(self) -> None:
        if self._dropped:
            raise TierError(
                "the parameter tier was closed with close(restore=False): the model's shards are gone; "
                "it cannot be used again"
            )


def _check_types(
    nvme_path: Any, optimizer: Any, aio: Any, pin_memory: Any, params_from_master: Any, empty_shards: Any
) -> None:
    """TypeError naming the argument of offload_params that has the wrong
    type, before anything changes."""
    try:
        nvme_path_items(nvme_path)
    except TypeError as e:
        raise TypeError(f"offload_params: {e}") from None
    # By what the bracket uses (a wrapper that forwards them, e.g. Lightning's, works too).
    hooks = ("step", "register_step_pre_hook", "register_step_post_hook")
    if optimizer is not None and not all(callable(getattr(optimizer, n, None)) for n in hooks):
        got = type(optimizer).__name__
        raise TypeError(f"offload_params: optimizer must be a torch.optim.Optimizer (or None), got {got}")
    if aio is not None and not isinstance(aio, Mapping):
        raise TypeError(f"offload_params: aio must be a dict of AsyncIOHandle settings, got {aio!r}")
    flags = {"pin_memory": pin_memory, "params_from_master": params_from_master, "empty_shards": empty_shards}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"offload_params: {name} must be a bool, got {value!r}")


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
    empty_shards: bool = False,
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
    none (see :mod:`aio.fsdp.master`); ``empty_shards``: the model was
    built on the meta device, ``fully_shard``-ed and ``to_empty()``-ed, so
    its shards hold no values yet: nothing is written now, every shard is
    freed at once, and a group is made in memory (not read) when an op
    first touches its parameters -- an init function run after this, which
    so never has more than ``window`` groups in memory. Returns the
    :class:`ParamTier` (``stats()``, ``resident()``, ``close()``).

    Between steps the shards' storage is freed. State dicts, DCP and
    ``model.to()`` go inside ``with tier.resident():`` (outside it they
    raise :class:`TierError`). Any other op on a parameter (an EMA, a
    weight norm, ``full_tensor()``) is served from a synchronous read of its
    group, counted in ``stats()["user_fetches"]``, or raises; wrap many
    such reads in ``tier.resident(modified=False)`` to read each shard once
    (see docs/fsdp.md).
    """
    return ParamTier(
        model, nvme_path, optimizer, window=window, pin_memory=pin_memory, aio=aio,
        params_from_master=params_from_master, empty_shards=empty_shards,
    )  # fmt: skip
