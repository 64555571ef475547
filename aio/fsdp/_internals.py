"""The few FSDP2 internals the parameter tier touches, in one place.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter's local
shard in ``FSDPParam._sharded_param_data``: a padded 1-D tensor that owns its
storage; the registered DTensor's ``_local_tensor`` is a narrow of it. Every
all-gather FSDP makes -- forward, its explicit forward/backward prefetch, the
backward re-gather, activation-checkpoint recomputation, grouped
``fully_shard([a, b])`` -- goes through ``FSDPParamGroup.unshard``, which
reads that storage (``FSDPParam.all_gather_inputs``); with one rank,
``wait_for_unshard`` reads it instead. Those two methods are therefore where
the tier makes sure the shard is in memory: public hooks cannot cover every
path, and FSDP reading a freed storage is a segfault, not an exception.

These names are private to torch, so the tier runs only on the torch
versions CI has run it on (:data:`SUPPORTED`); elsewhere
:func:`check_torch` raises :class:`UnsupportedTorchError`, unless the user
opts in (``AIO_FSDP_UNTESTED_TORCH=1``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from .._log import logger

# (major, minor) of the torch releases the tier's tests have passed on.
SUPPORTED = ((2, 13), (2, 14))
# Set to 1 to run the tier on another torch anyway (the GPU image's 2.11 is one: its
# acceptance run sets it); the internals it touches are still checked one by one.
UNTESTED_ENV = "AIO_FSDP_UNTESTED_TORCH"
_warned: set[tuple[int, int]] = set()
_log = logger.getChild("fsdp")
_GROUP_ATTRS = ("unshard", "wait_for_unshard", "fsdp_params", "is_sharded")


class UnsupportedTorchError(RuntimeError):
    """The installed torch is not one the FSDP parameter tier was tested on,
    or its FSDP2 internals are not the ones the tier relies on."""


class TierError(RuntimeError):
    """The FSDP parameter tier cannot do what was asked (a model it cannot
    manage, a shard that is on the drive where it must be in memory)."""


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch."""
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def check_torch() -> None:
    """Raise UnsupportedTorchError unless torch is a version in SUPPORTED,
    or the user opted in to an untested one (:data:`UNTESTED_ENV` = 1: a
    warning, logged once; the checks of the internals themselves still run)."""
    v = torch_version()
    if v in SUPPORTED:
        return
    tested = ", ".join(f"{a}.{b}" for a, b in SUPPORTED)
    opt_in = os.environ.get(UNTESTED_ENV, "").strip()
    if opt_in == "1":
        if v not in _warned:
            _warned.add(v)
            _log.warning(
                "aio.fsdp's parameter tier on torch %s, which its tests have not run on (%s): %s=1 is "
                "set. A changed FSDP2 internal shows as an UnsupportedTorchError or a wrong result",
                torch.__version__, tested, UNTESTED_ENV,
            )  # fmt: skip
        return
    if opt_in not in ("", "0"):
        raise ValueError(f"environment variable {UNTESTED_ENV}={opt_in!r}: 1 (opt in) or 0/unset")
    raise UnsupportedTorchError(
        f"aio.fsdp's parameter tier relies on FSDP2 internals and runs only on the torch versions "
        f"it was tested on ({tested}); this is torch {torch.__version__}. Keep the parameters in "
        f"memory (no offload_params), use a tested torch, or set {UNTESTED_ENV}=1 to try this one "
        "at your own risk"
    )


@dataclass
class Shard:
    """One parameter's padded local shard: where it sits in its group's
    extent on the drive (`start`, bytes) and how big it is."""

    fsdp_param: Any
    start: int
    nbytes: int

    @property
    def data(self) -> torch.Tensor:
        """FSDP's padded 1-D shard tensor, read anew each time: FSDP may
        replace it (``reset_sharded_param`` after a load)."""
        return self.fsdp_param._sharded_param_data

    @property
    def local_numel(self) -> int:
        """Elements of the parameter's local shard, unpadded (metadata: no
        op runs on the parameter, whose shard may be on the drive)."""
        return int(self.fsdp_param.sharded_size.numel())

    def resident_bytes(self) -> int:
        """Bytes of its storage in memory now (0 once released)."""
        return int(self.data.untyped_storage().nbytes())


