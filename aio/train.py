"""aio-train: train a small GPT-style model with its parameters and optimizer
state offloaded to a drive, then run the same training in memory and compare.

    aio-train                       # temp dir as the drive, 10 steps
    aio-train --nvme-path /local_nvme --layers 12 --width 768 --steps 20
    aio-train --config ds_config.json   # your DeepSpeed-format config
    aio-train --nproc 2 --steps 5       # FSDP2 on 2 ranks, both tiers on the drive (aio/fsdp/train.py)

Prints per step: loss, step time, GB/s moved to and from the drive, peak
RSS; at the end the in-memory baseline's losses and time for the same model,
data and optimizer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import MemoryEstimate


def _torch() -> Any:
    import torch

    return torch


def build_gpt(vocab: int, width: int, layers: int, heads: int, seq: int) -> Any:
    """A GPT-2-shaped decoder (tied embedding/head, pre-LayerNorm blocks)."""
    if heads < 1 or width % heads:
        raise ValueError(f"width {width} is not a multiple of heads {heads}")
    torch = _torch()
    nn: Any = _gpt2_init_layers(torch.nn)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)

        def forward(self, x: Any) -> Any:
            b, t, c = x.shape
            q, k, v = self.qkv(x).split(c, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(width)
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(width)
            self.fc = nn.Linear(width, 4 * width)
            self.act = nn.GELU()
            self.out = nn.Linear(4 * width, width)

        def forward(self, x: Any) -> Any:
            x = x + self.attn(self.ln1(x))
            return x + self.out(self.act(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, width)
            self.wpe = nn.Embedding(seq, width)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, idx: Any) -> Any:
            pos = torch.arange(idx.shape[1], device=idx.device)
            h = self.wte(idx) + self.wpe(pos)
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.ln(h))

    return GPT()


def _gpt2_init_layers(nn: Any) -> Any:
    """torch.nn with Linear and Embedding initialised as GPT-2 does (weights
    N(0, 0.02), biases 0) in their constructors. Drawing the values once as
    each layer is built, instead of torch's default and then a
    ``model.apply`` pass, spares a large model's build under aio.zero.Init
    one random draw and a read and write of every weight from the drive."""

    class Linear(nn.Linear):
        def reset_parameters(self) -> None:
            normal_on_every_core(self.weight, 0.02)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    class Embedding(nn.Embedding):
        def reset_parameters(self) -> None:
            normal_on_every_core(self.weight, 0.02)

    return types.SimpleNamespace(
        Module=nn.Module,
        ModuleList=nn.ModuleList,
        LayerNorm=nn.LayerNorm,
        GELU=nn.GELU,
        Linear=Linear,
        Embedding=Embedding,
    )


# Elements per random draw of normal_on_every_core: 4M (16 MiB of fp32) keeps
# each thread's slice in cache and the threads busy.
INIT_CHUNK = 1 << 22


def normal_on_every_core(t: Any, std: float) -> None:
    """Fill the CPU tensor `t` with N(0, std) values drawn on every core.

    torch's CPU normal_ draws from one generator in one thread: 14 s of a
    3.2B model's 30 s set-up on 2 cores. Here each 4M-element chunk gets a
    generator of its own, seeded from one draw of the global generator, so
    torch.manual_seed still decides every value and the in-memory baseline
    (the same build) gets the same ones. Elsewhere (a tensor on a GPU, or a
    small one): torch's normal_."""
    import concurrent.futures

    torch = _torch()
    n = t.numel()
    if t.device.type != "cpu" or not t.is_contiguous() or n <= INIT_CHUNK:
        with torch.no_grad():
            t.normal_(0.0, std)
        return
    seed = int(torch.randint(0, 1 << 62, (1,)).item())
    flat = t.detach().view(-1)

    def fill(k: int) -> None:
        g = torch.Generator().manual_seed(seed + k)
        flat[k * INIT_CHUNK : (k + 1) * INIT_CHUNK].normal_(0.0, std, generator=g)

    with concurrent.futures.ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        list(pool.map(fill, range(-(-n // INIT_CHUNK))))


def gpt_params(vocab: int, width: int, layers: int, seq: int) -> int:
    """The parameter count of :func:`build_gpt` with these sizes (the tied
    embedding/head counted once); `heads` does not change it."""
    per_block = 12 * width * width + 13 * width
    return vocab * width + seq * width + layers * per_block + 2 * width


# Tokens the synthetic data uses (half of the default --vocab). With every
# token of a 32000-word vocabulary equally likely, a batch of 64 tokens
# teaches nothing the next batch shares: a 2B model's loss rose.
ACTIVE_VOCAB = 128


def batch(step: int, micro: int, batch_size: int, seq: int, vocab: int) -> tuple[Any, Any]:
    """Synthetic sequences with learnable structure: arithmetic progressions
    (each token and its predecessor determine the next) over the first
    :data:`ACTIVE_VOCAB` tokens, so a large vocabulary also has something
    every batch teaches (which tokens occur at all, as in text) and the loss
    falls in the first steps at any size."""
    torch = _torch()
    g = torch.Generator().manual_seed(1000 * step + micro)
    active = min(vocab, ACTIVE_VOCAB)
    start = torch.randint(0, active, (batch_size, 1), generator=g)
    stride = torch.randint(1, 7, (batch_size, 1), generator=g)
    seqs = (start + stride * torch.arange(seq + 1)) % active
    return seqs[:, :-1], seqs[:, 1:]


def peak_rss() -> int:
    """Bytes of this process's peak resident set since it started (VmHWM).
    Not ru_maxrss: that survives execve, so a process started from a large
    parent (pytest, a notebook) would report the parent's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int:
    """This process's resident memory now, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def gib(n: float) -> str:
    """Bytes as ``1.23 GiB``, or ``456 MiB`` under a GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


# The default learning rate at width BASE_WIDTH, scaled as 1/width above it:
# Adam moves every weight by about lr per step, so a layer's output moves
# in proportion to width x lr; at 1e-3 a 2560-wide model's loss rose
# (10.95, 11.01, 11.06) where a 256-wide one's falls.
BASE_LR = 1e-3
BASE_WIDTH = 256


def default_lr(width: int) -> float:
    """``aio-train``'s learning rate for a model `width` wide."""
    return BASE_LR * min(1.0, BASE_WIDTH / width)


def lr_of(args: argparse.Namespace) -> float:
    """``--lr``, or :func:`default_lr` of ``--width`` when it was not given."""
    return float(args.lr) if args.lr is not None else default_lr(args.width)


# Sequences per micro-batch by default. aio-train shows what the drive does
# for a model past RAM, so its default step is bound by the drive, not by the
# host's matrix multiplies: one 64-token sequence. On a 2-core CPU host a
# 3.2B model's fp32 forward and backward at batch 8 take about 73 s, as long
# as the drive needs for the step's 141 GB (the step then measures the CPU),
# while at batch 1 they take about 17 s and overlap the drive's work.
# On a GPU, or to train for real, raise --batch (and --gas).
DEFAULT_BATCH = 1

# Optimizer steps of linear lr warm-up by default: Adam's first step moves
# every weight by about lr whatever its gradient's size. Measured (fp32,
# --batch 1 --seq 64), step 2's loss: width 2560, 4 layers 10.80 -> 10.69;
# 24 layers (2B) 11.06 -> 11.03. The 2B loss still rises at step 2 (10.81,
# 11.03, 8.10): one 64-token batch's loss varies by about 0.2 from batch to
# batch, and the untrained model's on step 2's is 11.07, so that first step
# did lower it; a gentler first step cannot make the printed loss fall there.
DEFAULT_WARMUP_STEPS = 2


def warmup_lr(lr: float, step: int, warmup: int) -> float:
    """The learning rate of optimizer step `step` (counted from 1) under a
    linear warm-up of `warmup` steps: ``lr * min(1, step / warmup)``, so
    step 1 takes ``lr / warmup`` (never 0) and step `warmup` on takes `lr`;
    `warmup` 0 or 1 is no warm-up."""
    if warmup <= 1 or step >= warmup:
        return lr
    return lr * (step / warmup)


# Pinned bytes the built-in config lets the optimizer swapper's buffers hold.
OPTIMIZER_BUFFER_BUDGET = 2 << 30


def optimizer_buffers(largest: int) -> dict[str, Any]:
    """The built-in config's ``offload_optimizer`` buffers for AdamW (4
    tensors per sub-group), each sized for the `largest` parameter in fp32:
    11 buffers read ahead and write behind in full; where 11 would pass
    :data:`OPTIMIZER_BUFFER_BUDGET`, 7 write behind only; past that, 4 step
    without pipelining. Each is a setting the swapper runs in full (a
    pipelining short of buffers would overlap only partly, and says so)."""
    per_buffer = 4 * largest
    for count, read, write in ((11, True, True), (7, False, True)):
        if count * per_buffer <= OPTIMIZER_BUFFER_BUDGET:
            return {"buffer_count": count, "pipeline_read": read, "pipeline_write": write}
    return {"buffer_count": 4, "pipeline_read": False, "pipeline_write": False}


def make_config(args: argparse.Namespace, nvme_path: str | list[str]) -> dict[str, Any]:
    """The DeepSpeed-format config dict for this run: the ``--config`` file as
    read (not validated here; the size and offload flags then do not change
    it), else one built from the flags, with both offload blocks on
    `nvme_path` (one directory, or a list striped over) for ``--offload nvme``."""
    if args.config:
        from .config import read_config_data

        data, _where = read_config_data(args.config)
        return dict(data)
    n = gpt_params(args.vocab, args.width, args.layers, args.seq)
    largest = max(args.vocab * args.width, 4 * args.width * args.width)
    cfg: dict[str, Any] = {
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": max(largest, min(n, args.sub_group_size)),
            "stage3_prefetch_bucket_size": max(largest, 2 * 4 * args.width * args.width),
            "stage3_param_persistence_threshold": 10_000,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": lr_of(args), "weight_decay": 0.01}},
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": args.clip,
    }
    z = cfg["zero_optimization"]
    if args.offload == "nvme":
        z["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme_path,
            "buffer_count": 8,
            "buffer_size": largest,
            "max_in_cpu": 0,
        }
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, **optimizer_buffers(largest)}
        if args.optimizer_states != "fp32":
            cfg.setdefault("aio_zero", {})["optimizer_states"] = args.optimizer_states
        if args.gradients != "auto":
            cfg.setdefault("aio_zero", {})["gradients"] = args.gradients
    elif args.offload == "cpu":
        z["offload_param"] = {"device": "cpu"}
        z["offload_optimizer"] = {"device": "cpu"}
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def gpt_activation_bytes(args: argparse.Namespace) -> int:
    """What :func:`build_gpt`'s forward saves for backward at ``--batch`` x
    ``--seq``: about 16 values per token and width in each block (the inputs
    and outputs of its layer norms, qkv, attention, projection, fc and
    GELU; measured with saved_tensors_hooks: 117 and 207 MiB for 1 and 2
    blocks of width 2880 at 512 tokens), and the fp32 logits three times
    (output, its float() and the loss's gradient)."""
    tokens = args.batch * args.seq
    per_block = 16 * tokens * args.width * (2 if args.dtype == "bf16" else 4)
    return args.layers * per_block + 3 * 4 * tokens * args.vocab


def estimate_run(args: argparse.Namespace, cfg: dict[str, Any]) -> MemoryEstimate:
    """What ``aio-config estimate`` predicts for this run before anything is
    allocated (an :class:`aio.config.MemoryEstimate`): the GPT's parameter
    count and activations, and with an offload the gradients where
    ``aio_zero.gradients`` will put them given the memory available now."""
    import aio.zero  # noqa: F401 - imported before the runtime is measured
    from aio.config import estimate_memory, load_train_config
    from aio.config.gradients import place_gradients
    from aio.config.memory import measured_runtime_bytes

    n = gpt_params(args.vocab, args.width, args.layers, args.seq)
    est = estimate_memory(
        cfg,
        n,
        dtype=args.dtype,
        optimizer_states=2,
        activation_bytes=gpt_activation_bytes(args),
        runtime_bytes=measured_runtime_bytes(),  # the torch build this runs on (CPU or CUDA wheel)
    )
    if args.offload != "none":
        est.add_gradients(place_gradients(load_train_config(cfg), n, est.held_bytes))
    return est


def _print_estimate(args: argparse.Namespace, cfg: dict[str, Any], out: Any) -> int:
    """Print the estimate before allocating (and its warnings); the predicted peak RSS."""
    est = estimate_run(args, cfg)
    print(
        f"estimate before allocating: pinned {gib(est.pinned_bytes)}, drive {gib(sum(est.nvme.values()))}, "
        f"peak RSS {gib(est.peak_rss_bytes)}",
        file=out,
    )
    for problem in est.check():
        print(f"warning: {problem}", file=out)
    return int(est.peak_rss_bytes)


def build_model(args: argparse.Namespace, cfg: dict[str, Any]) -> Any:
    """The GPT, seeded; with --init built under aio.zero.Init, each parameter
    stored (on the drive) as it is made."""
    import aio.zero

    _torch().manual_seed(args.seed)
    if args.init:
        with aio.zero.Init(cfg):
            return build_gpt(args.vocab, args.width, args.layers, args.heads, args.seq)
    return build_gpt(args.vocab, args.width, args.layers, args.heads, args.seq)


def build_trainer(args: argparse.Namespace, cfg: dict[str, Any]) -> tuple[Any, Any]:
    """The model (:func:`build_model`) and its OffloadTrainer."""
    import aio.zero

    model = build_model(args, cfg)
    return model, aio.zero.initialize(model, cfg)


def train_offloaded(args: argparse.Namespace, cfg: dict[str, Any], out: Any) -> dict[str, Any]:
    """Train with aio.zero under `cfg`, printing each step; the figures."""
    predicted = _print_estimate(args, cfg, out)
    import aio.zero

    t0 = time.perf_counter()
    model = build_model(args, cfg)
    built = time.perf_counter() - t0
    trainer = aio.zero.initialize(model, cfg)
    setup = time.perf_counter() - t0
    n = sum(p.aio_numel for p in {id(p): p for p in model.parameters()}.values())
    print(
        f"model: {n / 1e6:.1f}M parameters ({args.layers} layers, width {args.width}); "
        f"set-up {setup:.1f} s (model {built:.1f} s, trainer {setup - built:.1f} s); "
        f"pinned buffers {gib(trainer.pinned_bytes())}; fp32 optimizer state {gib(n * 12)}",
        file=out,
    )
    grads = trainer.stats()["gradients"]
    print(
        f"fp32 gradients: {'in memory' if grads['where'] == 'cpu' else 'on the drive'} ({grads['reason']})",
        file=out,
    )
    rates = _measure_floor(args, cfg, out) if args.floor else None
    try:
        run = _offloaded_steps(args, trainer, out, rates)
    finally:
        stats = trainer.stats()
        trainer.close()
    run.update(params=n, peak_rss=peak_rss(), pinned_bytes=stats["pinned_bytes"], setup_s=setup, stats=stats)
    run.update(setup_model_s=built, predicted_peak_rss=predicted)
    return run


def _drive_dir(cfg: dict[str, Any]) -> str | None:
    """The first nvme_path of the config's offload blocks (optimizer first)."""
    z = cfg.get("zero_optimization", {})
    for key in ("offload_optimizer", "offload_param"):
        block = z.get(key) or {}
        if block.get("device") == "nvme" and block.get("nvme_path"):
            path = block["nvme_path"]
            return str(path[0] if isinstance(path, list) else path)
    return None


def _measure_floor(args: argparse.Namespace, cfg: dict[str, Any], out: Any) -> dict[str, float] | None:
    """--floor: the drive's write and read GB/s in the swap directory, now."""
    from .quickcheck import drive_rates

    where = _drive_dir(cfg)
    if where is None:
        print("drive floor: no drive in this config (nothing offloaded to nvme)", file=out)
        return None
    rates = drive_rates(where, args.floor_mib << 20)
    print(
        f"drive floor reference ({args.floor_mib} MiB in {where}): write {rates['write']:.2f} GB/s, "
        f"read {rates['read']:.2f} GB/s",
        file=out,
    )
    return rates


def step_bytes(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """The bytes moved between two ``trainer.io_bytes_by_category()`` readings,
    by direction and category (categories that did not move left out)."""
    return {
        d: {k: v - before[d].get(k, 0) for k, v in after[d].items() if v - before[d].get(k, 0)} for d in after
    }


def _print_floor(
    moved: dict[str, dict[str, int]], dt: float, rates: dict[str, float] | None, out: Any
) -> float:
    """One step's bytes by category and, with drive rates, the floor: bytes
    read / read GB/s + bytes written / write GB/s. Returns the floor (0 without rates)."""
    for d in ("read", "written"):
        parts = ", ".join(f"{k} {gib(v)}" for k, v in sorted(moved[d].items()))
        print(f"      {d:7s} {parts or 'nothing'}", file=out)
    if not rates:
        return 0.0
    floor = sum(moved["read"].values()) / (rates["read"] * 1e9)
    floor += sum(moved["written"].values()) / (rates["write"] * 1e9)
    print(f"      drive floor {floor:.1f} s; step / floor {dt / floor if floor else 0:.2f}", file=out)
    return floor


def _offloaded_steps(
    args: argparse.Namespace, trainer: Any, out: Any, floor_rates: dict[str, float] | None = None
) -> dict[str, Any]:
    lf = _torch().nn.functional.cross_entropy
    losses, times, rates, by_step, floors = [], [], [], [], []
    # The warm-up scales the lr the trainer starts with: --lr's, or the
    # --config file's optimizer lr.
    base_lr = trainer.get_lr()
    phases: list[dict[str, float]] = []
    for step in range(args.steps):
        io0, cat0 = trainer.io_bytes(), trainer.io_bytes_by_category()
        trainer.set_lr(warmup_lr(base_lr, step + 1, args.warmup_steps))
        t = time.perf_counter()
        spent = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        for micro in range(args.gas):
            x, y = batch(step, micro, args.batch, args.seq, args.vocab)
            t0 = time.perf_counter()
            loss = lf(trainer(x).flatten(0, 1).float(), y.flatten())
            t1 = time.perf_counter()
            trainer.backward(loss)
            t2 = time.perf_counter()
            trainer.step()
            spent["forward"] += t1 - t0
            spent["backward"] += t2 - t1
            spent["step"] += time.perf_counter() - t2
        dt = time.perf_counter() - t
        phases.append(spent)
        moved = trainer.io_bytes() - io0
        losses.append(loss.item())
        times.append(dt)
        rates.append(moved / dt / 1e9)
        print(
            f"step {step + 1:3d}  loss {loss.item():.4f}  {dt * 1000:7.0f} ms  "
            f"{rates[-1]:5.2f} GB/s ({gib(moved)})  peak RSS {gib(peak_rss())}",
            file=out,
            flush=True,
        )
        if args.floor:
            print("      " + ", ".join(f"{k} {v:.1f} s" for k, v in spent.items()), file=out)
            by_step.append(step_bytes(cat0, trainer.io_bytes_by_category()))
            floors.append(_print_floor(by_step[-1], dt, floor_rates, out))
    run: dict[str, Any] = {"losses": losses, "step_s": times, "gbps": rates, "phase_s": phases}
    if args.floor:
        run.update(bytes_by_category=by_step, floor_s=floors, drive_gbps=floor_rates)
    return run


def train_in_memory(args: argparse.Namespace, out: Any, config: Any = None) -> dict[str, Any]:
    """The baseline: the same model, seed and data trained in memory with the
    AdamW step the offloaded run takes under `config` (aio.optim.CPUAdamW
    with the square root ``aio_zero.adam_sqrt`` names, torch's AdamW with
    ``optimizer.params.torch_adam`` or for bf16 parameters), ``--lr`` with
    ``--warmup-steps`` of warm-up (:func:`warmup_lr`), weight decay 0.01,
    ``--clip`` and ``--gas`` (with ``--config``, its values: see
    :func:`adopt_config`). Returns ``losses`` and ``step_s`` (seconds) per optimizer
    step; prints nothing (`out` is unused)."""
    from .config import load_train_config
    from .zero.trainer import stepping_optimizer

    torch = _torch()
    cls, hyper = torch.optim.AdamW, {"lr": lr_of(args), "weight_decay": 0.01}
    if args.dtype != "bf16":
        cls, hyper = stepping_optimizer(load_train_config(config or {}), cls, hyper)
    torch.manual_seed(args.seed)
    model = build_gpt(args.vocab, args.width, args.layers, args.heads, args.seq)
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    opt = cls(model.parameters(), **hyper)
    lf = torch.nn.functional.cross_entropy
    losses, times = [], []
    for step in range(args.steps):
        # The same float as the offloaded run's set_lr: the losses stay bit-identical.
        for group in opt.param_groups:
            group["lr"] = warmup_lr(lr_of(args), step + 1, args.warmup_steps)
        t = time.perf_counter()
        for micro in range(args.gas):
            x, y = batch(step, micro, args.batch, args.seq, args.vocab)
            loss = lf(model(x).flatten(0, 1).float(), y.flatten())
            (loss / args.gas if args.gas > 1 else loss).backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    return {"losses": losses, "step_s": times}


# The share of available memory the in-memory baseline may fill before it is skipped.
BASELINE_MEMORY_SHARE = 0.8


# What a --config file sets for the offloaded run: these flags would only have
# changed the header, the estimate and the in-memory baseline.
_CONFIG_SETS = ("--lr", "--gas", "--clip", "--dtype", "--offload", "--sub-group-size")


def _given(argv: list[str] | None, flags: tuple[str, ...]) -> list[str]:
    """Which of `flags` the command line gives (``--flag v`` or ``--flag=v``)."""
    words = sys.argv[1:] if argv is None else argv
    return [f for f in flags if any(w == f or w.startswith(f + "=") for w in words)]


def adopt_config(args: argparse.Namespace, cfg: dict[str, Any]) -> str | None:
    """With ``--config``: take the run's lr, gradient accumulation, clipping and
    dtype from the config (read as aio.zero reads it), so the header and the
    in-memory baseline train as the offloaded run does. Returns why the
    baseline cannot match it (another optimizer, fp16), or None."""
    from .config import load_train_config

    tc = load_train_config(cfg)
    args.gas, args.clip = tc.gradient_accumulation_steps, tc.gradient_clipping
    hyper = tc.optimizer_params
    args.lr = float(hyper.get("lr", args.lr))
    if tc.dtype == "fp16":
        return "the config trains in fp16 (the baseline trains in fp32 or bf16)"
    args.dtype = tc.dtype
    other = {k: v for k, v in hyper.items() if k not in ("lr", "weight_decay")}
    if tc.optimizer_type not in (None, "AdamW") or hyper.get("weight_decay", 0.01) != 0.01 or other:
        return "the config's optimizer is not the baseline's (AdamW, weight decay 0.01)"
    return None


def baseline_skip_reason(args: argparse.Namespace, available: int | None = None) -> str | None:
    """Why the in-memory baseline cannot run on this machine, or None: it holds
    the parameters, their gradients and AdamW's two states in the training
    dtype (16 bytes per parameter in fp32, 8 in bf16; activations aside), and
    past :data:`BASELINE_MEMORY_SHARE` of the `available` memory (default:
    now) it would swap or be killed -- a model offloaded because it does not
    fit memory has no baseline there."""
    import psutil

    per = 16 if args.dtype == "fp32" else 8
    need = per * gpt_params(args.vocab, args.width, args.layers, args.seq)
    avail = int(psutil.virtual_memory().available) if available is None else available
    if need <= BASELINE_MEMORY_SHARE * avail:
        return None
    return (
        f"training this model in memory takes about {gib(need)} ({per} B per parameter: parameters, "
        f"gradients, AdamW's states), more than {BASELINE_MEMORY_SHARE:.0%} of the {gib(avail)} available"
    )


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else math.nan


def number_arg(lo: float, strictly: bool = False) -> Any:
    """An argparse type: a finite float >= lo (> lo when strictly)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or v < lo or (strictly and v == lo):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>' if strictly else '>='} {lo}, got {text!r}"
            )
        return v

    return parse


def model_arguments(ap: argparse.ArgumentParser) -> None:
    """The GPT's shape."""
    from ._cli import int_in

    ap.add_argument("--layers", type=int_in(1, 100_000), default=6, help="transformer blocks of the GPT")
    ap.add_argument("--width", type=int_in(1, 1 << 20), default=256, help="hidden size of the GPT")
    ap.add_argument("--heads", type=int_in(1, 1 << 20), default=4, help="attention heads (divides --width)")
    ap.add_argument("--vocab", type=int_in(1, 1 << 31), default=256, help="vocabulary size")
    ap.add_argument("--seq", type=int_in(1, 1 << 24), default=64, help="tokens per sequence")


def _run_arguments(ap: argparse.ArgumentParser) -> None:
    """What the run compares and measures, and where its results go."""
    from ._cli import int_in

    ap.add_argument("--no-init", dest="init", action="store_false", help="build the model in memory first")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the in-memory run")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="measure the drive's write/read GB/s in the swap directory after set-up and print each "
        "step's bytes by category against the drive floor (bytes read / read GB/s + written / write GB/s)",
    )
    ap.add_argument(
        "--floor-mib",
        type=int_in(1, 1 << 20),
        default=512,
        help="MiB each way for --floor, through a buffer of at most 256 MiB; a VM host's page cache "
        "serves a small sample: past it (e.g. 16384) the floor uses the drive's sustained rates",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``aio-train`` argument parser; numbers are range-checked as they are parsed."""
    from ._cli import CliParser, int_in

    big = 1 << 40
    ap = CliParser(prog="aio-train", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--nvme-path",
        nargs="+",
        metavar="DIR",
        help="directory on the drive, or several (one per drive, striped); default: a temporary directory",
    )
    ap.add_argument("--config", help="DeepSpeed-format JSON config (replaces the built-in one)")
    ap.add_argument(
        "--offload",
        choices=["nvme", "cpu", "none"],
        default="nvme",
        help="where parameters and optimizer state live between uses: the drive, CPU memory, or nowhere "
        "else (plain training through aio.zero)",
    )
    ap.add_argument("--steps", type=int_in(1, big), default=10, help="optimizer steps to train")
    model_arguments(ap)
    ap.add_argument(
        "--batch",
        type=int_in(1, 1 << 24),
        default=DEFAULT_BATCH,
        help="sequences per micro-batch",
    )
    ap.add_argument("--gas", type=int_in(1, 1 << 20), default=1, help="gradient accumulation steps")
    ap.add_argument("--clip", type=number_arg(0.0), default=1.0, help="gradient clipping (0: off)")
    ap.add_argument(
        "--lr",
        type=number_arg(0.0),
        default=None,
        help=f"AdamW learning rate (default: {BASE_LR:g} x {BASE_WIDTH}/width, at most {BASE_LR:g})",
    )
    ap.add_argument(
        "--warmup-steps",
        type=int_in(0, big),
        default=DEFAULT_WARMUP_STEPS,
        metavar="N",
        help=(
            "linear lr warm-up: optimizer step k (from 1) takes lr x min(1, k/N), so step 1 takes lr/N "
            f"(0 or 1: none; default: {DEFAULT_WARMUP_STEPS}); in the in-memory baseline too"
        ),
    )
    ap.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="training dtype of the parameters (bf16: fp32 master weights in the optimizer)",
    )
    ap.add_argument(
        "--sub-group-size",
        type=int_in(1, big),
        default=1_000_000,
        help="elements per optimizer sub-group, the unit paged to and from the drive at a step",
    )
    ap.add_argument(
        "--optimizer-states",
        choices=["fp32", "bf16"],
        default="fp32",
        help="optimizer states on the drive (--offload nvme): bf16 halves their bytes, not bit-identical",
    )
    ap.add_argument(
        "--gradients",
        choices=["auto", "cpu", "nvme"],
        default="auto",
        help=(
            "where fp32 gradients wait for the step (--offload nvme; aio_zero.gradients): auto keeps them "
            "in memory within the host-memory budget, nvme always on the drive (least RAM)"
        ),
    )
    ap.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="seed of the model and the batches")
    _run_arguments(ap)
    return ap


def huge_pages_for_torch() -> bool:
    """Ask torch to put its large CPU tensors on transparent huge pages
    (``THP_MEM_ALLOC_ENABLE=1``: 2 MiB-aligned, ``MADV_HUGEPAGE``), unless the
    environment already says either way. Every large temporary of a step (a
    layer's gathered weights, its gradients) is a fresh mapping that the
    kernel otherwise faults in 4 KiB at a time: at 820M parameters that was
    9.6M minor faults and 40 s of system time over set-up and three steps,
    against 0.4M and 24 s with huge pages (docs/performance.md). torch reads
    the variable once, at its first allocation, so this works only before
    torch is imported; returns whether the setting is in force."""
    if "THP_MEM_ALLOC_ENABLE" not in os.environ and "torch" not in sys.modules:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"


def _several_ranks(argv: list[str] | None) -> bool:
    """``--nproc N``, or started by torchrun with WORLD_SIZE over 1: the FSDP2 run."""
    args = sys.argv[1:] if argv is None else argv
    launched = os.environ.get("WORLD_SIZE", "1") not in ("", "1")
    return launched or any(a == "--nproc" or a.startswith("--nproc=") for a in args)


def main(argv: list[str] | None = None) -> int:
    """Run ``aio-train`` on `argv` (default: ``sys.argv[1:]``); returns the exit
    status: 0 when done, 2 for an error the user can fix, 130 when interrupted.
    Bad arguments exit with status 2 from argument parsing (SystemExit)."""
    from ._cli import run_cli

    huge_pages_for_torch()
    if _several_ranks(argv):  # FSDP2 with both tiers: aio.fsdp.train
        from .fsdp.train import main as fsdp_main

        return fsdp_main(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.lr = lr_of(args)
    if args.width % args.heads:
        ap.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    if args.optimizer_states != "fp32" and args.offload != "nvme":
        ap.error("--optimizer-states bf16 stores the states on the drive: it needs --offload nvme")
    if args.gradients != "auto" and args.offload != "nvme":
        ap.error(f"--gradients {args.gradients} is for the drive's optimizer: it needs --offload nvme")
    if args.config and (args.gradients != "auto" or args.optimizer_states != "fp32"):
        ap.error("--gradients and --optimizer-states do not apply with --config: set its aio_zero keys")
    if args.config and args.nvme_path:
        ap.error("--nvme-path does not apply with --config: the config's offload blocks name their nvme_path")
    if args.config and (given := _given(argv, _CONFIG_SETS)):
        ap.error(
            f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply with --config: the config "
            "file sets that (optimizer.params.lr, gradient_accumulation_steps, gradient_clipping, bf16, "
            "the offload blocks, zero_optimization.sub_group_size)"
        )
    if not args.floor and _given(argv, ("--floor-mib",)):
        ap.error("--floor-mib sets the sample size of --floor's measurement: add --floor")
    for path in args.nvme_path or []:
        if not os.path.isdir(path):
            ap.error(f"--nvme-path {path} is not a directory")
    if args.json is not None:
        parent = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(parent):
            ap.error(f"--json {args.json}: cannot write a file there")
    return run_cli("aio-train", lambda: _train(args), "drive files removed")


def _train(args: argparse.Namespace) -> int:
    tmp = None
    nvme: str | list[str]
    if args.config:
        nvme = "(the --config file's nvme_path)"  # a temporary drive would be unused
    elif args.nvme_path is None:
        tmp = tempfile.mkdtemp(prefix="aio-train-", dir=os.environ.get("AIO_TRAIN_DIR"))
        nvme = tmp
    else:
        nvme = args.nvme_path[0] if len(args.nvme_path) == 1 else list(args.nvme_path)
    out = sys.stdout
    try:
        cfg = make_config(args, nvme)
        mismatch = adopt_config(args, cfg) if args.config else None
        drives = nvme if isinstance(nvme, str) else " ".join(nvme)
        offload = "(from --config)" if args.config else args.offload
        print(
            f"aio-train: offload={offload} drive={drives} dtype={args.dtype} lr={args.lr:g} "
            f"({f'warm-up {args.warmup_steps} steps' if args.warmup_steps > 1 else 'no warm-up'})",
            file=out,
        )
        skip = (mismatch or baseline_skip_reason(args)) if args.baseline else None
        if skip:
            print(f"in-memory baseline: skipped: {skip}", file=out)
            args.baseline = False
        off = train_offloaded(args, cfg, out)
        result: dict[str, Any] = {"offloaded": off, "args": vars(args), "baseline_skipped": skip}
        if args.baseline:
            print("in-memory baseline (same model, data and optimizer):", file=out, flush=True)
            mem = train_in_memory(args, out, cfg)
            result["in_memory"] = mem
            diffs = [abs(a - b) for a, b in zip(off["losses"], mem["losses"], strict=True)]
            same = all(a == b for a, b in zip(off["losses"], mem["losses"], strict=True))
            ratio = _median(off["step_s"]) / _median(mem["step_s"])
            print(
                f"  losses: {', '.join(f'{v:.4f}' for v in mem['losses'])}\n"
                f"  max |loss difference| {max(diffs):.3g}"
                f"{' (bit-identical)' if same else ''}; median step {_median(mem['step_s']) * 1000:.0f} ms "
                f"in memory vs {_median(off['step_s']) * 1000:.0f} ms offloaded (an offloaded step takes "
                f"{ratio:.2f}x the time of one in memory)",
                file=out,
            )
            result["identical"] = same
            result["step_ratio"] = ratio
        state = off["params"] * 12  # fp32 master weights and Adam's two moments
        print(
            f"offloaded run: peak RSS {gib(off['peak_rss'])} ({gib(off['predicted_peak_rss'])} predicted), "
            f"pinned {gib(off['pinned_bytes'])}, median {_median(off['gbps']):.2f} GB/s to/from the drive; "
            f"the fp32 optimizer state ({gib(state)}) is {state / off['peak_rss']:.1f}x the peak RSS "
            f"({'more than' if state > off['peak_rss'] else 'less than'} the process ever held in memory)",
            file=out,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
