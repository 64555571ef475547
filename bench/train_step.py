"""Training step: aio.zero against DeepSpeed ZeRO-3, CPU offload and NVMe
offload, plus the same training in memory; one table, measured in one run.

    python bench/train_step.py [--dir /local_nvme] [--rounds 3] [--steps 8]
                               [--model mlp|gpt] [--cuda] [--json out.json]

Variants (``--variants``, comma list; the default is the first five):

  memory        plain PyTorch, no offload (torch AdamW; fused on CUDA)
  ds-cpu        DeepSpeed ZeRO-3, parameters + optimizer offloaded to CPU
                (its DeepSpeedCPUAdam, built by its JIT on first use)
  zero-cpu      aio.zero, the same config
  ds-nvme       DeepSpeed ZeRO-3, parameters + optimizer on the drive, on its
                own async_io op (needs libaio-dev for the JIT build)
  zero-nvme     aio.zero, the same config
  zero-nvme-pf  aio.zero NVMe with parameter prefetch on (DeepSpeed 0.19
                asserts with NVMe parameter prefetch, so the shared block has
                it off)
  ds-nvme-aio   DeepSpeed ZeRO-3 NVMe on aio's handle (aio.integrations)
  ds-nvme-hf    DeepSpeed ZeRO-3 NVMe at HF's documented block on aio:
                parameter/optimizer buffer_count 5/4, pipelining on, reuse
                distance and max live 1e9, prefetch 0.9 h^2, persistence 10 h
                (DeepSpeed's own swappers assert there; aio's buffer rules,
                aio.integrations.ds_swappers, make it run)
  ds-nvme-safe  the same block with the workaround DeepSpeed users find
                (stage3_max_reuse_distance 0, pipelining off), on aio's
                handle with DeepSpeed's own swapper classes

Both engines get the identical config dict: the ``zero_optimization`` block,
``optimizer: {type: AdamW}``, ``gradient_clipping: 1.0``, the ``aio`` block
and, with ``--cuda`` or ``--bf16``, ``bf16.enabled``. Same model, data and
seed in every variant.

DeepSpeed on the CPU (no ``--cuda``): ``DS_ACCELERATOR=cpu`` and a
one-process gloo group. DeepSpeed 0.19.8 on its CPU accelerator cannot run
an fp32 model with NVMe parameter offload: ``zero.Init._set_dtype`` with an
explicit dtype evaluates ``dtype or fp16 if is_fp16_supported() else bf16
if is_bf16_supported else fp32``, which binds as ``(dtype or fp16) if ...
else ...``; ``is_fp16_supported()`` returns None without mkldnn fp16 and
``is_bf16_supported`` is not called (always true), so the parameter
swapper gets bf16 buffers while the model is fp32, and its ZeRO-3 linear
fails with "self and mat2 must have the same dtype, but got Float and
BFloat16" (ds-nvme and ds-nvme-aio alike, once parameters are large: a
width-1024 MLP fails, the width-256 models of tests/integrations pass;
ds-cpu is unaffected). That is
DeepSpeed's bug, not the bench's config; the bench therefore runs every
variant in bf16 by default (``bf16.enabled`` for the engines, bf16
autocast in memory), as on the GPU. ``--fp32`` runs fp32 and skips the
DeepSpeed NVMe variants. On a CPU without native bf16 (the dev box: AVX2
only) a bf16 GPT's backward is ~10x slower than fp32 (25 s per step for the
17M-parameter CPU default), so on such a CPU use ``--model gpt --fp32``.

Columns (each run in a fresh process; figures are medians over the steps
after ``--warmup``):

  s/step       whole step: forward, backward, step()
  step()       the optimizer phase alone: ``engine.step()`` /
               ``trainer.step()`` (in memory: clip + AdamW + zero_grad)
  peak RSS     VmHWM of the worker process (aio.train.peak_rss)
  pinned       aio: ``trainer.pinned_bytes()``; DeepSpeed: the bytes it asks
               its accelerator's ``pin_memory`` to pin (a no-op on its CPU
               accelerator, counted anyway: on a GPU they are pinned) plus
               the page-locked memory of its I/O handles (VmLck). VmLck is
               also reported for every variant.
  drive B/step read_bytes + write_bytes of /proc/self/io per step (counts
               the same way for both engines; aio's own ``io_bytes()`` delta
               is reported beside it as a check)
  I/O eff.     step time / (bytes read / drive read GB/s + bytes written /
               drive write GB/s), the drive measured in the same round with
               aio's handle (1 GiB written then read, O_DIRECT, on the same
               directory): 1.0 means the step runs at the drive's speed,
               2.0 that it takes twice the time the drive needs
  minflt, sys, user  minor page faults, system and user CPU seconds per
               step (getrusage of the worker, all its threads)

Method: rounds are interleaved (all variants, then all again), each timed
run after ~1 s idle; the ratios DeepSpeed/aio (ds-cpu/zero-cpu,
ds-nvme/zero-nvme) are taken per round and their median reported (> 1:
aio is faster / smaller).
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
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_VARIANTS = "memory,ds-cpu,zero-cpu,ds-nvme,zero-nvme"
ALL_VARIANTS = DEFAULT_VARIANTS.split(",") + ["zero-nvme-pf", "ds-nvme-aio", "ds-nvme-hf", "ds-nvme-safe"]
PAIRS = (
    ("ds-cpu", "zero-cpu"),
    ("ds-nvme", "zero-nvme"),
    ("ds-nvme-aio", "zero-nvme"),
    ("ds-nvme-hf", "zero-nvme"),
    ("ds-nvme-safe", "zero-nvme"),
)
AIO_BLOCK = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1}
LABELS = {
    "memory": "in memory (plain PyTorch)",
    "ds-cpu": "DeepSpeed ZeRO-3, CPU offload",
    "zero-cpu": "aio.zero, CPU offload",
    "ds-nvme": "DeepSpeed ZeRO-3, NVMe (own op)",
    "zero-nvme": "aio.zero, NVMe",
    "zero-nvme-pf": "aio.zero, NVMe, prefetch on",
    "ds-nvme-aio": "DeepSpeed ZeRO-3, NVMe on aio",
    "ds-nvme-hf": "DeepSpeed ZeRO-3, NVMe, HF's block on aio",
    "ds-nvme-safe": "DeepSpeed ZeRO-3, NVMe, HF's block, workaround",
}


# -- model and data ----------------------------------------------------------------------
def model_defaults(a: argparse.Namespace) -> None:
    """Fill unset sizes: the MLP, or the GPT of shared/GPU.md on CUDA (277M
    parameters) and a smaller one on the CPU."""
    if a.param_buffers is None:  # shared/GPU.md's NVMe row used 48 on the GPU
        a.param_buffers = 48 if a.cuda else 32
    if a.model == "mlp":
        d = {"width": 1024, "layers": 8, "batch": 8}
    elif a.cuda:
        d = {"width": 1536, "layers": 8, "batch": 8, "vocab": 32000, "seq": 1024, "heads": 12}
    else:
        d = {"width": 512, "layers": 4, "batch": 4, "vocab": 8192, "seq": 128, "heads": 8}
    for k, v in d.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.sub_group_size is None:  # aio.zero needs every parameter to fit one sub-group
        a.sub_group_size = max(2_000_000, largest_param(a))


def largest_param(a: argparse.Namespace) -> int:
    """Elements of the model's largest parameter (the GPT's tied embedding/head,
    or its 4x MLP matrix)."""
    if a.model == "mlp":
        return int(a.width * a.width)
    return int(max(4 * a.width * a.width, a.vocab * a.width))


def n_params(a: argparse.Namespace) -> int:
    """Trainable parameters of the model the flags describe."""
    if a.model == "mlp":
        return a.layers * (a.width * a.width + a.width) + a.width * 16 + 16
    from aio.train import gpt_params

    return int(gpt_params(a.vocab, a.width, a.layers, a.seq))


def build(a: argparse.Namespace) -> tuple[Any, list[tuple[Any, Any]], Any]:
    """(model on the CPU in fp32, batches, loss function); the same for every variant."""
    import torch

    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(99)
    n = a.warmup + a.steps
    if a.model == "mlp":
        mods: list[Any] = []
        for _ in range(a.layers):
            mods += [torch.nn.Linear(a.width, a.width), torch.nn.GELU()]
        mods.append(torch.nn.Linear(a.width, 16))
        data = [
            (torch.randn(a.batch, a.width, generator=g), torch.randn(a.batch, 16, generator=g))
            for _ in range(n)
        ]

        def loss_fn(out: Any, y: Any) -> Any:
            return torch.nn.functional.mse_loss(out.float(), y.float())

        return torch.nn.Sequential(*mods), data, loss_fn
    from aio.train import batch, build_gpt

    model = build_gpt(a.vocab, a.width, a.layers, a.heads, a.seq)
    data = [batch(i, 0, a.batch, a.seq, a.vocab) for i in range(n)]

    def ce(out: Any, y: Any) -> Any:
        return torch.nn.functional.cross_entropy(out.float().view(-1, out.shape[-1]), y.reshape(-1))

    return model, data, ce


# -- the config both engines get -----------------------------------------------------------
def zero_block(a: argparse.Namespace, variant: str, nvme: str) -> dict:
    """The zero_optimization block: identical for DeepSpeed and aio.zero
    (only prefetch differs, for zero-nvme-pf)."""
    prefetch = 50_000_000 if variant == "zero-nvme-pf" else 0
    block: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": a.sub_group_size,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": prefetch,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
    }
    if variant.endswith("-cpu"):
        block["offload_param"] = {"device": "cpu", "pin_memory": True}
        block["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        return block
    largest = largest_param(a)
    block["offload_param"] = {
        "device": "nvme",
        "nvme_path": nvme,
        "buffer_count": a.param_buffers,
        "buffer_size": max(300_000, largest),
        "max_in_cpu": 0,
        "pin_memory": True,
    }
    block["offload_optimizer"] = {
        "device": "nvme",
        "nvme_path": nvme,
        "buffer_count": a.optimizer_buffers,
        "pipeline_read": True,
        "pipeline_write": True,
        "pin_memory": True,
    }
    if variant in ("ds-nvme-hf", "ds-nvme-safe"):
        hf_block(a, block, workaround=variant == "ds-nvme-safe")
    return block


def hf_block(a: argparse.Namespace, block: dict, workaround: bool) -> None:
    """HF Transformers' documented ZeRO-3 NVMe values (the Trainer's ``auto``
    ones for this width) in `block`; with `workaround`, the reuse distance 0
    and pipelining off that let DeepSpeed's own swappers run."""
    h = a.width
    block["stage3_prefetch_bucket_size"] = int(0.9 * h * h)
    block["stage3_param_persistence_threshold"] = 10 * h
    block["stage3_max_reuse_distance"] = 0 if workaround else 1_000_000_000
    block["offload_param"]["buffer_count"] = 5
    block["offload_optimizer"]["buffer_count"] = 4
    block["offload_optimizer"]["pipeline_read"] = not workaround
    block["offload_optimizer"]["pipeline_write"] = not workaround


