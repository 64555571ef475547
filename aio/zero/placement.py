"""Parameter placement: every check on the model against the config before
anything is allocated, and the layout of the trainable parameters in the
optimizer's sub-groups (model order, each sub-group at most
``sub_group_size`` elements)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, TrainConfig
from ..config.gradients import GradientPlacement
from .config import check_drive_paths
from .params import ParamStore, check_fits


class ParamPlace:
    """Where one parameter lives in the optimizer: its sub-group, its element
    offset there, and its position in model order."""

    __slots__ = ("param", "group", "offset", "numel", "order")

    def __init__(self, param: Any, group: int, offset: int, numel: int, order: int) -> None:
        self.param, self.group, self.offset, self.numel, self.order = param, group, offset, numel, order


@dataclass
class Plan:
    """The checked model: its parameters, the Init store they already belong
    to (if any), the device, and the trainable ones packed into sub-groups."""

    named: list[tuple[str, Any]]
    store: ParamStore | None
    device: Any
    packed: list[list[Any]]
    group_of: list[int]  # each sub-group's torch param group
    order: dict[int, int]  # id(param) -> position among the trainable parameters in model order


def plan_placement(model: Any, cfg: TrainConfig, device: Any, groups: list[list[Any]] | None = None) -> Plan:
    """Check `model` against `cfg` (raising before any allocation) and pack its
    trainable parameters into sub-groups; with torch param `groups` (each a
    list of parameters), each group's trainable parameters into sub-groups of
    their own (a sub-group never mixes two groups). A trainable parameter in
    no group is refused: nothing would step it."""
    import torch

    named = _unique_named_params(model)
    if not named:
        raise ValueError("the model has no parameters")
    store = _existing_store(named)
    if device is None:
        device = store.device if store is not None else named[0][1].device
    elif store is not None and not _same_device(device, store.device):
        raise ValueError(
            f"the model was built under aio.zero.Init for device {store.device}, but initialize() was "
            f"given device={device}: pass the same device to both (or leave initialize's out)"
        )
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise ValueError("no parameter requires grad: nothing to train")
    sizes = {n: _numel(p) for n, p in named}
    _check_sub_group_size(cfg.sub_group_size, trainable, sizes)
    if store is not None:
        _check_same_store_config(store, cfg)
    else:
        for n, _p in named:
            check_fits(cfg, n, sizes[n])
    check_drive_paths(cfg)
    order = {id(p): i for i, (_n, p) in enumerate(trainable)}
    packed: list[list[Any]] = []
    group_of: list[int] = []
    for k, members in enumerate(_group_members(trainable, groups)):
        if members:
            subs = pack_subgroups(members, sizes, cfg.sub_group_size)
            packed.extend(subs)
            group_of.extend([k] * len(subs))
    return Plan(named, store, torch.device(device), packed, group_of, order)


def _group_members(
    trainable: list[tuple[str, Any]], groups: list[list[Any]] | None
) -> list[list[tuple[str, Any]]]:
    """The trainable (name, param) pairs of each group, in model order."""
    if groups is None:
        return [trainable]
    index = {id(p): k for k, ps in enumerate(groups) for p in ps}
    missing = [n for n, p in trainable if id(p) not in index]
    if missing:
        raise ValueError(
            f"{len(missing)} parameters require grad but are in no param group of the optimizer "
            f"(e.g. {missing[:3]}); add them to a group or freeze them (requires_grad_(False))"
        )
    out: list[list[tuple[str, Any]]] = [[] for _ in groups]
    for n, p in trainable:
        out[index[id(p)]].append((n, p))
    return out


def _check_sub_group_size(sgs: int, trainable: list[tuple[str, Any]], sizes: dict[str, int]) -> None:
    name = max(trainable, key=lambda np_: sizes[np_[0]])[0]
    if sizes[name] > sgs:
        raise ConfigError(
            [
                (
                    "zero_optimization.sub_group_size",
                    f"{sgs} elements is smaller than parameter {name!r} ({sizes[name]} "
                    f"elements); set it to at least {sizes[name]}",
                )
            ]
        )


def _check_same_store_config(store: ParamStore, cfg: TrainConfig) -> None:
    if store.cfg.offload.offload_param != cfg.offload.offload_param or store.dtype != cfg.torch_dtype:
        raise ConfigError(
            [
                (
                    "zero_optimization.offload_param",
                    "the model was built under aio.zero.Init with a different offload_param "
                    "block or dtype than this config; pass the same config to both",
                )
            ]
        )


def pack_subgroups(trainable: list[tuple[str, Any]], sizes: dict[str, int], sgs: int) -> list[list[Any]]:
    """Pack `trainable` (name, param) pairs, in order, into consecutive sub-groups
    of at most `sgs` elements (sizes from `sizes[name]`): a sub-group is closed
    when the next parameter would not fit. Returns the parameters per sub-group."""
    packed: list[list[Any]] = []
    cur: list[Any] = []
    cur_n = 0
    for n, p in trainable:
        if cur and cur_n + sizes[n] > sgs:
            packed.append(cur)
            cur, cur_n = [], 0
        cur.append(p)
        cur_n += sizes[n]
    packed.append(cur)
    return packed


class SubGroupLayout:
    """The places of the trainable parameters (adopted by the store) in their
    sub-groups: ``places`` by parameter id, ``groups`` in order, and each
    sub-group's element count."""

    def __init__(self, packed: list[list[Any]], order: dict[int, int] | None = None) -> None:
        self.places: dict[int, ParamPlace] = {}
        self.groups: list[list[ParamPlace]] = []
        self.group_numel: list[int] = []
        seq = 0
        for gi, members in enumerate(packed):
            group = []
            off = 0
            for p in members:
                # Model order (gradient norms are summed in it, as clip_grad_norm_ does).
                place = ParamPlace(p, gi, off, p.aio_numel, order[id(p)] if order else seq)
                seq += 1
                group.append(place)
                self.places[p.aio_id] = place
                off += p.aio_numel
            self.groups.append(group)
            self.group_numel.append(off)

    def ordered(self) -> list[ParamPlace]:
        """Every place, in model order."""
        return sorted(self.places.values(), key=lambda s: s.order)

    def fill_master(self, gi: int, start_read_into: Any, out: Any, dtype: Any = None) -> None:
        """Write sub-group `gi`'s fp32 master weights into `out` (float32, the
        sub-group's size) from its parameters, stored in `dtype`: every
        parameter's read started at once (start_master_reads); bfloat16 ones
        read into the front of `out` and widened in place
        (start_widened_reads), others converted one by one. Returns once all
        have landed, raising the first failure."""
        import torch

        start = self.start_widened_reads if dtype == torch.bfloat16 else self.start_master_reads
        errors = [fut.exception() for fut in start(gi, start_read_into, out)]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def start_widened_reads(self, gi: int, start_read_into: Any, out: Any) -> list[Any]:
        """start_master_reads() for bfloat16 parameters: read into the front of
        `out` (float32, the sub-group's size), widened in place by whoever
        first waits for the one future returned (a :class:`WidenedReads`).
        Set-up then neither reads nor writes their master weights: the first
        step reads half their bytes from the parameters instead of all of
        them from the drive."""
        import torch

        narrow = out.view(torch.bfloat16)[: out.numel()]
        return [WidenedReads(self.start_master_reads(gi, start_read_into, narrow), out)]

    def start_master_reads(self, gi: int, start_read_into: Any, out: Any) -> list[Any]:
        """fill_master() without waiting: ``start_read_into(param, view)`` starts
        each parameter's read (returning its future, or None once `view` holds
        the values); returns the futures in flight. If one fails to start, the
        reads already started are waited for before the error is raised."""
        futs = []
        try:
            for s in self.groups[gi]:
                fut = start_read_into(s.param, out[s.offset : s.offset + s.numel])
                if fut is not None:
                    futs.append(fut)
        except BaseException:
            for fut in futs:  # none may still land in `out` once the caller reuses it
                fut.exception()
            raise
        return futs


