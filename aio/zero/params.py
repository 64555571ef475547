"""Where the model's parameters live between uses, and how they come back.

A :class:`ParamStore` owns every parameter of a model as one *partition*
(one flat tensor in the training dtype), either on the drive through
:class:`aio.swap.ParamSwapper` (``offload_param.device: nvme``) or in CPU
memory (``cpu``/``none``). While a parameter is not in use its ``.data`` is
an empty placeholder; ``param.aio_shape`` / ``param.aio_numel`` keep its
real shape. :class:`Fetcher` installs the module hooks that bring a module's
parameters in right before its forward (and its backward) and let them go
right after, prefetching the next modules in the execution order recorded on
the first pass.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ..swap import ParamSwapper, PoolExhaustedError, State, SwapStateError
from . import stored_param
from .malloc import BUILD_MMAP_THRESHOLD, TRAIN_MMAP_THRESHOLD, TRAIN_TRIM_THRESHOLD, set_mmap_threshold
from .streams import DeviceCopies, HostCopies, copies_for
from .uploads import UploadPolicy, Uploads

if TYPE_CHECKING:
    from ..swap.drives import IOFuture


def check_fits(cfg: Any, name: str, numel: int) -> None:
    """Raise a config error if a parameter of `numel` elements cannot be swapped."""
    from ..config import ConfigError

    p = cfg.offload.offload_param
    if cfg.param_device == "nvme" and numel > p.buffer_size:
        raise ConfigError(
            [
                (
                    "zero_optimization.offload_param.buffer_size",
                    f"{p.buffer_size} elements is smaller than parameter {name!r} "
                    f"({numel} elements); set it to at least {numel}",
                )
            ]
        )


# At most this many bytes of parameters' initial values are written while a
# model is built (each is the builder's own tensor, held until it lands).
ADOPT_WRITE_BYTES = 512 << 20


class ParamStore:
    """Owns parameter partitions (drive or CPU memory) and hands them out.

    ``acquire``/``drop`` are reference counted per parameter; a parameter is
    materialised (``.data`` set to its full tensor) while its count is > 0.
    """

    def __init__(self, cfg: Any, device: Any = None, policy: UploadPolicy | None = None) -> None:
        import torch

        self.cfg = cfg
        self.dtype = cfg.torch_dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.on_drive = cfg.param_device == "nvme"
        self.copies: HostCopies | DeviceCopies = copies_for(self.device)
        self.swapper: ParamSwapper | None = None
        if self.on_drive:
            set_mmap_threshold(BUILD_MMAP_THRESHOLD)
            p = cfg.offload.offload_param
            self.swapper = ParamSwapper(
                p.nvme_dirs(),
                dtype=self.dtype,
                buffer_count=p.buffer_count,
                buffer_size=p.buffer_size,
                max_in_cpu=p.max_in_cpu,
                pin_memory=p.pin_memory,
                aio=cfg.offload.aio.handle_kwargs(),
                min_swap_bytes=cfg.persistence_threshold * torch.empty(0, dtype=self.dtype).element_size(),
                register_host=self.copies.register_host,
            )
        self.resident: dict[int, Any] = {}  # part_id -> flat CPU tensor (memory backend)
        # sub-group index -> (one low-precision tensor its partitions' resident
        # tensors are consecutive views of, their part ids); see pack().
        self.packed: dict[int, tuple[Any, list[int]]] = {}
        self.params: dict[int, Any] = {}  # part_id -> weakref to the Parameter
        self.refs: collections.Counter[int] = collections.Counter()
        self.speculative: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.next_part_id = 0
        self.buffer_ptrs: set[int] = set()  # storages of swap buffers (see linear.py)
        # Host memory an upload still reads is not overwritten or handed back
        # before the upload is done; the host never runs too far ahead.
        self.uploads = Uploads(self.copies, policy or UploadPolicy(cfg.aio_zero.modules_ahead))
        self.counters = {"write_copy_bytes": 0, "writes": 0}
        # Adoption writes in flight (part ids, oldest first) and their bytes:
        # each future holds the parameter's initial values until it lands.
        self._adopting: collections.deque[int] = collections.deque()
        self._adopting_bytes = 0
        # > 0 while aio.zero.Init builds a model: parameters fetched then are
        # host tensors even for a GPU model (see _materialise_all).
        self.on_host = 0
        # Counts changes of stored values (writes, refreshes, checkpoint loads):
        # what was read before a change is not handed out after it (state_dict.py).
        self.generation = 0
        # A trainer steps these parameters (master weights elsewhere decide
        # their values): set by OffloadTrainer once built.
        self.trained = False
        # The thread that may fetch parameters outside the engine's own hooks
        # (stored_param.py): acquire/drop and the pools are not locked.
        self.thread = threading.get_ident()
        self.closed = False

    # -- adoption ------------------------------------------------------------------------
    def adopt(self, param: Any, name: str = "") -> None:
        """Take ownership of `param`: its current values become the stored
        copy (in the training dtype) and its ``.data`` becomes a placeholder
        (or, in CPU memory on a CPU model, the stored copy itself)."""
        import torch

        if getattr(param, "_aio_store", None) is not None:
            if param._aio_store is not self:
                raise ValueError(f"parameter {name!r} already belongs to another aio.zero trainer")
            if name and name != param.aio_name:  # adopted under Init as "Class.attr"
                # Checkpoints written before the model's own names were kept
                # hold the build name: still accepted at load (checkpoint.py).
                param.aio_build_name = param.aio_name
                param.aio_name = name
            return
        self._check_open()
        numel = param.numel()
        check_fits(self.cfg, name or f"#{self.next_part_id}", numel)
        part_id = self.next_part_id
        self.next_part_id += 1
        shape = tuple(param.shape)
        if param.is_meta:
            # Built on the meta device (transformers' from_pretrained): no values
            # yet; zeros until the checkpoint's tensor arrives (Init's
            # register_parameter). A meta tensor cannot take CPU data, so the
            # parameter (same object, its attributes kept) becomes a CPU one.
            src = torch.zeros(numel, dtype=self.dtype, device="cpu")
            fresh = torch.nn.Parameter(
                torch.empty(0, dtype=param.dtype, device="cpu"), requires_grad=param.requires_grad
            )
            fresh.__dict__.update(param.__dict__)
            torch.utils.swap_tensors(param, fresh)
        else:
            src = param.detach().reshape(-1).to(self.dtype)
        param.aio_shape = shape
        param.aio_numel = numel
        param.aio_id = part_id
        param.aio_name = name
        if self.swapper is not None:
            self.swapper.register(part_id, numel)
            self._adopt_write(part_id, src.cpu())
        else:
            host = self.copies.host_tensor(numel, self.dtype)
            host.copy_(src)
            self.resident[part_id] = host
        del src
        param._aio_store = self
        self.params[part_id] = weakref.ref(param)
        if self._stays_materialised(part_id):
            param.data = self._host(part_id).view(param.aio_shape)
        else:
            param.data = self.copies.placeholder(self.dtype)
            # Only a parameter that shows placeholders pays for the checks.
            stored_param.mark(param)

    def forget_orphans(self) -> list[int]:
        """Give back the partitions of parameters that no longer exist (a
        module's weight replaced by a tied one after it was adopted, as
        transformers ties ``lm_head`` under Init): their drive copy is never
        read again. Returns their part ids."""
        import gc

        gc.collect()  # a replaced parameter only a reference cycle still holds
        gone = [part_id for part_id, ref in self.params.items() if ref() is None]
        for part_id in gone:
            if self.swapper is not None:
                self.swapper.unregister(part_id)
            else:
                self.resident.pop(part_id, None)
            del self.params[part_id]
            self.refs.pop(part_id, None)
            self.speculative.pop(part_id, None)
        return gone

    def pack(self, groups: list[list[Any]]) -> None:
        """With the memory backend in bfloat16 or float16 on a CPU model, lay
        each sub-group's partitions (`groups`: each sub-group's parameters, in
        their order in its master weights) end to end in one tensor, recorded
        in :attr:`packed`; the parameters are views of it. The optimizer then
        writes a stepped sub-group's parameters in its own pass instead of a
        converting copy per parameter (:meth:`wrote_packed`). Nothing to do on
        the drive, in float32 or for a GPU model: its partitions are pinned,
        and torch's caching host allocator would keep each one's block after
        packing (twice the pinned memory, not counted by pinned_bytes()) and
        round each packed tensor up to a power of two."""
        import torch

        if self.swapper is not None or self.dtype not in (torch.bfloat16, torch.float16):
            return
        if self.device.type != "cpu":
            return
        for gi, params in enumerate(groups):
            flat = torch.empty(sum(p.aio_numel for p in params), dtype=self.dtype)
            off = 0
            for p in params:
                view = flat[off : off + p.aio_numel]
                view.copy_(self.resident[p.aio_id])
                self.resident[p.aio_id] = view
                p.data = view.view(p.aio_shape)  # a CPU model points at its partition
                off += p.aio_numel
            self.packed[gi] = (flat, [p.aio_id for p in params])

    def wrote_packed(self, param: Any) -> None:
        """`param`'s new values were written into its packed sub-group tensor,
        which the parameter already views (what write() counts after its copy)."""
        self.counters["writes"] += 1
        self.generation += 1

    def _host(self, part_id: int) -> Any:
        if self.swapper is None:
            return self.resident[part_id]
        return self.swapper.parts[part_id].tensor

    def _stays_materialised(self, part_id: int) -> bool:
        """A CPU model whose partition lives in CPU memory can keep pointing at it."""
        if self.device.type != "cpu":
            return False
        if self.swapper is None:
            return True
        return self.swapper.parts[part_id].state == State.RESIDENT

    def on_drive_part_ids(self, params: Iterable[Any]) -> list[int]:
        """The part ids of `params` that are swapped, i.e. not kept resident in CPU
        memory; always empty with the memory backend."""
        if self.swapper is None:
            return []
        return [p.aio_id for p in params if self.swapper.parts[p.aio_id].state != State.RESIDENT]

    # -- use ---------------------------------------------------------------------------
    def begin_training(self) -> None:
        """A training pass starts: malloc's thresholds are set for recycling
        each step's temporaries (with parameters on the drive, the build-time
        bound is relaxed; see set_mmap_threshold)."""
        set_mmap_threshold(TRAIN_MMAP_THRESHOLD, TRAIN_TRIM_THRESHOLD)

    def pace(self) -> None:
        """A module is about to be fetched (see :meth:`Uploads.pace`)."""
        self.uploads.pace()

    def acquire(self, params: list[Any]) -> None:
        """Materialise `params` (reads them from the drive if needed)."""
        self._check_open()
        self._reap(block=False)
        todo = []
        for p in params:
            part_id = p.aio_id
            self.refs[part_id] += 1
            if self.refs[part_id] == 1:
                self.speculative.pop(part_id, None)
                self.uploads.keep(part_id)  # in use again: keep its buffer
                if not self._stays_materialised(part_id):
                    todo.append(p)
        if not todo:
            return
        if self.swapper is not None:
            part_ids = [p.aio_id for p in todo]
            parts = self.swapper.parts
            need = sum(
                1
                for part_id in part_ids
                if parts[part_id].lease is None and parts[part_id].state != State.RESIDENT
            )
            try:
                self._make_room(need)
                tensors = self.swapper.swap_in(part_ids)
            except BaseException:
                for p in params:
                    self.refs[p.aio_id] -= 1
                    if self.refs[p.aio_id] <= 0:
                        del self.refs[p.aio_id]
                raise
        else:
            tensors = [self.resident[p.aio_id] for p in todo]
        try:
            self._materialise_all(todo, tensors)
        except BaseException:
            # A device out of memory mid-upload: undo as if never acquired, so
            # a retry (a smaller batch) uploads them again instead of finding
            # them counted as in use with placeholder data.
            self.drop(params)
            raise

    def _materialise_all(self, params: list[Any], hosts: list[Any]) -> None:
        """Point `params` at their values: on a CPU model (or while a model is
        built, :attr:`on_host`) the host tensors themselves; on a device,
        copies queued on the side stream (large parameters one by one, the
        small ones of this call in one transfer)."""
        if self.device.type == "cpu" or self.on_host:
            for p, host in zip(params, hosts, strict=True):
                if self.swapper is not None:
                    self.buffer_ptrs.add(host.untyped_storage().data_ptr())
                p.data = host.view(p.aio_shape)
            return
        self.uploads.upload(params, hosts)

    def _materialise(self, p: Any, host: Any) -> None:
        self._materialise_all([p], [host])

    def _reap(self, block: bool) -> None:
        """Hand back the buffers of dropped partitions whose upload is done
        (with `block`, of all of them, waiting as needed)."""
        if self.swapper is None:
            return
        done = self.uploads.reap(block)
        if done:
            self.swapper.release(done)

    def drop(self, params: list[Any], keep: set[int] | None = None) -> None:
        """Undo acquire(); parameters no longer in use go back to placeholders.
        Those in `keep` (needed again soon) keep their buffer for now."""
        release = []
        for p in params:
            part_id = p.aio_id
            if self.refs[part_id] <= 0:
                continue
            self.refs[part_id] -= 1
            if self.refs[part_id] == 0:
                del self.refs[part_id]
                if self._stays_materialised(part_id):
                    continue
                p.data = self.copies.placeholder(self.dtype)
                if self.swapper is not None:
                    if keep is not None and part_id in keep:
                        self.speculative[part_id] = None
                    elif not self.uploads.defer(part_id):  # not still being copied up
                        release.append(part_id)
        if release and self.swapper is not None:
            self.swapper.release(release)

    def prefetch(self, part_ids: list[int], limit: int) -> None:
        """Start reading partitions needed soon, keeping `limit` buffers free."""
        if self.swapper is None or not part_ids:
            return
        self._reap(block=False)
        room = self.swapper.pool.available() - limit
        want = [part_id for part_id in part_ids if self.swapper.parts[part_id].state == State.ON_DRIVE][
            : max(room, 0)
        ]
        if want:
            self.swapper.prefetch(want)
            for part_id in want:
                if self.swapper.parts[part_id].lease is not None and self.refs[part_id] == 0:
                    self.speculative[part_id] = None

    def _make_room(self, need: int) -> None:
        assert self.swapper is not None
        while self.swapper.pool.available() < need and (part_id := self.uploads.reap_oldest()) is not None:
            self.swapper.release([part_id])
        while self.swapper.pool.available() < need and self.speculative:
            part_id, _ = self.speculative.popitem(last=False)
            self.uploads.settle(part_id)
            self.swapper.release([part_id])
        if self.swapper.pool.available() < need:
            in_use = sum(1 for part_id in self.refs if self.swapper.parts[part_id].lease is not None)
            raise PoolExhaustedError(
                f"{need} more parameter swap buffers needed but {in_use} of "
                f"{self.swapper.pool.count} hold parameters in use; raise "
                "zero_optimization.offload_param.buffer_count"
            )

    def release_all(self) -> None:
        """Drop every parameter still held (end of a backward pass)."""
        held = [p for part_id in list(self.refs) if (p := self.params[part_id]()) is not None]
        for p in held:
            self.refs[p.aio_id] = 1  # so that one drop() releases it
        self.drop(held)

    # -- values --------------------------------------------------------------------------
    def _adopt_write(self, part_id: int, src: Any) -> None:
        """Write a parameter's initial values without waiting for it: while
        one lands, the model builder computes the next module's values (a
        synchronous write left the drive idle for that time). Past one swap
        buffer's bytes (the largest parameter, so the config bounds this
        memory too) or ADOPT_WRITE_BYTES in flight the oldest is waited for."""
        assert self.swapper is not None
        self.swapper.write(part_id, src, async_op=True)
        self._adopting.append(part_id)
        self._adopting_bytes += src.nbytes
        bound = min(ADOPT_WRITE_BYTES, self.swapper.pool.slot_bytes)
        while self._adopting_bytes > bound and len(self._adopting) > 1:
            self._settle_adoption()

    def _settle_adoption(self) -> None:
        part_id = self._adopting.popleft()
        assert self.swapper is not None
        self._adopting_bytes -= self.swapper.parts[part_id].nbytes
        self.swapper.wait([part_id])

    def finish_adoption(self) -> None:
        """Wait for every adoption write still in flight; raises the first
        failure (SwapStateError, caused by the OSError with path, offset and
        length) after all landed."""
        first: BaseException | None = None
        while self._adopting:
            try:
                self._settle_adoption()
            except BaseException as e:  # noqa: BLE001 - every write waited for, the first raised
                first = first or e
        if first is not None:
            raise first

    def read(self, param: Any) -> Any:
        """A CPU copy of a parameter's stored values (flat, training dtype)."""
        import torch

        part_id = param.aio_id
        if self.swapper is None:
            return self.resident[part_id].clone()
        part = self.swapper.parts[part_id]
        self.swapper.wait([part_id])
        if part.state == State.INVALID:
            raise SwapStateError(
                f"parameter {param.aio_name!r}: its drive copy is invalid after a failed write"
            )
        if part.state == State.RESIDENT or part.lease is not None:
            return part.tensor.clone()
        out = torch.empty(part.numel, dtype=self.dtype)
        self.swapper.read_into(part_id, out)
        return out

    def start_read_into(self, param: Any, out: Any) -> IOFuture | None:
        """Put a parameter's stored values into `out` (flat, its numel, any float
        dtype; converted): a read from the drive started when `out` has the
        training dtype and no buffer holds the parameter (its future; `out`
        must stay untouched until it is done), else copied through read()
        (None: `out` holds them)."""
        if self.swapper is not None and out.dtype == self.dtype and out.is_contiguous():
            part = self.swapper.parts[param.aio_id]
            if part.state != State.RESIDENT and part.lease is None:
                return self.swapper.start_read_into(param.aio_id, out)
        out.copy_(self.read(param))
        return None

    def write(self, param: Any, flat: Any, async_op: bool = True) -> None:
        """Store new values (flat, any float dtype; converted). The caller may
        reuse `flat` right away: an asynchronous write goes from a copy."""
        part_id = param.aio_id
        self.uploads.settle(part_id)  # an upload may still read the old values
        self.counters["writes"] += 1
        self.generation += 1
        self.counters["write_copy_bytes"] += self._host(part_id).nbytes if self.swapper is None else 0
        if self.swapper is None:
            self.resident[part_id].copy_(flat)
        else:
            part = self.swapper.parts[part_id]
            if part.state != State.RESIDENT and part.lease is not None:
                self.swapper.wait([part_id])  # its buffer may still be read into or written from
            if part.state == State.RESIDENT or (part.lease is not None and not part.releasing):
                # One (converting) copy straight into the swapper's memory; the
                # swapper then writes from there and copying onto itself is free.
                part.tensor.copy_(flat)
                src = part.tensor
            else:
                # An asynchronous write outlives this call: it must own its source.
                src = flat.to(self.dtype, copy=async_op)
            self.counters["write_copy_bytes"] += part.nbytes if src is not flat else 0
            self.swapper.write(part_id, src, async_op=async_op)
        if self.refs.get(part_id, 0) > 0 and not self._stays_materialised(part_id):
            # In use right now (e.g. inside gathered()): refresh the live copy too.
            self._materialise(param, self._host(part_id))

    def mirrors(self, param: Any) -> bool:
        """Whether `param`'s drive copy is read from the optimizer's master
        weights (:meth:`aio.swap.ParamSwapper.alias`): after a step it needs
        :meth:`refresh`, not :meth:`write`."""
        return self.swapper is not None and self.swapper.is_aliased(param.aio_id)

    def refresh(self, param: Any, flat: Any) -> None:
        """New values for a mirrored parameter (see :meth:`mirrors`) that the
        optimizer writes to the drive itself: only copies in memory (a buffer
        read ahead, a parameter in use) take them; nothing is written."""
        if self.swapper is None:
            raise ValueError(f"parameter {param.aio_name!r} is not on the drive; write() it")
        part_id = param.aio_id
        self.uploads.settle(part_id)  # an upload may still read the old values
        self.generation += 1
        self.swapper.owner_wrote(part_id, flat)
        if self.refs.get(part_id, 0) > 0 and self.swapper.parts[part_id].lease is not None:
            self._materialise(param, self._host(part_id))

    def lose_mirrors(self) -> None:
        """The optimizer's write of the master weights failed: every mirrored
        parameter's drive copy is now untrusted and refuses to be read until
        new values are stored (loading a checkpoint does)."""
        self.generation += 1
        if self.swapper is not None:
            self.swapper.invalidate_aliased()

    def settle(self, params: list[Any]) -> None:
        """Wait for these parameters' pending writes (raises a failed one)."""
        if self.swapper is not None:
            self.swapper.wait([p.aio_id for p in params])

    def synchronize(self) -> None:
        """Wait for every parameter read, write and upload in flight; raises the first failure."""
        done = self.uploads.synchronize()
        if done and self.swapper is not None:
            self.swapper.release(done)
        if self.swapper is not None:
            self.swapper.synchronize()

    def quiesce(self) -> None:
        """Wait for every read and write in flight, ignoring failures (before
        the files a mirrored parameter reads are closed; see close())."""
        if self.swapper is not None:
            with contextlib.suppress(Exception):
                self.swapper.synchronize()

    @contextlib.contextmanager
    def gathered(self, params: list[Any], modify: bool = False) -> Iterator[None]:
        """Materialise `params` for use outside forward/backward; with
        `modify`, whatever the block writes into them is stored on exit."""
        params = [p for p in params if getattr(p, "_aio_store", None) is self]
        need = len(self.on_drive_part_ids(params)) if self.swapper is not None else 0
        if need > self.swapper_buffer_count():
            raise ValueError(
                f"gathered() of {len(params)} parameters needs {need} parameter swap buffers at once "
                f"and there are {self.swapper_buffer_count()}; gather fewer at a time (e.g. one module's), "
                "or read the whole model with model.state_dict() (one parameter at a time) or write it "
                "with engine.save_pretrained(dir)"
            )
        self.acquire(params)
        try:
            yield
        except BaseException:
            self.drop(params)
            raise
        if modify:
            self.put_back(params)
        else:
            self.drop(params)

    def swapper_buffer_count(self) -> int:
        """The parameter swapper's buffers (0 without a drive)."""
        return self.swapper.pool.count if self.swapper is not None else 0

    def put_back(self, params: list[Any]) -> None:
        """Undo acquire() after the caller changed the values: store them first."""
        try:
            for p in params:
                if not self._stays_materialised(p.aio_id):
                    self.write(p, p.data.detach().reshape(-1).cpu(), async_op=False)
        finally:
            self.drop(params)

    def shape_of(self, part_id: int) -> tuple[int, ...]:
        """The shape of the parameter stored as `part_id`."""
        p = self.params[part_id]()
        if p is None:
            raise ValueError(f"parameter partition {part_id} has no parameter any more")
        return tuple(p.aio_shape)

    def keeps_values_of(self, param: Any) -> bool:
        """Whether `param` (one of this store's) shows values that stay its own
        -- its CPU-resident partition on a CPU model -- rather than a
        placeholder or a swap buffer that another parameter will reuse."""
        return self._stays_materialised(param.aio_id)

    def is_placeholder(self, t: Any) -> bool:
        """Whether `t` is one of this store's parameters showing its empty
        placeholder right now (not materialised by acquire() or kept in memory)."""
        part_id = getattr(t, "aio_id", None)
        return (
            part_id is not None
            and getattr(t, "_aio_store", None) is self
            and part_id not in self.refs
            and not self._stays_materialised(part_id)
        )

    # -- checkpoint -------------------------------------------------------------------------
    def export_checkpoint(self, directory: str) -> None:
        """Write every partition's stored values to `directory` (the swapper's data
        file and manifest, or ``params.pt`` in memory), durably, with a
        ``complete`` marker; `directory` must not exist or be empty."""
        if self.swapper is not None:
            self.swapper.export_checkpoint(directory)
            return
        from ..swap.storage import checkpoint_dir, save_plain

        with checkpoint_dir(directory) as tmp:
            save_plain(dict(self.resident), f"{tmp}/params.pt", "the parameters")

    def verify_checkpoint(self, directory: str, ids: dict[int, int] | None = None) -> Any:
        """Check a checkpoint completely without changing anything. `ids` maps
        the checkpoint's part ids to this store's (default: the same ids);
        partitions of the checkpoint it does not map are not loaded."""
        ids = ids if ids is not None else {i: i for i in self.params}
        if self.swapper is not None:
            return self.swapper.verify_checkpoint(directory, ids)
        from ..swap.storage import load_plain, require_complete

        require_complete(directory)
        saved = load_plain(f"{directory}/params.pt")
        if not isinstance(saved, dict):
            raise ValueError(f"{directory}: checkpoint parameters do not match this model")
        saved = {ids[k]: v for k, v in saved.items() if k in ids}
        if set(saved) != set(ids.values()) or not set(saved) <= set(self.resident):
            raise ValueError(f"{directory}: checkpoint parameters do not match this model")
        for part_id, t in saved.items():
            if not hasattr(t, "shape") or t.shape != self.resident[part_id].shape or t.dtype != self.dtype:
                raise ValueError(f"{directory}: parameter {part_id} has a different size or dtype")
        return saved

    def apply_checkpoint(self, directory: str, verified: Any) -> None:
        """Load a checkpoint verify_checkpoint() accepted."""
        self.synchronize()  # no upload may read what is overwritten now
        self.generation += 1
        if self.swapper is not None:
            self.swapper.apply_checkpoint(directory, verified)
        else:
            for part_id, t in verified.items():
                self.resident[part_id].copy_(t)
        for part_id in self.refs:
            p = self.params[part_id]()
            if p is not None and not self._stays_materialised(part_id):
                self._materialise(p, self._host(part_id))

    # -- accounting --------------------------------------------------------------------------
    def pinned_bytes(self) -> int:
        """Bytes page-locked for the parameters right now: the swapper's buffers
        and pinned CPU-resident partitions (nothing with ``pin_memory`` false), or
        with the memory backend the partitions registered for a GPU model (whole
        pages); plus the upload staging ring on a GPU."""
        staging = self.copies.pinned_bytes()
        if self.swapper is not None:
            return self.swapper.pinned_bytes() + staging
        return self.copies.host_registered + staging

    def stats(self) -> dict[str, Any]:
        """The swapper's stats(), or in memory ``partitions`` and ``resident_bytes``."""
        copies = dict(self.counters, **self.uploads.counters, **getattr(self.copies, "counters", {}))
        if self.swapper is not None:
            return dict(self.swapper.stats(), **copies)
        return {
            "partitions": len(self.resident),
            "resident_bytes": sum(t.nbytes for t in self.resident.values()),
            **copies,
        }

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("the aio.zero parameter store is closed")

    def close(self) -> None:
        """Close the swapper (I/O finished, swap files removed); idempotent. Acquiring
        or adopting afterwards raises ValueError."""
        if self.closed:
            return
        self.closed = True
        idle = False
        try:
            self.uploads.close()
        finally:
            try:
                # Every device copy from host memory ends before any of it goes
                # (the staging rings here, the swap buffers next); if that wait
                # fails, the buffers are left to the collector.
                self.copies.close()
                idle = True
            finally:
                if self.swapper is not None:
                    self.swapper.close(free_buffers=idle)


def module_params(module: Any) -> list[Any]:
    """The module's own parameters (not its children's), deduplicated."""
    seen: dict[int, Any] = {}
    for p in module.parameters(recurse=False):
        seen.setdefault(id(p), p)
    for p in getattr(module, "_aio_external_params", ()):
        seen.setdefault(id(p), p)
    return list(seen.values())