def full_config(a: argparse.Namespace, variant: str, nvme: str) -> dict:
    """The whole DeepSpeed-format config (aio.zero ignores DeepSpeed-only keys)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": zero_block(a, variant, nvme),
        "aio": {**AIO_BLOCK, "single_submit": False, "overlap_events": True},
        "steps_per_print": 10**9,
    }
    if a.bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


# -- measuring inside the worker ----------------------------------------------------------
def proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process caused at the block layer so far."""
    vals = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, _, v = line.partition(":")
            vals[k] = int(v)
    return vals["read_bytes"], vals["write_bytes"]


def vm_locked() -> int:
    """Bytes of this process's page-locked (mlock) memory, from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


class PinCounter:
    """Counts the bytes DeepSpeed asks its accelerator to pin (installed
    before the engine is built; on its CPU accelerator pin_memory pins nothing)."""

    def __init__(self) -> None:
        from deepspeed.accelerator import get_accelerator

        self.bytes = 0
        acc = get_accelerator()
        original = acc.pin_memory

        def pin_memory(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.bytes += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        acc.pin_memory = pin_memory


def ds_environment(a: argparse.Namespace) -> None:
    """One-process DeepSpeed: the CPU accelerator unless --cuda, a local group."""
    if not a.cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    port = str(29500 + (os.getpid() % 2000))
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port), ("RANK", "0")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")


def make_engine(a: argparse.Namespace, model: Any, config: dict) -> tuple[Any, Any, dict]:
    """(engine or None for in-memory, in-memory optimizer or None, extras for the result)."""
    import torch

    v = a.variant
    extra: dict[str, Any] = {}
    if v == "memory":
        if a.cuda:
            model.cuda()
        opt_kw = dict(config["optimizer"]["params"], betas=tuple(config["optimizer"]["params"]["betas"]))
        if a.cuda:
            opt_kw["fused"] = True
        return None, torch.optim.AdamW(model.parameters(), **opt_kw), extra
    if v.startswith("zero"):
        import aio.zero

        dev = "cuda" if a.cuda else "cpu"
        return aio.zero.initialize(model, config, device=dev), None, extra
    ds_environment(a)
    if v in ("ds-nvme-aio", "ds-nvme-hf", "ds-nvme-safe"):
        import aio.integrations.deepspeed as aio_ds

        aio_ds.enable()
        if v == "ds-nvme-safe":  # DeepSpeed's own swapper classes, on aio's handle
            from aio.integrations import ds_swappers

            ds_swappers.uninstall()
    import deepspeed

    pins = PinCounter()
    deepspeed.init_distributed(dist_backend="nccl" if a.cuda else "gloo")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    extra["pin_counter"] = pins
    return engine, None, extra


def sync(a: argparse.Namespace) -> None:
    if a.cuda:
        import torch

        torch.cuda.synchronize()


def run_steps(a: argparse.Namespace, engine: Any, opt: Any, model: Any, data: list, loss_fn: Any) -> dict:
    """Train over `data`; per-step wall times (whole step and step() alone),
    drive bytes, page faults and CPU times as lists."""
    import resource

    import torch

    dev = "cuda" if a.cuda else "cpu"
    rec: dict[str, list[float]] = {
        k: [] for k in ("step_s", "phase_s", "read_b", "write_b", "io_b", "minflt", "sys_s", "user_s", "loss")
    }
    # In memory: fp32 weights under bf16 autocast (the engines keep fp32 masters too).
    autocast = torch.autocast(dev, dtype=torch.bfloat16) if (a.bf16 and engine is None) else None
    for x, y in data:
        x, y = x.to(dev), y.to(dev)
        if a.bf16 and engine is not None and x.is_floating_point():
            x = x.to(torch.bfloat16)
        sync(a)
        r0, w0 = proc_io()
        io0 = engine.io_bytes() if hasattr(engine, "io_bytes") else 0
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        if engine is None:
            if autocast is not None:
                with autocast:
                    loss = loss_fn(model(x), y)
            else:
                loss = loss_fn(model(x), y)
            loss.backward()
            sync(a)
            t1 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            sync(a)
            t1 = time.perf_counter()
            engine.step()
        sync(a)
        t2 = time.perf_counter()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        r1, w1 = proc_io()
        rec["step_s"].append(t2 - t0)
        rec["phase_s"].append(t2 - t1)
        rec["read_b"].append(r1 - r0)
        rec["write_b"].append(w1 - w0)
        rec["io_b"].append((engine.io_bytes() if hasattr(engine, "io_bytes") else 0) - io0)
        rec["minflt"].append(ru1.ru_minflt - ru0.ru_minflt)
        rec["sys_s"].append(ru1.ru_stime - ru0.ru_stime)
        rec["user_s"].append(ru1.ru_utime - ru0.ru_utime)
        rec["loss"].append(float(loss.item()))
    return rec


def worker(a: argparse.Namespace) -> dict:
    """One variant in this (fresh) process: build, train, measure."""
    if a.variant.startswith("ds"):
        ds_environment(a)  # before torch/deepspeed pick an accelerator
    import torch

    model, data, loss_fn = build(a)
    config = full_config(a, a.variant, a.dir)
    engine, opt, extra = make_engine(a, model, config)
    if a.cuda:
        torch.cuda.reset_peak_memory_stats()
    rec = run_steps(a, engine, opt, model, data, loss_fn)
    timed = slice(a.warmup, None)
    res: dict[str, Any] = {k: statistics.median(rec[k][timed]) for k in ("step_s", "phase_s")}
    for k in ("read_b", "write_b", "io_b", "minflt", "sys_s", "user_s"):
        res[k] = statistics.mean(rec[k][timed])
    res["losses"] = rec["loss"]
    res["step_times"] = rec["step_s"]
    from aio.train import peak_rss

    res["peak_rss"] = peak_rss()
    res["vmlck"] = vm_locked()
    if engine is not None and hasattr(engine, "pinned_bytes"):
        res["pinned"] = int(engine.pinned_bytes())
    elif "pin_counter" in extra:
        res["pinned"] = extra["pin_counter"].bytes + res["vmlck"]
    else:
        res["pinned"] = 0
    if a.cuda:
        res["peak_gpu"] = torch.cuda.max_memory_allocated()
    if engine is not None and hasattr(engine, "close"):
        engine.close()
    return res


def drive_speed(directory: str, size: int) -> dict:
    """Sequential write then read of `size` bytes with aio's handle on a file
    in `directory` (O_DIRECT where the filesystem allows): bytes/s each way."""
    import torch

    import aio

    path = os.path.join(directory, "drive-speed.bin")
    h = aio.AsyncIOHandle(**{"block_size": AIO_BLOCK["block_size"], "queue_depth": AIO_BLOCK["queue_depth"]})
    buf = aio.new_locked_tensor(size, torch.uint8)
    buf.random_(0, 256)
    try:
        t0 = time.perf_counter()
        h.sync_pwrite(buf, path)
        t1 = time.perf_counter()
        h.sync_pread(buf, path)
        t2 = time.perf_counter()
    finally:
        h.close()
        os.unlink(path)
    return {"write_Bps": size / (t1 - t0), "read_Bps": size / (t2 - t1)}


# -- the parent: rounds, ratios, table -------------------------------------------------------
def available(variant: str, a: argparse.Namespace) -> str | None:
    """None if the variant can run here, else why not."""
    if variant not in ALL_VARIANTS:
        return f"unknown variant (known: {', '.join(ALL_VARIANTS)})"
    if variant.startswith("ds"):
        try:
            import importlib.util

            if importlib.util.find_spec("deepspeed") is None:
                return "deepspeed is not installed"
        except ImportError:
            return "deepspeed is not installed"
        if variant.startswith("ds-nvme") and not (a.cuda or a.bf16):
            return "DeepSpeed 0.19.8 partitions NVMe parameters in bf16 on its CPU accelerator (see --help)"
        if variant == "ds-nvme" and not os.path.exists("/usr/include/libaio.h"):
            return "DeepSpeed's async_io op needs libaio-dev (libaio.h) to build"
    return None


def child_args(a: argparse.Namespace) -> list[str]:
    out = ["--model", a.model, "--steps", str(a.steps), "--warmup", str(a.warmup)]
    for k in ("width", "layers", "batch", "vocab", "seq", "heads"):
        if getattr(a, k, None) is not None:
            out += [f"--{k}", str(getattr(a, k))]
    out += ["--sub-group-size", str(a.sub_group_size), "--param-buffers", str(a.param_buffers)]
    out += ["--optimizer-buffers", str(a.optimizer_buffers)]
    out.append("--bf16" if a.bf16 else "--fp32")
    if a.cuda:
        out.append("--cuda")
    return out


def worker_env() -> dict[str, str]:
    """The environment of a worker process: this checkout on PYTHONPATH, and
    torch's large CPU tensors on huge pages (``THP_MEM_ALLOC_ENABLE=1``, as
    aio-train sets it) unless the caller's environment says either way; every
    variant gets the same, so the engines are compared on one allocator."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return env


