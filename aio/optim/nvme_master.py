"""Where :class:`aio.optim.NVMeAdamW` keeps its fp32 master weights
(``master=``): on the drive beside the moments, or in the parameters.

``"drive"``: 12 bytes per element on the drive (master and two fp32
moments), 24 of I/O per step; the parameters get a copy after each step and
may live anywhere (a GPU). ``"params"``: the parameters themselves are the
master (they must be float32 tensors in CPU memory, as FSDP2 with
``CPUOffloadPolicy`` or a model on the CPU keeps them): 8 bytes per element
on the drive, 16 of I/O per step, no memory added. ``"auto"`` (the default)
takes ``"params"`` when every parameter's local tensor is float32 on the
CPU and no :func:`aio.fsdp.offload_params` tier reads parameters from the
master weights (``params_from_master=True``, the tier's default: it frees
the parameters between steps and needs a master on the drive; the tier
says so through ``skip_freed_parameters``); else ``"drive"``.

The mode is decided once, when the sub-groups are laid out, from the
parameters held then: at the first ``step()``, or earlier at a
``load_state_dict()`` of a state (DCP's ``set_state_dict`` too), at DCP's
``get_state_dict`` on an optimizer with no state (its hidden lr=0 step), or
when a parameter tier lays it out before its first step. It changes only
with a new layout, for parameters swapped for others in ``param_groups``
(decided again for them): parameters moved to a GPU after a CPU layout in
``"params"`` mode are a TypeError at every step (as torch's AdamW, whose
state stays on the CPU, fails too); build the optimizer after the move, or
use ``"drive"``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .dtensor import local_of

MASTERS = ("auto", "params", "drive")
FLOAT32_BYTES = 4


def check_master(master: Any) -> str:
    """The ``master`` option, checked: one of :data:`MASTERS`."""
    if not isinstance(master, str) or master not in MASTERS:
        raise ValueError(f"master must be one of {MASTERS}, got {master!r}")
    return master


def not_a_master(p: Any) -> str | None:
    """Why parameter `p` cannot be its own fp32 master weights (its local
    tensor is not float32 in CPU memory), or None when it can."""
    local = local_of(p)
    if local.dtype != torch.float32:
        return f"is {local.dtype}"
    if local.device.type != "cpu":
        return f"is on {local.device}"
    return None


def params_refused(requested: str, name: str, why: str) -> TypeError:
    """The error for a parameter that cannot be the master under ``master='params'``."""
    return TypeError(
        f"{name} {why}: master={requested!r} uses the parameters as the fp32 master weights, so "
        "they must be float32 tensors in CPU memory; use master='drive' (or 'auto') to keep the "
        "master weights on the drive"
    )


def resolve_master(requested: str, params: Sequence[Any], tier_reads_master: bool, name: Any) -> str:
    """``"params"`` or ``"drive"`` for the parameters laid out now
    (`name(k)` names parameter k). With ``"params"`` asked for, a parameter
    that cannot be the master is a TypeError naming it."""
    if requested == "drive":
        return "drive"
    for k, p in enumerate(params):
        why = not_a_master(p)
        if why is None:
            continue
        if requested == "params":
            raise params_refused(requested, name(k), why)
        return "drive"
    # auto: a tier that frees the parameters between steps reads them back
    # from the master on the drive; keep it there (its default path).
    if requested == "auto" and tier_reads_master:
        return "drive"
    overlap = overlapping(params)
    if overlap is None:
        return "params"
    if requested == "auto":
        return "drive"
    a, b = overlap
    raise ValueError(
        f"{name(a)} and {name(b)} share memory: master='params' updates the parameters in "
        "place, so the second would be stepped from the first's new values; use "
        "master='drive' (or 'auto'), or give the optimizer each tensor once"
    )


def overlapping(params: Sequence[Any]) -> tuple[int, int] | None:
    """The indices of two parameters whose local tensors share bytes
    (views of one buffer), or None."""
    spans = []
    for k, p in enumerate(params):
        local = local_of(p)
        storage = local.untyped_storage()
        n = local.numel() * local.element_size()
        if n and storage.nbytes():  # a freed shard (or aio.fsdp's stand-in for one) aliases nothing
            start = storage.data_ptr() + local.storage_offset() * local.element_size()
            spans.append((start, start + n, k))
    spans.sort()
    reach, owner = -1, -1  # the furthest end so far, and whose
    for start, end, k in spans:
        if start < reach:
            return (min(owner, k), max(owner, k))
        if end > reach:
            reach, owner = end, k
    return None


def check_live(flat: torch.Tensor, name: str) -> None:
    """Before a step reads the master weights from a parameter: TypeError
    unless it is still float32 on the CPU (``.data`` may have been replaced
    since the layout), ValueError if its storage was freed (an offload tier
    released it: reading would read freed memory, without an error). A
    tensor with no elements here is in no sub-group: nothing to check."""
    if not flat.numel():
        return
    if flat.dtype != torch.float32 or flat.device.type != "cpu":
        raise TypeError(
            f"{name} is {flat.dtype} on {flat.device} now: the sub-groups were laid out with the "
            "master weights in the parameters (master_mode 'params'), so they must stay float32 "
            "tensors in CPU memory. The mode is fixed at the layout: move or cast the model before "
            "the optimizer's first step (or load), or build it with master='drive'"
        )
    if flat.untyped_storage().nbytes() < (flat.storage_offset() + flat.numel()) * FLOAT32_BYTES:
        raise ValueError(
            f"{name}: its storage is freed (an offload tier released it), and with master='params' "
            "it holds the master weights; make it resident before the step, or use master='drive'"
        )


TIER_WARNING = (
    "NVMeAdamW keeps its master weights in the parameters (master='params'), not on the drive, so "
    "aio.fsdp.offload_params cannot read the parameters from them (params_from_master): the tier "
    "reads and writes the shards itself. For the tier's master path build NVMeAdamW with "
    "master='drive', or with master='auto' and give it to offload_params before its sub-groups are "
    "laid out (which fixes the mode): before its first step(), load_state_dict() or DCP "
    "get_state_dict()/set_state_dict()"
)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for a warning issued by the caller of this
    function that points at the first frame outside the aio package (the
    user's line: a warning from aio.fsdp's set-up calling into the optimizer
    would otherwise point inside aio)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
