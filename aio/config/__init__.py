"""DeepSpeed-format configuration: typed models, loading with key-path
errors, Lightning keyword mapping, and a pinned-memory estimate."""

from .lightning import from_lightning
from .load import ConfigError, load_config
from .memory import MemoryEstimate, dtype_bytes, estimate_memory
from .models import (
    AioConfig,
    OffloadConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
)

__all__ = [
    "AioConfig",
    "ConfigError",
    "MemoryEstimate",
    "OffloadConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroConfig",
    "dtype_bytes",
    "estimate_memory",
    "from_lightning",
    "load_config",
]