def run_one(
    a: argparse.Namespace, v: str, root: str, script: str = __file__, extra: tuple[str, ...] = ()
) -> dict:
    """Run worker `v` of `script` (default: this one) in a fresh process after
    ``--idle`` seconds, with the model flags and `extra`; its result dict."""
    drive = tempfile.mkdtemp(prefix=f"{v}-", dir=root)
    out = os.path.join(drive, "result.json")
    cmd = [sys.executable, os.path.abspath(script), "--worker", v, "--out", out, "--dir", drive]
    env = worker_env()
    time.sleep(a.idle)
    try:
        p = subprocess.run(cmd + child_args(a) + list(extra), capture_output=True, text=True, env=env)
        if p.returncode != 0:
            print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"{v} failed (exit {p.returncode})")
        with open(out) as f:
            return dict(json.load(f))
    finally:
        shutil.rmtree(drive, ignore_errors=True)


def measure_drive(a: argparse.Namespace, root: str) -> dict:
    time.sleep(a.idle)
    cmd = [sys.executable, os.path.abspath(__file__), "--drive-only", "--dir", root]
    cmd += ["--drive-size", str(a.drive_size)]
    env = worker_env()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        print(p.stderr[-3000:], file=sys.stderr)
        raise SystemExit("drive measurement failed")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def drive_floor(read_b: float, write_b: float, drive: dict) -> float:
    """Seconds the drive needs for these bytes: read / read rate + written /
    write rate (`drive` as :func:`drive_speed` gives it, bytes/s)."""
    return read_b / drive["read_Bps"] + write_b / drive["write_Bps"]


