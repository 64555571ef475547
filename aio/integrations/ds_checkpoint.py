"""Completing DeepSpeed 0.19's checkpoint load under NVMe optimizer offload.

With ``offload_optimizer.device: nvme``, ``DeepSpeedEngine.load_checkpoint``
skips the ZeRO optimizer checkpoint and only copies the swapped tensor files
back (engine.py, "if load_zero_checkpoint and not
self.zero_nvme_offload_optimizer()"). Two things are then lost, on
DeepSpeed's own async_io op as on aio:

- sub-groups too small to swap live in memory: their fp32 master weights and
  optimizer state resume from the fresh engine's values, and the parameter
  partitions written from them are the fresh ones;
- the optimizer state of every sub-group: a fresh engine has none until its
  first step, so that step starts Adam from ``step`` 0 and zero moments;
  the swapper never learns about the state files it copied back.

Both are in this rank's ``*_optim_states.pt``, which DeepSpeed writes anyway.
:func:`restore` reads it after DeepSpeed's own load and puts them back, so
training continues exactly where it stopped.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from ..swap.storage import load_plain


def _resolve_tag(load_dir: str, tag: Any) -> str | None:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def _subgroup_state_index(opt: Any) -> dict[int, int]:
    """Sub-group -> index of its fp32 flat tensor in the saved optimizer
    state_dict (DeepSpeed appends sub-groups to their param group in order,
    and state_dict numbers params group by group)."""
    order: dict[int, list[int]] = {}
    for sg in range(len(opt.fp16_groups)):
        order.setdefault(opt.sub_group_to_group_id[sg], []).append(sg)
    index, k = {}, 0
    for gid in range(len(opt.optimizer.param_groups)):
        for sg in order.get(gid, []):
            index[sg] = k
            k += 1
    return index


def _deepspeed_safe_types() -> tuple[Any, ...]:
    """The DeepSpeed classes a ZeRO-3 optimizer checkpoint pickles besides
    tensors and plain data: plain-attribute classes that run no code when
    rebuilt, so the file is still read with weights_only=True."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return (ZeroStageEnum, LossScaler, DynamicLossScaler)


# What a ZeRO-3 optimizer checkpoint (stage3.py, state_dict()) must hold for
# restore() to put everything back as DeepSpeed's own _rigid_load_state_dict
# would.
_REQUIRED_KEYS = ("optimizer_state_dict", "fp32_flat_groups", "loss_scaler", "dynamic_loss_scale", "overflow")


def _read_checkpoint(engine: Any, load_dir: str, tag: Any) -> tuple[str, dict[str, Any]]:
    """(path, saved ZeRO optimizer state_dict) of this rank's ``*_optim_states.pt``.

    Called only after DeepSpeed's own load succeeded: the checkpoint exists,
    so a missing or incomplete optimizer file is an error, not fresh state.
    """
    resolved = _resolve_tag(load_dir, tag)
    if resolved is None:
        latest = os.path.join(load_dir, "latest")
        raise FileNotFoundError(
            errno.ENOENT,
            "no tag given and no 'latest' file: cannot tell which optimizer state to restore",
            latest,
        )
    path = engine._get_zero_ckpt_name(load_dir, resolved)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            errno.ENOENT,
            "NVMe-offload checkpoint without this rank's ZeRO optimizer state file: its optimizer "
            "state cannot be restored (was it copied without its *_optim_states.pt files?)",
            path,
        )
    top = load_plain(path, _deepspeed_safe_types())
    saved = top.get("optimizer_state_dict") if isinstance(top, dict) else None
    if not isinstance(saved, dict):
        raise ValueError(
            f"{path}: no 'optimizer_state_dict' entry; not a DeepSpeed ZeRO-3 optimizer checkpoint"
        )
    missing = [k for k in _REQUIRED_KEYS if k not in saved]
    inner = saved.get("optimizer_state_dict")
    if not missing and not (isinstance(inner, dict) and isinstance(inner.get("state"), dict)):
        missing = ["optimizer_state_dict.state"]
    if missing:
        raise ValueError(f"{path}: ZeRO-3 optimizer checkpoint lacks {missing}; it cannot be restored")
    return path, saved


