#!/usr/bin/env python3
"""What aio.zero's GPU data path does, counted under the test suite's CUDA
simulator (tests/zero/cuda_sim.py) -- counts, not times: peak device bytes
against the model's parameter bytes, pageable host<->device copies, host
waits per step, for a GPU that keeps up (``eager``) and one that never runs
ahead of the host (``lazy``), at several ``aio_zero.modules_ahead``.

    PYTHONPATH=. python bench/gpu_sim_counts.py [--steps 2] [--ahead 1 2 4] [--gpus eager lazy]

Speed on a real GPU is bench/train_step.py --cuda (scripts/gpu_acceptance.sh).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import aio.zero  # noqa: E402
from tests.zero.common import cfg_for, gpt  # noqa: E402
from tests.zero.cuda_sim import CudaSim  # noqa: E402
from tests.zero.test_gpu_sim import train_on_device  # noqa: E402


def count(scheduler: str, ahead: int, steps: int) -> dict:
    """One run's simulator and trainer counters."""
    with tempfile.TemporaryDirectory() as d, CudaSim(scheduler=scheduler) as sim:
        model = gpt()
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        cfg = cfg_for(d, aio_zero={"modules_ahead": ahead})
        with aio.zero.initialize(model, cfg, device="cuda") as engine:
            train_on_device(engine, steps)
            fetches = engine.stats()["fetcher"]["fetches"]
        s = sim.stats()
    return {"param_bytes": param_bytes, "fetches": fetches, **s}


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--ahead", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument(
        "--gpus", nargs="+", choices=("eager", "lazy"), default=["eager", "lazy"], help="simulated GPUs"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| GPU | modules_ahead | peak device / params | pageable H2D | host waits / step |")
    print("|---|---|---|---|---|")
    for scheduler in args.gpus:
        for ahead in args.ahead:
            c = count(scheduler, ahead, args.steps)
            print(
                f"| {scheduler} | {ahead} | {c['peak_device_bytes'] / c['param_bytes']:.2f} | "
                f"{c['pageable_h2d']} | {c['blocking_waits'] / args.steps:.1f} |"
            )


if __name__ == "__main__":
    main()
