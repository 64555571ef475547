#!/usr/bin/env python3
"""Pinned (page-locked) host memory: aio.zero vs DeepSpeed ZeRO-3, same config,
same model (the GPT-like MLP of bench/train_step.py), one training step each.

    python bench/pinned_memory.py [--dir /local_nvme] [--width 1024] [--layers 8] [--json out.json]

Each side trains one step in its own fresh process and reports:

- aio: ``trainer.pinned_bytes()``, ``aio.locked_bytes()``, the kernel's VmLck
  (/proc/self/status) and ``aio-config estimate`` for the same config and
  parameter sizes.
- DeepSpeed (DS_ACCELERATOR=cpu, a one-process gloo group): its swap buffers
  are mlock'ed on CPU too (VmLck); what it pins through
  ``get_accelerator().pin_memory`` (a no-op on the CPU accelerator) is counted
  by wrapping that call -- it is what a GPU run would pin on top. With
  ``--native-pins`` DeepSpeed's native pinned-memory backend locks those too,
  so VmLck sees everything.

The ratio aio / DeepSpeed (pinned bytes as on a GPU machine) must be <= 1.
Needs deepspeed and its async_io op (libaio-dev for the JIT build);
``--sides aio`` measures aio alone (no ratio, no DeepSpeed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from train_step import AIO_BLOCK, parse, zero_block  # noqa: E402

MiB = 2**20


def nvme_block(a: argparse.Namespace) -> tuple[dict, int]:
    """bench/train_step.py's zero_optimization block (zero-nvme variant) for
    this MLP, and its batch size."""
    ts = parse(["--width", str(a.width), "--layers", str(a.layers)])
    return zero_block(ts, "zero-nvme", a.dir), ts.batch


def vmlck() -> int:
    """Bytes this process has locked, as the kernel counts them (VmLck)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmLck in /proc/self/status")


def model_and_data(width: int, layers: int, batch: int):
    import torch

    torch.manual_seed(1234)
    mods: list = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    mods.append(torch.nn.Linear(width, 16))
    model = torch.nn.Sequential(*mods)
    g = torch.Generator().manual_seed(99)
    return model, torch.randn(batch, width, generator=g), torch.randn(batch, 16, generator=g)


def run_aio(a: argparse.Namespace) -> dict:
    import torch

    import aio
    import aio.zero
    from aio.config import estimate_memory

    block, batch = nvme_block(a)
    model, x, y = model_and_data(a.width, a.layers, batch)
    numels = [p.numel() for p in model.parameters()]
    config = {"zero_optimization": block, "aio": AIO_BLOCK}
    base = vmlck()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    with aio.zero.initialize(model, config, optimizer=opt) as engine:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        est = estimate_memory(config, None, "fp32", param_numels=numels)
        return {
            "pinned_bytes": engine.pinned_bytes(),
            "locked_bytes": aio.locked_bytes(),
            "vmlck": vmlck() - base,
            "estimate": est.pinned_bytes,
            "estimate_parts": est.pinned,
            "params": engine.store.pinned_bytes(),
            "optimizer": engine.optimizer.pinned_bytes(),
        }


