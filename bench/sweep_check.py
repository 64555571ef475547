#!/usr/bin/env python3
"""Smart search vs exhaustive search of aio-sweep on the same drive and space.

Runs the smart search, then the exhaustive one, and reports (a) the time
ratio and (b) how the smart pick scores *in the exhaustive run's own
measurements* relative to the exhaustive best (the acceptance bar is >= 0.95
in <= 1/4 of the time).

    python bench/sweep_check.py [DIR] [extra aio-sweep options]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def run(args: list[str]) -> tuple[dict, float]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "aio.sweep", *args, "--json", out, "--no-fio"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    dt = time.monotonic() - t0
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data, dt


def scores(data: dict) -> dict[tuple, float]:
    per: dict[tuple, dict[str, list[float]]] = {}
    for t in data["trials"]:
        key = (
            t["block_size"],
            t["queue_depth"],
            t["thread_count"],
            t["single_submit"],
            t["overlap_events"],
        )
        per.setdefault(key, {}).setdefault(t["direction"], []).append(t["gbps"])
    out = {}
    for k, dirs in per.items():
        meds = [
            sorted(v)[len(v) // 2]
            if len(v) % 2
            else sum(sorted(v)[len(v) // 2 - 1 : len(v) // 2 + 1]) / 2
            for v in dirs.values()
        ]
        out[k] = len(meds) / sum(1 / m for m in meds)
    return out


def main() -> int:
    args = sys.argv[1:]
    smart, t_smart = run(args)
    ex, t_ex = run([*args, "--exhaustive"])
    ex_scores = scores(ex)
    b = smart["best"]
    pick = (
        b["block_size"],
        b["queue_depth"],
        b["intra_op_parallelism"],
        b["single_submit"],
        b["overlap_events"],
    )
    best_ex = max(ex_scores.values())
    ratio = ex_scores[pick] / best_ex
    print(f"smart search:      {t_smart:6.0f} s, pick {b}")
    print(f"exhaustive search: {t_ex:6.0f} s, best {ex['best']}")
    print(f"time ratio smart/exhaustive = {t_smart / t_ex:.3f} (bar: <= 0.25)")
    print(f"smart pick scored in the exhaustive run = {ratio:.3f} of its best (bar: >= 0.95)")
    return 0 if (ratio >= 0.95 and t_smart <= 0.25 * t_ex) else 1


if __name__ == "__main__":
    raise SystemExit(main())
