"""The training config aio.zero reads: a whole DeepSpeed-format config.

Read: ``aio``, ``zero_optimization`` (the offload blocks, ``sub_group_size``,
``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``),
``optimizer`` (``type``/``params``), ``bf16``/``fp16``,
``gradient_accumulation_steps``, ``gradient_clipping``; DeepSpeed's defaults
and meanings. One block of aio.zero's own, which DeepSpeed ignores:
``aio_zero`` (``gradients``: ``auto``, the default, ``cpu`` or ``nvme``, within
``host_memory_budget``; see :mod:`aio.config.gradients`). Other top-level
keys are ignored with one notice. Numbers follow the strict rules of
:mod:`aio.config.models`.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from .load import ConfigError, pick_blocks, read_config_data, similar_key, validate, warn_use_gds
from .models import AioConfig, Bool, Int, OffloadConfig, UnresolvedAuto, ZeroConfig, strict_float

Float = Annotated[float, BeforeValidator(strict_float)]

# DeepSpeed optimizer names -> torch.optim class names. DeepSpeed's "Adam"
# decouples weight decay unless adam_w_mode is false (its default is true).
OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop"}
# DeepSpeed-only optimizer parameters that torch's classes do not take.
_DS_ONLY_PARAMS = {"adam_w_mode", "torch_adam", "bias_correction", "fused"}
# Keys DeepSpeed users routinely have that mean nothing on one process.
_QUIET_KEYS = {
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "steps_per_print",
    "wall_clock_breakdown",
}
# Communication tuning: meaningful to DeepSpeed across ranks, nothing to do on one process.
_NOOP_ZERO_KEYS = {
    "contiguous_gradients",
    "overlap_comm",
    "reduce_bucket_size",
    "reduce_scatter",
    "allgather_bucket_size",
    "allgather_partitions",
    "round_robin_gradients",
}


def _enabled_block(v: Any) -> Any:
    """A precision block: an object with ``enabled``; a disabled block's other
    keys are not read (so not checked either)."""
    if v is None:
        return v
    if not isinstance(v, Mapping):
        raise ValueError(f'must be an object like {{"enabled": true}}, got {type(v).__name__}')
    return v if v.get("enabled", False) is not False else {"enabled": False}


class PrecisionConfig(BaseModel):
    """``bf16`` / ``bfloat16``: only ``enabled`` is read."""

    model_config = ConfigDict(extra="allow", frozen=True)

    enabled: Bool = False


class Fp16Config(PrecisionConfig):
    """``fp16``: mixed precision with loss scaling, DeepSpeed's keys and defaults."""

    loss_scale: Float = Field(0.0, ge=0, description="static loss scale; 0: dynamic")
    initial_scale_power: Int = Field(16, ge=0, description="dynamic scale starts at 2**this")
    loss_scale_window: Int = Field(1000, ge=1, description="clean steps before the scale doubles")
    hysteresis: Int = Field(2, ge=1, description="overflows before the scale halves")
    min_loss_scale: Float = Field(1.0, ge=0, description="the dynamic scale never goes below this")
    consecutive_hysteresis: Bool = Field(
        False, description="restore the hysteresis at every clean step, not only when the scale doubles"
    )