def run_ds(a: argparse.Namespace) -> dict:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.swap_tensor import utils as swap_utils

    acc = get_accelerator()
    counted: dict[int, int] = {}  # data_ptr -> bytes handed to pin_memory
    real_pin = acc.pin_memory

    def counting_pin(tensor, *args, **kw):
        if tensor.numel():
            counted[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return real_pin(tensor, *args, **kw)

    acc.pin_memory = counting_pin
    managers: list = []
    real_init = swap_utils.SwapBufferManager.__init__

    def recording_init(self, *args, **kw):
        real_init(self, *args, **kw)
        managers.append(self)

    swap_utils.SwapBufferManager.__init__ = recording_init
    deepspeed.init_distributed(dist_backend="gloo")
    block, batch = nvme_block(a)
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": block,
        "zero_force_ds_cpu_optimizer": False,
        "aio": {**AIO_BLOCK, "single_submit": False, "overlap_events": True},
        "steps_per_print": 10**9,
    }
    base = vmlck()
    # Built under zero.Init so that the parameter swapper takes the config's
    # dtype: wrapped afterwards, DeepSpeed 0.19.8 on the CPU accelerator swaps
    # parameters through bf16 buffers (its dtype fallback) and the forward fails.
    with deepspeed.zero.Init(config_dict_or_path=config):
        model, x, y = model_and_data(a.width, a.layers, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    locked = vmlck() - base
    opt_buffers = sum(b.numel() * b.element_size() for m in managers for b in m.all_buffers)
    swapper = next((p.nvme_swapper for p in model.parameters() if hasattr(p, "nvme_swapper")), None)
    param_buffers = 0
    if swapper is not None:
        param_buffers = swapper.buffers.numel() * swapper.buffers.element_size()
        if swapper.partitioned_swap_buffer is not None:
            param_buffers += (
                swapper.partitioned_swap_buffer.numel() * swapper.partitioned_swap_buffer.element_size()
            )
    native = os.environ.get("DS_PIN_MEMORY_BACKEND") == "native"
    accel = sum(counted.values())
    return {
        "vmlck": locked,
        "optimizer_swap_buffers": opt_buffers,
        "param_swap_buffers": param_buffers,
        "accelerator_pin_memory": accel,
        # what a GPU run pins: the mlock'ed swap buffers plus the pin_memory calls
        # (already inside VmLck when the native backend locked them here)
        "pinned_bytes": locked if native else locked + accel,
        "native_pins": native,
    }


def spawn(side: str, a: argparse.Namespace, root: str) -> dict:
    drive = tempfile.mkdtemp(prefix=f"{side}-", dir=root)
    out = os.path.join(drive, "result.json")
    cmd = [sys.executable, __file__, "--worker", side, "--out", out, "--dir", drive]
    cmd += ["--width", str(a.width), "--layers", str(a.layers)]
    env = dict(os.environ)
    if side == "ds":
        env.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        env["MASTER_PORT"] = str(29500 + os.getpid() % 400)
        if a.native_pins:
            env["DS_PIN_MEMORY_BACKEND"] = "native"
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0 or not os.path.exists(out):
        raise SystemExit(f"{side} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    with open(out) as f:
        res = json.load(f)
    shutil.rmtree(drive, ignore_errors=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dir", help="drive directory (default: a temporary directory)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--native-pins", action="store_true", help="DS_PIN_MEMORY_BACKEND=native for DeepSpeed")
    ap.add_argument(
        "--sides", default="aio,ds", help="comma list of aio, ds (aio alone: no ratio, and no DeepSpeed)"
    )
    ap.add_argument("--json")
    ap.add_argument("--worker", choices=["aio", "ds"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sides = [x for x in a.sides.split(",") if x]
    if not sides or any(x not in ("aio", "ds") for x in sides):
        ap.error(f"--sides: a comma list of aio, ds; got {a.sides!r}")
    if a.worker:
        res = run_aio(a) if a.worker == "aio" else run_ds(a)
        with open(a.out, "w") as f:
            json.dump(res, f)
        return 0
    root = a.dir or tempfile.mkdtemp(prefix="aio-pinned-bench-")
    try:
        got = {side: spawn(side, a, root) for side in ("aio", "ds") if side in sides}
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    n_params = a.layers * (a.width * a.width + a.width) + a.width * 16 + 16
    print(
        f"{n_params / 1e6:.1f}M-parameter MLP (width {a.width}, {a.layers} layers), "
        "bench/train_step.py zero_block()"
    )
    ai, ds = got.get("aio"), got.get("ds")
    if ai is not None:
        print(
            f"aio:       pinned_bytes() {ai['pinned_bytes'] / MiB:8.1f} MiB  "
            f"(params {ai['params'] / MiB:.1f}, "
            f"optimizer {ai['optimizer'] / MiB:.1f})  locked_bytes() {ai['locked_bytes'] / MiB:.1f} MiB  "
            f"VmLck {ai['vmlck'] / MiB:.1f} MiB  aio-config estimate {ai['estimate'] / MiB:.1f} MiB"
        )
    if ds is not None:
        print(
            f"DeepSpeed: pinned        {ds['pinned_bytes'] / MiB:8.1f} MiB  (VmLck {ds['vmlck'] / MiB:.1f}: "
            f"optimizer swap buffers {ds['optimizer_swap_buffers'] / MiB:.1f}, param swap buffers "
            f"{ds['param_swap_buffers'] / MiB:.1f}; pin_memory() calls "
            f"{ds['accelerator_pin_memory'] / MiB:.1f}"
            f"{', locked natively' if ds['native_pins'] else ', a no-op on CPU'})"
        )
    ratio = None
    if ai is not None and ds is not None:
        ratio = ai["pinned_bytes"] / ds["pinned_bytes"]
        locked_ratio = ai["vmlck"] / ds["vmlck"] if ds["vmlck"] else float("inf")
        print(f"aio / DeepSpeed pinned bytes = {ratio:.3f}  (VmLck only: {locked_ratio:.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"aio": ai, "deepspeed": ds, "ratio": ratio, "args": vars(a)}, f, indent=1)
    return 0 if ratio is None or ratio <= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
