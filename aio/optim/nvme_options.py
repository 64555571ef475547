"""The swap settings of :class:`aio.optim.NVMeAdamW`: keyword arguments
with DeepSpeed's names, or an ``offload_optimizer`` block in DeepSpeed's
format (validated by :class:`aio.config.models.OffloadOptimizerConfig`),
resolved per rank.

Per node, not per process: the host-memory budget (a fraction of the
available memory, or bytes) is divided by ``LOCAL_WORLD_SIZE`` (torchrun
sets it), so eight ranks on a node share one budget instead of each taking
"half the memory". ``nvme_path`` may name each rank's drive with
``{local_rank}`` or ``{rank}`` (``"/mnt/nvme{local_rank}"``); a list stripes
over several drives.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# aio's defaults (aio.config's offload_optimizer), DeepSpeed's names.
DEFAULTS: dict[str, Any] = {
    "buffer_count": 4,
    "pipeline_read": False,
    "pipeline_write": False,
    "pin_memory": True,
}
# Buffers stepping one sub-group takes (aio.swap.OptimizerSwapper's rule for
# Adam: its gradient, master weights, exp_avg and exp_avg_sq): fewer is
# refused when NVMeAdamW is made, in its own terms, not at its first step.
MIN_BUFFERS = 4
SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's and aio.config's default
HOST_MEMORY_BUDGET = 0.5  # aio_zero.host_memory_budget's default, for the whole node
GRADIENTS = ("cpu", "nvme")
STATE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class RankInfo:
    """This process's place: global rank, rank on its node, ranks on its node."""

    rank: int
    local_rank: int
    local_world_size: int


def rank_info() -> RankInfo:
    """From torch.distributed when it is initialized, else the launcher's
    environment (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE), else one process."""
    rank = _env_int("RANK", 0, 0)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
    except ImportError:  # a torch without torch.distributed
        pass
    local_rank = _env_int("LOCAL_RANK", rank, 0)
    return RankInfo(rank, local_rank, _env_int("LOCAL_WORLD_SIZE", 1, 1))


def _env_int(name: str, default: int, lo: int) -> int:
    """The launcher's variable `name` as an int >= `lo` (unset or empty:
    `default`); anything else is a ValueError naming it (a LOCAL_WORLD_SIZE
    of 0 taken as 1 would give this rank the whole node's memory budget)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = lo - 1
    if value < lo:
        raise ValueError(f"environment variable {name}={text!r}: an integer >= {lo} (as torchrun sets it)")
    return value


@dataclass(frozen=True)
class SwapOptions:
    """Resolved settings of one rank's optimizer swapper."""

    nvme_path: list[str]
    buffer_count: int
    pipeline_read: bool
    pipeline_write: bool
    pin_memory: bool
    sub_group_size: int | None  # None: chosen from the pinned share at layout
    state_dtype: str
    gradients: str
    pinned_share: int  # bytes of pinned buffers this rank may take
    aio: dict[str, Any] | None
    rank: RankInfo


def _paths(nvme_path: Any, info: RankInfo) -> list[str]:
    from ..swap.drives import nvme_path_items, nvme_path_list

    if nvme_path is None:
        raise ValueError("nvme_path: required (a directory on a local drive, or a list of them)")
    items = nvme_path_items(nvme_path)  # str paths (or lists of them): what the templates fill in
    out = []
    for p in items:
        if isinstance(p, (str, os.PathLike)):
            try:
                p = os.fspath(p).format(rank=info.rank, local_rank=info.local_rank)
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(
                    f"nvme_path {p!r}: only {{rank}} and {{local_rank}} may be filled in ({e})"
                ) from None
        out.append(p)
    paths = nvme_path_list(out)
    for d in paths:  # said at construction, not at the first step
        if not os.path.isdir(d):
            raise FileNotFoundError(errno.ENOENT, "nvme_path: not an existing directory", d)
    return paths


