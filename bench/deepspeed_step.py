#!/usr/bin/env python3
"""DeepSpeed ZeRO-3 step time with parameters and optimizer state on NVMe:
aio's handle vs DeepSpeed's own async_io op, same config, same machine.

Each round runs both A B B A (a fresh process per run, 1 s idle before
each); a run's figure is its median step time over steps 3..N (the first
steps pay for warm-up); the ratio DeepSpeed-op / aio is taken per round and
the median over rounds reported (> 1 means aio is faster).

    DS_ACCELERATOR=cpu python bench/deepspeed_step.py --rounds 5 --width 1024 --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "tests", "integrations", "ds_train.py")


def one(io: str, a: argparse.Namespace, base: str) -> float:
    nvme = tempfile.mkdtemp(dir=base)
    out = os.path.join(nvme, "out.json")
    cmd = [
        sys.executable,
        SCRIPT,
        "--io",
        io,
        "--offload",
        "nvme",
        "--nvme",
        nvme,
        "--steps",
        str(a.steps),
        "--width",
        str(a.width),
        "--layers",
        str(a.layers),
        "--out",
        out,
    ]
    if a.pipeline:
        cmd.append("--pipeline")
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_PORT=str(29500 + os.getpid() % 1000))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if not os.path.exists(out):
        raise RuntimeError(f"{io} run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    with open(out) as f:
        times = json.load(f)["step_s"][2:]
    shutil.rmtree(nvme, ignore_errors=True)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="nvme_path parent (default: a temporary directory)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pipeline", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, ".."))
    base = tempfile.mkdtemp(prefix="aio-ds-bench-", dir=a.dir)
    try:
        med = {"aio": [], "dsop": []}
        ratios = []
        for r in range(a.rounds):
            got = {"aio": [], "dsop": []}
            for io in ("aio", "dsop", "dsop", "aio"):
                time.sleep(1.0)
                got[io].append(one(io, a, base))
            for io in got:
                med[io].append(sum(got[io]) / 2)
            ratios.append(med["dsop"][-1] / med["aio"][-1])
            print(
                f"round {r + 1}: aio {med['aio'][-1] * 1e3:.1f} ms, DeepSpeed op "
                f"{med['dsop'][-1] * 1e3:.1f} ms per step",
                file=sys.stderr,
            )
        print(
            f"ZeRO-3, params+optimizer on NVMe, width {a.width} x {a.layers} layers, "
            f"pipeline={a.pipeline}: median step aio {statistics.median(med['aio']) * 1e3:.1f} ms, "
            f"DeepSpeed op {statistics.median(med['dsop']) * 1e3:.1f} ms; "
            f"DeepSpeed-op / aio step time = {statistics.median(ratios):.3f} "
            f"[{min(ratios):.3f}..{max(ratios):.3f}] over {a.rounds} rounds"
        )
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
