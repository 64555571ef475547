"""Map Lightning ``DeepSpeedStrategy`` keyword arguments onto aio's models.

:func:`lightning_config` gets the DeepSpeed config dict from Lightning's own
``DeepSpeedStrategy`` when Lightning is installed, else builds it the way
Lightning 2.6 does (:func:`builtin_config`: ``DeepSpeedStrategy.__init__`` /
``_create_default_config``);
:func:`from_lightning` validates it and warns about keyword combinations that
do not do what they read as. The main one: ``remote_device="nvme"`` is only the
device ``deepspeed.zero.Init`` creates the model on, and DeepSpeed replaces it
with ``offload_param``'s device; where things are offloaded is set by
``offload_params_device`` / ``offload_optimizer_device``, both "cpu" by default.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Mapping
from typing import Any

from .load import ConfigError, load_config, read_config_data
from .models import OffloadConfig

# The environment variable Lightning reads a config path from when config=None.
ENV_VAR = "PL_DEEPSPEED_CONFIG_PATH"

# Lightning's defaults for the keywords that shape the config it builds.
_DEFAULTS: dict[str, Any] = {
    "zero_optimization": True,
    "stage": 2,
    "remote_device": None,
    "offload_optimizer": False,
    "offload_parameters": False,
    "offload_params_device": "cpu",
    "nvme_path": "/local_nvme",
    "params_buffer_count": 5,
    "params_buffer_size": 100_000_000,
    "max_in_cpu": 1_000_000_000,
    "offload_optimizer_device": "cpu",
    "optimizer_buffer_count": 4,
    "block_size": 1048576,
    "queue_depth": 8,
    "single_submit": False,
    "overlap_events": True,
    "thread_count": 1,
    "pin_memory": False,
    "sub_group_size": 1_000_000_000_000,
    "contiguous_gradients": True,
    "overlap_comm": True,
    "allgather_partitions": True,
    "reduce_scatter": True,
    "allgather_bucket_size": 200_000_000,
    "reduce_bucket_size": 200_000_000,
    "zero_allow_untested_optimizer": True,
    "logging_batch_size_per_gpu": "auto",
    "partition_activations": False,
    "cpu_checkpointing": False,
    "contiguous_memory_optimization": False,
    "synchronize_checkpoint_boundary": False,
}

# Other DeepSpeedStrategy keywords: valid, but they do not reach the config.
_IGNORED = {
    "accelerator",
    "logging_level",
    "parallel_devices",
    "cluster_environment",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
    "load_full_weights",
    "precision_plugin",
    "process_group_backend",
    "timeout",
    "exclude_frozen_parameters",
}

# Lightning passes these to zero_optimization unchanged.
_ZERO_KEYS = (
    "stage",
    "contiguous_gradients",
    "overlap_comm",
    "allgather_partitions",
    "reduce_scatter",
    "allgather_bucket_size",
    "reduce_bucket_size",
    "sub_group_size",
)

# Config key path -> the keyword that sets it, so errors name what the user wrote.
_KEYWORD_OF = {
    "zero_optimization.stage": "stage",
    "zero_optimization.sub_group_size": "sub_group_size",
    "zero_optimization.offload_param.device": "offload_params_device",
    "zero_optimization.offload_param.nvme_path": "nvme_path",
    "zero_optimization.offload_param.buffer_count": "params_buffer_count",
    "zero_optimization.offload_param.buffer_size": "params_buffer_size",
    "zero_optimization.offload_param.max_in_cpu": "max_in_cpu",
    "zero_optimization.offload_param.pin_memory": "pin_memory",
    "zero_optimization.offload_optimizer.device": "offload_optimizer_device",
    "zero_optimization.offload_optimizer.nvme_path": "nvme_path",
    "zero_optimization.offload_optimizer.buffer_count": "optimizer_buffer_count",
    "zero_optimization.offload_optimizer.pin_memory": "pin_memory",
    "aio.block_size": "block_size",
    "aio.queue_depth": "queue_depth",
    "aio.single_submit": "single_submit",
    "aio.overlap_events": "overlap_events",
    "aio.thread_count": "thread_count",
    "aio.intra_op_parallelism": "thread_count",
}


def _check_keywords(kwargs: Mapping[str, Any]) -> None:
    known = set(_DEFAULTS) | _IGNORED | {"config"}
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        parts = []
        for k in unknown:
            close = difflib.get_close_matches(k, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            parts.append((k, "not a DeepSpeedStrategy keyword" + hint))
        raise ConfigError(parts, "from_lightning")


def lightning_config(**kwargs: Any) -> dict[str, Any]:
    """The DeepSpeed config ``DeepSpeedStrategy(**kwargs).config`` holds before
    setup: built by Lightning's own ``DeepSpeedStrategy`` when Lightning (and
    the DeepSpeed it needs) can be imported, else by :func:`builtin_config`,
    aio's copy of Lightning 2.6's rules. Unknown keywords are a
    :class:`ConfigError` either way."""
    _check_keywords(kwargs)
    theirs = _strategy_config(kwargs)
    return theirs if theirs is not None else builtin_config(**kwargs)


def _strategy_config(kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """``DeepSpeedStrategy(**kwargs).config`` (its __init__ builds the config;
    setup, the part needing a GPU, is not run), or None without Lightning or
    DeepSpeed, or if the strategy refuses to be built here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from lightning.pytorch.strategies import DeepSpeedStrategy

            cfg = DeepSpeedStrategy(**kwargs).config
    except Exception:  # noqa: BLE001 - any failure: aio's own copy of the rules
        return None
    return dict(cfg) if isinstance(cfg, Mapping) else None


