"""aio-config: validate a config, or estimate its memory before training.

aio-config validate ds_config.json     (every key aio reads, training keys too)
aio-config estimate ds_config.json --params 7e9 --dtype bf16
aio-config estimate ds_config.json --param-numels 1048576x8,1024x8 --dtype fp32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from typing import Any

from .gradients import place_gradients
from .hf_auto import filled_note, stand_in_autos
from .load import ConfigError, read_config_data
from .memory import MemoryEstimate, estimate_memory
from .train import load_train_config


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 7e9, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return v


# The most elements --params and --largest-subgroup take: the largest count a
# float holds exactly (9.0e15, thousands of times today's largest models);
# past it the estimate printed 1e30 as 1,000,000,000,000,000,019,884,... and
# drive space in exabytes instead of saying the number is wrong.
MAX_ELEMENTS = 2**53


def _count(text: str) -> float:
    """A positive finite element count up to :data:`MAX_ELEMENTS`."""
    v = _finite(text)
    if v > MAX_ELEMENTS:
        raise argparse.ArgumentTypeError(f"at most {MAX_ELEMENTS:.1e} (2**53) elements, got {text!r}")
    return v


# The most bytes --activations takes: 2**53 (8 PiB), the largest count a float
# holds exactly, as for the element counts; past it 99999999999999999999999T
# was printed as 99999999999999991611392.0 TiB of activations, exit 0.
MAX_BYTES = 2**53


def _bytes(text: str) -> int:
    """A size like ``400M`` (:func:`aio._cli.parse_size`) up to :data:`MAX_BYTES`."""
    from .._cli import parse_size

    n = parse_size(text)
    if n > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"at most 8 PiB (2**53 bytes), got {text!r}")
    return n


def _numels(text: str) -> list[tuple[int, int]]:
    """``1048576x8,1024`` -> [(1048576, 8), (1024, 1)]: parameter sizes in model
    order, as (size, count) runs (a count of 3e8 costs no more than 1)."""
    out: list[tuple[int, int]] = []
    for item in text.split(","):
        size, _, count = item.strip().partition("x")
        try:
            n, k = int(float(size)), int(count) if count else 1
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected sizes like 1048576x8,1024, got {item!r}") from None
        if n <= 0 or k <= 0 or float(size) != n:
            raise argparse.ArgumentTypeError(f"sizes and counts must be positive whole numbers: {item!r}")
        out.append((n, k))
    if sum(n * k for n, k in out) > MAX_ELEMENTS:
        raise argparse.ArgumentTypeError(f"at most {MAX_ELEMENTS:.1e} (2**53) elements in all, got {text!r}")
    return out


_AUTO_DTYPE_NOTE = (
    "the HF Trainer sets it from --bf16/--fp16 when training starts; fp32 gives the largest "
    "estimate; pass --dtype bf16 or --dtype fp16 for mixed precision"
)


def _precision_flags(path: str) -> dict[str, tuple[str, object]]:
    """Each precision block the config has: dtype name -> (key, its ``enabled``)."""
    from .load import read_config_data

    data, _ = read_config_data(path)
    out: dict[str, tuple[str, object]] = {}
    for key, dtype in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        blk = data.get(key)
        if isinstance(blk, dict) and "enabled" in blk:
            v = blk["enabled"]
            auto = isinstance(v, str) and v.strip().lower() == "auto"
            if dtype not in out or v is True:
                out[dtype] = (key, "auto" if auto else v)
    return out


def estimate_dtype(path: str, flag: str | None) -> tuple[str, str]:
    """(dtype, where it came from) for ``estimate``. The config decides where it
    says: ``enabled: true`` is that dtype, and ``--dtype`` naming another, or a
    dtype the config disables, is a conflict (CliError). ``--dtype`` fills what
    the config leaves open: no precision block (Lightning adds one from its
    ``precision``) or ``enabled: "auto"`` (the HF Trainer fills it); "auto"
    without ``--dtype`` is taken as fp32, the largest estimate, and said so."""
    from .._cli import CliError

    blocks = _precision_flags(path)
    on = {d: k for d, (k, v) in blocks.items() if v is True}
    if len(on) > 1:
        raise CliError(f"{on['bf16']}.enabled and fp16.enabled are both true in {path}; pick one")
    if on:
        ((dtype, key),) = on.items()
        if flag is not None and flag != dtype:
            raise CliError(
                f"--dtype {flag} conflicts with {key}.enabled: true in {path}; drop --dtype "
                "(the config decides) or change the config"
            )
        return dtype, f"from {key}.enabled: true in the config"
    off = {d: k for d, (k, v) in blocks.items() if v is False}
    auto = [k for k, v in blocks.values() if v == "auto"]
    if flag is not None:
        if flag in off:
            raise CliError(
                f"--dtype {flag} conflicts with {off[flag]}.enabled: false in {path}; drop --dtype "
                "(the config decides) or change the config"
            )
        why = f"; {_and_keys(auto)} 'auto' in the config" if auto else ""
        return flag, f"from --dtype{why}"
    if auto:
        verb = "are" if len(auto) > 1 else "is"
        return "fp32", f"assumed: {_and_keys(auto)} {verb} 'auto' in the config; {_AUTO_DTYPE_NOTE}"
    return "fp32", "the config enables neither bf16 nor fp16"


def _state_bytes(path: str) -> int:
    """Bytes per optimizer state on the drive: 2 with ``aio_zero.optimizer_states: bf16``."""
    from .load import read_config_data

    data, _ = read_config_data(path)
    blk = data.get("aio_zero")
    return 2 if isinstance(blk, dict) and blk.get("optimizer_states") == "bf16" else 4


def _and_keys(keys: list[str]) -> str:
    return " and ".join(f"{k}.enabled" for k in keys)


def build_parser() -> argparse.ArgumentParser:
    """The ``aio-config`` argument parser: ``validate CONFIG`` and ``estimate CONFIG
    (--params N | --param-numels SIZES) [--largest-subgroup N] [--dtype]
    [--optimizer-states] [--json] [--check]``."""
    from .._cli import CliParser, int_in

    ap = CliParser(prog="aio-config", description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check a DeepSpeed-format config")
    v.add_argument("config", help="the JSON config file (DeepSpeed's format, HF's \"auto\" values allowed)")
    v.add_argument(
        "--resolved",
        action="store_true",
        help="after the verdict and notes, print the config as aio.zero reads it (every default filled in)",
    )
    e = sub.add_parser("estimate", help="pinned memory and drive space for a model size")
    e.add_argument("config", help="the JSON config file (DeepSpeed's format)")
    size = e.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=_count, help="parameters per process, e.g. 7e9")
    size.add_argument(
        "--param-numels",
        type=_numels,
        help="every parameter's element count in model order, e.g. 1048576x8,1024x8 (exact estimate)",
    )
    e.add_argument(
        "--largest-subgroup",
        type=_count,
        help="elements in the largest optimizer sub-group (default: from --param-numels, "
        "else min(sub_group_size, params))",
    )
    e.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="parameter dtype where the config leaves it open (no bf16/fp16 block, or enabled "
        '"auto"; "auto" alone is taken as fp32); a dtype the config sets or disables wins, '
        "and a --dtype against it is an error",
    )
    e.add_argument(
        "--optimizer-states",
        type=int_in(0, 64),
        default=2,
        help="optimizer state tensors per parameter beside the master weights (Adam: 2)",
    )
    e.add_argument(
        "--activations",
        type=_bytes,
        default=None,
        metavar="BYTES",
        help="what the model's forward saves for backward at the batch trained (e.g. 400M), counted "
        "in the predicted peak RSS; aio-train prints its GPT's",
    )
    e.add_argument("--json", action="store_true", help="print JSON")
    e.add_argument("--check", action="store_true", help="compare with this machine; exit 1 if short")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run ``aio-config`` on `argv` (default: ``sys.argv[1:]``); returns the exit
    status: 0 when fine, 1 when ``estimate --check`` finds this machine short, 2
    for a config or file problem, 130 when interrupted. Bad arguments exit with
    status 2 from argument parsing (SystemExit)."""
    from .._cli import run_cli

    ap = build_parser()
    a = ap.parse_args(argv)
    if a.cmd == "estimate":
        _check_subgroup(ap, a)
    return run_cli("aio-config", lambda: _run(a))


