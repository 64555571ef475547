"""The moments of :class:`aio.optim.NVMeAdamW` as drive-backed placeholders
(:class:`DriveTensor`), and :class:`DriveMoments`, which reads and writes
them one parameter at a time: what :meth:`aio.optim.NVMeAdamW.streamed_state`
makes its state_dict() of, and what the DCP planners of
:mod:`aio.optim.dcp` read and write (no import of
torch.distributed.checkpoint here: the optimizer loads this module).

A placeholder is a meta tensor of the moment's local shape, float32 (the
local tensor of a DTensor for a DTensor parameter), that refuses to give
data (``detach``, ``cpu``, ``to``, ``clone``, ``copy_``, a pickle ...): one
that reaches a plain ``dcp.save``/``dcp.load`` (without aio's planners) or
torch's own optimizer is a TypeError saying so, never a checkpoint of
nothing. :class:`DriveMoments` goes through the swapper's public
``read_state``/``write_state``/``scalars`` and its own pinned buffers (one
sub-group per moment name, leased for the save or load and given back at
its end, or before the optimizer's next step when it failed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .dtensor import is_dtensor, local_of
from .layout import Layout

_REFUSED = (
    "detach", "cpu", "cuda", "to", "clone", "copy_", "numpy", "tolist", "item", "__reduce_ex__",
    "__deepcopy__", "untyped_storage", "storage", "data_ptr", "__dlpack__", "__array__",
)  # fmt: skip
_REFUSED_FUNCS = {getattr(torch.Tensor, n) for n in _REFUSED}


class DriveTensor(torch.Tensor):
    """A moment of :class:`aio.optim.NVMeAdamW` that is on the drive: a meta
    tensor with the moment's local shape and float32 dtype, carrying its
    :class:`DriveSource` (``.drive_source``; an alias of the same shape
    and strides keeps it, another view has none). Every way to
    take data out of it is a TypeError naming the remedy."""

    drive_source: DriveSource | None = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _REFUSED_FUNCS:
            raise TypeError(
                f"{getattr(func, '__name__', func)}() of a moment that is on the drive: this state_dict was "
                "made inside NVMeAdamW.streamed_state(); save it with dcp.save(..., planner="
                "aio.optim.DriveSavePlanner()) and load it with planner=aio.optim.DriveLoadPlanner(), or "
                "take state_dict() outside streamed_state() for the values"
            )
        if func is torch.empty_like and args and isinstance(args[0], DriveTensor):
            return args[0]  # DCP's load makes its meta tensors real: this one stays on the drive
        out = super().__torch_function__(func, types, args, kwargs or {})
        src = args[0] if args and isinstance(args[0], DriveTensor) else None
        if isinstance(out, DriveTensor) and src is not None and out is not src:
            # An alias of the whole moment (to_local(), view(shape)) stands for it; another layout
            # (t(), narrow) has no source: refused as data, never saved as the moment.
            same = out.shape == src.shape and out.stride() == src.stride()
            out.drive_source = src.drive_source if same else None
        return out


@dataclass(frozen=True)
class DriveSource:
    """Which moment a :class:`DriveTensor` stands for: `name` of parameter
    `index` (the optimizer's order) in `moments`."""

    moments: DriveMoments
    index: int
    name: str


def drive_tensor(shape: tuple[int, ...], source: DriveSource) -> DriveTensor:
    """A :class:`DriveTensor` of `shape` standing for `source`."""
    t = torch.Tensor._make_subclass(DriveTensor, torch.empty(shape, dtype=torch.float32, device="meta"))
    t.drive_source = source
    return t


def drive_source(value: Any) -> DriveSource | None:
    """The :class:`DriveSource` of a placeholder (a :class:`DriveTensor`,
    or a DTensor over one), else None."""
    local = local_of(value) if is_dtensor(value) else value
    return local.drive_source if isinstance(local, DriveTensor) else None


@dataclass
class _Open:
    """A sub-group's tensor held in a leased swap buffer."""

    index: int
    lease: Any
    view: torch.Tensor
    dirty: bool = False


@dataclass
class _Assembly:
    """A moment a load is filling: its buffer, the boxes DCP was given
    (offsets, lengths) and the elements it wrote."""

    flat: torch.Tensor
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    count: int = 0


def _overlap(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    """Whether two boxes (offsets, lengths) share an element."""
    if 0 in a[1] or 0 in b[1]:
        return False
    return all(ao < bo + bl and bo < ao + al for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1], strict=True))


