"""Pinned-memory and drive-space estimate for an offload config, before any
allocation, checked against this machine (psutil) on request.

What aio.zero page-locks (per process; see docs/memory.md), each buffer pool
or CPU-resident partition rounded up as locking it rounds it
(:func:`aio.pinned.locked_size`: whole pages, whole huge pages for large ones):

- parameters on nvme: ``buffer_count`` buffers of ``buffer_size`` elements of
  the model dtype, plus the parameters kept in CPU memory -- those smaller
  than ``stage3_param_persistence_threshold`` elements and the first
  ``max_in_cpu`` elements of the others (in model order) -- all locked only
  when ``pin_memory``; the drive holds the rest.
- optimizer on nvme: ``buffer_count`` buffers of ONE fp32 tensor of the
  largest sub-group each (DeepSpeed's meaning), locked when ``pin_memory``;
  the drive holds gradient, master weights and states of every sub-group;
  the fp32 gradients wait in CPU memory or on the drive as
  :func:`aio.config.gradients.place_gradients` decides
  (:meth:`MemoryEstimate.add_gradients`).
- device cpu: parameters are pinned by torch only for a GPU model (counted
  here when ``pin_memory``); the optimizer's state is never locked.

Exact when the parameter sizes are given (``param_numels``); from the total
alone, the largest sub-group is taken as ``largest_subgroup`` or else
``min(sub_group_size, num_params)``, and CPU-resident parameters as
``min(max_in_cpu, num_params)`` elements.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .load import ConfigError, ConfigSource, load_config
from .models import UnresolvedAuto, auto_message, strict_int

if TYPE_CHECKING:
    from .gradients import GradientPlacement

_ALIGN = 4096  # swap-file extents and optimizer tensors are whole 4 KiB blocks
_THRESHOLD_KEY = "zero_optimization.stage3_param_persistence_threshold"


def _page() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
        return 4096


def _round(n: int, a: int) -> int:
    return -(-n // a) * a


def _locked(nbytes: int) -> int:
    """What locking one allocation of `nbytes` locks (aio.pinned.locked_size)."""
    from ..pinned import locked_size  # the extension's rule; imported only to estimate

    return locked_size(nbytes)


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


def format_bytes(n: float) -> str:
    """`n` bytes for people: ``512 B``, ``1.5 KiB`` ... ``2.0 TiB``."""
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
    gradients: GradientPlacement | None = None  # set by add_gradients()
    # What the process holds at its peak besides the buffers: the runtime,
    # the largest tensors in use at once, the model's activations (if given).
    working: dict[str, int] = field(default_factory=dict)
    # Drive space of the optimizer's fp32 gradient slots, by nvme_path (in
    # ``nvme`` until add_gradients() keeps the gradients in memory).
    gradient_slots: dict[str, int] = field(default_factory=dict)

    def add_gradients(self, placement: GradientPlacement) -> None:
        """Count aio.zero's fp32 gradients as `placement` puts them: in CPU
        memory (and then not on the drive: aio.zero's swapped optimizer leaves
        their slots out), or on the drive, 8 bytes more per parameter of the
        optimizer's traffic; with the optimizer in CPU memory they are already
        counted there."""
        self.gradients = placement
        if placement.setting != "optimizer in memory" and placement.where == "cpu":
            self.cpu["fp32 gradients (aio_zero.gradients)"] = placement.nbytes
            for path, n in self.gradient_slots.items():
                self.nvme[path] -= n
            self.gradient_slots = {}

    @property
    def pinned_bytes(self) -> int:
        """Page-locked CPU memory in all, in bytes."""
        return sum(self.pinned.values())

    @property
    def cpu_bytes(self) -> int:
        """CPU memory in all, in bytes, the pinned part included."""
        return sum(self.cpu.values()) + self.pinned_bytes

    @property
    def held_bytes(self) -> int:
        """What aio.zero itself holds at its peak: the predicted peak RSS but
        the model's activations (the host-memory budget's share for aio)."""
        return self.peak_rss_bytes - self.working.get("activations", 0)

    @property
    def peak_rss_bytes(self) -> int:
        """The predicted peak resident set of a process training with this
        config: every buffer and CPU-resident tensor above, plus the working
        set (runtime, the largest sub-group's temporaries, activations)."""
        return self.cpu_bytes + sum(self.working.values())

    def check(self) -> list[str]:
        """Problems this machine would have with the estimate (empty if none)."""
        import psutil

        out: list[str] = []
        avail = psutil.virtual_memory().available
        if self.peak_rss_bytes > avail:
            out.append(
                f"needs {format_bytes(self.peak_rss_bytes)} of CPU memory at its peak "
                f"({format_bytes(self.pinned_bytes)} pinned) "
                f"but only {format_bytes(avail)} is available"
            )
        try:
            import resource

            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            privileged = os.geteuid() == 0
            if not privileged and soft != resource.RLIM_INFINITY and self.pinned_bytes > soft:
                out.append(
                    f"needs {format_bytes(self.pinned_bytes)} of locked memory but RLIMIT_MEMLOCK is "
                    f"{format_bytes(soft)} (raise ulimit -l, or set pin_memory false)"
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
                out.append(f"{path}: needs {format_bytes(need)} of drive space, {format_bytes(free)} free")
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
        lines.append(f"pinned CPU memory per process: {format_bytes(self.pinned_bytes)}")
        for k, v in self.pinned.items():
            lines.append(f"  {k:34s} {format_bytes(v):>12s}")
        if self.cpu:
            lines.append(f"other CPU memory: {format_bytes(sum(self.cpu.values()))}")
            for k, v in self.cpu.items():
                lines.append(f"  {k:34s} {format_bytes(v):>12s}")
        for path, v in self.nvme.items():
            lines.append(f"drive space under {path}: {format_bytes(v)}")
        if self.gradients is not None:
            lines.append(f"fp32 gradients: {self.gradients.where} ({self.gradients.reason})")
        if self.working:
            lines.append(f"predicted peak RSS: {format_bytes(self.peak_rss_bytes)} (the memory above, plus)")
            for k, v in self.working.items():
                lines.append(f"  {k:34s} {format_bytes(v):>12s}")
            if "activations" not in self.working:
                lines.append("  (the model's activations are not counted: give them with --activations)")
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
            "gradients": None if self.gradients is None else self.gradients.as_dict(),
            "working": dict(self.working),
            "peak_rss_bytes": self.peak_rss_bytes,
        }


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    if isinstance(v, float) and not v.is_integer():
        raise ValueError(f"{name} must be a whole number, got {v}")
    if int(v) <= 0:
        raise ValueError(f"{name} must be positive, got {v}")
    return int(v)


def _persistence_threshold(z: Any) -> int:
    """``stage3_param_persistence_threshold`` (elements), DeepSpeed's default 1e5."""
    v = getattr(z, "stage3_param_persistence_threshold", None)
    if v is None:
        # A plain OffloadConfig keeps the key unchecked (DeepSpeed's business); check it here.
        v = (z.model_extra or {}).get("stage3_param_persistence_threshold", 100_000)
    try:
        n = strict_int(v)
    except UnresolvedAuto as e:
        raise ConfigError([(_THRESHOLD_KEY, auto_message(_THRESHOLD_KEY, e.want))]) from None
    except ValueError as e:
        raise ConfigError([(_THRESHOLD_KEY, str(e))]) from None
    if n < 0:
        raise ConfigError([(_THRESHOLD_KEY, f"must be 0 or more, got {n}")])
    return n


# (size, count): `count` consecutive parameters of `size` elements, in model
# order. A model's sizes as runs cost O(distinct runs), not O(tensors).
NumelRuns = list[tuple[int, int]]


def numel_runs(param_numels: Iterable[int]) -> NumelRuns:
    """`param_numels` (model order) as runs of equal consecutive sizes."""
    return [(n, len(list(same))) for n, same in itertools.groupby(param_numels)]


def largest_subgroup(param_numels: list[int], sub_group_size: int) -> int:
    """Elements of the largest optimizer sub-group aio.zero packs `param_numels`
    (model order) into: a sub-group is closed when the next parameter would
    take it past `sub_group_size`."""
    return _largest_subgroup_runs(numel_runs(param_numels), sub_group_size)


def _largest_subgroup_runs(runs: NumelRuns, sub_group_size: int) -> int:
    """:func:`largest_subgroup` of parameters given as runs, one step per run."""
    best = cur = 0
    for n, k in runs:
        if cur:  # the open sub-group takes what still fits, then closes
            t = min(k, max(0, (sub_group_size - cur) // n))
            cur, k = cur + t * n, k - t
            best = max(best, cur)
            if not k:
                continue
        per = max(1, sub_group_size // n)  # a parameter larger than a sub-group is one alone
        full, rest = divmod(k, per)
        if full:
            best = max(best, per * n)
        cur = rest * n if rest else per * n
        best = max(best, cur)
    return best


def _param_residency(runs: NumelRuns, threshold: int, max_in_cpu: int, b: int) -> tuple[int, int, int]:
    """(bytes locked for CPU-resident parameters if pinned, elements resident,
    parameters on the drive) under ParamSwapper's rules."""
    locked = resident = on_drive = 0
    full = False
    for n, k in runs:  # each resident partition is an allocation of its own
        if n < threshold:  # small: always resident, and not counted against max_in_cpu
            locked += k * _locked(n * b)
            continue
        t = 0 if full else min(k, max(0, (max_in_cpu - resident) // n))
        locked += t * _locked(n * b)
        resident += t * n
        if t < k:  # the first that does not fit sends it and all later ones to the drive
            full = True
            on_drive += k - t
    return locked, resident, on_drive


def estimate_memory(
    config: ConfigSource,
    num_params: int | float | None,
    dtype: Any = "fp16",
    optimizer_states: int = 2,
    *,
    largest_subgroup_numel: int | float | None = None,
    param_numels: list[int] | None = None,
    param_numel_runs: NumelRuns | None = None,
    state_bytes: int = 4,
    activation_bytes: int | None = None,
    runtime_bytes: int | None = None,
) -> MemoryEstimate:
    """Pinned bytes per process and drive space per ``nvme_path`` for `config`.

    ``num_params``: parameters this process holds (its partition, for ZeRO-3
    over several ranks); 1e9-style floats are accepted; None when
    `param_numels` is given. ``dtype``: the parameters' training dtype.
    ``optimizer_states``: fp32 state tensors per parameter (Adam: 2).
    ``largest_subgroup_numel``: elements of the largest optimizer sub-group
    (default: from `param_numels`, else ``min(sub_group_size, num_params)``).
    ``param_numels``: every parameter's element count in model order, for an
    exact figure (what ``trainer.pinned_bytes()`` reports after a step).
    ``param_numel_runs``: the same as ``(size, count)`` runs in model order
    (``aio-config estimate --param-numels 1048576x8``), instead of it.
    ``state_bytes``: bytes of each state on the drive (2 with
    ``aio_zero.optimizer_states: bf16``; the buffers stay float32).
    ``activation_bytes``: what the model's forward saves for backward at
    the batch trained, counted in the predicted peak RSS (None: not known,
    and said so; :func:`aio.train.gpt_activation_bytes` for aio-train's GPT).
    ``runtime_bytes``: the interpreter, torch and aio in the peak RSS
    (default :data:`RUNTIME_BYTES`, the CPU wheel's;
    :func:`measured_runtime_bytes` in the process that will train).
    """
    cfg = load_config(config)
    numels = _checked_runs(param_numels, param_numel_runs)
    if num_params is None:
        if numels is None:
            raise ValueError("give num_params or param_numels (or param_numel_runs)")
        num_params = sum(n * k for n, k in numels)
    n = _positive_int("num_params", num_params)
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise ValueError(f"optimizer_states must be an int >= 0, got {optimizer_states!r}")
    b = dtype_bytes(dtype)
    est = MemoryEstimate(num_params=n, dtype_bytes=b)
    _estimate_params(est, cfg.zero_optimization, numels)
    z = cfg.zero_optimization
    if largest_subgroup_numel is not None:
        sub = _positive_int("largest_subgroup_numel", largest_subgroup_numel)
        if sub > n:  # a sub-group holds some of the parameters: 9e15 of 1e9 was 130967 TiB pinned
            raise ValueError(f"largest_subgroup_numel ({sub:,}) is more than num_params ({n:,})")
    elif numels is not None:
        sub = _largest_subgroup_runs(numels, z.sub_group_size)
    else:
        sub = min(z.sub_group_size, n)
    if state_bytes not in (2, 4):
        raise ValueError(f"state_bytes must be 2 (bf16 states) or 4, got {state_bytes!r}")
    _estimate_optimizer(est, z, sub, optimizer_states, state_bytes)
    _estimate_working(est, sub, numels, activation_bytes)
    if runtime_bytes is not None:
        est.working["runtime (python, torch, aio)"] = _positive_int("runtime_bytes", runtime_bytes)
    return est


def _checked_runs(numels: list[int] | None, runs: NumelRuns | None) -> NumelRuns | None:
    """`numels` or `runs` (at most one) as runs of positive sizes and counts."""
    if numels is not None and runs is not None:
        raise ValueError("give param_numels or param_numel_runs, not both")
    if numels is not None:
        runs = numel_runs(_positive_int("param_numels[]", n) for n in numels)
    if runs is None:
        return None
    return [(_positive_int("param_numels[]", n), _positive_int("param_numel_runs count", k)) for n, k in runs]


# The resident memory of a process training with aio.zero besides its buffers
# and tensors: the interpreter, torch, aio, their threads and allocator pools.
# Measured: aio-train's peak on a 4.8M-parameter model (426 MiB) less its
# 50 MiB of buffers and 18 MiB of gradients, rounded down to 350 MiB (python
# with torch and aio imported alone: 232 MiB) -- on torch's CPU wheel. A
# CUDA build of torch maps far more library pages (aio-train's peak there:
# 790 MiB), so a process that has torch imported measures its own:
# measured_runtime_bytes().
RUNTIME_BYTES = 350 << 20
# What training adds to the runtime beyond the imports: threads' stacks and
# arenas, the allocator's pools, library pages first touched by a step.
RUNTIME_TRAINING_EXTRA = (350 - 232) << 20


def measured_runtime_bytes() -> int:
    """The runtime term for a process that has torch (and aio) imported:
    its resident memory now plus what training adds
    (:data:`RUNTIME_TRAINING_EXTRA`), so the estimate follows the torch
    build it runs on; :data:`RUNTIME_BYTES` where it cannot be read."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss) + RUNTIME_TRAINING_EXTRA
    except Exception:  # noqa: BLE001 - no /proc (a sandbox): the CPU wheel's figure
        return RUNTIME_BYTES


def _estimate_working(
    est: MemoryEstimate, sub: int, numels: NumelRuns | None, activations: int | None
) -> None:
    """The transient part of the peak. At any moment aio.zero holds about
    three fp32 copies of its largest sub-group outside the pools: the
    master weights made at set-up (bf16/fp16 parameters, or master weights
    in memory), or in a step the parameter values made from them; in backward
    a parameter's gradient and its accumulation (a parameter is never
    larger than its sub-group)."""
    est.working["runtime (python, torch, aio)"] = RUNTIME_BYTES
    largest = max(n for n, _ in numels) if numels else sub
    est.working["largest tensors in use (3 x fp32)"] = 4 * (sub + 2 * min(largest, sub))
    if activations is not None:
        if isinstance(activations, bool) or not isinstance(activations, int) or activations < 0:
            raise ValueError(f"activation_bytes must be an int >= 0, got {activations!r}")
        est.working["activations"] = activations


def _shares(dirs: list[str], nbytes: int) -> dict[str, int]:
    """`nbytes` of drive space striped evenly over the directories of one nvme_path."""
    return {path: nbytes // len(dirs) + (1 if i < nbytes % len(dirs) else 0) for i, path in enumerate(dirs)}


def _spread(est: MemoryEstimate, dirs: list[str], nbytes: int) -> None:
    """Drive bytes striped evenly over the directories of one nvme_path."""
    for path, share in _shares(dirs, nbytes).items():
        est.nvme[path] = est.nvme.get(path, 0) + share


def _estimate_params(est: MemoryEstimate, z: Any, numels: NumelRuns | None) -> None:
    p, n, b = z.offload_param, est.num_params, est.dtype_bytes
    if p is not None and p.device == "nvme":
        bucket = est.pinned if p.pin_memory else est.cpu
        if numels is not None:
            locked, resident, on_drive = _param_residency(numels, _persistence_threshold(z), p.max_in_cpu, b)
        else:
            resident = min(p.max_in_cpu, n)
            locked, on_drive = _locked(resident * b), int(resident < n)
        if on_drive:  # the buffers (one pool) are allocated at the first read from the drive
            bucket["offload_param buffers"] = _locked(p.buffer_count * _round(p.buffer_size * b, _page()))
        if locked:
            bucket["offload_param in CPU (max_in_cpu, small)"] = locked
        _spread(est, p.nvme_dirs(), (n - resident) * b)
    elif p is not None and p.device == "cpu":
        key = "offload_param (all in CPU; pinned for a GPU model)"
        (est.pinned if p.pin_memory else est.cpu)[key] = n * b


def _estimate_optimizer(est: MemoryEstimate, z: Any, sub: int, states: int, state_bytes: int) -> None:
    o, n = z.offload_optimizer, est.num_params
    if o is not None and o.device == "nvme":
        slot = _round(_round(sub * 4, _ALIGN), _page())
        bucket = est.pinned if o.pin_memory else est.cpu
        bucket["offload_optimizer buffers"] = _locked(o.buffer_count * slot)
        # master, the states as stored, and the fp32 gradient slot (which
        # add_gradients() takes back when the gradients stay in memory)
        _spread(est, o.nvme_dirs(), n * (4 + state_bytes * states))
        est.gradient_slots = _shares(o.nvme_dirs(), n * 4)
        for path, share in est.gradient_slots.items():
            est.nvme[path] = est.nvme.get(path, 0) + share
    elif o is not None and o.device == "cpu":
        est.cpu["offload_optimizer (all in CPU)"] = n * 4 * (2 + states)