class OptimizerConfig(BaseModel):
    """``optimizer``: a DeepSpeed optimizer name and its parameters, checked
    against the torch.optim class they resolve to."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Any = Field(None, validate_default=True)
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            raise ValueError(f"must be an object with 'type' and 'params', got {type(data).__name__}")
        return data

    @field_validator("type")
    @classmethod
    def _known(cls, v: Any) -> str:
        if not isinstance(v, str) or v.lower() not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {v!r}; accepted: {', '.join(OPTIMIZERS.values())}")
        return v

    @field_validator("params", mode="before")
    @classmethod
    def _finite(cls, v: Any) -> Any:
        # torch lets some NaN/inf through (SGD momentum=NaN) and training would go NaN.
        if not isinstance(v, Mapping):
            raise ValueError(f"must be an object, got {type(v).__name__}")
        for k, x in v.items():
            if isinstance(x, str) and x.strip().lower() == "auto":
                raise UnresolvedAuto("a number" if k != "betas" else "a pair of numbers", key=str(k))
        out = {k: (tuple(x) if isinstance(x, list) else x) for k, x in v.items()}
        for k, x in out.items():
            if any(
                isinstance(y, float) and not math.isfinite(y) for y in (x if isinstance(x, tuple) else (x,))
            ):
                raise ValueError(f"{k}: expected a finite number, got {v[k]!r}")
        return out

    @property
    def torch_name(self) -> str:
        """The torch.optim class name this block means."""
        name = OPTIMIZERS[str(self.type).lower()]
        if name == "Adam" and self.params.get("adam_w_mode", True) and self.params.get("weight_decay"):
            return "AdamW"
        return name

    @property
    def torch_params(self) -> dict[str, Any]:
        """The parameters torch's class takes (DeepSpeed-only ones dropped)."""
        return {k: v for k, v in self.params.items() if k not in _DS_ONLY_PARAMS}

    def state_spec(self) -> list[tuple[str, Any]]:
        """(name, dtype) of the per-element state tensors the optimizer keeps."""
        import torch

        return discover_state_spec(getattr(torch.optim, self.torch_name), **self.torch_params)

    @model_validator(mode="after")
    def _torch_accepts(self) -> OptimizerConfig:
        for k in sorted(_DS_ONLY_PARAMS & set(self.params)):  # all DeepSpeed's flags are booleans
            _check_param_type(k, self.params[k], False)
        _check_torch_optimizer(self.torch_name, self.torch_params)
        return self


def _check_torch_optimizer(name: str, params: dict[str, Any]) -> None:
    """Construct the optimizer on a probe parameter: a bad name or value is a
    config error now, not a crash at the first step."""
    import inspect

    import torch

    cls = getattr(torch.optim, name)
    accepted = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")]
    bad = [k for k in params if k not in accepted]
    if bad:
        raise ValueError(
            f"params.{bad[0]}: not a parameter of torch.optim.{name}; accepted: {', '.join(accepted)}"
        )
    defaults = inspect.signature(cls.__init__).parameters
    for k, v in params.items():
        _check_param_type(k, v, defaults[k].default)
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"params: torch.optim.{name} refuses them: {e}") from None


def _json_text(v: Any) -> str:
    """`v` as the config wrote it (JSON: true, null, lists)."""
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def _check_param_type(key: str, v: Any, default: Any) -> None:
    """`v` is of the kind torch's `default` for `key` is (a ValueError naming
    ``params.<key>`` otherwise): a boolean flag takes true or false (null
    too where the default is None: torch then chooses), a number a finite
    JSON number (not a boolean or a string), a tuple such as ``betas`` a list
    of as many finite numbers. torch itself takes ``lr=True`` as 1.0, ``"yes"``
    as a true flag and fails deep inside on a short ``betas``."""
    if isinstance(default, bool) or default is None:
        if not isinstance(v, bool) and not (default is None and v is None):
            want = "true, false or null" if default is None else "true or false"
            raise ValueError(f"params.{key}: expected {want}, got {_json_text(v)}")
    elif isinstance(default, (int, float)):
        _check_param_number(f"params.{key}", v)
    elif isinstance(default, tuple):
        n = len(default)
        if not isinstance(v, (list, tuple)) or len(v) != n:
            raise ValueError(f"params.{key}: expected a list of {n} numbers, got {_json_text(v)}")
        for i, x in enumerate(v):
            _check_param_number(f"params.{key}", x, f"item {i}: ")


