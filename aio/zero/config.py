"""The training config the offload engine reads: a DeepSpeed-format dict or
JSON file. Everything is validated here, before the engine allocates a byte;
errors name the key path and what is accepted.

Read: ``aio``, ``zero_optimization`` (``offload_param``, ``offload_optimizer``,
``sub_group_size``, ``stage3_prefetch_bucket_size``), ``optimizer``
(``type``/``params``), ``bf16``/``fp16``, ``gradient_accumulation_steps``,
``gradient_clipping``. Other top-level keys are ignored with one notice.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError, OffloadConfig, load_config
from ..config.load import _read_json

_READ_KEYS = {
    "aio",
    "zero_optimization",
    "optimizer",
    "bf16",
    "bfloat16",
    "fp16",
    "gradient_accumulation_steps",
    "gradient_clipping",
}
# Keys DeepSpeed users routinely have that mean nothing on one process.
_QUIET_KEYS = {
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "steps_per_print",
    "wall_clock_breakdown",
}

# DeepSpeed optimizer names -> torch.optim class names. DeepSpeed's "Adam"
# decouples weight decay unless adam_w_mode is false (its default is true).
_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop"}
# DeepSpeed-only optimizer parameters that torch's classes do not take.
_DS_ONLY_PARAMS = {"adam_w_mode", "torch_adam", "bias_correction", "fused"}

# (LossScaleConfig field, fp16 key, integer?, minimum, default) -- DeepSpeed's defaults.
_FP16_KEYS = [
    ("static", "loss_scale", False, 0, 0.0),
    ("initial_scale_power", "initial_scale_power", True, 0, 16),
    ("window", "loss_scale_window", True, 1, 1000),
    ("hysteresis", "hysteresis", True, 1, 2),
    ("min_scale", "min_loss_scale", False, 0, 1.0),
]

_ZERO_READ = {
    "stage",
    "sub_group_size",
    "offload_param",
    "offload_optimizer",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
}


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 dynamic loss scaling (DeepSpeed's keys and defaults)."""

    static: float = 0.0  # fp16.loss_scale: 0 = dynamic
    initial_scale_power: int = 16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0


@dataclass(frozen=True)
class TrainConfig:
    offload: OffloadConfig
    dtype: str = "fp32"  # fp32 | bf16 | fp16
    optimizer_type: str | None = None  # torch.optim class name
    optimizer_params: dict[str, Any] = field(default_factory=dict)
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    prefetch_bucket_size: int = 50_000_000
    persistence_threshold: int = 100_000  # parameters smaller than this stay in memory
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    ignored: tuple[str, ...] = ()

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @property
    def param_device(self) -> str:
        return self.offload.zero_optimization.param_device()

    @property
    def optimizer_device(self) -> str:
        return self.offload.zero_optimization.optimizer_device()

    @property
    def sub_group_size(self) -> int:
        return self.offload.zero_optimization.sub_group_size

    def optimizer_class(self) -> Any:
        import torch

        if self.optimizer_type is None:
            return None
        return getattr(torch.optim, self.optimizer_type)


def _number(problems: list, path: str, v: Any, *, integer: bool, minimum: float, default: Any) -> Any:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and float(v) != int(v)):
        what = "an integer" if integer else "a number"
        problems.append((path, f"expected {what} >= {minimum}, got {v!r}"))
        return default
    if v < minimum:
        problems.append((path, f"must be >= {minimum}, got {v!r}"))
        return default
    return int(v) if integer else float(v)


