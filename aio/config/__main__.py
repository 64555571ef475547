"""aio-config: validate a config, or estimate its memory before training.

aio-config validate ds_config.json     (every key aio reads, training keys too)
aio-config estimate ds_config.json --params 7e9 --dtype bf16
aio-config estimate ds_config.json --param-numels 1048576x8,1024x8 --dtype fp32
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings

from .memory import estimate_memory
from .train import load_train_config


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 7e9, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return v


def _numels(text: str) -> list[int]:
    """``1048576x8,1024`` -> eight 1048576s and a 1024 (parameter sizes in model order)."""
    out: list[int] = []
    for item in text.split(","):
        size, _, count = item.strip().partition("x")
        try:
            n, k = int(float(size)), int(count) if count else 1
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected sizes like 1048576x8,1024, got {item!r}") from None
        if n <= 0 or k <= 0 or float(size) != n:
            raise argparse.ArgumentTypeError(f"sizes and counts must be positive whole numbers: {item!r}")
        out += [n] * k
    return out


def _config_dtype(path: str) -> str:
    """The training dtype a DeepSpeed config implies: bf16/fp16 when enabled, else fp32."""
    from .load import read_config_data

    data, _ = read_config_data(path)

    def on(key: str) -> bool:
        blk = data.get(key) if isinstance(data, dict) else None
        return isinstance(blk, dict) and blk.get("enabled") is True

    return "bf16" if on("bf16") or on("bfloat16") else "fp16" if on("fp16") else "fp32"


def build_parser() -> argparse.ArgumentParser:
    """The ``aio-config`` argument parser: ``validate CONFIG`` and ``estimate CONFIG
    (--params N | --param-numels SIZES) [--largest-subgroup N] [--dtype]
    [--optimizer-states] [--json] [--check]``."""
    from .._cli import CliParser, int_in

    ap = CliParser(prog="aio-config", description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check a DeepSpeed-format config")
    v.add_argument("config")
    e = sub.add_parser("estimate", help="pinned memory and drive space for a model size")
    e.add_argument("config")
    size = e.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=_finite, help="parameters per process, e.g. 7e9")
    size.add_argument(
        "--param-numels",
        type=_numels,
        help="every parameter's element count in model order, e.g. 1048576x8,1024x8 (exact estimate)",
    )
    e.add_argument(
        "--largest-subgroup",
        type=_finite,
        help="elements in the largest optimizer sub-group (default: from --param-numels, "
        "else min(sub_group_size, params))",
    )
    e.add_argument(
        "--dtype", default=None, help="training dtype (default: the config's bf16/fp16, else fp32)"
    )
    e.add_argument("--optimizer-states", type=int_in(0, 64), default=2)
    e.add_argument("--json", action="store_true", help="print JSON")
    e.add_argument("--check", action="store_true", help="compare with this machine; exit 1 if short")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run ``aio-config`` on `argv` (default: ``sys.argv[1:]``); returns the exit
    status: 0 when fine, 1 when ``estimate --check`` finds this machine short, 2
    for a config or file problem, 130 when interrupted. Bad arguments exit with
    status 2 from argument parsing (SystemExit)."""
    from .._cli import run_cli

    a = build_parser().parse_args(argv)
    return run_cli("aio-config", lambda: _run(a))


def _run(a: argparse.Namespace) -> int:
    if a.cmd == "validate":
        # Every key aio reads, training keys included: what validate calls OK,
        # aio.zero.initialize and aio-train accept.
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            cfg = load_train_config(a.config)
        print(json.dumps(cfg.model_dump(mode="json", exclude_none=True), indent=2))
        for n in notes:
            print(f"aio-config: note: {n.message}", file=sys.stderr)
        print("config OK", file=sys.stderr)
        return 0
    est = estimate_memory(
        a.config,
        a.params,
        a.dtype or _config_dtype(a.config),
        a.optimizer_states,
        largest_subgroup_numel=a.largest_subgroup,
        param_numels=a.param_numels,
    )
    print(json.dumps(est.as_dict(), indent=2) if a.json else est.format())
    if a.check:
        problems = est.check()
        for p in problems:
            print(f"WARNING: {p}", file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