def _check_param_number(where: str, v: Any, item: str = "") -> None:
    """A ValueError naming `where` unless `v` is a finite JSON number."""
    if v is None or isinstance(v, (list, tuple, Mapping)):
        raise ValueError(f"{where}: {item}expected a number, got {_json_text(v)}")
    try:
        strict_float(v)
    except ValueError as e:
        raise ValueError(f"{where}: {item}{e}") from None


def discover_state_spec(optimizer_cls: Any, **hyper: Any) -> list[tuple[str, Any]]:
    """(name, dtype) of the per-element state tensors `optimizer_cls` keeps,
    found by stepping it once on a small probe parameter."""
    import torch

    p = torch.nn.Parameter(torch.zeros(8))
    p.grad = torch.full((8,), 1e-3)
    opt = optimizer_cls([p], **hyper)
    opt.step()
    spec = []
    for name, v in opt.state[p].items():
        if torch.is_tensor(v) and v.shape == p.shape:
            spec.append((str(name), v.dtype))
    return spec


class TrainZeroConfig(ZeroConfig):
    """``zero_optimization`` as aio.zero reads it: :class:`ZeroConfig` plus the
    stage-3 fetch keys. A single process has nothing to partition across:
    stages 1-2 would mean the same as 3 here, so they are refused rather than
    silently reinterpreted."""

    stage3_prefetch_bucket_size: Int = Field(50_000_000, ge=0, description="elements fetched ahead")
    stage3_param_persistence_threshold: Int = Field(
        100_000, ge=0, description="parameters smaller than this stay in memory"
    )

    @model_validator(mode="after")
    def _stage_0_or_3(self) -> TrainZeroConfig:
        if self.stage not in (0, 3):
            raise ValueError(f"stage: aio.zero runs stage 3 (or 0 without offload); got {self.stage!r}")
        return self


# More module fetches ahead than a model has modules: no limit in effect.
MAX_MODULES_AHEAD = 65536