def module_groups(module: Any) -> list[Any]:
    """The FSDPParamGroups of one FSDP2 module's state (none where this
    torch's state has no such list)."""
    return list(getattr(module._get_fsdp_state(), "_fsdp_param_groups", ()))


def release_comm_buffers(pg: Any, gather: bool = False, reduce: bool = False) -> None:
    """Drop the buffers FSDP2 keeps in a group's ``comm_ctx`` past their
    collective to overlap the next one on a GPU: `gather`, the forward's
    all-gather output (kept until the next group's copy-out); `reduce`, the
    last reduce-scatter inputs (kept to recycle). As torch 2.13/2.14 name
    them; where they are not there nothing is dropped."""
    ctx: Any = getattr(pg, "comm_ctx", None)
    if gather and getattr(ctx, "all_gather_state", None) is not None:
        ctx.all_gather_state = None
    states = getattr(ctx, "reduce_scatter_states", None) if reduce else None
    if states:
        states.clear()


def fsdp_groups(model: torch.nn.Module) -> list[Any]:
    """Every FSDPParamGroup of `model`'s FSDP2 modules, once each (grouped
    ``fully_shard([a, b])`` shares one state), in module order."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            raise UnsupportedTorchError(
                "this torch's FSDP2 state has no _fsdp_param_groups: not the internals aio.fsdp knows"
            )
        for pg in groups:
            missing = [a for a in _GROUP_ATTRS if not hasattr(pg, a)]
            if missing:
                raise UnsupportedTorchError(
                    f"FSDPParamGroup lacks {missing}: not the internals aio.fsdp knows"
                )
            seen.setdefault(id(pg), pg)
    return list(seen.values())


def shards_of(pg: Any, where: str) -> tuple[list[Shard], int]:
    """The group's shards laid out back to back (16-byte aligned) and the
    total bytes. Each shard tensor must own its whole storage, as FSDP's
    padded shards do: the tier frees and refills storages, never part of one."""
    out, pos = [], 0
    for fp in pg.fsdp_params:
        data = getattr(fp, "_sharded_param_data", None)
        if not isinstance(data, torch.Tensor) or type(data) is not torch.Tensor:
            raise TierError(
                f"{where}: {fp} has no plain sharded tensor (tensor subclasses are not supported)"
            )
        nbytes = data.numel() * data.element_size()
        storage = data.untyped_storage()
        if data.storage_offset() != 0 or storage.nbytes() != nbytes or not data.is_contiguous():
            raise TierError(
                f"{where}: {fp}'s shard does not own its storage ({storage.nbytes()} bytes for a "
                f"{nbytes}-byte shard); the tier cannot free it"
            )
        out.append(Shard(fp, pos, nbytes))
        pos += -(-nbytes // 16) * 16
    return out, pos


def module_name(pg: Any) -> str:
    """The group's module path for messages ('' is the root)."""
    fqn = getattr(pg, "_module_fqn", None)
    return repr(fqn) if fqn else "<root>"


def lazy_init(model: torch.nn.Module) -> None:
    """Run FSDP's lazy initialisation of `model` (the root) now, as its
    first forward would. It re-pads every shard from its local tensor, so
    it must run before the tier frees any shard; a model whose shards are
    still on the meta device is a :class:`TierError`."""
    state = getattr(model, "_get_fsdp_state", None)
    if state is None:
        raise TierError(
            "offload_params: the model's root is not fully_shard-ed; apply fully_shard(model) last"
        )
    root = state()
    if not hasattr(root, "_lazy_init"):
        raise UnsupportedTorchError(
            "this torch's FSDP2 state has no _lazy_init: not the internals aio.fsdp knows"
        )
    for pg in fsdp_groups(model):
        if any(fp.sharded_param.is_meta for fp in pg.fsdp_params):
            raise TierError(
                f"FSDP group {module_name(pg)} is still on the meta device: call model.to_empty(device=...) "
                "before offload_params(..., empty_shards=True)"
            )
    root._lazy_init()