def _enabled(problems: list, data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    blk = data.get(key)
    if blk is None:
        return {}
    if not isinstance(blk, Mapping):
        problems.append((key, f'must be an object like {{"enabled": true}}, got {type(blk).__name__}'))
        return {}
    en = blk.get("enabled", False)
    if not isinstance(en, bool):
        problems.append((f"{key}.enabled", f"expected true or false, got {en!r}"))
        return {}
    return blk if en else {}


def load_train_config(source: Any) -> TrainConfig:
    """Parse and validate a training config (dict, JSON path or JSON text).

    Raises :class:`aio.config.ConfigError` listing every problem with its key
    path. Unknown top-level keys are reported once as a warning and ignored.
    """
    if isinstance(source, TrainConfig):
        return source
    where = ""
    if isinstance(source, Mapping):
        data = source
    elif isinstance(source, str) and source.lstrip().startswith("{"):
        data = _read_json(source, "JSON text")
    elif isinstance(source, str) or hasattr(source, "__fspath__"):
        import os

        where = os.fspath(source)
        try:
            with open(where, encoding="utf-8") as f:
                data = _read_json(f.read(), where)
        except FileNotFoundError:
            raise ConfigError([("", f"config file not found: {where}")]) from None
    else:
        raise TypeError(f"config must be a dict or a JSON file path, got {type(source).__name__}")
    if not isinstance(data, Mapping):
        raise ConfigError([("", f"the top level must be a JSON object, got {type(data).__name__}")], where)

    problems: list[tuple[str, str]] = []
    try:
        offload = load_config(data)
    except ConfigError as e:
        problems.extend(e.problems)
        offload = OffloadConfig()

    zero = data.get("zero_optimization") or {}
    zero = zero if isinstance(zero, Mapping) else {}
    stage = zero.get("stage", 3 if ("offload_param" in zero or "offload_optimizer" in zero) else 0)
    if stage not in (0, 3):
        # A single process has nothing to partition across: stages 1-2 mean
        # the same as 3 here, but say so rather than silently reinterpret.
        problems.append(
            ("zero_optimization.stage", f"aio.zero runs stage 3 (or 0 without offload); got {stage!r}")
        )
    prefetch, persist = (
        _number(problems, f"zero_optimization.{key}", zero.get(key), integer=True, minimum=0, default=d)
        for key, d in (
            ("stage3_prefetch_bucket_size", 50_000_000),
            ("stage3_param_persistence_threshold", 100_000),
        )
    )

    bf16 = _enabled(problems, data, "bf16") or _enabled(problems, data, "bfloat16")
    fp16 = _enabled(problems, data, "fp16")
    dtype = "fp32"
    if bf16 and fp16:
        problems.append(("fp16.enabled", "bf16 and fp16 cannot both be enabled; pick one"))
    elif bf16:
        dtype = "bf16"
    elif fp16:
        dtype = "fp16"
    scale = LossScaleConfig()
    if fp16:
        scale = LossScaleConfig(
            **{
                attr: _number(problems, f"fp16.{key}", fp16.get(key), integer=i, minimum=m, default=d)
                for attr, key, i, m, d in _FP16_KEYS
            }
        )
    gas, clip = (
        _number(problems, key, data.get(key), integer=i, minimum=m, default=d)
        for key, i, m, d in (
            ("gradient_accumulation_steps", True, 1, 1),
            ("gradient_clipping", False, 0, 0.0),
        )
    )

    opt_type: str | None = None
    opt_params: dict[str, Any] = {}
    opt = data.get("optimizer")
    if opt is not None:
        if not isinstance(opt, Mapping):
            problems.append(
                ("optimizer", f"must be an object with 'type' and 'params', got {type(opt).__name__}")
            )
        else:
            t = opt.get("type")
            if not isinstance(t, str) or t.lower() not in _OPTIMIZERS:
                problems.append(
                    (
                        "optimizer.type",
                        f"unknown optimizer {t!r}; accepted: {', '.join(_OPTIMIZERS.values())}",
                    )
                )
            params = opt.get("params", {})
            if not isinstance(params, Mapping):
                problems.append(("optimizer.params", f"must be an object, got {type(params).__name__}"))
                params = {}
            opt_params = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()}
            if isinstance(t, str) and t.lower() in _OPTIMIZERS:
                opt_type = _OPTIMIZERS[t.lower()]
                if (
                    opt_type == "Adam"
                    and opt_params.get("adam_w_mode", True)
                    and opt_params.get("weight_decay")
                ):
                    opt_type = "AdamW"
                for k in _DS_ONLY_PARAMS & set(opt_params):
                    opt_params.pop(k)
                problems.extend(_check_optimizer_params(opt_type, opt_params))

    o = offload.offload_optimizer
    if o is not None and o.device == "nvme":
        need = 1 + int(o.pipeline_read) + int(o.pipeline_write)
        if o.buffer_count < need:
            problems.append(
                (
                    "zero_optimization.offload_optimizer.buffer_count",
                    f"{o.buffer_count} is too small for pipeline_read={o.pipeline_read} / "
                    f"pipeline_write={o.pipeline_write}; need at least {need}",
                )
            )
    if problems:
        raise ConfigError(problems, where)

    ignored = sorted(k for k in data if k not in _READ_KEYS and k not in _QUIET_KEYS)
    ignored += sorted(
        f"zero_optimization.{k}" for k in zero if k not in _ZERO_READ and not _is_noop_zero_key(k)
    )
    if ignored:
        warnings.warn(
            f"aio.zero ignores these config keys: {', '.join(ignored)}",
            UserWarning,
            stacklevel=3,
        )
    return TrainConfig(
        offload=offload,
        dtype=dtype,
        optimizer_type=opt_type,
        optimizer_params=opt_params,
        gradient_accumulation_steps=gas,
        gradient_clipping=clip,
        prefetch_bucket_size=prefetch,
        persistence_threshold=persist,
        loss_scale=scale,
        ignored=tuple(ignored),
    )


def _is_noop_zero_key(k: str) -> bool:
    # Communication tuning keys: meaningful to DeepSpeed across ranks, nothing to do on one process.
    return k in {
        "contiguous_gradients",
        "overlap_comm",
        "reduce_bucket_size",
        "reduce_scatter",
        "allgather_bucket_size",
        "allgather_partitions",
        "round_robin_gradients",
    }


def _check_optimizer_params(opt_type: str, params: dict[str, Any]) -> list[tuple[str, str]]:
    """Construct the optimizer on a probe parameter: a bad name or value is a
    config error now, not a crash at the first step."""
    import inspect

    import torch

    cls = getattr(torch.optim, opt_type)
    accepted = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")]
    bad = [k for k in params if k not in accepted]
    if bad:
        return [
            (
                f"optimizer.params.{k}",
                f"not a parameter of torch.optim.{opt_type}; accepted: {', '.join(accepted)}",
            )
            for k in bad
        ]
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **params)
    except (ValueError, TypeError) as e:
        return [("optimizer.params", f"torch.optim.{opt_type} refuses them: {e}")]
    return []


def check_drive_paths(cfg: TrainConfig) -> None:
    """Every nvme_path must be an existing directory (checked before any allocation)."""
    import os

    problems = []
    for key in ("offload_param", "offload_optimizer"):
        blk = getattr(cfg.offload, key)
        if blk is not None and blk.device == "nvme" and not os.path.isdir(str(blk.nvme_path)):
            problems.append(
                (f"zero_optimization.{key}.nvme_path", f"{blk.nvme_path} is not an existing directory")
            )
    if problems:
        raise ConfigError(problems)
