#!/usr/bin/env python3
"""bfloat16 optimizer states on the drive (``aio_zero.optimizer_states:
bf16``) against float32 states: bytes moved per parameter per step, and the
accuracy cost as the loss curve of aio-train's model trained both ways.

Each variant is one ``aio-train`` run (same model, data, seed, NVMe offload
of parameters and optimizer); the runs alternate over --rounds, and the loss
curves are deterministic (the same every round), the times are medians.

    python bench/optimizer_states.py --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def run(states: str, a: argparse.Namespace, workdir: str) -> dict[str, Any]:
    out = os.path.join(workdir, f"{states}.json")
    args = ["--steps", str(a.steps), "--layers", str(a.layers), "--width", str(a.width)]
    args += ["--vocab", str(a.vocab), "--seq", str(a.seq), "--batch", str(a.batch), "--lr", str(a.lr)]
    args += ["--optimizer-states", states, "--no-baseline", "--json", out]
    # Prepend the checkout, keep the caller's path (a carried site-packages, say).
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, AIO_TRAIN_DIR=workdir, PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-m", "aio.train", *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"aio-train --optimizer-states {states} failed:\n{r.stdout}{r.stderr}")
    with open(out) as f:
        res = json.load(f)["offloaded"]
    o = res["stats"]["optimizer"]
    return {
        "losses": res["losses"],
        "step_s": statistics.median(res["step_s"]),
        "params": res["params"],
        "opt_bytes_per_param_step": (o["bytes_read"] + o["bytes_written"]) / res["params"] / a.steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write the results to this file")
    a = ap.parse_args()
    results: dict[str, list[dict[str, Any]]] = {"fp32": [], "bf16": []}
    with tempfile.TemporaryDirectory(prefix="aio-states-") as workdir:
        for r in range(a.rounds):
            for states in ("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32"):
                results[states].append(run(states, a, workdir))
    fp, bf = results["fp32"][0], results["bf16"][0]
    for states, runs in results.items():  # the training itself is deterministic
        if any(x["losses"] != runs[0]["losses"] for x in runs):
            print(f"WARNING: {states} losses differ between rounds")
    rel = [abs(b - f) / abs(f) for f, b in zip(fp["losses"], bf["losses"], strict=True)]
    print(f"aio-train model, {fp['params']:,} parameters, {a.steps} steps, NVMe offload, AdamW")
    print(f"{'step':>5} {'loss fp32 states':>17} {'loss bf16 states':>17} {'rel. diff':>10}")
    for i, (f, b, d) in enumerate(zip(fp["losses"], bf["losses"], rel, strict=True)):
        if i < 5 or (i + 1) % max(1, a.steps // 10) == 0 or i == a.steps - 1:
            print(f"{i + 1:>5} {f:>17.5f} {b:>17.5f} {d:>10.2e}")
    print(f"max relative loss difference {max(rel):.2e}, mean {statistics.mean(rel):.2e}")
    for states, runs in results.items():
        step = statistics.median(x["step_s"] for x in runs)
        per = runs[0]["opt_bytes_per_param_step"]
        print(f"{states} states: optimizer I/O {per:.2f} B/param/step, median step {step * 1000:.0f} ms")
    saved = fp["opt_bytes_per_param_step"] - bf["opt_bytes_per_param_step"]
    print(f"bf16 states save {saved:.2f} B/param/step of optimizer I/O")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results, "max_rel": max(rel)}, f, indent=1)


if __name__ == "__main__":
    main()