def _check_subgroup(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse (exit 2) a --largest-subgroup larger than the parameters given:
    a sub-group holds some of them (9e15 of 1e9 printed 130967 TiB pinned)."""
    if a.largest_subgroup is None:
        return
    total = a.params if a.params is not None else sum(n * k for n, k in a.param_numels)
    if a.largest_subgroup > total:
        ap.error(
            f"--largest-subgroup {a.largest_subgroup:,.0f} is more than the {total:,.0f} parameters "
            "given: a sub-group holds some of them"
        )


def _validate(a: argparse.Namespace) -> int:
    """``aio-config validate``: the verdict, then the notes, then (with
    ``--resolved``) the config as aio.zero reads it."""
    # Every key aio reads, training keys included: what validate calls OK,
    # aio.zero.initialize and aio-train accept.
    data, where = read_config_data(a.config)
    data, filled = stand_in_autos(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cfg = load_train_config(data)
        except ConfigError as e:
            raise ConfigError(e.problems, where) from None
    notes = [str(n.message) for n in caught] + _drive_notes(cfg)
    if filled:
        notes.append(filled_note(filled))
    op = cfg.offload.offload_param
    if op is not None and op.device == "nvme" and op.max_in_cpu >= 1_000_000_000:
        notes.append(
            f"offload_param.device is nvme but max_in_cpu={op.max_in_cpu} keeps "
            f"the first {op.max_in_cpu:,} parameter elements in CPU memory: a smaller model never "
            "pages parameters to the drive; set zero_optimization.offload_param.max_in_cpu "
            "(0: all on the drive)"
        )
    print(f"config OK: {a.config}" + (f" ({len(notes)} note{'s' * (len(notes) > 1)} below)" if notes else ""))
    sys.stdout.flush()  # the verdict before the notes on a terminal
    for n in notes:
        print(f"aio-config: note: {n}", file=sys.stderr)
    if a.resolved:
        sys.stderr.flush()
        print(json.dumps(cfg.model_dump(mode="json", exclude_none=True), indent=2))
    return 0


def _drive_notes(cfg: Any) -> list[str]:
    """Notes on the offload blocks' drives: missing here, or several."""
    out = []
    for key in ("offload_param", "offload_optimizer"):
        blk = getattr(cfg.offload, key)
        for d in blk.nvme_dirs() if blk is not None and blk.device == "nvme" else []:
            if not os.path.isdir(d):  # a config for another machine may name its drives
                out.append(
                    f"zero_optimization.{key}.nvme_path {d} is not an existing "
                    "directory here: aio.zero and aio-train refuse it on this machine"
                )
        if blk is not None and len(blk.nvme_dirs()) > 1:
            out.append(
                f"zero_optimization.{key}.nvme_path lists "
                f"{len(blk.nvme_dirs())} drives: aio.zero stripes over them; DeepSpeed's own "
                "engine takes one directory (give it one, or a RAID-0 mount)"
            )
    return out


def _add_gradients(est: MemoryEstimate, path: str) -> None:
    """Where aio.zero would put the fp32 gradients (aio_zero.gradients within
    host_memory_budget, against this machine's available memory now), when the
    file is a training config aio.zero accepts; else a note on stderr (the
    estimate of the offload blocks stands on its own)."""
    data, _ = read_config_data(path)
    data, _ = stand_in_autos(data)
    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            train = load_train_config(data)
    except ConfigError as e:
        note = f"gradient placement not estimated, not an aio.zero config: {e}"
        print(f"aio-config: note: {note}", file=sys.stderr)
        return
    for n in notes:  # a misspelt key (sub_grup_size) changes the estimate: say so
        print(f"aio-config: note: {n.message}", file=sys.stderr)
    est.add_gradients(place_gradients(train, est.num_params, est.held_bytes))


def _run(a: argparse.Namespace) -> int:
    if a.cmd == "validate":
        return _validate(a)
    dtype, source = estimate_dtype(a.config, a.dtype)
    est = estimate_memory(
        a.config,
        a.params,
        dtype,
        a.optimizer_states,
        largest_subgroup_numel=a.largest_subgroup,
        param_numel_runs=a.param_numels,
        state_bytes=_state_bytes(a.config),
        activation_bytes=a.activations,
    )
    _add_gradients(est, a.config)
    if a.json:
        print(json.dumps({"dtype": dtype, "dtype_source": source, **est.as_dict()}, indent=2))
    else:
        print(f"parameter dtype: {dtype} ({source})")
        print(est.format())
    if a.check:
        problems = est.check()
        for p in problems:
            print(f"WARNING: {p}", file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
