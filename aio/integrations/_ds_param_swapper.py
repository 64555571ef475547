"""EvictingParamSwapper: DeepSpeed's ZeRO-3 parameter swapper that never
asserts for want of a buffer (see ds_swappers.py for the why and the list of
overridden methods).

Imports DeepSpeed: ds_swappers imports this module only when installing.

The protocol it keeps (DeepSpeed 0.19; partitioned_param_swapper.py "pps",
partition_parameters.py "pp", partitioned_param_coordinator.py "coord"):

1. A partition DeepSpeed sees as AVAILABLE must hold its data until
   ``remove_partition_and_release_buffers``; only where it lives may change
   (ordinary memory instead of a swap buffer).
2. A gathered parameter's partition is never NOT_AVAILABLE: the NVMe
   prefetch (coord ``_is_currently_on_nvme``) would read it again into a
   second buffer while the first is still in use.
3. No buffer is released or reused while a read into it is in flight
   (``synchronize_reads`` would mark a stale buffer AVAILABLE), nor, on a
   device, while the device copy out of it may still run.
4. Nothing is written here but at DeepSpeed's own write points.
5. What is kept in ordinary memory stays under the held cap
   (``ds_swappers.held_cap``); past it a gathered partition is released
   only where the parameter holds its own copy (the drive has the
   partition: parameters are not written between steps), and a released
   partition is not read ahead again while its parameter stays gathered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (
    AsyncPartitionedParameterSwapper,
    PartitionedParamStatus,
)
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from .deepspeed import register_param_swapper_cleanup
from .ds_swappers import (
    PARAM_COUNTERS,
    buffers_short,
    bump,
    held_cap,
    held_cap_short,
    note_buffer_count,
    note_held_cap,
    peak,
)


def _landed(param: Any) -> bool:
    """Whether `param`'s partition is AVAILABLE (not a partition being made at Init)."""
    part = getattr(param, "ds_tensor", None)
    return part is not None and part.status == PartitionedParamStatus.AVAILABLE


def _shares_storage(a: Any, b: Any) -> bool:
    """Whether tensors `a` and `b` are views of one storage."""
    try:
        return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    except RuntimeError:  # a tensor without storage (meta, a freed placeholder)
        return False


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


