#!/usr/bin/env python3
"""DeepSpeed ZeRO-3 step time with parameters and optimizer state on NVMe:
aio's handle vs DeepSpeed's own async_io op, same config, same machine.

Each round runs both A B B A (a fresh process per run, 1 s idle before
each); a run's figure is its median step time after the warm-up steps; the
ratio DeepSpeed-op / aio is taken per round and the median over rounds
reported (> 1 means aio is faster).

    python bench/deepspeed_step.py --rounds 5 [--model gpt] [--dir /local_nvme]
    python bench/deepspeed_step.py --sides aio --torch-adam ...   # no JIT build at all

The runs are bench/train_step.py's ``ds-nvme`` (DeepSpeed's op) and
``ds-nvme-aio`` (aio.integrations.deepspeed) workers, so the model, config
and precision are the ones that table uses: bf16, because DeepSpeed 0.19.8
on its CPU accelerator partitions NVMe-offloaded parameters of an fp32
model in bf16 and then fails in its ZeRO-3 linear (see train_step.py; the
small models of tests/integrations/ds_train.py still pass, a width-1024
one does not).

Both sides step with DeepSpeedCPUAdam, which DeepSpeed JIT-builds on first
use (about a minute); ``--torch-adam`` sets DeepSpeed's
``optimizer.params.torch_adam`` instead (torch's AdamW, no build; slower
steps, on both sides alike). DeepSpeed's own op is JIT-built too, and only
where libaio-dev is installed; ``--sides aio`` runs aio's side alone (one
run per round, no ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_step  # noqa: E402

# --sides name -> bench/train_step.py's worker variant
SIDES = {"aio": "ds-nvme-aio", "dsop": "ds-nvme"}


def own_parser() -> argparse.ArgumentParser:
    """This script's own options; the rest are bench/train_step.py's."""
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        add_help=False,
        allow_abbrev=False,  # an abbreviated train_step.py option stays train_step.py's
        epilog="The other options are bench/train_step.py's, listed below.",
    )
    ap.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    ap.add_argument(
        "--sides",
        default="aio,dsop",
        help="comma list: aio (DeepSpeed on aio's handle), dsop (DeepSpeed's own async_io op); "
        "with one side there is no ratio (default: aio,dsop)",
    )
    ap.add_argument(
        "--torch-adam",
        action="store_true",
        help="DeepSpeed's optimizer.params.torch_adam: torch's AdamW, not DeepSpeedCPUAdam "
        "(no JIT build; slower steps), on both sides",
    )
    return ap


def parse(argv: list[str] | None) -> argparse.Namespace:
    """bench/train_step.py's options plus ``sides`` and ``torch_adam``."""
    ap = own_parser()
    own, rest = ap.parse_known_args(argv)
    if own.help:
        ap.print_help()
        print("\nbench/train_step.py's options:")
        train_step.parse(["--help"])  # prints its options and exits
    sides = [s for s in own.sides.split(",") if s]
    if not sides or set(sides) - set(SIDES) or len(set(sides)) < len(sides):
        ap.error(f"--sides {own.sides}: a comma list of {', '.join(SIDES)}, each at most once")
    a = train_step.parse(rest)
    a.sides, a.torch_adam = sides, own.torch_adam
    return a


def worker(a: argparse.Namespace) -> int:
    """One run in this (fresh) process: train_step.py's worker, its config
    given ``torch_adam`` with --torch-adam; writes the result to a.out."""
    if a.torch_adam:
        base = train_step.full_config

        def full_config(b: argparse.Namespace, variant: str, nvme: str) -> dict:
            cfg = base(b, variant, nvme)
            cfg["optimizer"]["params"]["torch_adam"] = True
            return cfg

        train_step.full_config = full_config  # train_step.worker looks it up at call time
    res = train_step.worker(a)
    with open(a.out, "w") as f:
        json.dump(res, f)
    return 0


def run_one(a: argparse.Namespace, v: str, root: str) -> dict:
    """Run worker variant `v` in a fresh process of this script (so that
    --torch-adam reaches its config); its result."""
    extra = ("--torch-adam",) if a.torch_adam else ()
    return train_step.run_one(a, v, root, script=__file__, extra=extra)


def measure(a: argparse.Namespace, root: str) -> tuple[dict[str, list[float]], list[float]]:
    """Per side, each round's mean step time (s); the per-round ratios
    DeepSpeed-op / aio (empty with one side)."""
    # A B B A cancels a drift over the round; one side alone has nothing to cancel.
    order = ("aio", "dsop", "dsop", "aio") if len(a.sides) == 2 else tuple(a.sides)
    med: dict[str, list[float]] = {io: [] for io in a.sides}
    ratios = []
    for r in range(a.rounds):
        got: dict[str, list[float]] = {io: [] for io in a.sides}
        for io in order:
            got[io].append(run_one(a, SIDES[io], root)["step_s"])
        for io in got:
            med[io].append(sum(got[io]) / len(got[io]))
        if len(a.sides) == 2:
            ratios.append(med["dsop"][-1] / med["aio"][-1])
        each = ", ".join(
            f"{'aio' if io == 'aio' else 'DeepSpeed op'} {med[io][-1] * 1e3:.1f} ms" for io in med
        )
        print(f"round {r + 1}: {each} per step", file=sys.stderr)
    return med, ratios


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and print the summary line; the exit status (2: a side cannot run here)."""
    a = parse(argv)
    if a.variant:
        return worker(a)
    for side in a.sides:
        why = train_step.available(SIDES[side], a)
        if why:
            print(f"cannot run {SIDES[side]}: {why}", file=sys.stderr)
            return 2
    root = tempfile.mkdtemp(prefix="aio-ds-bench-", dir=a.dir)
    try:
        med, ratios = measure(a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    head = (
        f"ZeRO-3, params+optimizer on NVMe, {a.model} {train_step.n_params(a) / 1e6:.1f}M params, "
        f"{'bf16' if a.bf16 else 'fp32'}{', torch AdamW' if a.torch_adam else ''}: median step"
    )
    figures: list[str] = []
    if "aio" in med:
        figures.append(f"aio {statistics.median(med['aio']) * 1e3:.1f} ms")
    if "dsop" in med:
        figures.append(f"DeepSpeed op {statistics.median(med['dsop']) * 1e3:.1f} ms")
    tail = (
        f"; DeepSpeed-op / aio step time = {statistics.median(ratios):.3f} "
        f"[{min(ratios):.3f}..{max(ratios):.3f}] over {a.rounds} rounds"
        if ratios
        else f" over {a.rounds} rounds (one side: no ratio)"
    )
    print(f"{head} {', '.join(figures)}{tail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