class WidenedReads:
    """Reads of bfloat16 values into the front of a float32 buffer `out`, as one
    future: waiting for it waits for them all, then widens them in place
    (:func:`aio.swap.lowp.widen_bf16_threaded`) once, in whichever thread
    waits first; the first read's error instead, after all have ended."""

    def __init__(self, futs: list[Any], out: Any) -> None:
        self._futs = futs
        self._out = out
        self._lock = threading.Lock()
        self._settled = False
        self._exc: BaseException | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the reads move (bfloat16: half the float32 bytes they fill)."""
        return sum(int(f.nbytes) for f in self._futs)

    def done(self) -> bool:
        """Whether every read has ended (the widening waits for exception())."""
        return all(f.done() for f in self._futs)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for every read (`timeout` for each), widen once they all
        landed; the first read's error, or None."""
        import torch

        from ..swap.lowp import widen_bf16_threaded

        with self._lock:
            if not self._settled:
                errors = [f.exception(timeout) for f in self._futs]
                self._exc = next((e for e in errors if e is not None), None)
                if self._exc is None:
                    # Settled (as failed) before widening: a widening cut
                    # short (Ctrl-C between two of its chunks) leaves values
                    # half widened, and running it again would read floats
                    # as bfloat16. Either is an error from now on, never
                    # success and never a second widening.
                    self._exc = _interrupted_widening(self._out.numel())
                    self._settled = True
                    widen_bf16_threaded(self._out.view(torch.uint8), self._out.numel())
                    self._exc = None
                self._settled = True
        return self._exc

    def result(self, timeout: float | None = None) -> int:
        """exception(), raised; else the bytes read."""
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return self.nbytes


