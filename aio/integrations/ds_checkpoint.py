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


def restore(engine: Any, load_dir: str, tag: Any) -> bool:
    """Put back what DeepSpeed's NVMe-offload load left out; True if it did."""
    import torch

    opt = engine.optimizer
    if not getattr(opt, "swap_optimizer", False) or not hasattr(opt, "fp32_partitioned_groups_flat"):
        return False
    tag = _resolve_tag(load_dir, tag)
    if tag is None:
        return False
    path = engine._get_zero_ckpt_name(load_dir, tag)
    if not os.path.isfile(path):
        return False
    saved = load_plain(path, _deepspeed_safe_types())["optimizer_state_dict"]
    states = saved["optimizer_state_dict"]["state"]
    flats = saved["fp32_flat_groups"]
    index = _subgroup_state_index(opt)
    for sg, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        saved_state = states.get(index[sg], {})
        live = opt.optimizer.state[fp32]
        swapped = opt._swappable_optimizer_subgroup(sg)
        if swapped and live:
            continue  # DeepSpeed restored and registered this state itself (a later release)
        numel = int(opt.fp16_partitioned_groups_flat_numel[sg])
        for key, value in saved_state.items():
            # Swapped sub-groups too: DeepSpeed registers a sub-group's state
            # tensors with its swapper from optimizer.state at the next
            # swap-in, finds the files it copied back under their names and
            # reads them into these tensors. The checkpoint holds their values
            # (pipelined swapper) or empty placeholders (plain swapper): either
            # way a full-size tensor must be there to be registered.
            if swapped and torch.is_tensor(value) and value.dim() > 0 and value.numel() != numel:
                live[key] = torch.empty(numel, dtype=value.dtype)
            elif torch.is_tensor(value):
                if key in live and torch.is_tensor(live[key]) and live[key].shape == value.shape:
                    live[key].data.copy_(value)
                else:
                    live[key] = value.clone()
            else:
                live[key] = value
        if not swapped:
            if flats[sg].numel() != fp32.numel():
                raise ValueError(
                    f"{path}: sub-group {sg} has {flats[sg].numel()} elements, this engine "
                    f"{fp32.numel()}; load with the same model and ZeRO settings"
                )
            fp32.data.copy_(flats[sg])
            # The parameter partitions of this sub-group were written from the
            # fresh fp32 values during DeepSpeed's load: write them again.
            opt._partitioned_params_swap_out(sg)
    return True