class AioZeroConfig(BaseModel):
    """The top-level ``aio_zero`` block: choices of aio.zero's own, with no
    DeepSpeed key to carry them (DeepSpeed ignores the block)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gradients: Literal["auto", "cpu", "nvme"] = Field(
        "auto",
        description=(
            "where fp32 gradients wait for the step when the optimizer is on NVMe: "
            "'cpu' holds them in memory (4 bytes per parameter, as DeepSpeed does); "
            "'nvme' writes them to the drive and reads them back (8 more bytes of I/O "
            "per parameter per step, for the least memory); 'auto' holds them in memory "
            "when they fit host_memory_budget with the rest aio.zero holds there, else "
            "on the drive"
        ),
    )
    host_memory_budget: Float = Field(
        0.5,
        gt=0,
        description=(
            "CPU memory aio.zero may fill with fp32 gradients and its own buffers (pinned "
            "pools, resident parameters) under gradients 'auto': a fraction of the memory "
            "available when training starts (0 < x <= 1), or bytes (a whole number above 1); "
            "'cpu' past it warns"
        ),
    )
    optimizer_states: Literal["fp32", "bf16"] = Field(
        "fp32",
        description=(
            "how float32 optimizer states (Adam's moments) are stored on the drive when the "
            "optimizer is on NVMe: 'fp32' as they are; 'bf16' rounded to bfloat16, half their "
            "bytes read and written per step (Adam: 8 bytes less per parameter per step), "
            "the master weights still float32. Not bit-identical to training in memory"
        ),
    )
    adam_sqrt: Literal["ieee", "torch"] = Field(
        "ieee",
        description=(
            "the square root of aio's fused Adam/AdamW step (aio.optim): 'ieee' the correctly "
            "rounded one (the same bits on every CPU); 'torch' the one torch's Adam uses on this "
            "machine (MKL's on x86), so the step is bit-identical to torch.optim.Adam/AdamW, at "
            "about 35% more arithmetic. optimizer.params.torch_adam true steps with torch's "
            "own class instead, as in DeepSpeed"
        ),
    )
    openmp_spin: Literal["auto", "short", "torch"] = Field(
        "auto",
        description=(
            "how long torch's OpenMP workers spin after each parallel region before they sleep "
            "(aio.optim.OpenMPThrottle): 'short' makes libgomp take its short count (about 100 "
            "iterations instead of 300,000), so workers do not spin through the main thread's "
            "waits for I/O on the cores aio's I/O threads need; 'torch' leaves the runtime as it "
            "is; 'auto': 'short' when parameters or optimizer are offloaded to NVMe"
        ),
    )

    params_from_master: Bool = Field(
        True,
        description=(
            "with parameters and optimizer both on NVMe and float32 parameters: read each "
            "parameter from its slice of the optimizer's fp32 master weights on the drive "
            "instead of a copy of its own, which then is not written back after every step "
            "(4 bytes per parameter less written per step); false keeps the copy"
        ),
    )

    modules_ahead: Int = Field(
        2,
        ge=1,
        le=MAX_MODULES_AHEAD,
        description=(
            "on a GPU: how many modules' parameters the host may upload ahead of the module "
            "the GPU is running (FSDP's limit_all_gathers): before fetching module i the host "
            "waits until the GPU has finished everything queued before module i - modules_ahead "
            "was fetched, so device memory holds about modules_ahead + 1 modules' parameters "
            "however far the host runs ahead (1 to 65536; a whole JSON number)"
        ),
    )

    @field_validator("host_memory_budget")
    @classmethod
    def _fraction_or_bytes(cls, v: float) -> float:
        if v > 1 and not v.is_integer():
            raise ValueError(f"above 1 it is bytes and must be a whole number, got {v}")
        return v

    def short_openmp_spin(self, nvme: bool) -> bool:
        """Whether to throttle OpenMP spinning, with or without NVMe offload."""
        return self.openmp_spin == "short" or (self.openmp_spin == "auto" and nvme)


class TrainConfig(BaseModel):
    """A whole DeepSpeed-format training config, validated (see the module
    docstring for the keys read); other top-level keys are kept in
    :attr:`ignored`."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    aio: AioConfig = Field(default_factory=lambda: AioConfig())
    aio_zero: AioZeroConfig = Field(default_factory=lambda: AioZeroConfig())
    zero_optimization: TrainZeroConfig = Field(default_factory=lambda: TrainZeroConfig())
    optimizer: OptimizerConfig | None = None
    bf16: Annotated[PrecisionConfig | None, BeforeValidator(_enabled_block)] = None
    bfloat16: Annotated[PrecisionConfig | None, BeforeValidator(_enabled_block)] = None
    fp16: Annotated[Fp16Config | None, BeforeValidator(_enabled_block)] = None
    gradient_accumulation_steps: Int = Field(1, ge=1)
    gradient_clipping: Float = Field(0.0, ge=0, description="max global gradient norm; 0: off")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self._precision() == "both":
            raise ValueError("fp16.enabled: bf16 and fp16 cannot both be enabled; pick one")
        # DeepSpeed's meaning: one tensor per buffer, so stepping a sub-group takes
        # its gradient, its master weights and one buffer per optimizer state. With
        # no optimizer block (a torch optimizer passed in code) only the floor of 2
        # is checked here; the swapper checks the rest and warns when pipelining
        # has fewer buffers than it could use.
        o = self.zero_optimization.offload_optimizer
        if self.aio_zero.optimizer_states == "bf16" and (o is None or o.device != "nvme"):
            raise ValueError(
                "aio_zero.optimizer_states: 'bf16' stores the states on the drive and needs "
                "zero_optimization.offload_optimizer.device 'nvme'"
            )
        if o is None or o.device != "nvme":
            return self
        spec = self.optimizer.state_spec() if self.optimizer is not None else []
        if o.buffer_count < 2 + len(spec):
            states = f" and {len(spec)} for {self.optimizer.torch_name}'s states" if self.optimizer else ""
            raise ValueError(
                f"zero_optimization.offload_optimizer.buffer_count: {o.buffer_count} is too small; "
                f"stepping a sub-group takes 2 buffers (gradient and master weights){states}"
            )
        return self

    def _precision(self) -> str:
        bf16 = any(b is not None and b.enabled for b in (self.bf16, self.bfloat16))
        fp16 = self.fp16 is not None and self.fp16.enabled
        return "both" if bf16 and fp16 else "bf16" if bf16 else "fp16" if fp16 else "fp32"

    # -- what aio.zero reads -------------------------------------------------------------
    @property
    def offload(self) -> OffloadConfig:
        """The ``aio`` and ``zero_optimization`` blocks as :func:`load_config` reads them."""
        return OffloadConfig(aio=self.aio, zero_optimization=self.zero_optimization)

    @property
    def dtype(self) -> str:
        """``fp32``, ``bf16`` or ``fp16``."""
        return self._precision()

    @property
    def torch_dtype(self) -> Any:
        """The torch dtype of :attr:`dtype`: ``torch.float32``, ``torch.bfloat16`` or
        ``torch.float16`` (imports torch)."""
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @property
    def loss_scale(self) -> Fp16Config:
        """fp16 loss scaling (DeepSpeed's defaults when fp16 is off)."""
        return self.fp16 if self.fp16 is not None and self.fp16.enabled else Fp16Config()

    @property
    def optimizer_type(self) -> str | None:
        """The torch.optim class name of the ``optimizer`` block, or None."""
        return self.optimizer.torch_name if self.optimizer is not None else None

    @property
    def optimizer_params(self) -> dict[str, Any]:
        """Keyword arguments for :meth:`optimizer_class` (DeepSpeed-only keys dropped,
        lists as tuples); empty without an ``optimizer`` block."""
        return self.optimizer.torch_params if self.optimizer is not None else {}

    @property
    def torch_adam(self) -> bool:
        """DeepSpeed's ``optimizer.params.torch_adam``: step with torch's own
        Adam/AdamW class rather than the fused CPU kernel."""
        return self.optimizer is not None and self.optimizer.params.get("torch_adam") is True

    def optimizer_class(self) -> Any:
        """The torch.optim class :attr:`optimizer_type` names (imports torch), or None
        without an ``optimizer`` block."""
        import torch

        return getattr(torch.optim, self.optimizer_type) if self.optimizer_type else None

    @property
    def param_device(self) -> str:
        """``zero_optimization.offload_param.device``: ``none``, ``cpu`` or ``nvme``."""
        return self.zero_optimization.param_device()

    @property
    def optimizer_device(self) -> str:
        """``zero_optimization.offload_optimizer.device``: ``none``, ``cpu`` or ``nvme``."""
        return self.zero_optimization.optimizer_device()

    @property
    def sub_group_size(self) -> int:
        """``zero_optimization.sub_group_size``: at most this many elements per optimizer sub-group."""
        return self.zero_optimization.sub_group_size

    @property
    def prefetch_bucket_size(self) -> int:
        """``stage3_prefetch_bucket_size``: how many parameter elements the fetcher
        reads ahead of use (0: no prefetch)."""
        return self.zero_optimization.stage3_prefetch_bucket_size

    @property
    def persistence_threshold(self) -> int:
        """``stage3_param_persistence_threshold``, in elements: parameters smaller than
        this stay in CPU memory instead of being swapped to the drive."""
        return self.zero_optimization.stage3_param_persistence_threshold

    @property
    def ignored(self) -> tuple[str, ...]:
        """Config keys given but not read (quiet DeepSpeed keys left out)."""
        top = [k for k in self.model_extra or {} if k not in _QUIET_KEYS]
        zero = self.zero_optimization.model_extra or {}
        opt = (self.optimizer.model_extra or {}) if self.optimizer is not None else {}
        precision = [
            f"{name}.{k}"
            for name in ("bf16", "bfloat16", "fp16")
            if (block := getattr(self, name)) is not None
            for k in block.model_extra or {}
        ]
        return tuple(
            sorted(
                top
                + [f"zero_optimization.{k}" for k in zero if k not in _NOOP_ZERO_KEYS]
                + [f"optimizer.{k}" for k in opt]
                + precision
            )
        )


