"""Stand-ins for released shards: a read between steps is served, never a segfault.

The tier frees a released group's shard storages (``resize_(0)``), and torch
reads a storage without checking its size: a read of a freed shard is a
SIGSEGV, not an exception. FSDP's own reads are guarded where its gathers
pass (:mod:`aio.fsdp.tier`). Everything else -- an EMA update, a weight
norm, ``p.to_local()``, ``p.full_tensor()``, ``torch.save(p)``,
``p.mul_(...)`` -- reaches a shard through its registered parameter: a
DTensor that runs every op on its ``_local_tensor``, a view of the shard.

So while a group is released (from its first release until the next
optimizer step or ``resident()``), each of its parameters' ``_local_tensor``
is a :class:`ShardStandIn`: a tensor subclass of the same shape and dtype
that has no storage of its own. Every aten op that reaches one is routed
through :func:`run`: the owning tier makes the group resident (a synchronous
read if it is on the drive: counted, logged once), the op runs on the real
local tensors, an op that writes one marks its group changed, and a view of a
stand-in is a stand-in too. No alias of a shard's storage escapes to outlive
the shard; what cannot be served (the storage itself, ``data_ptr()``,
``numpy()``) raises.

The training loop never meets a stand-in: FSDP gathers from its padded shard
tensor, not the DTensor, and the optimizer step and ``resident()`` put the
real local tensors back first. The per-op cost falls only on these reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import torch

from ._internals import TierError

# Ops that change a local tensor's metadata or storage in place: a stand-in
# cannot mirror that onto a shard FSDP owns.
_REFUSED = ("aten::set_", "aten::resize_", "aten::resize_as_", "aten::_resize_output_")


class Keeper(Protocol):
    """What a stand-in asks of the tier that owns its group."""

    window: int

    def user_hold(self, group: Any, what: Any) -> None:
        """Make the group's shards resident for an op outside the step."""

    def user_wrote(self, group: Any) -> None:
        """An op wrote the group's shards: its drive copy is stale."""

    def user_settle(self) -> None:
        """After an op: free the groups held for such ops beyond the window."""

    def real_local(self, group: Any, index: int) -> torch.Tensor:
        """The shard's real local tensor (its group resident)."""


class ShardStandIn(torch.Tensor):
    """A released shard's local tensor in its DTensor (see the module
    docstring). ``_make`` is None for the shard's own local tensor; for a view
    of a stand-in it is ``(op, args, kwargs, output index)``, replayed on the
    real tensors at each use."""

    _keeper: Keeper
    _group: Any
    _index: int
    _make: tuple[Any, Any, Any, int | None] | None

    @staticmethod
    def __new__(
        cls, like: torch.Tensor, keeper: Keeper, group: Any, index: int, make: Any = None, device: Any = None
    ) -> ShardStandIn:
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), storage_offset=like.storage_offset(),
            dtype=like.dtype, device=device or like.device, layout=like.layout, requires_grad=False,
        )  # fmt: skip
        t._keeper, t._group, t._index, t._make = keeper, group, index, make
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        return run(func, tuple(args), dict(kwargs or {}))

    def _resolve(self) -> torch.Tensor:
        """The real tensor behind the stand-in (its group must be resident)."""
        if self._make is None:
            return self._keeper.real_local(self._group, self._index)
        func, args, kwargs, which = self._make
        real_args, real_kwargs = _reals(args, kwargs)
        out = func(*real_args, **real_kwargs)
        return out if which is None else out[which]

    def _plain(self) -> torch.Tensor:
        """A plain tensor holding a copy of the values (read as any op is)."""
        with torch.no_grad():
            return self.clone()

    # A stand-in holds no memory: its storage is empty (so NVMeAdamW's step
    # skips writing it back, as for a freed shard) and it has no address.
    def untyped_storage(self) -> torch.UntypedStorage:
        """An empty storage: the stand-in holds no memory."""
        return torch.UntypedStorage(0, device=self.device)

    def data_ptr(self) -> int:
        """Refused: the shard may be on the drive (no address to give)."""
        raise TierError(
            "data_ptr() of an FSDP parameter's local tensor whose shard the parameter tier may have on "
            "the drive; take it inside `with tier.resident():`"
        )

    # Pickling, printing and deepcopy reach the data without an aten op: each
    # gets a plain copy (torch.save would otherwise keep only the metadata).
    def __reduce_ex__(self, proto: Any) -> Any:
        return self._plain().__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self._plain()

    def __repr__(self, **_: Any) -> str:  # type: ignore[override]
        return repr(self._plain())


