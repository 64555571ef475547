#!/usr/bin/env python3
"""DeepSpeed ZeRO-3 step time with parameters and optimizer state on NVMe:
aio's handle vs DeepSpeed's own async_io op, same config, same machine.

Each round runs both A B B A (a fresh process per run, 1 s idle before
each); a run's figure is its median step time after the warm-up steps; the
ratio DeepSpeed-op / aio is taken per round and the median over rounds
reported (> 1 means aio is faster).

    python bench/deepspeed_step.py --rounds 5 [--model gpt] [--dir /local_nvme]

The runs are bench/train_step.py's ``ds-nvme`` (DeepSpeed's op) and
``ds-nvme-aio`` (aio.integrations.deepspeed) workers, so the model, config
and precision are the ones that table uses: bf16, because DeepSpeed 0.19.8
on its CPU accelerator partitions NVMe-offloaded parameters of an fp32
model in bf16 and then fails in its ZeRO-3 linear (see train_step.py; the
small models of tests/integrations/ds_train.py still pass, a width-1024
one does not).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_step  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    a = train_step.parse(argv)
    for v in ("ds-nvme", "ds-nvme-aio"):
        why = train_step.available(v, a)
        if why:
            print(f"cannot run {v}: {why}", file=sys.stderr)
            return 2
    root = tempfile.mkdtemp(prefix="aio-ds-bench-", dir=a.dir)
    try:
        med: dict[str, list[float]] = {"aio": [], "dsop": []}
        ratios = []
        for r in range(a.rounds):
            got: dict[str, list[float]] = {"aio": [], "dsop": []}
            for io in ("aio", "dsop", "dsop", "aio"):
                res = train_step.run_one(a, "ds-nvme-aio" if io == "aio" else "ds-nvme", root)
                got[io].append(res["step_s"])
            for io in got:
                med[io].append(sum(got[io]) / 2)
            ratios.append(med["dsop"][-1] / med["aio"][-1])
            print(
                f"round {r + 1}: aio {med['aio'][-1] * 1e3:.1f} ms, DeepSpeed op "
                f"{med['dsop'][-1] * 1e3:.1f} ms per step",
                file=sys.stderr,
            )
        print(
            f"ZeRO-3, params+optimizer on NVMe, {a.model} {train_step.n_params(a) / 1e6:.1f}M params, "
            f"{'bf16' if a.bf16 else 'fp32'}: median step aio {statistics.median(med['aio']) * 1e3:.1f} ms, "
            f"DeepSpeed op {statistics.median(med['dsop']) * 1e3:.1f} ms; "
            f"DeepSpeed-op / aio step time = {statistics.median(ratios):.3f} "
            f"[{min(ratios):.3f}..{max(ratios):.3f}] over {a.rounds} rounds"
        )
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