def _saved_states(opt: Any, path: str, saved: dict[str, Any]) -> list[dict[str, Any]]:
    """Each sub-group's saved optimizer state, after checking that the
    checkpoint fits this engine. Checks everything before restore() changes
    anything, so a mismatch leaves the engine as DeepSpeed's load left it."""
    import torch

    groups = opt.fp32_partitioned_groups_flat
    flats = saved["fp32_flat_groups"]
    if len(flats) != len(groups):
        raise ValueError(
            f"{path}: {len(flats)} optimizer sub-groups, this engine {len(groups)}; "
            "load with the same model and ZeRO settings (sub_group_size)"
        )
    states = saved["optimizer_state_dict"]["state"]
    index = _subgroup_state_index(opt)
    present = [index[sg] in states for sg in range(len(groups))]
    if any(present) and not all(present):
        lacking = [sg for sg, p in enumerate(present) if not p]
        raise ValueError(f"{path}: no optimizer state for sub-groups {lacking} (a damaged checkpoint?)")
    trained = any(opt.optimizer.state[fp32] for fp32 in groups)
    if not any(present) and trained:
        # Saved before the first optimizer step; the swapper of this trained
        # engine has its state files registered and cannot be reset to none.
        raise ValueError(
            f"{path}: holds no optimizer state (saved before the first step); load it into a fresh engine"
        )
    out = [dict(states[index[sg]]) if present[sg] else {} for sg in range(len(groups))]
    for sg, fp32 in enumerate(groups):
        live = opt.optimizer.state[fp32]
        if not opt._swappable_optimizer_subgroup(sg):
            if flats[sg].numel() != fp32.numel():
                raise ValueError(
                    f"{path}: sub-group {sg} has {flats[sg].numel()} elements, this engine "
                    f"{fp32.numel()}; load with the same model and ZeRO settings"
                )
        elif live:
            files = [k for k, v in out[sg].items() if torch.is_tensor(v) and v.dim() > 0 and k not in live]
            if files:
                raise ValueError(
                    f"{path}: sub-group {sg} has optimizer state {files} that this engine's optimizer lacks"
                )
    return out


def _restore_state(opt: Any, sg: int, saved_state: dict[str, Any]) -> None:
    """Put sub-group `sg`'s saved optimizer state into ``optimizer.state``."""
    import torch

    live = opt.optimizer.state[opt.fp32_partitioned_groups_flat[sg]]
    swapped = opt._swappable_optimizer_subgroup(sg)
    registered = swapped and bool(live)
    numel = int(opt.fp16_partitioned_groups_flat_numel[sg])
    for key, value in saved_state.items():
        is_file = torch.is_tensor(value) and value.dim() > 0
        if registered and is_file:
            # This engine has stepped: its swapper already holds this tensor
            # and, at the next swap-in, reads the file DeepSpeed copied back.
            continue
        if swapped and is_file and value.numel() != numel:
            # A fresh engine: DeepSpeed registers a sub-group's state tensors
            # with its swapper from optimizer.state at the next swap-in, finds
            # the files it copied back under their names and reads them into
            # these tensors. The checkpoint holds their values (pipelined
            # swapper) or empty placeholders (plain swapper): either way a
            # full-size tensor must be there to be registered.
            live[key] = torch.empty(numel, dtype=value.dtype)
        elif torch.is_tensor(value):
            # Scalars (Adam's `step`) too, even when the engine has stepped:
            # no file holds them.
            if key in live and torch.is_tensor(live[key]) and live[key].shape == value.shape:
                live[key].data.copy_(value)
            else:
                live[key] = value.clone()
        else:
            live[key] = value


def _regather_persistent(opt: Any) -> None:
    """Gather the persistent parameters again from their restored partitions.

    Persistent parameters (``stage3_param_persistence_threshold``; HF's
    ``auto`` is 10 x hidden size) stay gathered on every rank. DeepSpeed's
    load gathers them (``checkpoint_event_epilogue``) before this module
    restores the in-memory sub-groups: without a second gather, they would
    resume with the fresh engine's values (step-4 loss 0.8069 against
    0.8105 in the reproducer of issue 43). A collective: every rank restores.
    """
    persistent = getattr(opt, "persistent_parameters", None)
    if persistent:
        # all_gather skips parameters already gathered: release them first,
        # as stage3's checkpoint prologue/epilogue do around a load.
        persistent[0].partition(persistent)
        persistent[0].all_gather(persistent)


def restore(engine: Any, load_dir: str, tag: Any) -> bool:
    """Put back what DeepSpeed's NVMe-offload load left out; True if it did.

    Call it only after DeepSpeed's own ``load_checkpoint`` succeeded. Returns
    False (nothing to do) unless the optimizer state is swapped to NVMe.
    Raises FileNotFoundError when this rank's ``*_optim_states.pt`` is
    missing and ValueError when it does not fit this engine, before changing
    anything.
    """
    opt = engine.optimizer
    if not getattr(opt, "swap_optimizer", False) or not hasattr(opt, "fp32_partitioned_groups_flat"):
        return False
    path, saved = _read_checkpoint(engine, load_dir, tag)
    per_group = _saved_states(opt, path, saved)
    for sg, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        _restore_state(opt, sg, per_group[sg])
        if not opt._swappable_optimizer_subgroup(sg):
            fp32.data.copy_(saved["fp32_flat_groups"][sg])
            # The parameter partitions of this sub-group were written from the
            # fresh fp32 values during DeepSpeed's load: write them again.
            opt._partitioned_params_swap_out(sg)
    _regather_persistent(opt)
    # As stage3.py's _rigid_load_state_dict does (skipped under NVMe offload).
    opt.loss_scaler = saved["loss_scaler"]
    opt.dynamic_loss_scale = saved["dynamic_loss_scale"]
    opt.overflow = saved["overflow"]
    return True
