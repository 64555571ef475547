"""Training step time: aio.zero with NVMe offload vs CPU offload vs in memory,
and vs DeepSpeed ZeRO-3 with the same NVMe config (when installed).

    python bench/train_step.py [--dir /local_nvme] [--rounds 5] [--steps 8]
                               [--width 1024] [--layers 8] [--json out.json]

Every variant runs in its own process (fresh memory, same model, data and
AdamW); rounds are interleaved (A B C ... A B C ...) because the drive here
is noisy, and each ratio is the median over rounds of (variant / aio.zero
nvme) step time, each run's step time being the median of its steps after
the first two. Variants:

  zero-nvme       aio.zero, params + optimizer on the drive, the same
                  zero_optimization block DeepSpeed gets (prefetch off:
                  DeepSpeed 0.19 asserts with NVMe param prefetch on)
  zero-nvme-pf    the same with parameter prefetch on (aio.zero's default)
  zero-cpu        aio.zero, everything in CPU memory
  memory          plain PyTorch, no offload
  ds-nvme         DeepSpeed ZeRO-3 NVMe offload on its own async_io op
                  (needs deepspeed and libaio-dev for its JIT build)
  ds-nvme-aio     DeepSpeed ZeRO-3 NVMe offload on aio's handle
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

BATCH = 8


def zero_block(nvme: str, width: int, prefetch: int) -> dict:
    return {
        "stage": 3,
        "sub_group_size": 2_000_000,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": prefetch,
        "offload_param": {
            "device": "nvme",
            "nvme_path": nvme,
            "buffer_count": 32,
            "buffer_size": max(300_000, width * width),
            "max_in_cpu": 0,
            "pin_memory": True,
        },
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": nvme,
            "buffer_count": 16,
            "pipeline_read": True,
            "pipeline_write": True,
            "pin_memory": True,
        },
    }


AIO_BLOCK = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1}


def worker(a: argparse.Namespace) -> dict:
    if a.variant.startswith("ds"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29631"), ("RANK", "0")):
            os.environ.setdefault(k, v)
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    import torch

    torch.manual_seed(1234)
    mods: list = []
    for _ in range(a.layers):
        mods += [torch.nn.Linear(a.width, a.width), torch.nn.GELU()]
    mods.append(torch.nn.Linear(a.width, 16))
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(99)
    data = [
        (torch.randn(BATCH, a.width, generator=g), torch.randn(BATCH, 16, generator=g))
        for _ in range(a.steps)
    ]
    zero = zero_block(a.dir, a.width, 50_000_000 if a.variant == "zero-nvme-pf" else 0)
    if a.variant == "zero-cpu":
        zero = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    engine: object
    if a.variant == "memory":
        engine = None
    elif a.variant.startswith("zero"):
        import aio.zero

        engine = aio.zero.initialize(model, {"zero_optimization": zero, "aio": AIO_BLOCK}, optimizer=opt)
    else:
        if a.variant == "ds-nvme-aio":
            import aio.integrations.deepspeed as aio_ds

            aio_ds.enable()
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "zero_force_ds_cpu_optimizer": False,
            "aio": {**AIO_BLOCK, "single_submit": False, "overlap_events": True},
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    times, losses = [], []
    for x, y in data:
        t0 = time.perf_counter()
        if engine is None:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            loss = torch.nn.functional.mse_loss(engine(x), y)  # type: ignore[operator]
            engine.backward(loss)  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if engine is not None and hasattr(engine, "close"):
        engine.close()
    return {"step_s": statistics.median(times[2:] or times), "losses": losses}


def available(variant: str) -> str | None:
    """None if the variant can run here, else why not."""
    if not variant.startswith("ds"):
        return None
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return "deepspeed is not installed"
    if variant == "ds-nvme" and not os.path.exists("/usr/include/libaio.h"):
        return "DeepSpeed's async_io op needs libaio-dev to build"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="drive directory (default: a temporary directory)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--variants", default="zero-nvme,zero-nvme-pf,zero-cpu,memory,ds-nvme,ds-nvme-aio", help="comma list"
    )
    ap.add_argument("--json")
    ap.add_argument("--worker", dest="variant", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.variant:
        res = worker(a)
        with open(a.out, "w") as f:
            json.dump(res, f)
        return 0

    root = a.dir or tempfile.mkdtemp(prefix="aio-train-bench-")
    variants = []
    for v in a.variants.split(","):
        why = available(v)
        if why:
            print(f"skipping {v}: {why}")
        else:
            variants.append(v)
    results: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, list[float]] = {}
    try:
        for r in range(a.rounds):
            for v in variants:
                drive = tempfile.mkdtemp(prefix=f"{v}-", dir=root)
                out = os.path.join(drive, "result.json")
                cmd = [sys.executable, __file__, "--worker", v, "--out", out, "--dir", drive]
                cmd += ["--steps", str(a.steps), "--width", str(a.width), "--layers", str(a.layers)]
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode != 0:
                    print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"{v} failed (exit {p.returncode})")
                with open(out) as f:
                    res = json.load(f)
                shutil.rmtree(drive, ignore_errors=True)
                results[v].append(res["step_s"])
                losses[v] = res["losses"]
                print(f"round {r + 1} {v:13s} {res['step_s'] * 1000:8.1f} ms/step", flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    base = "zero-nvme" if "zero-nvme" in results else variants[0]
    n_params = a.layers * (a.width * a.width + a.width) + a.width * 16 + 16
    print(f"\n{n_params / 1e6:.1f}M-parameter MLP, batch {BATCH}, {a.steps} steps x {a.rounds} rounds")
    summary = {}
    for v in variants:
        ratios = sorted(x / y for x, y in zip(results[v], results[base], strict=True))
        med = statistics.median(results[v])
        summary[v] = {"median_step_s": med, "ratio_vs_" + base: statistics.median(ratios), "runs": results[v]}
        print(
            f"{v:13s} median {med * 1000:8.1f} ms  {v}/{base} {statistics.median(ratios):.3f} "
            f"[{ratios[0]:.3f}..{ratios[-1]:.3f}]"
        )
    same = {v: losses[v] == losses.get(base) for v in variants}
    print("losses identical to " + base + ": " + ", ".join(f"{v}={same[v]}" for v in variants))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "losses": losses, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
