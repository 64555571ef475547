"""DeepSpeed-format configuration: typed models, loading with key-path
errors, the training config aio.zero reads, Lightning keyword mapping, and a
pinned-memory estimate."""

from .lightning import from_lightning, lightning_config
from .load import ConfigError, load_config, read_config_data
from .memory import MemoryEstimate, dtype_bytes, estimate_memory
from .models import (
    AioConfig,
    OffloadConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
)
from .train import (
    Fp16Config,
    OptimizerConfig,
    PrecisionConfig,
    TrainConfig,
    TrainZeroConfig,
    discover_state_spec,
    load_train_config,
)

__all__ = [
    "AioConfig",
    "ConfigError",
    "Fp16Config",
    "MemoryEstimate",
    "OffloadConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "TrainConfig",
    "TrainZeroConfig",
    "ZeroConfig",
    "discover_state_spec",
    "dtype_bytes",
    "estimate_memory",
    "from_lightning",
    "lightning_config",
    "load_config",
    "load_train_config",
    "read_config_data",
]
