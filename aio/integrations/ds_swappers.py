"""aio's buffer rules inside DeepSpeed's own ZeRO-3 NVMe swappers.

DeepSpeed's parameter swapper and pipelined optimizer swapper assert when
their fixed pools of ``buffer_count`` pinned buffers run short (project
issue 43, DeepSpeed issue #3062), in configs users actually run (HF's
documented ZeRO-3 NVMe block):

- ``Not enough buffers 0 for swapping 1`` (partitioned_param_swapper.py:310):
  every parameter reused within ``stage3_max_reuse_distance`` stays gathered
  and keeps its swap buffer until it is released, and nothing holds that
  against ``buffer_count``;
- ``param N already assigned swap buffer id M`` (:185): the coordinator's
  NVMe prefetch lists a parameter twice when it recurs in its window;
- ``assert new_alloc_buffers is not None`` (pipelined_optimizer_swapper.py:219)
  and ``ran out of swap buffers`` (:253): Adam's first-step state and the
  read-ahead ask for buffers that the current sub-group, the read-ahead and
  the pending write hold.

Replacing DeepSpeed's swappers with aio.swap's does not fit (stage3.py owns
the sub-group loop, the checkpoint is a copy of the swap folder), so these
subclasses keep DeepSpeed's files, checkpoints and call protocol and change
only who gets a buffer when:

:class:`EvictingParamSwapper` (``AsyncPartitionedParameterSwapper``):
    ``swap_in`` takes each parameter once; when buffers are short it gives
    back the buffer of a *gathered* parameter (``ds_status`` AVAILABLE: its
    data has been copied out; on a device, only once a recorded event says
    the device copy that read it is done) after copying the partition to
    ordinary memory (the partition stays AVAILABLE, so the coordinator never
    reads it again while gathered), then drops prefetched partitions nobody
    gathers now, then waits for reads in flight, and only then raises
    (``ValueError`` naming ``offload_param.buffer_count``).
    ``available_swap_in_buffers`` counts the buffers gathered parameters
    could give back, so the NVMe prefetch keeps reading ahead.
    What it keeps in ordinary memory is capped (:func:`held_cap`:
    ``aio_zero.host_memory_budget``, by default half the memory available
    when the swapper is built, shared by the ranks of the node); past the
    cap a gathered partition whose parameter holds its own copy (several
    ranks, or a device) is *released* instead (NOT_AVAILABLE; the drive has
    it; not read ahead again while gathered), and one whose parameter is a
    view of the buffer (one rank on the CPU) keeps its buffer: a gather that
    then finds none raises (a ValueError naming the cap), never waits for a
    buffer nothing would free.
    Overrides: ``available_swap_in_buffers``, ``swap_in``,
    ``_allocate_and_return_buffers_for_swap_in``, ``get_buffer``,
    ``swap_into_buffer``, ``swap_out_and_release`` (a partition updated in
    its ordinary-memory copy, by ``GatheredParameters(modifier_rank=...)``,
    gets a buffer back to be written), ``remove_partition_and_release_buffers``
    (lands reads in flight first, forgets the copy), ``reserve_available_buffers``.

:class:`BackpressurePipelinedOptimizerSwapper` (``PipelinedOptimizerSwapper``):
    reads ahead only into free buffers (keeping room for the state Adam
    creates at its first step), completes the pending write early, and drops
    the read-ahead, when a sub-group's swap-in or its first-step swap-out
    needs a buffer; raises only if one sub-group alone needs more than
    ``offload_optimizer.buffer_count``. It also releases the optimizer state
    Adam creates in ordinary memory at a sub-group's first step once the
    write of its copy has completed (DeepSpeed keeps it until the next
    swap-in: 8 bytes per parameter after step 1). Overrides:
    ``swap_in_optimizer_state``, ``_swap_out_optimizer_state``,
    ``_complete_swap_out``.

:func:`install` puts them at DeepSpeed's two construction sites
(``partition_parameters.AsyncPartitionedParameterSwapper``,
``stage3.PipelinedOptimizerSwapper``) and wraps
``Init._ensure_availability_of_partitioned_params`` so the parameter swapper
knows which partitions the gather in progress reads (never dropped), and
``Init._partition_param`` so a partition released past the cap gets a buffer
back before DeepSpeed writes an update into it (``GatheredParameters`` with
``modifier_rank``).
:func:`uninstall` restores them. ``aio.integrations.deepspeed.enable()``
calls :func:`install` unless ``AIO_DEEPSPEED_SWAPPERS=0``.

Written against DeepSpeed 0.19 (``SUPPORTED``): the classes rely on the
swappers' private bookkeeping (``available_buffer_ids``,
``param_id_to_buffer_id``, ``param_id_to_swap_buffer``, ``inflight_params``,
``swap_ops``, ``swap_buffer_manager.free_buffer_index``) and on the
``ds_tensor.status`` / ``ds_status`` protocol; other versions are left
untouched, with a log line. Scheduling (and releasing state already
written) is all they change: the bytes read, written and computed on are
DeepSpeed's, so losses equal DeepSpeed's
CPU-offload run bit for bit (tests/integrations/test_ds_swappers.py).
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._log import logger

SUPPORTED = ((0, 19), (0, 20))  # [lowest, highest) major.minor whose swapper internals this matches
SUPPORTED_TEXT = "deepspeed>=0.19,<0.20"
ENV_SWITCH = "AIO_DEEPSPEED_SWAPPERS"

_log = logger.getChild("deepspeed")
_lock = threading.Lock()
_installed: list[tuple[Any, str, Any]] = []  # (owner, attribute, original)

# Process-wide counters, summed over every swapper (one log line at exit).
PARAM_COUNTERS = (
    "evicted",  # gathered partitions whose buffer went back, data kept in ordinary memory
    "held_peak",  # most such partitions at once
    "held_peak_bytes",
    "dropped_prefetch",  # prefetched partitions no gather was reading, dropped for room
    "deduplicated",  # repeated entries removed from a swap-in request
    "waited",  # times a swap-in waited for reads in flight to free a buffer
    "trimmed_prefetch",  # prefetch entries not read for want of a buffer
    "rebuffered",  # partitions updated in their ordinary-memory copy, given a buffer to be written
    "device_waits",  # buffers whose reuse waited for a device copy's event
    "released",  # gathered partitions past the held cap given back without a copy (the drive has them)
)
OPTIMIZER_COUNTERS = (
    "writes_completed_early",
    "read_ahead_dropped",
    "read_ahead_skipped",
    "state_released",  # first-step optimizer state tensors released once their write completed
    "state_released_bytes",
)
_totals: dict[str, int] = dict.fromkeys(PARAM_COUNTERS + OPTIMIZER_COUNTERS, 0)
_buffer_counts: dict[str, set[int]] = {"param": set(), "optimizer": set()}
_held_caps: dict[int, str] = {}  # cap bytes -> where it comes from, each distinct cap once
_atexit_registered = False
_said_off = False  # the switched-off line is logged once


def _version_ok(version: str) -> bool:
    try:
        parts = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return SUPPORTED[0] <= parts < SUPPORTED[1]


def switched_off() -> bool:
    """Whether ``AIO_DEEPSPEED_SWAPPERS`` turns these classes off (0/false/no/off)."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "no", "off")


