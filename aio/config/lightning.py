"""Map Lightning ``DeepSpeedStrategy`` keyword arguments onto aio's models."""

from __future__ import annotations

import difflib
from typing import Any

from .load import ConfigError, load_config
from .models import OffloadConfig

# Lightning's defaults for the keywords that shape offloading.
_DEFAULTS: dict[str, Any] = {
    "stage": 2,
    "offload_optimizer": False,
    "offload_parameters": False,
    "offload_params_device": "cpu",
    "offload_optimizer_device": "cpu",
    "nvme_path": "/local_nvme",
    "params_buffer_count": 5,
    "params_buffer_size": 100_000_000,
    "max_in_cpu": 1_000_000_000,
    "optimizer_buffer_count": 4,
    "block_size": 1048576,
    "queue_depth": 8,
    "single_submit": False,
    "overlap_events": True,
    "thread_count": 1,
    "pin_memory": False,
    "sub_group_size": 1_000_000_000_000,
}

# Other DeepSpeedStrategy keywords: valid, but nothing aio reads.
_IGNORED = {
    "accelerator",
    "zero_optimization",
    "remote_device",
    "contiguous_gradients",
    "overlap_comm",
    "allgather_partitions",
    "reduce_scatter",
    "allgather_bucket_size",
    "reduce_bucket_size",
    "zero_allow_untested_optimizer",
    "logging_batch_size_per_gpu",
    "logging_level",
    "parallel_devices",
    "cluster_environment",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "synchronize_checkpoint_boundary",
    "load_full_weights",
    "precision_plugin",
    "process_group_backend",
    "timeout",
    "exclude_frozen_parameters",
}


def from_lightning(**kwargs: Any) -> OffloadConfig:
    """Build the config that ``DeepSpeedStrategy(**kwargs)`` would give DeepSpeed.

    As in Lightning, an explicit ``config=`` (dict or JSON path) wins over the
    individual keywords.
    """
    if kwargs.get("config") is not None:
        return load_config(kwargs["config"])
    unknown = [k for k in kwargs if k not in _DEFAULTS and k not in _IGNORED and k != "config"]
    if unknown:
        known = sorted(set(_DEFAULTS) | _IGNORED)
        parts = []
        for k in unknown:
            close = difflib.get_close_matches(k, known, n=1)
            parts.append(
                (
                    k,
                    "not a DeepSpeedStrategy keyword" + (f"; did you mean {close[0]!r}?" if close else ""),
                )
            )
        raise ConfigError(parts, "from_lightning")
    a = {**_DEFAULTS, **kwargs}
    zero: dict[str, Any] = {"stage": a["stage"], "sub_group_size": a["sub_group_size"]}
    if a["offload_parameters"]:
        zero["offload_param"] = {
            "device": a["offload_params_device"],
            "nvme_path": a["nvme_path"],
            "buffer_count": a["params_buffer_count"],
            "buffer_size": a["params_buffer_size"],
            "max_in_cpu": a["max_in_cpu"],
            "pin_memory": a["pin_memory"],
        }
    if a["offload_optimizer"]:
        zero["offload_optimizer"] = {
            "device": a["offload_optimizer_device"],
            "nvme_path": a["nvme_path"],
            "buffer_count": a["optimizer_buffer_count"],
            "pin_memory": a["pin_memory"],
        }
    aio_block = {
        "block_size": a["block_size"],
        "queue_depth": a["queue_depth"],
        "single_submit": a["single_submit"],
        "overlap_events": a["overlap_events"],
        "thread_count": a["thread_count"],
    }
    return load_config({"zero_optimization": zero, "aio": aio_block})