def io_eff(res: dict, drive: dict) -> float | None:
    """step time / the time the drive needs for this step's bytes (None without I/O)."""
    need = drive_floor(res["read_b"], res["write_b"], drive)
    return res["step_s"] / need if res["read_b"] + res["write_b"] > 1 << 20 else None


def summarise(runs: dict[str, list[dict]], drives: list[dict]) -> dict:
    """Per-variant medians over rounds and per-round DeepSpeed/aio ratios."""
    out: dict[str, Any] = {"variants": {}, "ratios": {}}
    keys = (
        "step_s",
        "phase_s",
        "peak_rss",
        "pinned",
        "vmlck",
        "read_b",
        "write_b",
        "io_b",
        "minflt",
        "sys_s",
        "user_s",
    )
    for v, rs in runs.items():
        row = {k: statistics.median(r[k] for r in rs) for k in keys}
        effs = [e for e in (io_eff(r, d) for r, d in zip(rs, drives, strict=True)) if e is not None]
        row["io_eff"] = statistics.median(effs) if effs else None
        if "peak_gpu" in rs[0]:
            row["peak_gpu"] = statistics.median(r["peak_gpu"] for r in rs)
        row["rounds"] = rs
        out["variants"][v] = row
    for ds, ours in PAIRS:
        if ds in runs and ours in runs:
            per = {}
            for k in ("step_s", "phase_s", "peak_rss", "pinned", "minflt", "sys_s", "read_b", "write_b"):
                vals = [r1[k] / r2[k] for r1, r2 in zip(runs[ds], runs[ours], strict=True) if r2[k]]
                if vals:
                    per[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
            out["ratios"][f"{ds}/{ours}"] = per
    return out


def print_table(summary: dict, drives: list[dict], a: argparse.Namespace) -> None:
    mib, gib = 1 << 20, 1 << 30
    print()
    print(
        f"{a.model} {n_params(a) / 1e6:.1f}M params, batch {a.batch}, "
        f"{'bf16' if a.bf16 else 'fp32'}, {'CUDA' if a.cuda else 'CPU'}; "
        f"{a.steps} timed steps after {a.warmup} warm-up x {a.rounds} rounds"
    )
    rd = statistics.median(d["read_Bps"] for d in drives) / 1e9
    wr = statistics.median(d["write_Bps"] for d in drives) / 1e9
    print(
        f"drive (aio handle, {a.drive_size >> 20} MiB, median over rounds): "
        f"read {rd:.2f} GB/s, write {wr:.2f} GB/s"
    )
    head = (
        f"| {'variant':34s} | s/step | step() s | peak RSS GiB | pinned MiB | VmLck MiB | drive MB/step "
        f"| I/O eff. | minflt/step | sys s/step | user s/step |"
    )
    if a.cuda:
        head += " peak GPU GiB |"
    print(head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    for v, r in summary["variants"].items():
        eff = f"{r['io_eff']:.2f}" if r["io_eff"] is not None else "-"
        mb = (r["read_b"] + r["write_b"]) / 1e6
        gpu = f" {r['peak_gpu'] / gib:.2f} |" if "peak_gpu" in r else ""
        print(
            f"| {LABELS[v]:34s} | {r['step_s']:.3f} | {r['phase_s']:.3f} | {r['peak_rss'] / gib:.2f} "
            f"| {r['pinned'] / mib:.0f} | {r['vmlck'] / mib:.0f} | {mb:.0f} | {eff} "
            f"| {r['minflt']:.0f} | {r['sys_s']:.3f} | {r['user_s']:.3f} |{gpu}"
        )
    for pair, per in summary["ratios"].items():
        parts = [f"{k} {x['median']:.3f} [{x['min']:.3f}..{x['max']:.3f}]" for k, x in per.items()]
        print(f"{pair} (per-round ratio, median [min..max]): " + "; ".join(parts))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--dir", help="drive directory (default: a temporary directory)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    for k in ("width", "layers", "batch", "vocab", "seq", "heads"):
        ap.add_argument(f"--{k}", type=int)
    ap.add_argument("--sub-group-size", type=int, help="default: max(2M, the largest parameter)")
    ap.add_argument("--param-buffers", type=int, help="offload_param.buffer_count (32; 48 with --cuda)")
    ap.add_argument("--optimizer-buffers", type=int, default=16, help="offload_optimizer.buffer_count")
    prec = ap.add_mutually_exclusive_group()
    prec.add_argument("--bf16", dest="bf16", action="store_true", default=True, help="bf16 (the default)")
    prec.add_argument(
        "--fp32", dest="bf16", action="store_false", help="fp32 (DeepSpeed fails on its CPU accelerator)"
    )
    ap.add_argument(
        "--cuda", action="store_true", help="model and batch on the GPU, DeepSpeed on its CUDA accelerator"
    )
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of {', '.join(ALL_VARIANTS)}")
    ap.add_argument("--idle", type=float, default=1.0, help="seconds idle before each timed run")
    ap.add_argument("--drive-size", type=int, default=1 << 30, help="bytes for the drive measurement")
    ap.add_argument("--json", help="write every measurement and the summary here")
    ap.add_argument("--worker", dest="variant", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--drive-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    model_defaults(a)
    if a.model == "gpt" and a.width % a.heads:
        ap.error(f"--width {a.width} is not a multiple of --heads {a.heads}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.drive_only:
        print(json.dumps(drive_speed(a.dir, a.drive_size)))
        return 0
    if a.variant:
        res = worker(a)
        with open(a.out, "w") as f:
            json.dump(res, f)
        return 0
    root = a.dir or tempfile.mkdtemp(prefix="aio-train-bench-")
    os.makedirs(root, exist_ok=True)  # --dir may name a folder still to make
    variants = []
    for v in a.variants.split(","):
        why = available(v, a)
        if why:
            print(f"skipping {v}: {why}")
        else:
            variants.append(v)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    drives: list[dict] = []
    try:
        for r in range(a.rounds):
            t_round = time.perf_counter()
            drives.append(measure_drive(a, root))
            for v in variants:
                res = run_one(a, v, root)
                runs[v].append(res)
                print(
                    f"round {r + 1} {v:13s} {res['step_s']:8.3f} s/step  step() {res['phase_s']:.3f} s",
                    flush=True,
                )
            print(f"round {r + 1} took {time.perf_counter() - t_round:.0f} s", flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarise(runs, drives)
    print_table(summary, drives, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "drives": drives, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