def _block(offload_optimizer: Mapping[str, Any] | None) -> dict[str, Any]:
    """The settings an ``offload_optimizer`` block gives (validated as
    DeepSpeed's; its device must be 'nvme')."""
    if offload_optimizer is None:
        return {}
    if not isinstance(offload_optimizer, Mapping):
        raise TypeError(f"offload_optimizer must be a dict, got {type(offload_optimizer).__name__}")
    from ..config.models import OffloadOptimizerConfig

    block = OffloadOptimizerConfig(**dict(offload_optimizer))
    if block.device != "nvme":
        raise ValueError(f"offload_optimizer.device must be 'nvme' for NVMeAdamW, got {block.device!r}")
    return {"nvme_path": block.nvme_dirs(), **{k: getattr(block, k) for k in DEFAULTS}}


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return v


def resolve(explicit: dict[str, Any], offload_optimizer: Mapping[str, Any] | None) -> SwapOptions:
    """`explicit` (the constructor's keywords, None where not given) over
    the `offload_optimizer` block over aio's defaults; TypeError/ValueError
    naming the setting."""
    info = rank_info()
    merged = {**DEFAULTS, **_block(offload_optimizer)}
    merged.update({k: v for k, v in explicit.items() if v is not None})
    count = merged["buffer_count"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"buffer_count must be a positive int, got {count!r}")
    if count < MIN_BUFFERS:
        where = (
            "buffer_count" if explicit.get("buffer_count") is not None else "offload_optimizer.buffer_count"
        )
        raise ValueError(
            f"{where} is {count}: stepping one sub-group takes {MIN_BUFFERS} buffers (its gradient, "
            f"master weights, exp_avg and exp_avg_sq); give at least {MIN_BUFFERS}"
        )
    sgs = merged.get("sub_group_size")
    if sgs is not None and (isinstance(sgs, bool) or not isinstance(sgs, int) or sgs < 1):
        raise ValueError(f"sub_group_size must be a positive int, got {sgs!r}")
    if merged.get("optimizer_states", "fp32") not in STATE_DTYPES:
        raise ValueError(
            f"optimizer_states must be one of {STATE_DTYPES}, got {merged['optimizer_states']!r}"
        )
    if merged.get("gradients", "cpu") not in GRADIENTS:
        raise ValueError(f"gradients must be one of {GRADIENTS}, got {merged['gradients']!r}")
    budget = merged.get("host_memory_budget", HOST_MEMORY_BUDGET)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ValueError(f"host_memory_budget must be a positive fraction or a byte count, got {budget!r}")
    from ..config.gradients import host_memory_budget

    return SwapOptions(
        nvme_path=_paths(merged.get("nvme_path"), info),
        buffer_count=count,
        pipeline_read=_bool("pipeline_read", merged["pipeline_read"]),
        pipeline_write=_bool("pipeline_write", merged["pipeline_write"]),
        pin_memory=_bool("pin_memory", merged["pin_memory"]),
        sub_group_size=sgs,
        state_dtype=merged.get("optimizer_states", "fp32"),
        gradients=merged.get("gradients", "cpu"),
        pinned_share=host_memory_budget(float(budget)) // info.local_world_size,
        aio=merged.get("aio"),
        rank=info,
    )


def sub_group_size(opts: SwapOptions, largest_local: int) -> int:
    """The sub-group size: the one asked for, else the largest whose
    buffers fit this rank's pinned share (at least one page of fp32, at most
    DeepSpeed's default and this rank's local elements)."""
    if opts.sub_group_size is not None:
        return opts.sub_group_size
    fit = opts.pinned_share // (opts.buffer_count * 4)
    return max(1024, min(SUB_GROUP_SIZE, fit, max(1, largest_local)))


def check_pinned(opts: SwapOptions, planned: int) -> None:
    """ValueError when the swap buffers (`planned` bytes) are more than this
    rank's share of the node's host-memory budget."""
    if planned > opts.pinned_share:
        raise ValueError(
            f"NVMeAdamW's swap buffers need {planned} bytes on rank {opts.rank.rank}, more than its share "
            f"({opts.pinned_share} bytes: host_memory_budget over LOCAL_WORLD_SIZE="
            f"{opts.rank.local_world_size}); lower sub_group_size or buffer_count, or raise "
            "host_memory_budget"
        )
