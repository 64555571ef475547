"""The training config aio.zero reads is :class:`aio.config.TrainConfig`
(loaded by :func:`aio.config.load_train_config`); this module adds the one
check that needs the machine: the drive folders exist."""

from __future__ import annotations

import os

from ..config import ConfigError, TrainConfig, load_train_config

__all__ = ["TrainConfig", "check_drive_paths", "load_train_config"]


def check_drive_paths(cfg: TrainConfig) -> None:
    """Every nvme_path must be an existing directory (checked before any allocation)."""
    problems = []
    for key in ("offload_param", "offload_optimizer"):
        blk = getattr(cfg.offload, key)
        if blk is not None and blk.device == "nvme" and not os.path.isdir(str(blk.nvme_path)):
            problems.append(
                (f"zero_optimization.{key}.nvme_path", f"{blk.nvme_path} is not an existing directory")
            )
    if problems:
        raise ConfigError(problems)
