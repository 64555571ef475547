"""The training config aio.zero reads is :class:`aio.config.TrainConfig`
(loaded by :func:`aio.config.load_train_config`); this module adds the one
check that needs the machine: the drive folders exist."""

from __future__ import annotations

import os

from ..config import ConfigError, TrainConfig, load_train_config

__all__ = ["TrainConfig", "check_drive_paths", "load_train_config"]


def check_drive_paths(cfg: TrainConfig) -> None:
    """Every nvme_path directory (each drive of a list) must exist and be
    writable (checked before any allocation); the error names the key, the
    list position and the directory."""
    problems = []
    for key in ("offload_param", "offload_optimizer"):
        blk = getattr(cfg.offload, key)
        if blk is None or blk.device != "nvme":
            continue
        dirs = blk.nvme_dirs()
        for i, path in enumerate(dirs):
            where = f"zero_optimization.{key}.nvme_path" + (f"[{i}]" if len(dirs) > 1 else "")
            if not os.path.isdir(path):
                problems.append((where, f"{path} is not an existing directory"))
            elif not os.access(path, os.W_OK | os.X_OK):
                problems.append((where, f"{path} is not writable by this user"))
    if problems:
        raise ConfigError(problems)