def _interrupted_widening(n: int) -> BaseException:
    """The error of WidenedReads whose widening did not run to its end."""
    from ..swap.param import SwapStateError

    return SwapStateError(
        f"widening {n} bfloat16 values to float32 in place was interrupted part-way: the "
        "buffer holds a mix of both and cannot be widened again; read the values again"
    )


def _same_device(a: Any, b: Any) -> bool:
    """Whether devices `a` and `b` are one (``cuda`` and ``cuda:0`` alike when
    device 0 is the current one)."""
    import torch

    da, db = torch.device(a), torch.device(b)
    if da.type != db.type:
        return False
    if da.type != "cuda" or da.index == db.index:
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (da.index if da.index is not None else current) == (db.index if db.index is not None else current)


def _unique_named_params(model: Any) -> list[tuple[str, Any]]:
    out = []
    seen: set[int] = set()
    for n, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def _numel(p: Any) -> int:
    return int(getattr(p, "aio_numel", p.numel()))


def _existing_store(named: list[tuple[str, Any]]) -> ParamStore | None:
    stores = {id(s): s for _n, p in named if (s := getattr(p, "_aio_store", None)) is not None}
    if len(stores) > 1:
        raise ValueError("the model's parameters belong to more than one aio.zero.Init store")
    store = next(iter(stores.values()), None)
    if store is not None and store.closed:
        raise ValueError("the model's parameters belong to a closed aio.zero trainer or Init")
    return store


def place_gradients_for(
    cfg: TrainConfig, named: list[tuple[str, Any]], layout: SubGroupLayout
) -> GradientPlacement:
    """Where this model's fp32 gradients wait for the step
    (:func:`aio.config.gradients.place_gradients`), counting against the host
    budget what :func:`aio.config.estimate_memory` says aio.zero holds in CPU
    memory for these parameters under `cfg` at its peak (pinned pools,
    resident parameters, the runtime and the largest tensors in use:
    ``held_bytes``), so that peak stays within the budget."""
    from ..config import estimate_memory
    from ..config.gradients import place_gradients

    numels = [p.aio_numel for _n, p in named if p.aio_numel]  # empty parameters hold nothing
    trainable = sum(layout.group_numel)
    if not numels or not trainable:
        return place_gradients(cfg, 0, 0)
    est = estimate_memory(
        cfg.offload, None, cfg.dtype, param_numels=numels, largest_subgroup_numel=max(layout.group_numel)
    )
    return place_gradients(cfg, trainable, est.held_bytes)
