"""Pinned-memory and drive-space estimate for an offload config, before any
allocation, checked against this machine (psutil) on request.

Model (per process):
- parameters on nvme: ``buffer_count x buffer_size`` elements of the model
  dtype in pinned buffers, plus ``min(max_in_cpu, num_params)`` elements kept
  resident in CPU memory (pinned when ``pin_memory``); the drive holds every
  parameter once.
- optimizer on nvme: ``buffer_count`` pinned buffers, each holding one
  sub-group's fp32 master weights, gradient and optimizer states (Adam: 2),
  i.e. ``min(sub_group_size, num_params) x 4 x (2 + states)`` bytes; the drive
  holds that for every parameter.
- device cpu keeps the same state in (pinned if asked) CPU memory instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .load import ConfigSource, load_config

_DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "float": 4,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp64": 8,
    "float64": 8,
    "double": 8,
    "int8": 1,
    "uint8": 1,
}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element for 'fp16'/'bf16'/'fp32'..., a torch dtype or an int."""
    if isinstance(dtype, bool):
        raise TypeError("dtype must be a name, a torch dtype or a byte count")
    if isinstance(dtype, int):
        if dtype <= 0:
            raise ValueError(f"dtype byte count must be positive, got {dtype}")
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key not in _DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; accepted: {', '.join(sorted(_DTYPE_BYTES))}")
        return _DTYPE_BYTES[key]
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int) and itemsize > 0:
        return itemsize
    raise TypeError(f"dtype must be a name, a torch dtype or a byte count, got {dtype!r}")


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


@dataclass
class MemoryEstimate:
    """The result of :func:`estimate_memory` for one process, all sizes in bytes:
    ``pinned`` (page-locked) and ``cpu`` (ordinary CPU memory) by component,
    ``nvme`` (drive space) by ``nvme_path``."""

    num_params: int
    dtype_bytes: int
    pinned: dict[str, int] = field(default_factory=dict)  # component -> pinned bytes
    cpu: dict[str, int] = field(default_factory=dict)  # component -> unpinned CPU bytes
    nvme: dict[str, int] = field(default_factory=dict)  # nvme_path -> bytes on the drive

    @property
    def pinned_bytes(self) -> int:
        """Page-locked CPU memory in all, in bytes."""
        return sum(self.pinned.values())

    @property
    def cpu_bytes(self) -> int:
        """CPU memory in all, in bytes, the pinned part included."""
        return sum(self.cpu.values()) + self.pinned_bytes

    def check(self) -> list[str]:
        """Problems this machine would have with the estimate (empty if none)."""
        import psutil

        out: list[str] = []
        avail = psutil.virtual_memory().available
        if self.cpu_bytes > avail:
            out.append(
                f"needs {_fmt(self.cpu_bytes)} of CPU memory ({_fmt(self.pinned_bytes)} pinned) "
                f"but only {_fmt(avail)} is available"
            )
        try:
            import resource

            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            privileged = os.geteuid() == 0
            if not privileged and soft != resource.RLIM_INFINITY and self.pinned_bytes > soft:
                out.append(
                    f"needs {_fmt(self.pinned_bytes)} of locked memory but RLIMIT_MEMLOCK is "
                    f"{_fmt(soft)} (raise ulimit -l, or set pin_memory false)"
                )
        except (ImportError, OSError):  # pragma: no cover - non-Linux
            pass
        for path, need in self.nvme.items():
            probe = path
            while probe and not os.path.exists(probe):
                probe = os.path.dirname(probe.rstrip("/")) or "/"
            if not probe:
                continue
            free = psutil.disk_usage(probe).free
            if need > free:
                out.append(f"{path}: needs {_fmt(need)} of drive space, {_fmt(free)} free")
        return out

    def warn(self) -> list[str]:
        """Issue a ResourceWarning for each problem from check(); return them."""
        import warnings

        problems = self.check()
        for p in problems:
            warnings.warn(f"aio memory estimate: {p}", ResourceWarning, stacklevel=2)
        return problems

    def format(self) -> str:
        """A multi-line, human-readable report (sizes in B/KiB/MiB/GiB/TiB)."""
        lines = [f"{self.num_params:,} parameters, {self.dtype_bytes} bytes each"]
        lines.append(f"pinned CPU memory per process: {_fmt(self.pinned_bytes)}")
        for k, v in self.pinned.items():
            lines.append(f"  {k:34s} {_fmt(v):>12s}")
        if self.cpu:
            lines.append(f"other CPU memory: {_fmt(sum(self.cpu.values()))}")
            for k, v in self.cpu.items():
                lines.append(f"  {k:34s} {_fmt(v):>12s}")
        for path, v in self.nvme.items():
            lines.append(f"drive space under {path}: {_fmt(v)}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The estimate as JSON-ready plain data (sizes in bytes), with the
        ``pinned_bytes`` and ``cpu_bytes`` totals added."""
        return {
            "num_params": self.num_params,
            "dtype_bytes": self.dtype_bytes,
            "pinned": dict(self.pinned),
            "cpu": dict(self.cpu),
            "nvme": dict(self.nvme),
            "pinned_bytes": self.pinned_bytes,
            "cpu_bytes": self.cpu_bytes,
        }


def estimate_memory(
    config: ConfigSource, num_params: int | float, dtype: Any = "fp16", optimizer_states: int = 2
) -> MemoryEstimate:
    """Pinned bytes per process and drive space per ``nvme_path`` for `config`.

    ``num_params``: parameters this process holds (its partition, for ZeRO-3
    over several ranks); 1e9-style floats are accepted. ``dtype``: the
    parameters' compute dtype. ``optimizer_states``: fp32 state tensors per
    parameter (Adam: 2).
    """
    cfg = load_config(config)
    if isinstance(num_params, bool) or not isinstance(num_params, (int, float)):
        raise TypeError(f"num_params must be a number, got {type(num_params).__name__}")
    if isinstance(num_params, float) and not num_params.is_integer():
        raise ValueError(f"num_params must be a whole number, got {num_params}")
    n = int(num_params)
    if n <= 0:
        raise ValueError(f"num_params must be positive, got {num_params}")
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise ValueError(f"optimizer_states must be an int >= 0, got {optimizer_states!r}")
    b = dtype_bytes(dtype)
    est = MemoryEstimate(num_params=n, dtype_bytes=b)
    z = cfg.zero_optimization

    p = z.offload_param
    if p is not None and p.device == "nvme":
        bucket = est.pinned if p.pin_memory else est.cpu
        bucket["offload_param buffers"] = p.buffer_count * p.buffer_size * b
        resident = min(p.max_in_cpu, n) * b
        if resident:
            bucket["offload_param max_in_cpu"] = resident
        path = str(p.nvme_path)
        est.nvme[path] = est.nvme.get(path, 0) + n * b
    elif p is not None and p.device == "cpu":
        (est.pinned if p.pin_memory else est.cpu)["offload_param (all in CPU)"] = n * b

    o = z.offload_optimizer
    per_elem = 4 * (2 + optimizer_states)  # fp32 master + gradient + states
    if o is not None and o.device == "nvme":
        sub = min(z.sub_group_size, n)
        bucket = est.pinned if o.pin_memory else est.cpu
        bucket["offload_optimizer buffers"] = o.buffer_count * sub * per_elem
        path = str(o.nvme_path)
        est.nvme[path] = est.nvme.get(path, 0) + n * per_elem
    elif o is not None and o.device == "cpu":
        (est.pinned if o.pin_memory else est.cpu)["offload_optimizer (all in CPU)"] = n * per_elem
    return est
