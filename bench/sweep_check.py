#!/usr/bin/env python3
"""Smart search vs exhaustive search of aio-sweep on the same drive and space.

1. runs the smart search, then the exhaustive one (each as `aio-sweep` would);
2. measures the two picks head to head, interleaved A B B A over --rounds
   rounds (1 s idle before each run), and reports the median ratio of the
   smart pick's score to the exhaustive pick's (score: harmonic mean of read
   and write GB/s).

Acceptance: ratio >= 0.95 in <= 1/4 of the exhaustive time. Also printed: the
smart pick's score inside the exhaustive run's own 2-sample medians -- a
biased figure (the exhaustive maximum over hundreds of noisy configurations
is inflated: winner's curse), shown for completeness.

    python bench/sweep_check.py [--dir DIR] [--rounds 7] [--keep out_prefix]
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aio.sweep import Drive, Setting  # noqa: E402


def run(args: list[str], out: str) -> tuple[dict, float]:
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "aio.sweep", *args, "--json", out, "--no-fio"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    dt = time.monotonic() - t0
    with open(out) as f:
        return json.load(f), dt


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
    return {k: len(d) / sum(1 / statistics.median(v) for v in d.values()) for k, d in per.items()}


def setting(block: dict) -> Setting:
    return Setting(
        block["block_size"],
        block["queue_depth"],
        block["intra_op_parallelism"],
        block["single_submit"],
        block["overlap_events"],
    )


def head_to_head(d: str, a: Setting, b: Setting, rounds: int, io_size: int) -> list[float]:
    drive = Drive([d], io_size, False)
    drive.check()
    drive.prepare()
    ratios = []
    try:
        for _ in range(rounds):
            t = {"a": {"read": 0.0, "write": 0.0}, "b": {"read": 0.0, "write": 0.0}}
            for name, s in (("a", a), ("b", b), ("b", b), ("a", a)):
                for direction in ("read", "write"):
                    time.sleep(1.0)
                    t[name][direction] += drive.run(s, direction)
            # score = harmonic mean of read/write rates = 2 * bytes / (t_read + t_write)
            ratios.append((t["b"]["read"] + t["b"]["write"]) / (t["a"]["read"] + t["a"]["write"]))
    finally:
        drive.cleanup()
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="drive directory (default: a temporary directory)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--keep", help="write smart/exhaustive trial JSON to PREFIX.smart.json etc.")
    a, rest = ap.parse_known_args()
    tmp = None if a.dir else tempfile.mkdtemp(prefix="aio-sweep-check-")
    d = a.dir or tmp
    try:
        prefix = a.keep or os.path.join(d, "check")
        smart, t_smart = run([d, *rest], prefix + ".smart.json")
        ex, t_ex = run([d, *rest, "--exhaustive"], prefix + ".exhaustive.json")
        sp, ep = setting(smart["best"]), setting(ex["best"])
        ex_scores = scores(ex)
        inside = ex_scores[
            (sp.block_size, sp.queue_depth, sp.thread_count, sp.single_submit, sp.overlap_events)
        ] / max(ex_scores.values())
        ratios = head_to_head(d, sp, ep, a.rounds, smart["io_size"]) if sp != ep else [1.0]
        med = statistics.median(ratios)
        print(f"smart search:      {t_smart:6.0f} s, pick {sp.short()}")
        print(f"exhaustive search: {t_ex:6.0f} s, pick {ep.short()}")
        print(f"time ratio smart/exhaustive = {t_smart / t_ex:.3f} (bar: <= 0.25)")
        print(
            f"head to head, smart pick / exhaustive pick = {med:.3f} "
            f"[{min(ratios):.3f}..{max(ratios):.3f}] over {len(ratios)} rounds (bar: >= 0.95)"
        )
        print(f"(smart pick inside the exhaustive run's own medians: {inside:.3f} of its max)")
        return 0 if (med >= 0.95 and t_smart <= 0.25 * t_ex) else 1
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