# An aten op's arguments are values or flat lists of them (a foreach op's
# tensor lists): mapped and walked one level deep, which costs a fraction of
# torch's pytree at every op.
def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, (list, tuple)) and any(isinstance(x, ShardStandIn) for x in value):
        return type(value)([fn(x) for x in value])
    return fn(value)


def _map_args(fn: Callable[[Any], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    return tuple(_map(fn, a) for a in args), {k: _map(fn, v) for k, v in kwargs.items()}


def _stand_ins(*values: Any) -> Iterator[ShardStandIn]:
    for v in values:
        for x in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(x, ShardStandIn):
                yield x


def _real(x: Any) -> Any:
    return x._resolve() if isinstance(x, ShardStandIn) else x


def _reals(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    return _map_args(_real, args, kwargs)


class _OpInfo(NamedTuple):
    refused: bool  # changes a local tensor's metadata or storage in place
    written: tuple[tuple[int, str], ...]  # (position or -1, name) of each argument it writes
    viewed: int  # the position of the argument its output is a view of, or -1
    foreach: bool


@functools.cache
def _info(func: Any) -> _OpInfo:
    schema = func._schema
    written, viewed = [], -1
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None:
            continue
        if a.alias_info.is_write:
            written.append((-1 if a.kwarg_only else i, a.name))
        elif func.is_view and viewed < 0:
            viewed = i
    refused = torch.Tag.inplace_view in func.tags or schema.name in _REFUSED
    return _OpInfo(refused, tuple(written), viewed, schema.name.startswith("aten::_foreach_"))


def run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run aten op `func` whose arguments hold stand-ins (see the module docstring)."""
    info = _info(func)
    if info.refused:
        raise TierError(
            f"{func}: changes the metadata or storage of an FSDP parameter's local tensor, whose shard "
            "the parameter tier may have on the drive; do it inside `with tier.resident():`"
        )
    chunks = _foreach_chunks(args, list(_stand_ins(*args))) if info.foreach else None
    if chunks is None:
        return _run_once(func, args, kwargs)
    outs = [_run_once(func, *_take(args, kwargs, idx)) for idx in chunks]
    return None if all(o is None for o in outs) else [x for o in outs for x in o]


def _run_once(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    ins = list(_stand_ins(*args, *kwargs.values()))
    info = _info(func)
    if 0 <= info.viewed < len(args) and not info.written and len(ins) == 1 and args[info.viewed] is ins[0]:
        return _lazy_view(func, args, kwargs, ins[0])
    keepers = {id(t._keeper): t._keeper for t in ins}
    try:
        for t in {id(t._group): t for t in ins}.values():
            t._keeper.user_hold(t._group, func)
        reals = {id(t): t._resolve() for t in ins}
        real_args, real_kwargs = _map_args(
            lambda x: reals[id(x)] if isinstance(x, ShardStandIn) else x, args, kwargs
        )
        # Marked before the op runs: one that writes part of a shard and then
        # raises has still changed it (else the change is dropped at the release).
        for pos, name in info.written:
            for t in _stand_ins(args[pos] if 0 <= pos < len(args) else kwargs.get(name)):
                t._keeper.user_wrote(t._group)
        if func.namespace == "c10d":  # its schema marks no write, yet allreduce_ & co. write in place
            for t in ins:
                t._keeper.user_wrote(t._group)
        out = func(*real_args, **real_kwargs)
        if func.namespace == "c10d":
            # A collective in flight (async_op=True) on a shard the settle below may
            # free: waited for here, so the shard outlives it (its Work then is done).
            for x in out if isinstance(out, (list, tuple)) else (out,):
                if not isinstance(x, (torch.Tensor, list, tuple)) and callable(getattr(x, "wait", None)):
                    x.wait()
        return _rewrap(func, args, kwargs, out, ins, reals)
    finally:
        for k in keepers.values():
            k.user_settle()


def _lazy_view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], base: ShardStandIn) -> Any:
    """A view of a stand-in, shaped on the meta device: no read (the view
    is replayed on the real tensor when an op uses it). So `p.detach()`,
    `to_local().view(-1)` and NVMeAdamW's look at a parameter read nothing."""
    extent = (
        1 + sum((n - 1) * st for n, st in zip(base.shape, base.stride(), strict=True)) if base.numel() else 0
    )
    meta = torch.empty(base.storage_offset() + extent, dtype=base.dtype, device="meta")
    meta = meta.as_strided(base.shape, base.stride(), base.storage_offset())
    pos = _info(func).viewed
    out = func(*args[:pos], meta, *args[pos + 1 :], **kwargs)
    k, g, j, dev = base._keeper, base._group, base._index, base.device
    if isinstance(out, torch.Tensor):
        return ShardStandIn(out, k, g, j, (func, args, kwargs, None), device=dev)
    return type(out)(
        [ShardStandIn(o, k, g, j, (func, args, kwargs, i), device=dev) for i, o in enumerate(out)]
    )


def _rewrap(
    func: Any, args: Any, kwargs: Any, out: Any, ins: list[ShardStandIn], reals: dict[int, torch.Tensor]
) -> Any:
    """`out` with no alias of a shard in it: a view of a stand-in becomes a
    stand-in that replays the view; an in-place op's result (the real
    tensor it wrote) becomes the stand-in it was given."""
    pos = _info(func).viewed
    base = args[pos] if 0 <= pos < len(args) and isinstance(args[pos], ShardStandIn) else None
    if base is not None:
        if isinstance(out, torch.Tensor):
            return ShardStandIn(out, base._keeper, base._group, base._index, (func, args, kwargs, None))
        k, g, j = base._keeper, base._group, base._index
        return type(out)([ShardStandIn(o, k, g, j, (func, args, kwargs, i)) for i, o in enumerate(out)])
    back = {id(reals[id(t)]): t for t in ins}
    # Ops whose schema declares no alias but whose output shares the input's
    # storage (aten::_unsafe_view, unsafe_split, unsafe_chunk): found by storage.
    storages = {r.untyped_storage().data_ptr(): t for t in ins for r in (reals[id(t)],)}
    storages.pop(0, None)

    # Module-level recursion: a nested function calling itself is a reference
    # cycle that held this op's arguments (a whole gathered layer at set-up)
    # until the next full collection.
    return _unaliased(out, None, back, storages, (func, args, kwargs))


def _unaliased(
    x: Any, which: int | None, back: dict[int, Any], storages: dict[int, Any], op: tuple[Any, Any, Any]
) -> Any:
    """`x` (an op's output, or a list/tuple of them) with every alias of a
    shard replaced: the stand-in it was given back (`back`, an in-place
    op's result), or a stand-in replaying the op (one sharing a shard's
    storage, `storages`)."""
    if isinstance(x, (list, tuple)):  # a collective's (tensors, work), a split's pieces
        return type(x)(
            [_unaliased(y, i if which is None else which, back, storages, op) for i, y in enumerate(x)]
        )
    if not isinstance(x, torch.Tensor) or isinstance(x, ShardStandIn):
        return x
    if id(x) in back:
        return back[id(x)]
    t = storages.get(x.untyped_storage().data_ptr())
    if t is None:
        return x
    # An alias of the shard would outlive its release: a stand-in replaying the op.
    return ShardStandIn(x, t._keeper, t._group, t._index, (*op, which))


def _foreach_chunks(args: tuple[Any, ...], ins: list[ShardStandIn]) -> list[list[int]] | None:
    """For a foreach op over more groups than the window (an EMA over the
    whole model), the list indices to run it on in turn, each touching at
    most `window` groups: the shards in memory stay bounded. The op is
    elementwise per list entry, so the pieces give the same bits."""
    if not ins or not args or not isinstance(args[0], (list, tuple)):
        return None
    window = ins[0]._keeper.window
    if len({id(t._group) for t in ins}) <= window:
        return None
    n = len(args[0])
    lists = [a for a in args if isinstance(a, (list, tuple)) and len(a) == n]
    chunks: list[list[int]] = []
    seen: set[int] = set()
    for i in range(n):
        here = {id(a[i]._group) for a in lists if isinstance(a[i], ShardStandIn)}
        if not chunks or len(seen | here) > window:
            chunks.append([])
            seen = set()
        chunks[-1].append(i)
        seen |= here
    return chunks


def _take(args: tuple[Any, ...], kwargs: dict[str, Any], idx: list[int]) -> tuple[tuple[Any, ...], dict]:
    n = len(args[0])

    def cut(a: Any) -> Any:
        return [a[i] for i in idx] if isinstance(a, (list, tuple)) and len(a) == n else a

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