def bump(counters: dict[str, int], name: str, n: int = 1) -> None:
    """Add `n` to a swapper's counter `name` and to the process's total."""
    counters[name] += n
    with _lock:
        _totals[name] += n


def peak(counters: dict[str, int], name: str, value: int) -> None:
    """Raise a swapper's high-water mark `name` (and the process's) to `value`."""
    counters[name] = max(counters[name], value)
    with _lock:
        _totals[name] = max(_totals[name], value)


def note_buffer_count(kind: str, count: int) -> None:
    """Record a swapper's ``buffer_count`` ("param" or "optimizer") for the
    summary line; the first call also schedules that line at exit."""
    global _atexit_registered
    with _lock:
        _buffer_counts[kind].add(count)
        if _atexit_registered:
            return
        _atexit_registered = True
    atexit.register(_log_summary)


HOST_MEMORY_BUDGET = 0.5  # aio_zero.host_memory_budget's default (aio.config.train.AioZeroConfig)
BUDGET_KEY = "aio_zero.host_memory_budget"


@dataclass(frozen=True)
class HeldCap:
    """The most bytes of gathered partitions the parameter swapper keeps in
    ordinary memory, and where that number comes from (for log lines)."""

    nbytes: int
    source: str


def _ranks_on_node() -> int:
    """Ranks sharing this node's budget: LOCAL_WORLD_SIZE (torchrun), else
    LOCAL_SIZE (DeepSpeed's launcher), else 1."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        text = os.environ.get(name, "").strip()
        if not text:
            continue
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"environment variable {name}={text!r}: an integer >= 1, as launchers set it")
        return int(text)
    return 1


def held_cap(param_dict: Mapping[str, Any] | None, available: int | None = None) -> HeldCap:
    """The held cap for a DeepSpeed config dict: ``aio_zero.host_memory_budget``
    (aio's host-memory budget, a block DeepSpeed ignores; default 0.5), a
    fraction of `available` (default: this machine's available memory now)
    or bytes, divided among the node's ranks."""
    block = (param_dict or {}).get("aio_zero") or {}
    if not isinstance(block, Mapping):
        raise ValueError(f"aio_zero must be a mapping (a JSON object), got {type(block).__name__}")
    setting = block.get("host_memory_budget", HOST_MEMORY_BUDGET)
    ok = isinstance(setting, (int, float)) and not isinstance(setting, bool) and setting > 0
    if not ok or (setting > 1 and not float(setting).is_integer()):
        raise ValueError(
            f"{BUDGET_KEY}: a fraction of available memory (0 < x <= 1) or a whole number of bytes, "
            f"got {setting!r}"
        )
    from ..config.gradients import host_memory_budget
    from ..config.memory import format_bytes

    if setting > 1:
        what = f"{int(setting)} bytes"
    else:
        if available is None:
            import psutil

            available = int(psutil.virtual_memory().available)
        what = f"{setting:g} of {format_bytes(available)} available"
    ranks = _ranks_on_node()
    nbytes = host_memory_budget(float(setting), available) // ranks
    return HeldCap(nbytes, f"{BUDGET_KEY} {what}" + (f" / {ranks} ranks" if ranks > 1 else ""))


def note_held_cap(cap: HeldCap) -> None:
    """Record a parameter swapper's held cap for the summary line."""
    with _lock:
        _held_caps.setdefault(cap.nbytes, cap.source)


def held_cap_short(have: int, held: int, held_bytes: int, cap: HeldCap) -> ValueError:
    """The error for a gather that finds no buffer when every buffer holds a
    gathered partition that can neither move to ordinary memory (the cap)
    nor be released (one rank on the CPU: the parameter is a view of its
    buffer). Nothing would free a buffer, so waiting would hang."""
    from ..config.memory import format_bytes

    return ValueError(
        f"zero_optimization.offload_param.buffer_count={have} is too small for the parameters DeepSpeed "
        "keeps gathered (stage3_max_reuse_distance, stage3_max_live_parameters): every buffer holds a "
        "gathered partition, and moving one more to ordinary memory would pass aio's cap of "
        f"{format_bytes(cap.nbytes)} ({cap.source}; {held} partitions, {format_bytes(held_bytes)} held now); "
        f"raise offload_param.buffer_count or {BUDGET_KEY}, or lower stage3_max_reuse_distance / "
        "stage3_max_live_parameters"
    )


def buffers_short(key: str, have: int, need: int, what: str) -> ValueError:
    """The error for a pool that aio's rules cannot make do with: names the
    config key and the count to set."""
    return ValueError(
        f"zero_optimization.{key}.buffer_count={have} is too small: {what} needs {need} buffers at once; "
        f"set it to at least {need}"
    )


def summary() -> dict[str, int]:
    """This process's counters so far, summed over every swapper built."""
    with _lock:
        return dict(_totals)


def summary_line() -> str | None:
    """The line logged at exit, or None if the rules never had to act."""
    t = summary()
    if not any(t.values()):
        return None
    from ..config.memory import format_bytes

    # One engine per process, as a rule: one count each (several: all of them).
    pb, ob = ("/".join(str(n) for n in sorted(_buffer_counts[k])) or "-" for k in ("param", "optimizer"))
    with _lock:
        # Several engines (a fraction of available memory differs each time): the smallest cap.
        n = min(_held_caps, default=None)
        caps = "-" if n is None else f"{format_bytes(n)}, {_held_caps[n]}"
        if len(_held_caps) > 1:
            caps += f", the smallest of {len(_held_caps)}"
    return (
        f"DeepSpeed NVMe swappers on aio's buffer rules: held {t['evicted']} gathered partitions past "
        f"buffer_count={pb} in ordinary memory (at most {t['held_peak']} at once, "
        f"{format_bytes(t['held_peak_bytes'])}; cap {caps}), released {t['released']} past the cap "
        f"without a copy, dropped {t['dropped_prefetch']} prefetched partitions, "
        f"took {t['deduplicated']} repeated prefetch entries once, waited {t['waited']} times for reads, "
        f"trimmed {t['trimmed_prefetch']} prefetch entries, "
        f"re-buffered {t['rebuffered']} updated partitions, "
        f"waited on {t['device_waits']} device copies; optimizer (buffer_count={ob}): "
        f"{t['writes_completed_early']} writes completed early, {t['read_ahead_dropped']} read-aheads "
        f"dropped, {t['read_ahead_skipped']} skipped, released {t['state_released']} first-step state "
        f"tensors once written ({format_bytes(t['state_released_bytes'])})"
    )


def _log_summary() -> None:
    line = summary_line()
    if line is not None:
        _log.info("%s", line)


def param_swapper_class() -> Any:
    """aio's subclass of DeepSpeed's ``AsyncPartitionedParameterSwapper`` (imports DeepSpeed)."""
    from ._ds_param_swapper import EvictingParamSwapper

    return EvictingParamSwapper


def optimizer_swapper_class() -> Any:
    """aio's subclass of DeepSpeed's ``PipelinedOptimizerSwapper`` (imports DeepSpeed)."""
    from ._ds_optimizer_swapper import BackpressurePipelinedOptimizerSwapper

    return BackpressurePipelinedOptimizerSwapper


def _wrap_ensure_availability(orig: Any) -> Any:
    """``Init._ensure_availability_of_partitioned_params`` telling the
    parameter swapper which partitions the gather in progress reads."""

    @functools.wraps(orig)
    def ensure(self: Any, params: Any) -> Any:
        params = list(params)
        swapper = next((p.nvme_swapper for p in params if getattr(p, "nvme_swapper", None) is not None), None)
        gathering = getattr(swapper, "gathering", None)
        if gathering is None:
            return orig(self, params)
        with gathering(params):
            return orig(self, params)

    ensure._aio_wrapped = True  # type: ignore[attr-defined]
    return ensure


def _wrap_partition_param(orig: Any) -> Any:
    """``Init._partition_param`` that, before DeepSpeed copies an updated
    parameter into its partition (``has_been_updated``), gives a partition
    the parameter swapper released past its cap a buffer again."""

    @functools.wraps(orig)
    def partition_param(self: Any, param: Any, *args: Any, **kwargs: Any) -> Any:
        updated = kwargs.get("has_been_updated", args[1] if len(args) > 1 else False)
        restore = getattr(getattr(param, "nvme_swapper", None), "restore_released", None)
        if updated and restore is not None:
            restore(param)
        return orig(self, param, *args, **kwargs)

    partition_param._aio_wrapped = True  # type: ignore[attr-defined]
    return partition_param


def install(*, force: bool = False, param_swapper: Any = None, optimizer_swapper: Any = None) -> bool:
    """Put aio's swapper classes at DeepSpeed's construction sites; returns
    whether they are in place.

    Does nothing (and says why, once, in a log line) for a DeepSpeed outside
    ``SUPPORTED`` or, unless `force`, when ``AIO_DEEPSPEED_SWAPPERS=0``.
    `param_swapper` / `optimizer_swapper` replace aio's classes (tests).
    A model built under ``zero.Init`` before the call keeps DeepSpeed's
    parameter swapper (the build makes it; :func:`warn_if_built_before`
    says so when its engine starts), and an engine built before it keeps
    DeepSpeed's optimizer swapper.
    """
    import deepspeed

    version = getattr(deepspeed, "__version__", "unknown")
    if not _version_ok(version):
        _log.warning(
            "DeepSpeed %s: its NVMe swappers are left as they are (aio's buffer rules are written for %s)",
            version,
            SUPPORTED_TEXT,
        )
        return False
    if switched_off() and not force:
        global _said_off
        if not _said_off:
            _said_off = True
            _log.info("%s=0: DeepSpeed's NVMe swappers keep DeepSpeed's own buffer rules", ENV_SWITCH)
        with _lock:
            _restore()  # an earlier install() goes too: the switch means off
        return False
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.runtime.zero import stage3

    sites = [
        (pp, "AsyncPartitionedParameterSwapper", param_swapper or param_swapper_class()),
        (stage3, "PipelinedOptimizerSwapper", optimizer_swapper or optimizer_swapper_class()),
    ]
    with _lock:
        _restore()
        for owner, attr, cls in sites:
            _installed.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, cls)
        for attr, wrap in (
            ("_ensure_availability_of_partitioned_params", _wrap_ensure_availability),
            ("_partition_param", _wrap_partition_param),
        ):
            orig = getattr(pp.Init, attr)
            _installed.append((pp.Init, attr, orig))
            setattr(pp.Init, attr, wrap(orig))
    return True


def warn_if_built_before(module: Any) -> bool:
    """Log one warning when `module`'s parameters page through DeepSpeed's
    own parameter swapper while aio's classes are installed: the model was
    built under ``zero.Init`` (which makes the swapper) before
    :func:`install` ran, so aio's buffer rules do not apply to it. Returns
    whether it warned."""
    if not installed():
        return False
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

    swapper = next((getattr(p, "nvme_swapper", None) for p in module.parameters()), None)
    if type(swapper) is not AsyncPartitionedParameterSwapper:
        return False
    _log.warning(
        "this DeepSpeed engine's parameters page through DeepSpeed's own swapper (it asserts 'Not enough "
        "buffers' on HF's NVMe block): its model was built under deepspeed.zero.Init before "
        "aio.integrations.deepspeed.enable(); call enable() (or set AIO_DEEPSPEED=1) before building the "
        "model (zero.Init, from_pretrained)"
    )
    return True


def _restore() -> None:
    while _installed:
        owner, attr, orig = _installed.pop()
        setattr(owner, attr, orig)


def uninstall() -> None:
    """Give DeepSpeed its own swapper classes back (engines already built keep theirs)."""
    with _lock:
        _restore()


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    with _lock:
        return bool(_installed)