class EvictingParamSwapper(AsyncPartitionedParameterSwapper):
    """DeepSpeed's parameter swapper with aio's buffer rules: when buffers
    run short it evicts gathered partitions to ordinary memory, drops
    prefetched partitions nobody gathers, waits for reads, and only then
    raises (a ValueError naming ``offload_param.buffer_count``). What it
    keeps in ordinary memory stays under ``self.cap`` (see rule 5)."""

    def __init__(self, ds_config: Any, model_dtype: Any) -> None:
        # The cap first: a bad aio_zero block fails before any buffer is pinned.
        self.cap = held_cap(getattr(ds_config, "_param_dict", None))
        super().__init__(ds_config, model_dtype)
        # Its files go with it, engine or not (an initialize that fails after zero.Init).
        register_param_swapper_cleanup(self)
        self.counters: dict[str, int] = dict.fromkeys(PARAM_COUNTERS, 0)
        self._released: set[int] = set()  # gathered, partition released past the cap (on the drive)
        self._capped = False  # a gathered partition kept its buffer for want of room under the cap
        self._holders: dict[int, Any] = {}  # ds_id -> parameter whose partition holds a buffer
        self._since: dict[int, int] = {}  # ds_id -> when it got its buffer (oldest evicted first)
        self._tick = 0
        self._private: dict[int, int] = {}  # ds_id -> bytes of its partition kept in ordinary memory
        self._private_bytes = 0
        self._gathering: frozenset[int] = frozenset()
        self._events: dict[int, Any] = {}  # buffer id -> device event to wait for before reuse
        note_buffer_count("param", self.param_buffer_count)
        note_held_cap(self.cap)

    @contextlib.contextmanager
    def gathering(self, params: Iterable[Any]) -> Iterator[None]:
        """While a gather makes its partitions available: never drop them."""
        prev = self._gathering
        self._gathering = prev | {p.ds_id for p in params}
        try:
            yield
        finally:
            self._gathering = prev

    # which partitions can give their buffer back
    def _evictable(self) -> list[Any]:
        """Gathered parameters whose partition holds a buffer that nothing
        reads any more (oldest first)."""
        if self.use_gds:
            # GPUDirect buffers live on the device: a copy "to ordinary
            # memory" would move the partition off it. Untested; left out.
            return []
        inflight = {p.ds_id for p in self.inflight_params}
        found = []
        for pid, p in self._holders.items():
            if pid in self._gathering or pid in inflight or not _landed(p):
                continue
            if p.ds_status == ZeroParamStatus.AVAILABLE or (
                # One rank on the CPU: the gather made param.data a view of
                # the buffer at once (pp NoGatherHandle); the copy is done.
                p.ds_status == ZeroParamStatus.INFLIGHT and _shares_storage(p.data, self.buffers)
            ):
                found.append(p)
        return sorted(found, key=lambda p: self._since[p.ds_id])

    def _droppable(self) -> list[Any]:
        """Landed prefetched partitions of parameters nobody gathers now
        (latest prefetched first: needed last)."""
        inflight = {p.ds_id for p in self.inflight_params}
        found = [
            p
            for pid, p in self._holders.items()
            if pid not in self._gathering
            and pid not in inflight
            and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
            and _landed(p)
        ]
        return sorted(found, key=lambda p: -self._since[p.ds_id])

    def _keeps_own_copy(self, param: Any) -> bool:
        """Whether a gathered parameter's data is not a view of the buffers
        (several ranks: the gather's output; a device: the copy there)."""
        return not _shares_storage(param.data, self.buffers)

    def _givable(self) -> list[Any]:
        """The evictable parameters that can give their buffer back now:
        kept in ordinary memory while the cap allows, else released if they
        hold their own copy."""
        room = self.cap.nbytes - self._private_bytes
        found = []
        for p in self._evictable():
            n = _nbytes(p.ds_tensor)
            if n <= room:
                room -= n
                found.append(p)
            elif self._keeps_own_copy(p):
                found.append(p)
        return found

    def available_swap_in_buffers(self) -> int:
        """Free buffers plus those gathered parameters can give back: the
        bound of the coordinator's NVMe prefetch."""
        return len(self.available_buffer_ids) + len(self._givable())

    # giving buffers back
    def _give_back(self, param: Any) -> None:
        """Return `param`'s buffer to the pool without touching its status."""
        pid = param.ds_id
        buffer_id = self.param_id_to_buffer_id.pop(pid)
        del self.param_id_to_swap_buffer[pid]
        self._holders.pop(pid, None)
        if pid in self.available_params:
            self.available_params.remove(pid)
            self.available_numel -= self.param_id_to_numel[pid]
        self.available_buffer_ids.append(buffer_id)

    def _fence(self, param: Any) -> None:
        """On a device, the buffer's reuse waits for an event recorded after
        the device copy that read it (rule 3)."""
        if param.data.device.type != "cpu":
            event = get_accelerator().Event()
            event.record()
            self._events[self.param_id_to_buffer_id[param.ds_id]] = event

    def _evict_gathered(self, param: Any) -> None:
        """Keep a gathered partition in ordinary memory, AVAILABLE (rule 2),
        and give its buffer back (rule 3: fenced on a device)."""
        part = param.ds_tensor
        private = part.data.to("cpu", copy=True)
        if _shares_storage(param.data, part.data):
            # One rank on the CPU: the parameter is a view of the buffer.
            offset = (param.data.data_ptr() - part.data.data_ptr()) // part.element_size()
            param.data = private.narrow(0, offset, param.data.numel()).view(param.data.shape)
        else:
            self._fence(param)
        part.data = private
        nbytes = _nbytes(private)
        self._private[param.ds_id] = nbytes
        self._private_bytes += nbytes
        self._give_back(param)
        bump(self.counters, "evicted")
        peak(self.counters, "held_peak", len(self._private))
        peak(self.counters, "held_peak_bytes", self._private_bytes)

    def _release_gathered(self, param: Any) -> None:
        """Past the cap: give a gathered partition's buffer back without a
        copy (its parameter holds its own; the drive has the partition).
        NOT_AVAILABLE until DeepSpeed releases the parameter (rule 5)."""
        self._fence(param)
        super().remove_partition_and_release_buffers([param])
        self._holders.pop(param.ds_id, None)
        self._released.add(param.ds_id)
        bump(self.counters, "released")

    def restore_released(self, param: Any) -> None:
        """A buffer again for a partition released past the cap, before
        DeepSpeed copies an update of its parameter into it (ds_swappers
        wraps ``Init._partition_param``); the copy fills it."""
        if param.ds_id not in self._released:
            return
        buffer = self.get_buffer(param, param.ds_tensor.ds_numel)
        param.ds_tensor.data = buffer.data
        param.ds_tensor.status = PartitionedParamStatus.AVAILABLE

    def _drop(self, param: Any) -> None:
        """Drop a landed prefetched partition (read again when needed)."""
        super().remove_partition_and_release_buffers([param])
        self._forget(param.ds_id)
        bump(self.counters, "dropped_prefetch")

    def _forget(self, pid: int) -> None:
        self._holders.pop(pid, None)
        self._since.pop(pid, None)
        self._released.discard(pid)
        self._private_bytes -= self._private.pop(pid, 0)

    def _free(self) -> int:
        return len(self.available_buffer_ids)

    def _evict_until(self, need: int) -> None:
        """Give back gathered partitions' buffers, oldest first, until `need`
        are free: kept in ordinary memory under the cap, released past it."""
        for p in self._evictable():
            if self._free() >= need:
                return
            if self._private_bytes + _nbytes(p.ds_tensor) <= self.cap.nbytes:
                self._evict_gathered(p)
            elif self._keeps_own_copy(p):
                self._release_gathered(p)
            else:  # one rank on the CPU: the parameter is the buffer; it stays
                self._capped = True

    def _drop_until(self, need: int) -> None:
        for p in self._droppable():
            if self._free() >= need:
                return
            self._drop(p)

    def _make_room(self, need: int, speculative: bool) -> int:
        """Free buffers until `need` are free; returns how many are.
        A speculative request (the prefetch) only evicts (or, past the
        cap, releases) gathered partitions; a needed one also drops
        prefetched ones, then waits for the reads in flight, and raises if
        that is not enough: nothing else would free a buffer."""
        self._capped = False
        self._evict_until(need)
        if speculative or self._free() >= need:
            return self._free()
        self._drop_until(need)
        if self._free() < need and self.inflight_params:
            self.synchronize_reads()  # what lands becomes evictable or droppable
            bump(self.counters, "waited")
            self._evict_until(need)
            self._drop_until(need)
        if self._free() < need:
            if self._capped:
                n, held = len(self._private), self._private_bytes
                raise held_cap_short(self.param_buffer_count, n, held, self.cap)
            held = self.param_buffer_count - self._free()
            raise buffers_short(
                "offload_param", self.param_buffer_count, need + held, "one gather of parameters"
            )
        return self._free()

    def _take_buffer_ids(self, params: list[Any]) -> None:
        """Bookkeeping for params about to get buffers; waits for the device
        copies still reading the buffers they will get (rule 3)."""
        for buffer_id in self.available_buffer_ids[-len(params) :] if params else []:
            event = self._events.pop(buffer_id, None)
            if event is not None:
                event.synchronize()
                bump(self.counters, "device_waits")
        for p in params:
            self._tick += 1
            self._holders[p.ds_id] = p
            self._since[p.ds_id] = self._tick
            self._released.discard(p.ds_id)

    def _allocate_and_return_buffers_for_swap_in(self, params: list[Any]) -> Any:
        self._take_buffer_ids(params)
        return super()._allocate_and_return_buffers_for_swap_in(params)

    def swap_in(self, params: Any, async_op: bool = True, swap_in_buffers: Any = None) -> None:
        """DeepSpeed's swap-in, each parameter once, with room made first
        (a prefetch reads only as many as it finds buffers for)."""
        if swap_in_buffers is not None:
            return super().swap_in(params, async_op, swap_in_buffers)
        todo, seen = [], set()
        for p in params:
            if p.ds_id in seen:
                bump(self.counters, "deduplicated")
                continue
            seen.add(p.ds_id)
            # A partition released past the cap is not read ahead while its
            # parameter is still gathered: nothing reads it (rule 5).
            if p.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE and not (
                async_op and p.ds_id in self._released
            ):
                todo.append(p)
        free = self._make_room(len(todo), speculative=async_op)
        if len(todo) > free:
            bump(self.counters, "trimmed_prefetch", len(todo) - free)
            todo = todo[:free]
        if todo:
            super().swap_in(todo, async_op)
        elif not async_op:
            self.synchronize_reads()
        return None

    def get_buffer(self, param: Any, numel: int) -> Any:
        """A buffer for a new partition (at Init), room made first."""
        self._make_room(1, speculative=False)
        self._take_buffer_ids([param])
        return super().get_buffer(param, numel)

    def swap_into_buffer(self, param: Any, dest_buffer: Any) -> None:
        """DeepSpeed's read into a caller's buffer, room made first if it
        needs a swap buffer for it."""
        if not self.available_buffer_ids:
            self._make_room(1, speculative=False)
        super().swap_into_buffer(param, dest_buffer)

    def swap_out_and_release(
        self, params: Any, async_op: bool = False, force_buffer_release: bool = False
    ) -> Any:
        """DeepSpeed's write, after giving a buffer back to any partition
        that was updated in its ordinary-memory copy."""
        for p in params:
            if p.ds_id in self._private and p.ds_id not in self.param_id_to_buffer_id:
                self._rebuffer(p)
        return super().swap_out_and_release(params, async_op, force_buffer_release)

    def _rebuffer(self, param: Any) -> None:
        self._make_room(1, speculative=False)
        self._take_buffer_ids([param])
        buffer = super().get_buffer(param, param.ds_tensor.numel())
        buffer.copy_(param.ds_tensor.data)
        self._private_bytes -= self._private.pop(param.ds_id, 0)
        param.ds_tensor.data = buffer.data
        bump(self.counters, "rebuffered")

    def remove_partition_and_release_buffers(self, params: Any) -> None:
        """DeepSpeed's release, after landing any read into these buffers (rule 3)."""
        params = list(params)
        pending = {p.ds_id for p in self.inflight_params}
        if any(p.ds_id in pending for p in params):
            self.synchronize_reads()
        super().remove_partition_and_release_buffers(params)
        for p in params:
            self._forget(p.ds_id)

    def reserve_available_buffers(self) -> Any:
        """DeepSpeed lends the free buffers to the optimizer's fast init:
        no device copy may still read them."""
        for buffer_id in list(self.available_buffer_ids):
            event = self._events.pop(buffer_id, None)
            if event is not None:
                event.synchronize()
                bump(self.counters, "device_waits")
        return super().reserve_available_buffers()
