"""Offload training: DeepSpeed-format configs with ``offload_param`` /
``offload_optimizer`` ``device: nvme`` train a plain PyTorch model with its
parameters and optimizer state on the drive (see docs/zero.md)."""

from typing import Any

from .config import TrainConfig, load_train_config
from .init import Init
from .optimizer import ZeroOptimizer
from .params import ParamStore
from .trainer import OffloadTrainer, initialize


def register_external_parameter(module: Any, param: Any) -> None:
    """Declare that `module`'s forward uses `param`, a parameter owned by
    another module (so it is fetched for `module` too)."""
    ext = module.__dict__.setdefault("_aio_external_params", [])
    if all(p is not param for p in ext):
        ext.append(param)


__all__ = [
    "Init",
    "OffloadTrainer",
    "ParamStore",
    "TrainConfig",
    "ZeroOptimizer",
    "initialize",
    "load_train_config",
    "register_external_parameter",
]