def builtin_config(**kwargs: Any) -> dict[str, Any]:
    """aio's copy of how Lightning 2.6 builds the config (the fallback of
    :func:`lightning_config`): an explicit ``config=`` (dict or JSON path),
    else a path in ``$PL_DEEPSPEED_CONFIG_PATH``, else the dict built from
    the keywords."""
    _check_keywords(kwargs)
    config = kwargs.get("config")
    if config is None and ENV_VAR in os.environ:
        config = os.environ[ENV_VAR]
    if config is not None:
        return dict(read_config_data(config)[0]) if not isinstance(config, dict) else config
    a = {**_DEFAULTS, **kwargs}
    cfg: dict[str, Any] = {
        "activation_checkpointing": {
            k: a[k]
            for k in (
                "partition_activations",
                "cpu_checkpointing",
                "contiguous_memory_optimization",
                "synchronize_checkpoint_boundary",
            )
        },
        "aio": {
            k: a[k] for k in ("block_size", "queue_depth", "single_submit", "overlap_events", "thread_count")
        },
    }
    if a["zero_optimization"]:
        cfg = {
            "zero_allow_untested_optimizer": a["zero_allow_untested_optimizer"],
            "zero_optimization": {**{k: a[k] for k in _ZERO_KEYS}, **_offload_blocks(a)},
            **cfg,
        }
    if a["logging_batch_size_per_gpu"] != "auto":
        cfg = {"train_micro_batch_size_per_gpu": a["logging_batch_size_per_gpu"], **cfg}
    return cfg