@dataclass(eq=False)  # one per state_dict(): compared (and hashed) by identity
class DriveMoments:
    """Reads and writes a laid-out optimizer's moments one parameter at a
    time through its swapper's public ``read_state``/``write_state``,
    holding each moment name's current sub-group in one of the swapper's own
    buffers (``try_acquire_buffer``; given back by :meth:`release`, which a
    planner calls after its last item, :meth:`abandon` and :meth:`close`).
    `steps`: each sub-group's step count when the placeholders were made (a
    save after a step would pair new moments with the old counts). The
    owner's hooks: `on_load`, called by :meth:`begin_load`; `on_write`,
    called before each write to the drive (from then on the optimizer
    refuses to step until load_state_dict() loads the steps); `refusal`,
    why a save may not read now (None: it may). A moment counts as loaded
    (:meth:`is_loaded`) only once all of it is on the drive. Thread-safe
    (DCP's writer may resolve items from several threads)."""

    swapper: Any
    layout: Layout
    on_load: Callable[[DriveMoments], None] | None = None
    on_write: Callable[[DriveMoments], None] | None = None
    refusal: Callable[[], str | None] | None = None
    steps: list[float] = field(default_factory=list)
    closed: bool = False
    loaded: set[tuple[int, str]] = field(default_factory=set)
    _open: dict[str, _Open] = field(default_factory=dict)
    _assembling: dict[tuple[int, str], _Assembly] = field(default_factory=dict)
    # By name: moments whole in that name's open buffer (and on the drive before it), not yet written.
    _unflushed: dict[str, set[int]] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        self.steps = self._steps_now()

    def _steps_now(self, subgroups: Iterable[int] | None = None) -> list[float]:
        # As numbers: a step may count on in the tensor the snapshot would share.
        indices = range(len(self.layout.subgroup_numels)) if subgroups is None else subgroups
        return [float((self.swapper.scalars(i) or {}).get("step", -1.0)) for i in indices]

    def check_current(self) -> None:
        """ValueError unless a save may read the placeholders now: their
        ``streamed_state()`` block is open, the optimizer has not stepped
        since they were made, and no streamed load waits for its steps."""
        with self._lock:
            self._check(reading=True)

    def begin_save(self) -> None:
        """:meth:`check_current`, then what an earlier failed load left in
        buffers (not on the drive) dropped: a save reads the drive."""
        with self._lock:
            self._check(reading=True)
            self._drop()

    def begin_load(self) -> None:
        """Start a load of the placeholders (DriveLoadPlanner's set-up):
        what an earlier failed load of them left (moments part-assembled,
        in buffers not yet on the drive, or counted as loaded) is dropped,
        so this one loads every moment again; `on_load` is told."""
        with self._lock:
            self._check(reading=False)
            self._drop()
            self.loaded.clear()
        if self.on_load is not None:
            self.on_load(self)

    def read(self, index: int, name: str) -> torch.Tensor:
        """Parameter `index`'s moment `name`, flattened local float32 (a new tensor)."""
        with self._lock:
            self._check(reading=True, subgroups=[pc.subgroup for pc in self.layout.pieces[index]])
            out = torch.empty(self.layout.numel(index), dtype=torch.float32)
            for pc in self.layout.pieces[index]:
                buf = self._buffer(pc.subgroup, name)
                out[pc.start : pc.start + pc.count].copy_(buf[pc.offset : pc.offset + pc.count])
            return out

    def target(
        self, index: int, name: str, shape: tuple[int, ...], offsets: Any, lengths: Any
    ) -> torch.Tensor:
        """Where DCP writes the box (`offsets`, `lengths`) of parameter
        `index`'s moment `name` (local `shape`): a view of a buffer the
        moment is assembled in until :meth:`commit` counted all of it. A
        box overlapping one given before is a ValueError (the count would
        complete the moment with elements never written)."""
        numel = self.layout.numel(index)
        if torch.Size(shape).numel() != numel:
            raise ValueError(
                f"the placeholder for {name!r} of parameter {index} has shape {tuple(shape)}, the layout "
                f"{numel} local elements: make the state_dict again after the parameters changed"
            )
        with self._lock:
            self._check(reading=False)
            entry = self._assembling.get((index, name))
            if entry is None:
                entry = self._assembling[(index, name)] = _Assembly(torch.empty(numel, dtype=torch.float32))
            box = (tuple(map(int, offsets)), tuple(map(int, lengths)))
            if any(_overlap(box, b) for b in entry.boxes):
                del self._assembling[(index, name)]
                raise ValueError(
                    f"moment {name!r} of parameter {index}: the checkpoint's piece at {box[0]} (lengths "
                    f"{box[1]}) overlaps another; the moment is not loaded"
                )
            entry.boxes.append(box)
        view = entry.flat.view(shape)
        for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
            view = view.narrow(dim, start, length)
        return view

    def commit(self, index: int, name: str, count: int) -> None:
        """`count` more elements of the moment are in its buffer; once all
        are, it goes to the drive and the buffer is freed."""
        with self._lock:
            self._check(reading=False)
            entry = self._assembling.get((index, name))
            if entry is None:
                raise ValueError(
                    f"moment {name!r} of parameter {index} was committed without a target() buffer: "
                    "load with dcp.load(..., planner=aio.optim.DriveLoadPlanner())"
                )
            entry.count += count
            numel = entry.flat.numel()
            if entry.count < numel:
                return
            del self._assembling[(index, name)]
            if entry.count > numel:  # more than its boxes (checked not to overlap) hold
                raise ValueError(
                    f"moment {name!r} of parameter {index}: the checkpoint's pieces gave {entry.count} "
                    f"elements for {numel}; the moment is not loaded"
                )
            self._store(index, name, entry.flat)

    def is_loaded(self, index: int, name: str) -> bool:
        """Whether the last load wrote all of the moment to the drive (one
        with no local elements is)."""
        return (index, name) in self.loaded or not self.layout.pieces[index]

    def _store(self, index: int, name: str, flat: torch.Tensor) -> None:
        pieces = self.layout.pieces[index]
        fresh = [pc.subgroup for pc in pieces if self.swapper.scalars(pc.subgroup) is None]
        if fresh:  # write_state() takes a never-stepped sub-group's whole state only
            raise ValueError(
                f"sub-group {fresh[0]} was never stepped: load a streamed state after a step, or through "
                "get_optimizer_state_dict (which takes torch's initializing step)"
            )
        for pc in pieces:
            buf = self._buffer(pc.subgroup, name)
            buf[pc.offset : pc.offset + pc.count].copy_(flat[pc.start : pc.start + pc.count])
            self._open[name].dirty = True
        # Loaded once this buffer is written: the earlier sub-groups were as the next one was opened.
        self._unflushed.setdefault(name, set()).add(index)

    def _check(self, reading: bool, subgroups: list[int] | None = None) -> None:
        """ValueError when the placeholders ended; reading (a save), also
        when the owner refuses or the steps of `subgroups` (default all)
        changed since the placeholders were made."""
        if self.closed:
            raise ValueError(
                "a moment placeholder used after its NVMeAdamW.streamed_state() ended (or a later "
                "state_dict() replaced it): save and load inside the `with` block"
            )
        why = self.refusal() if reading and self.refusal is not None else None
        if why:
            raise ValueError(why)
        then = self.steps if subgroups is None else [self.steps[i] for i in subgroups]
        if reading and self._steps_now(subgroups) != then:
            raise ValueError(
                "the optimizer stepped after state_dict() made these placeholders: the moments on the drive "
                "are newer than their steps; take the state_dict again right before dcp.save"
            )

    def _buffer(self, index: int, name: str) -> torch.Tensor:
        """Sub-group `index`'s tensor `name`, read into a leased buffer (the
        one this name holds, written back first if changed)."""
        cur = self._open.get(name)
        if cur is not None and cur.index == index:
            return cur.view
        lease = self._take_lease(name)
        view = lease.tensor(torch.float32, self.layout.subgroup_numels[index])
        self._open[name] = _Open(index, lease, view)
        try:
            self.swapper.read_state(index, name, out=view)
        except BaseException:
            self._release(name)
            raise
        return view

    def _take_lease(self, name: str) -> Any:
        """A buffer for `name`: the one it holds (its sub-group written back
        first), a free one of the swapper's, else another name's."""
        if name in self._open:
            self._flush(name)
            return self._open.pop(name).lease
        lease = self.swapper.try_acquire_buffer()
        if lease is not None:
            return lease
        for other in list(self._open):
            self._flush(other)
            return self._open.pop(other).lease
        raise ValueError(
            "no swap buffer of the optimizer is free for a streamed DCP save or load (all leased, e.g. by "
            "a gradient stream): raise buffer_count, or save and load between steps"
        )

    def _flush(self, name: str) -> None:
        cur = self._open[name]
        if cur.dirty:
            if self.on_write is not None:
                self.on_write(self)  # first: a failed write leaves the drive changed too
            self.swapper.write_state(cur.index, {name: cur.view})
            cur.dirty = False
        self.loaded.update((k, name) for k in self._unflushed.pop(name, ()))

    def _release(self, name: str) -> None:
        self._open.pop(name).lease.release()

    def _drop(self) -> None:
        """Every buffer given back unwritten, part-assembled moments forgotten."""
        self._assembling.clear()
        self._unflushed.clear()
        for name in list(self._open):
            self._release(name)

    def flush(self) -> None:
        """Write every changed sub-group buffer to the drive."""
        with self._lock:
            for name in list(self._open):
                self._flush(name)

    def release(self) -> None:
        """:meth:`flush`, then give every buffer back to the swapper (also
        when the flush fails: the swapper's steps need them; a moment whose
        write failed is not loaded); a later read or write leases again."""
        with self._lock:
            try:
                self.flush()
            finally:
                self._drop()

    def abandon(self) -> None:
        """Give every buffer back writing nothing (what a failed save or
        load left leased, before a step): a moment not yet on the drive is
        not loaded."""
        with self._lock:
            self._drop()

    def close(self) -> None:
        """:meth:`abandon`; placeholders refuse from then on (a finished
        load wrote everything at its last item). Idempotent."""
        with self._lock:
            self.closed = True
            self._drop()
