"""Where fp32 gradients wait for the optimizer step (``aio_zero.gradients``).

With the optimizer on NVMe, each sub-group's fp32 gradient is either held in
CPU memory until its step (``cpu``: 4 bytes per trainable parameter, no I/O,
as DeepSpeed does) or gathered in a pinned buffer, written to the drive and
read back by the step (``nvme``: 8 more bytes of I/O per parameter per step).
``auto`` (the default) keeps them in memory only while they fit the host
budget (``aio_zero.host_memory_budget``) together with what else aio.zero
holds in CPU memory at its peak (pinned pools, resident parameters, the
runtime and the largest tensors in use: ``MemoryEstimate.held_bytes``), so that host memory
is set by the config, not by the model's size. One function decides, for the
engine and for ``aio-config estimate`` alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .memory import format_bytes

GRADIENT_BYTES = 4  # fp32 per trainable parameter


@dataclass(frozen=True)
class GradientPlacement:
    """The decision: ``where`` ("cpu" or "nvme"), from ``setting`` (the
    ``aio_zero.gradients`` value, or "optimizer in memory"), the fp32 gradient
    bytes, the host-memory budget in bytes, the other CPU bytes counted
    against it, and why."""

    where: str
    setting: str
    nbytes: int
    budget: int
    other_bytes: int
    reason: str

    @property
    def in_memory_bytes(self) -> int:
        """Bytes of gradients held in CPU memory (0 on the drive)."""
        return self.nbytes if self.where == "cpu" else 0

    @property
    def over_budget(self) -> bool:
        """Whether the gradients held in memory take aio.zero past its budget."""
        return self.other_bytes + self.in_memory_bytes > self.budget

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready plain data."""
        return {
            "where": self.where,
            "setting": self.setting,
            "bytes": self.nbytes,
            "budget": self.budget,
            "other_bytes": self.other_bytes,
            "reason": self.reason,
        }


def host_memory_budget(setting: float, available: int | None = None) -> int:
    """``aio_zero.host_memory_budget`` in bytes: a fraction (<= 1) of `available`
    (default: this machine's available memory now), or bytes."""
    if setting > 1:
        return int(setting)
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    return int(setting * available)


def place_gradients(
    cfg: Any, trainable_numel: int, other_bytes: int, available: int | None = None
) -> GradientPlacement:
    """Where `cfg` (a :class:`aio.config.TrainConfig`) puts the fp32 gradients
    of `trainable_numel` parameters, given `other_bytes` of CPU memory aio.zero
    holds besides them; `available`: the memory a fraction budget is taken of
    (default: psutil's available memory now)."""
    setting = cfg.aio_zero.host_memory_budget
    budget = host_memory_budget(setting, available)
    nbytes = GRADIENT_BYTES * trainable_numel
    what = f"aio_zero.host_memory_budget {setting:g}" + ("" if setting > 1 else " of available memory")
    o = cfg.zero_optimization.offload_optimizer
    if o is None or o.device != "nvme":
        why = "the optimizer is in CPU memory, its gradients too"
        return GradientPlacement("cpu", "optimizer in memory", nbytes, budget, other_bytes, why)
    choice = cfg.aio_zero.gradients
    if choice != "auto":
        return GradientPlacement(choice, choice, nbytes, budget, other_bytes, f"aio_zero.gradients: {choice}")
    sizes = f"{format_bytes(nbytes)} of gradients + {format_bytes(other_bytes)}"
    if other_bytes + nbytes <= budget:
        why = f"auto: {sizes} fit the budget of {format_bytes(budget)} ({what})"
        return GradientPlacement("cpu", "auto", nbytes, budget, other_bytes, why)
    why = (
        f"auto: {sizes} exceed the budget of {format_bytes(budget)} ({what}); "
        "8 more bytes of drive I/O per parameter per step"
    )
    return GradientPlacement("nvme", "auto", nbytes, budget, other_bytes, why)


def warn_if_over_budget(placement: GradientPlacement, stacklevel: int = 2) -> None:
    """A UserWarning when what aio.zero holds in CPU memory goes past the budget:
    an explicit ``gradients: cpu``, or buffers too large even with the gradients
    on the drive (``auto`` never puts gradients past it)."""
    import warnings

    budget = format_bytes(placement.budget)
    if placement.setting == "cpu" and placement.over_budget:
        msg = (
            f"aio_zero.gradients: 'cpu' holds {format_bytes(placement.nbytes)} of fp32 gradients in "
            f"memory, with {format_bytes(placement.other_bytes)} of aio.zero's buffers past the "
            f"host-memory budget of {budget} (aio_zero.host_memory_budget); 'auto' would put them "
            "on the drive"
        )
    elif placement.setting in ("auto", "nvme") and placement.other_bytes > placement.budget:
        msg = (
            f"aio.zero's buffers, resident parameters and working set take "
            f"{format_bytes(placement.other_bytes)} of CPU memory, past the host-memory budget of "
            f"{budget} (aio_zero.host_memory_budget) even "
            "with the gradients on the drive: lower the offload buffer_count/buffer_size or max_in_cpu"
        )
    else:
        return
    # Not ResourceWarning: Python hides those by default.
    warnings.warn(msg, UserWarning, stacklevel=stacklevel + 1)