def _offload_blocks(a: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if a["offload_optimizer"]:
        out["offload_optimizer"] = {
            "device": a["offload_optimizer_device"],
            "nvme_path": a["nvme_path"],
            "buffer_count": a["optimizer_buffer_count"],
            "pin_memory": a["pin_memory"],
        }
    if a["offload_parameters"]:
        out["offload_param"] = {
            "device": a["offload_params_device"],
            "nvme_path": a["nvme_path"],
            "buffer_count": a["params_buffer_count"],
            "buffer_size": a["params_buffer_size"],
            "max_in_cpu": a["max_in_cpu"],
            "pin_memory": a["pin_memory"],
        }
    return out


def from_lightning(**kwargs: Any) -> OffloadConfig:
    """Build the config that ``DeepSpeedStrategy(**kwargs)`` would give DeepSpeed.

    As in Lightning, an explicit ``config=`` (dict or JSON path) wins over the
    individual keywords. Warns (UserWarning) about combinations that do not
    offload where they seem to, e.g. ``remote_device="nvme"`` with the offload
    devices left at "cpu", naming the keywords to set. Problems are a
    :class:`ConfigError` naming the keyword and the config key.
    """
    cfg = lightning_config(**kwargs)
    from_keywords = kwargs.get("config") is None and ENV_VAR not in os.environ
    for message in _traps(kwargs, cfg, from_keywords):
        warnings.warn(message, UserWarning, stacklevel=2)
    if not from_keywords:
        return load_config(cfg)
    try:
        return load_config(cfg)
    except ConfigError as e:
        named = [(f"{_KEYWORD_OF[p]} ({p})" if p in _KEYWORD_OF else p, m) for p, m in e.problems]
        raise ConfigError(named, "from_lightning") from None


def _device(block: Any) -> str | None:
    if not isinstance(block, Mapping):
        return None
    d = block.get("device")
    return d.strip().lower() if isinstance(d, str) else d


def _traps(kwargs: Mapping[str, Any], cfg: Mapping[str, Any], from_keywords: bool) -> list[str]:
    """Warnings for `kwargs` whose effect differs from what they read as."""
    out = []
    remote = kwargs.get("remote_device")
    if isinstance(remote, str) and remote.strip().lower() == "nvme":
        message = _remote_nvme_trap(kwargs, cfg, from_keywords)
        if message:
            out.append(message)
    if not from_keywords:
        shaped = sorted(k for k in kwargs if k in _DEFAULTS and k != "remote_device")
        if shaped:
            out.append(
                "DeepSpeedStrategy: a config is given (config= or $PL_DEEPSPEED_CONFIG_PATH), so "
                f"Lightning ignores these keywords: {', '.join(shaped)}; set them in the config"
            )
        return out
    a = {**_DEFAULTS, **kwargs}
    for flag, dev_key in (
        ("offload_parameters", "offload_params_device"),
        ("offload_optimizer", "offload_optimizer_device"),
    ):
        if dev_key in kwargs and not a[flag]:
            out.append(f"DeepSpeedStrategy: {dev_key}={a[dev_key]!r} does nothing without {flag}=True")
    if not a["zero_optimization"] and (a["offload_parameters"] or a["offload_optimizer"]):
        out.append(
            "DeepSpeedStrategy: zero_optimization=False writes no zero_optimization block, so "
            "offload_parameters / offload_optimizer do nothing; drop zero_optimization=False"
        )
    zero = cfg.get("zero_optimization") or {}
    nvme = [b for b in ("offload_param", "offload_optimizer") if _device(zero.get(b)) == "nvme"]
    out += _max_in_cpu_trap(zero)
    if nvme and "nvme_path" not in kwargs:
        out.append(
            f"DeepSpeedStrategy: nvme_path is not given, so the NVMe offload goes to Lightning's "
            f"default {_DEFAULTS['nvme_path']!r}; set nvme_path to a directory on the NVMe drive"
        )
    return out


def _max_in_cpu_trap(zero: Mapping[str, Any]) -> list[str]:
    """``offload_param.device: nvme`` with DeepSpeed's default max_in_cpu (1e9
    elements): the first billion parameter elements stay in CPU memory, so a
    model smaller than that never pages parameters to the drive."""
    param = zero.get("offload_param")
    if _device(param) != "nvme" or not isinstance(param, Mapping):
        return []
    n = param.get("max_in_cpu", _DEFAULTS["max_in_cpu"])
    if not isinstance(n, (int, float)) or n < _DEFAULTS["max_in_cpu"]:
        return []
    return [
        f"DeepSpeedStrategy: max_in_cpu={int(n)} keeps the first {int(n):,} parameter elements in CPU "
        "memory before any goes to the drive, so a model of fewer parameters never pages them to "
        "NVMe; set max_in_cpu (0: every parameter on the drive)"
    ]


def _remote_nvme_trap(kwargs: Mapping[str, Any], cfg: Mapping[str, Any], from_keywords: bool) -> str:
    """Why ``remote_device="nvme"`` does not put parameters or optimizer state
    on NVMe with this config ('' when it does): Lightning hands it to
    ``deepspeed.zero.Init`` alone, only at stage 3, and zero.Init then takes
    ``offload_param.device`` in its place (and asserts the block exists)."""
    zero = cfg.get("zero_optimization")
    zero = zero if isinstance(zero, Mapping) else {}
    stage = zero.get("stage", 0)
    param, opt = zero.get("offload_param"), zero.get("offload_optimizer")
    found = []
    if stage != 3:
        found.append(f"at stage {stage} Lightning does not run zero.Init, so it is not used at all")
    elif param is None:
        found.append("with no offload_param block DeepSpeed's zero.Init stops on an assertion at setup")
    elif _device(param) != "nvme":
        found.append(f"parameters go to {_device(param)!r} (offload_param.device)")
    if opt is not None and _device(opt) != "nvme":
        found.append(f"optimizer state goes to {_device(opt)!r} (offload_optimizer.device)")
    if not found:
        return ""
    params_wrong = _device(param) != "nvme"
    opt_wrong = opt is not None and _device(opt) != "nvme"
    if from_keywords:
        path = kwargs.get("nvme_path", _DEFAULTS["nvme_path"])
        fix = ["stage=3"] if stage != 3 else []
        fix += ["offload_parameters=True"] if param is None else []
        fix += ['offload_params_device="nvme"'] if params_wrong else []
        fix += ['offload_optimizer_device="nvme"'] if opt_wrong else []
        fix.append(f'nvme_path="{path}" (a directory on the NVMe drive)')
    else:
        fix = ["zero_optimization.stage: 3"] if stage != 3 else []
        fix += ['offload_param.device: "nvme"'] if params_wrong else []
        fix += ['offload_optimizer.device: "nvme"'] if opt_wrong else []
        fix.append("their nvme_path in the config")
    return (
        "DeepSpeedStrategy(remote_device='nvme') does not offload to NVMe here: "
        + "; ".join(found)
        + ". remote_device is only the device zero.Init creates the model on; the offload "
        "devices are offload_params_device / offload_optimizer_device (default 'cpu'). Set " + ", ".join(fix)
    )
