"""Typed models of the DeepSpeed-format blocks aio reads.

Defaults and meanings follow DeepSpeed 0.19 (the `aio` block and
`zero_optimization.offload_param` / `offload_optimizer`), so an existing
DeepSpeed config means the same thing here. Stricter than DeepSpeed where
strictness saves a user hours: unknown keys in these blocks, unresolved
"auto", block sizes the drive cannot take, nvme without a path, and numbers
that are not plain finite JSON numbers (strings, booleans, NaN, inf).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from .._paths import repeated_directory


class UnresolvedAuto(ValueError):
    """A config value left as ``"auto"``: a placeholder an integration was meant
    to replace. ``want`` says what to write instead; :func:`auto_message` says
    who fills the key, once its path is known."""

    def __init__(self, want: str, key: str = "") -> None:
        self.want = want
        # A validator of a whole block names the key first ("lr: ..."), as other errors do.
        super().__init__(f"{key + ': ' if key else ''}'auto' was not resolved; give {want} here")


# Keys whose "auto" an integration replaces before DeepSpeed reads the config,
# and from what. Checked against transformers 5 (integrations/deepspeed.py:
# trainer_config_process / trainer_config_finalize) and accelerate 1.x
# (DeepSpeedPlugin, which the HF Trainer also runs). Lightning fills none.
_HF = "the HF Trainer"
_ACC = "Accelerate's DeepSpeed plugin (run by the HF Trainer too)"
AUTO_FILLED: dict[str, tuple[str, str]] = {
    "train_micro_batch_size_per_gpu": (_HF, "from per_device_train_batch_size"),
    "train_batch_size": (_HF, "from world size x per-device batch x accumulation steps"),
    "gradient_accumulation_steps": (_HF, "from gradient_accumulation_steps"),
    "gradient_clipping": (_HF, "from max_grad_norm"),
    "optimizer.params.lr": (_HF, "from learning_rate"),
    "optimizer.params.betas": (_HF, "from adam_beta1 and adam_beta2"),
    "optimizer.params.eps": (_HF, "from adam_epsilon"),
    "optimizer.params.weight_decay": (_HF, "from weight_decay"),
    "scheduler.params.warmup_min_lr": (_HF, "with 0"),
    "scheduler.params.warmup_max_lr": (_HF, "from learning_rate"),
    "scheduler.params.warmup_num_steps": (_HF, "from the warmup arguments"),
    "scheduler.params.total_num_steps": (_HF, "from the number of training steps"),
    "fp16.enabled": (_HF, "from --fp16 (Accelerate also from mixed_precision)"),
    "bf16.enabled": (_HF, "from --bf16 (Accelerate also from mixed_precision)"),
    "zero_optimization.reduce_bucket_size": (_HF, "from the model's hidden_size"),
    "zero_optimization.stage3_prefetch_bucket_size": (_HF, "from the model's hidden_size"),
    "zero_optimization.stage3_param_persistence_threshold": (_HF, "from the model's hidden_size"),
    "zero_optimization.stage": (_ACC, "from its zero_stage (default 2)"),
    "zero_optimization.offload_param.device": (_ACC, "from offload_param_device (default none: no offload)"),
    "zero_optimization.offload_optimizer.device": (
        _ACC,
        "from offload_optimizer_device (default none: no offload)",
    ),
    "zero_optimization.offload_param.nvme_path": (_ACC, "from offload_param_nvme_path"),
    "zero_optimization.offload_optimizer.nvme_path": (_ACC, "from offload_optimizer_nvme_path"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (_ACC, "from zero3_save_16bit_model"),
}


def auto_message(path: str, want: str = "a number") -> str:
    """Why ``"auto"`` at `path` (a dotted key path) is an error, and what to do:
    who would have filled it, or that nobody does."""
    filled = AUTO_FILLED.get(path)
    if filled is None:
        return (
            "'auto' is not filled in by anyone: the HF Trainer, Accelerate and Lightning "
            f"leave this key as written and DeepSpeed does not resolve it either; give {want} here"
        )
    return (
        f"'auto' was not resolved: {filled[0]} fills this key ({filled[1]}) when training "
        f"starts; this config is read as written, so give {want} here (the value the run will use)"
    )


def _unresolved_auto(v: Any, want: str = "a number") -> None:
    if isinstance(v, str) and v.strip().lower() == "auto":
        raise UnresolvedAuto(want)


def strict_int(v: Any) -> int:
    """A JSON integer: whole numbers, also written 1e8 (a JSON float). Refused,
    with a ValueError saying why: booleans, strings (DeepSpeed refuses "1e8"
    too), NaN/inf, fractions, and values beyond 64 bits."""
    _unresolved_auto(v)
    if isinstance(v, bool):
        raise ValueError(f"expected an integer, got the boolean {str(v).lower()}")
    if isinstance(v, str):
        raise ValueError(f"expected an integer, got the string {v!r}; write the number without quotes")
    if isinstance(v, numbers.Integral):
        n = int(v)
    elif isinstance(v, numbers.Real):
        f = float(v)
        if not math.isfinite(f):
            raise ValueError(f"expected a finite integer, got {f}")
        if not f.is_integer():
            raise ValueError(f"expected a whole number, got {f}")
        n = int(f)
    else:
        raise ValueError(f"expected an integer, got {type(v).__name__}")
    if not -(2**63) <= n < 2**63:
        raise ValueError(f"{n} is out of range (more than 64 bits)")
    return n


def strict_float(v: Any) -> float:
    """A finite JSON number; booleans, strings, NaN and inf are refused (ValueError)."""
    _unresolved_auto(v)
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got the boolean {str(v).lower()}")
    if isinstance(v, str):
        raise ValueError(f"expected a number, got the string {v!r}; write the number without quotes")
    if not isinstance(v, numbers.Real):
        raise ValueError(f"expected a number, got {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:  # an integer past any float
        raise ValueError(f"out of range: {str(v)[:12]}... has {len(str(v))} digits") from None
    if not math.isfinite(f):
        raise ValueError(f"expected a finite number, got {f}")
    return f


def _as_device(v: Any) -> Any:
    _unresolved_auto(v, "a device: none, cpu or nvme")
    if isinstance(v, str):
        return v.strip().lower()
    if v is None:
        return "none"
    return v


def _as_path(v: Any) -> Any:
    _unresolved_auto(v, "a directory on a local drive")
    if v is None:
        return None
    if isinstance(v, (str, os.PathLike)):
        s = os.fspath(v)
        if not s:
            raise ValueError("must not be empty")
        return s
    raise ValueError(f"expected a directory path, got {type(v).__name__}")


def _as_paths(v: Any) -> Any:
    """One directory (DeepSpeed's format) or a list of them, one per drive."""
    if isinstance(v, (list, tuple)):
        if not v:
            raise ValueError("an empty list: give a directory, or a list of directories (one per drive)")
        out = []
        for i, item in enumerate(v):
            try:
                out.append(_as_path(item))
            except ValueError as e:
                raise ValueError(f"item {i}: {e}") from None
            if out[-1] is None:
                raise ValueError(f"item {i}: expected a directory path, got None")
        twice = repeated_directory(out)  # the swappers' rule, aio.swap.drives
        if twice is not None:
            raise ValueError(f"{twice[0]!r} and {twice[1]!r} are the same directory; list each drive once")
        return out if len(out) > 1 else out[0]
    return _as_path(v)


Int = Annotated[int, BeforeValidator(strict_int)]
Device = Annotated[Literal["none", "cpu", "nvme"], BeforeValidator(_as_device)]
PathStr = Annotated[str | None, BeforeValidator(_as_path)]
PathList = Annotated[str | list[str] | None, BeforeValidator(_as_paths)]
Bool = Annotated[StrictBool, BeforeValidator(lambda v: (_unresolved_auto(v, "true or false"), v)[1])]
Ratio = Annotated[float, BeforeValidator(strict_float), Field(ge=0.0, le=1.0)]


class _Disagree:
    """``thread_count`` and ``intra_op_parallelism`` given with different
    values, handed from AioConfig's block validator to the field's own."""

    def __init__(self, thread_count: Any, intra_op_parallelism: Any) -> None:
        self.thread_count = thread_count
        self.intra_op_parallelism = intra_op_parallelism


# The largest block_size the I/O core (csrc/core) takes: 1 TiB.
MAX_BLOCK_SIZE = 1 << 40


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class AioConfig(_Block):
    """The top-level ``aio`` block: how the swappers' I/O is submitted."""

    block_size: Int = Field(
        1048576,
        gt=0,
        le=MAX_BLOCK_SIZE,
        description="bytes per submitted I/O (at most 1 TiB, the I/O core's limit)",
    )
    queue_depth: Int = Field(8, gt=0, le=65536, description="I/Os in flight per worker thread")
    intra_op_parallelism: Int = Field(
        1,
        gt=0,
        le=1024,
        validation_alias=AliasChoices("intra_op_parallelism", "thread_count"),
        description="worker threads; each request is split into this many slices",
    )
    single_submit: Bool = Field(False, description="one io_submit per I/O instead of per batch")
    overlap_events: Bool = Field(True, description="keep the queue full as completions arrive")
    use_gds: Bool = Field(False, description="GPUDirect Storage (DeepSpeed only; aio ignores it)")
    engine: Literal["auto", "kernel_aio", "io_uring", "posix"] = Field(
        "auto",
        description="aio's I/O engine (aio-sweep picks one; an aio-only key, DeepSpeed ignores it)",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_thread_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "thread_count" in data and "intra_op_parallelism" in data:
            rest = {k: v for k, v in data.items() if k not in ("thread_count", "intra_op_parallelism")}
            if data["thread_count"] != data["intra_op_parallelism"]:
                # Raising here would stop pydantic before the block's other keys
                # (only this conflict was reported): the field reports it instead.
                return {**rest, "thread_count": _Disagree(data["thread_count"], data["intra_op_parallelism"])}
            return {**rest, "intra_op_parallelism": data["intra_op_parallelism"]}
        return data

    @field_validator("intra_op_parallelism", mode="before")
    @classmethod
    def _threads_agree(cls, v: Any) -> Any:
        if isinstance(v, _Disagree):
            raise ValueError(
                "thread_count and intra_op_parallelism are the same setting and disagree "
                f"({v.thread_count} vs {v.intra_op_parallelism}); keep one "
                "(intra_op_parallelism is the name DeepSpeed reads)"
            )
        return v

    @field_validator("block_size")
    @classmethod
    def _block_multiple(cls, v: int) -> int:
        if v % 4096:
            raise ValueError(
                f"{v} is not a multiple of 4096; direct I/O moves whole blocks "
                "(try 262144, 1048576 or 4194304)"
            )
        return v

    @property
    def thread_count(self) -> int:
        """``intra_op_parallelism`` under the name :class:`aio.AsyncIOHandle` uses
        (also accepted as an input key for it)."""
        return self.intra_op_parallelism

    def handle_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`aio.AsyncIOHandle`."""
        return {
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            "single_submit": self.single_submit,
            "overlap_events": self.overlap_events,
            "thread_count": self.intra_op_parallelism,
            "engine": self.engine,
        }

    def to_deepspeed(self) -> dict[str, Any]:
        """The block as DeepSpeed 0.19 and aio.config both read it (real booleans)."""
        return {
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            "intra_op_parallelism": self.intra_op_parallelism,
            "single_submit": self.single_submit,
            "overlap_events": self.overlap_events,
            "use_gds": self.use_gds,
        }


class _OffloadBase(_Block):
    device: Device = Field("none", description="none | cpu | nvme")
    nvme_path: PathList = Field(
        None,
        description="directory on a fast local drive (device nvme), or a list of them, one per "
        "drive, to stripe over (aio.zero; DeepSpeed takes one)",
    )
    pin_memory: Bool = Field(True, description="page-locked CPU buffers")

    def nvme_dirs(self) -> list[str]:
        """``nvme_path`` as a list (one entry per drive; empty when unset)."""
        if self.nvme_path is None:
            return []
        return [self.nvme_path] if isinstance(self.nvme_path, str) else list(self.nvme_path)

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadBase:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("nvme_path: required when device is 'nvme' (a directory on a local drive)")
        return self


class OffloadParamConfig(_OffloadBase):
    """``zero_optimization.offload_param``: where parameter partitions live."""

    buffer_count: Int = Field(5, gt=0, description="pinned buffers for parameter swapping")
    buffer_size: Int = Field(100_000_000, gt=0, description="elements per parameter buffer")
    max_in_cpu: Int = Field(1_000_000_000, ge=0, description="elements kept in CPU memory")


class OffloadOptimizerConfig(_OffloadBase):
    """``zero_optimization.offload_optimizer``: where optimizer sub-groups live."""

    buffer_count: Int = Field(4, gt=0, description="pinned buffers for optimizer swapping")
    pipeline_read: Bool = Field(False, description="read sub-group i+1 during step of i")
    pipeline_write: Bool = Field(False, description="write sub-group i-1 during step of i")
    # Accepted (and validated) because DeepSpeed 0.19 reads them, so one
    # config serves both; aio reads none of them.
    fast_init: Bool = Field(False, description="DeepSpeed: skip the initial NVMe write (unused by aio)")
    ratio: Ratio = Field(1.0, description="DeepSpeed: fraction of the step on CPU (unused by aio)")
    super_offload: Bool = False
    cpuadam_cores_perc: Ratio = 0.8


class _NestedAio:
    """An ``aio`` block inside ``zero_optimization``, marked by ZeroConfig's
    block validator for its extra keys' validator to refuse."""


def _not_nested_aio(v: Any) -> Any:
    if isinstance(v, _NestedAio):
        raise ValueError(
            "the aio block belongs at the top level of the config, not inside "
            "zero_optimization (DeepSpeed silently ignores it there)"
        )
    return v


class ZeroConfig(BaseModel):
    """The parts of ``zero_optimization`` the offload path depends on; other
    ZeRO keys are DeepSpeed's business and pass through untouched."""

    model_config = ConfigDict(extra="allow", frozen=True)

    stage: Int = Field(0, ge=0, le=3)
    sub_group_size: Int = Field(1_000_000_000, gt=0, description="elements per optimizer sub-group")
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None

    # Other keys pass through as they are; an ``aio`` block here is refused by
    # its own validator, so pydantic still reports the block's other errors
    # (a model validator raising stopped it before them).
    __pydantic_extra__: dict[str, Annotated[Any, BeforeValidator(_not_nested_aio)]]

    @model_validator(mode="before")
    @classmethod
    def _no_nested_aio(cls, data: Any) -> Any:
        if isinstance(data, dict) and "aio" in data:
            return {**data, "aio": _NestedAio()}
        return data

    @model_validator(mode="after")
    def _param_offload_needs_stage3(self) -> ZeroConfig:
        p = self.offload_param
        if p is not None and p.device != "none" and self.stage != 3:
            raise ValueError(
                f"stage: offload_param with device '{p.device}' needs stage 3 "
                f"(parameter partitioning); this config has stage {self.stage}"
            )
        return self

    def param_device(self) -> str:
        """``offload_param.device``: ``none``, ``cpu`` or ``nvme`` (``none`` without the block)."""
        return self.offload_param.device if self.offload_param else "none"

    def optimizer_device(self) -> str:
        """``offload_optimizer.device``: ``none``, ``cpu`` or ``nvme`` (``none`` without the block)."""
        return self.offload_optimizer.device if self.offload_optimizer else "none"


class OffloadConfig(BaseModel):
    """What aio reads from a DeepSpeed config: the ``aio`` block and ``zero_optimization``."""

    model_config = ConfigDict(frozen=True)

    aio: AioConfig = Field(default_factory=lambda: AioConfig())
    zero_optimization: ZeroConfig = Field(default_factory=lambda: ZeroConfig())

    @property
    def offload_param(self) -> OffloadParamConfig | None:
        """``zero_optimization.offload_param``, or None when the config has none."""
        return self.zero_optimization.offload_param

    @property
    def offload_optimizer(self) -> OffloadOptimizerConfig | None:
        """``zero_optimization.offload_optimizer``, or None when the config has none."""
        return self.zero_optimization.offload_optimizer

    def nvme_paths(self) -> list[str]:
        """The distinct ``nvme_path`` of each offload block whose device is ``nvme``
        (parameters' first); empty when nothing goes to a drive."""
        out: list[str] = []
        for blk in (self.offload_param, self.offload_optimizer):
            if blk is not None and blk.device == "nvme":
                out.extend(p for p in blk.nvme_dirs() if p not in out)
        return out