_BLOCKS = ("aio", "zero_optimization", "optimizer", "bf16", "bfloat16", "fp16", "aio_zero")


def load_train_config(source: Any) -> TrainConfig:
    """Parse and validate a training config (dict, JSON path or JSON text).

    Raises :class:`ConfigError` listing the problems with their key paths.
    Unknown top-level keys are reported once as a warning and ignored.
    """
    if isinstance(source, TrainConfig):
        return source
    data, where = read_config_data(source)
    blocks, problems = pick_blocks(data, ("aio", "zero_optimization"))
    if problems:
        raise ConfigError(problems, where)
    rest = {k: v for k, v in data.items() if k not in _BLOCKS[:2] and not (k in _BLOCKS and v is None)}
    cfg = validate(TrainConfig, {**rest, **blocks}, where)
    warn_use_gds(cfg.aio, stacklevel=3)
    if cfg.ignored:
        keys = ", ".join(_with_guess(k, cfg) for k in cfg.ignored)
        warnings.warn(f"aio.zero ignores these config keys: {keys}", UserWarning, stacklevel=3)
    return cfg


# Keys DeepSpeed reads that aio.zero does not (nothing to guess for them).
_DEEPSPEED_KEYS = frozenset(
    (
        "activation_checkpointing amp autotuning checkpoint comet comms_logger communication_data_type "
        "compile compression_training csv_monitor curriculum_learning data_efficiency data_types "
        "dump_state eigenvalue elasticity flops_profiler gradient_accumulation_dtype "
        "gradient_predivide_factor hybrid_engine load_universal_checkpoint memory_breakdown nebula "
        "pipeline prescale_gradients progressive_layer_drop scheduler sparse_attention sparse_gradients "
        "tensor_parallel tensorboard timers torch_autocast use_node_local_storage wandb "
        "weight_quantization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer "
        "optimizer.legacy_fusion"
    ).split()
    + [
        "zero_optimization." + k
        for k in (
            "cpu_offload cpu_offload_params cpu_offload_use_pin_memory elastic_checkpoint "
            "gather_16bit_weights_on_model_save ignore_unused_parameters legacy_stage1 "
            "load_from_fp32_weights log_trace_cache_warnings memory_efficient_linear "
            "mics_hierarchical_params_gather mics_shard_size model_persistence_threshold "
            "module_granularity_threshold override_module_apply pipeline_loading_checkpoint "
            "stage3_gather_16bit_weights_on_model_save stage3_gather_fp16_weights_on_model_save "
            "stage3_model_persistence_threshold stage3_module_granularity_threshold "
            "use_all_reduce_for_fetch_params zero_hpz_partition_size zero_quantized_gradients "
            "zero_quantized_nontrainable_weights zero_quantized_weights zeropp_loco_param"
        ).split()
    ]
)


def _with_guess(key: str, cfg: TrainConfig) -> str:
    """`key`, and the key it looks like a misspelling of: an ignored key is
    noted, not refused (DeepSpeed configs carry many aio does not read), so
    a typo in one it does read must not pass unseen. No guess for a key
    DeepSpeed reads, nor one naming a key the config gives already."""
    guess = None if key in _DEEPSPEED_KEYS else similar_key(TrainConfig, key)
    return f"{key} (did you mean {guess}?)" if guess and not _given(cfg, guess) else key


def _given(cfg: BaseModel, dotted: str) -> bool:
    """Whether the config sets the (dotted) key itself."""
    block: Any = cfg
    for part in dotted.split("."):
        if not isinstance(block, BaseModel) or part not in block.model_fields_set:
            return False
        block = getattr(block, part)
    return True
