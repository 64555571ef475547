"""aio-train on several ranks: the same GPT trained with FSDP2 and both aio
tiers -- each rank's parameter shards on its drive between uses
(:func:`aio.fsdp.offload_params`) and its optimizer state there too
(:class:`aio.optim.NVMeAdamW`) -- then, when it fits, the same FSDP2
training in memory (``torch.optim.AdamW(foreach=False)``), losses compared.

    torchrun --nproc-per-node 2 -m aio.train --layers 4 --width 256 --steps 5
    aio-train --nproc 2 --layers 4 --width 256 --steps 5      # the same, launched for you

No rank holds the whole model: it is built on the meta device, sharded and
filled group by group through the tier (``empty_shards``), with the values
the in-memory build gives it. Past RAM (``--gradients auto``) the fp32
gradients are streamed to the drive during backward
(:func:`aio.fsdp.stream_gradients`) instead of waiting in memory for the step.

Every rank prints, per step: the loss (mean over ranks), step time (forward,
backward, clip + step), bytes read from and written to its drive, peak RSS,
pinned bytes and, with ``--floor``, the drive floor (read bytes / read GB/s +
written / write GB/s) and step / floor. gloo on CPU hosts, NCCL with one GPU
per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from .. import train as single

# What one fully_shard group holds (--unit).
UNITS = ("linear", "block")
# NVMeAdamW's sub-group per rank (--sub-group-size), in elements: 16 MiB of
# fp32, so its 11 pinned buffers take 176 MiB whatever the model. Each
# parameter is cut into sub-groups of this size (the step is elementwise:
# the same bits as whole tensors) and the drive sees 16 MiB I/Os.
SUB_GROUP_SIZE = 1 << 22


def build_parser() -> argparse.ArgumentParser:
    """The arguments of the several-rank run (a subset of aio-train's)."""
    from .._cli import CliParser, int_in

    ap = CliParser(prog="aio-train (FSDP2)", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--nproc", type=int_in(1, 1024), help="launch this many ranks on this host (torchrun)")
    ap.add_argument("--nvme-path", nargs="+", metavar="DIR", help="drive directory (default: a temp dir)")
    ap.add_argument("--steps", type=int_in(1, 1 << 40), default=10, help="optimizer steps to train")
    single.model_arguments(ap)
    ap.add_argument(
        "--batch", type=int_in(1, 1 << 24), default=single.DEFAULT_BATCH, help="sequences per rank"
    )
    ap.add_argument("--clip", type=single.number_arg(0.0), default=1.0, help="gradient clipping (0: off)")
    ap.add_argument(
        "--lr",
        type=single.number_arg(0.0),
        default=None,
        help="AdamW learning rate (default: aio-train's, 0.001 x 256/width, at most 0.001)",
    )
    ap.add_argument(
        "--warmup-steps",
        type=int_in(0, 1 << 40),
        default=single.DEFAULT_WARMUP_STEPS,
        help="linear lr warm-up over this many optimizer steps (0 or 1: none)",
    )
    ap.add_argument("--window", type=int_in(1, 1 << 20), default=2, help="FSDP groups read ahead")
    ap.add_argument(
        "--unit",
        choices=UNITS,
        default="linear",
        help="what one fully_shard group holds: linear (each Linear of a block, then the block's layer "
        "norms: a gathered group is one weight matrix) or block (a whole transformer block)",
    )
    ap.add_argument(
        "--backward-prefetch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let FSDP2 all-gather the next group during a group's backward (its default). Default: on "
        "GPU ranks (NCCL overlaps it), off on CPU ranks (nothing to overlap with; one gathered group "
        "fewer in memory)",
    )
    ap.add_argument(
        "--sub-group-size",
        type=int_in(1, 1 << 40),
        default=SUB_GROUP_SIZE,
        help="NVMeAdamW's sub-group, in local elements (at most the largest local shard): its 11 pinned "
        "buffers hold 4 bytes each per element",
    )
    ap.add_argument(
        "--gradients",
        choices=("auto", "cpu", "nvme"),
        default="auto",
        help="fp32 gradients until the step: cpu (FSDP's and the optimizer's copy in memory), nvme "
        "(streamed to the drive during backward, aio.fsdp.stream_gradients), auto (nvme when the copies "
        "of this node's ranks pass half the memory available)",
    )
    ap.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="seed of the model and the batches")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the in-memory run")
    ap.add_argument("--floor", action="store_true", help="measure the drive and print step / drive floor")
    ap.add_argument("--floor-mib", type=int_in(1, 1 << 20), default=256, help="MiB each way for --floor")
    ap.add_argument("--json", help="write each rank's results to this file ({rank} is filled in)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run it on `argv`; with ``--nproc N``, launch N ranks through torchrun."""
    from .._cli import run_cli

    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.width % args.heads:
        ap.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    args.lr = single.lr_of(args)
    if args.nproc:
        return _launch(args.nproc, _without_nproc(argv))
    return run_cli("aio-train", lambda: _rank_main(args), "drive files removed")


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _launch(n: int, argv: list[str]) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    return subprocess.call([*cmd, "-m", "aio.fsdp.train", *argv])


def _init_dist() -> tuple[int, int, Any]:
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:  # one rank, not under torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def _build(args: argparse.Namespace, device: Any, meta: bool = False) -> Any:
    """The GPT (seeded, so every rank builds the same), fully_shard-ed over
    all ranks in groups of ``args.unit`` (see :func:`shard_gpt`). With
    `meta`, built on the meta device and given empty shards (``to_empty``):
    no rank ever holds the whole model; fill them with :func:`init_like_build`."""
    import torch

    torch.manual_seed(args.seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = single.build_gpt(args.vocab, args.width, args.layers, args.heads, args.seq)
    if not meta:
        model = model.to(device)
    shard_gpt(model, device, args.unit, backward_prefetch(args, device))
    if meta:
        model.to_empty(device=device)
    return model


def backward_prefetch(args: argparse.Namespace, device: Any) -> bool:
    """``--backward-prefetch`` as asked, else on for GPU ranks only."""
    return device.type == "cuda" if args.backward_prefetch is None else bool(args.backward_prefetch)


def shard_gpt(model: Any, device: Any, unit: str = "linear", backward_prefetch: bool = False) -> None:
    """fully_shard ``build_gpt``'s model over all ranks. `unit` "block": each
    transformer block is one group; "linear": each of its four Linears is
    one, and the block one more for its layer norms. FSDP2 holds a few
    groups gathered at once (the parameters, its all-gather buffer, in
    backward their gradients and the reduce-scatter input): a rank's working
    set scales with the largest group, 398 MB of fp32 for a block of width
    2880 against 133 MB for its largest Linear. The root holds the tied
    embedding/head. Each parameter's shard is the same either way (dim 0,
    chunked per parameter), and so are the values trained.

    Without `backward_prefetch`, each FSDP module is set to prefetch only
    itself in backward (``set_modules_to_backward_prefetch``; gathered
    already, a no-op): FSDP2's default all-gathers the next group while a
    group's gradients are computed and reduced, one more group in memory."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for block in model.blocks:
        if unit == "linear":
            for layer in (block.attn.qkv, block.attn.proj, block.fc, block.out):
                fully_shard(layer, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not backward_prefetch:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_modules_to_backward_prefetch([m])
    if device.type == "cpu":
        free_comm_buffers(model)


def free_comm_buffers(model: Any) -> None:
    """On CPU ranks, free the buffers FSDP2 keeps past their collective: the
    forward's all-gather output, kept until the next group's copy-out (to
    overlap the two on a GPU), and the last reduce-scatter input, kept until
    the next group's reduction (to recycle it on a GPU). With gloo both
    collectives are synchronous: the buffers are done with when FSDP keeps
    them, one gathered group each. On every FSDP module, a forward pre-hook
    after FSDP's (its own is prepended) drops the first, and a gradient hook
    on its outputs, as the module's backward begins and before FSDP gathers
    the module's group for it, drops the second (a
    multi-grad hook, as FSDP2 uses itself: a full backward hook would wrap
    every input and output, warn when no input needs a gradient, and refuse
    in-place ops on them). These are FSDP2's internals (``comm_ctx``), as
    torch 2.13/2.14 name them; where they are not there nothing is freed
    (aio.fsdp._internals keeps them)."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._pytree import tree_leaves

    from ._internals import module_groups, release_comm_buffers

    def drop_gather(m: Any, *_: Any) -> None:
        for pg in module_groups(m):
            release_comm_buffers(pg, gather=True)

    def arm_reduce(m: Any, _args: Any, output: Any) -> None:
        outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:

            def drop_reduce(_grads: Any) -> None:
                for pg in module_groups(m):
                    release_comm_buffers(pg, reduce=True)

            torch.autograd.graph.register_multi_grad_hook(outs, drop_reduce, mode="any")

    for module in model.modules():
        if isinstance(module, FSDPModule):
            hooks: Any = module  # an nn.Module too
            hooks.register_forward_pre_hook(drop_gather)
            # Prepended: FSDP2's post-forward hook puts its pre-backward (the
            # group's all-gather) on the same outputs, and a tensor's hooks run
            # in the order registered; after it, the last reduce-scatter input
            # (up to a gathered group) would still be held at that gather.
            hooks.register_forward_hook(arm_reduce, prepend=True)


def init_like_build(model: Any, seed: int) -> None:
    """Set every parameter's local shard to the values ``build_gpt`` gives
    it after ``torch.manual_seed(seed)`` (the in-memory run's, and the
    single-process aio-train's): each layer's ``reset_parameters`` is
    replayed in construction order on a full-size copy of its parameters,
    one layer at a time, and this rank's rows are copied into its shard.
    The tied head draws its own values and drops them, as the build does.
    With the parameter tier on, the copies go through the shards'
    stand-ins: at most ``window`` FSDP groups are in memory."""
    import gc

    import torch

    torch.manual_seed(seed)
    done: set[int] = set()
    with torch.no_grad():
        for m in model.modules():
            reset = getattr(type(m), "reset_parameters", None)
            own = dict(m._parameters)
            if reset is None or all(p is None for p in own.values()):
                continue
            # The same layer on full-size tensors of its own. Not copy.copy: a
            # fully_shard-ed class's __new__ runs __init__ again (without its arguments).
            layer = object.__new__(type(m))
            layer.__dict__.update(m.__dict__)
            layer.__dict__["_parameters"] = {
                n: None if p is None else torch.empty(p.shape, dtype=p.dtype) for n, p in own.items()
            }
            reset(layer)
            for n, p in own.items():
                if p is not None and id(p) not in done:
                    done.add(id(p))
                    _set_shard(p, layer._parameters[n])
                    # Young cycles collected now: one through the copy's stand-in held the
                    # full-size layer until a full collection (+0.37 GiB a block at width
                    # 2880; aio.fsdp.guard no longer makes it, this stays as the guard
                    # against any other, for a collection of young objects costs little).
                    gc.collect(1)


def _set_shard(p: Any, full: Any) -> None:
    """Copy this rank's rows of `full` into DTensor `p`'s local shard (FSDP2
    shards dim 0 as ``torch.chunk`` does)."""
    import torch.distributed as dist

    local = p.to_local()
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = full.chunk(world, dim=0)
    mine = chunks[rank] if rank < len(chunks) else full[:0]
    if tuple(mine.shape) != tuple(local.shape):
        raise RuntimeError(
            f"a shard of {tuple(local.shape)} for rows {tuple(mine.shape)} of {tuple(full.shape)}"
        )
    local.copy_(mine)


def _step(
    args: argparse.Namespace,
    model: Any,
    opt: Any,
    step: int,
    rank: int,
    device: Any,
    stream: Any = None,
    phases: list[tuple[float, float, float]] | None = None,
) -> float:
    """One training step; its mean loss over ranks. `phases` gets its
    forward, backward and clip + optimizer step seconds."""
    import torch
    import torch.distributed as dist

    from ..zero.malloc import trim_if_fragmented

    for g in opt.param_groups:
        g["lr"] = single.warmup_lr(args.lr, step + 1, args.warmup_steps)
    x, y = single.batch(step, rank, args.batch, args.seq, args.vocab)
    opt.zero_grad()
    t0 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(
        model(x.to(device)).flatten(0, 1).float(), y.to(device).flatten()
    )
    t1 = time.perf_counter()
    loss.backward()
    trim_if_fragmented()  # the activations' holes in the heap (as aio.zero's trainer does)
    t2 = time.perf_counter()
    if args.clip and stream is not None:
        stream.clip_grad_norm_(args.clip)  # the gradients are on the drive, p.grad is None
    elif args.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    if phases is not None:
        phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean.item()) / dist.get_world_size()


def _drive_bytes(tier: Any, opt: Any) -> tuple[int, int]:
    t, o = tier.stats(), opt.swap_stats()
    return t["bytes_read"] + o.get("bytes_read", 0), t["bytes_written"] + o.get("bytes_written", 0)


def largest_local(model: Any) -> int:
    """Elements of this rank's largest local shard."""
    from ..optim.dtensor import local_of

    return max(local_of(p).numel() for p in model.parameters())


def streams_gradients(args: argparse.Namespace, world: int) -> bool:
    """``--gradients``: whether to stream them to the drive. auto: when the
    two fp32 copies a rank holds until the step (FSDP's reduced gradient and
    NVMeAdamW's), 8 bytes per local parameter, times this node's ranks pass
    half the memory available (aio.zero's ``gradients: auto`` budget)."""
    if args.gradients != "auto":
        return bool(args.gradients == "nvme")
    import psutil

    n = single.gpt_params(args.vocab, args.width, args.layers, args.seq)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return 8 * n // world * local_ranks > psutil.virtual_memory().available // 2


def _set_up(args: argparse.Namespace, device: Any, nvme: list[str], stream: bool) -> tuple[Any, ...]:
    """Model (meta-built, its shards filled through the tier), NVMeAdamW at
    aio-train's built-in optimizer settings per rank (its buffer rule, for
    sub-groups of ``--sub-group-size`` elements or the largest local tensor
    if smaller), the tier and the stream (or None)."""
    import torch.distributed as dist

    from ..optim import NVMeAdamW
    from ..zero.malloc import TRAIN_MMAP_THRESHOLD, TRAIN_TRIM_THRESHOLD, set_mmap_threshold
    from . import offload_params, stream_gradients

    # aio.zero's training setting: blocks of 8 MiB or more (shards, gathered
    # groups, gradients) get their own mapping, returned to the OS when freed.
    set_mmap_threshold(TRAIN_MMAP_THRESHOLD, TRAIN_TRIM_THRESHOLD)
    model = _build(args, device, meta=True)
    largest = largest_local(model)
    size = min(largest, args.sub_group_size)
    opt = NVMeAdamW(
        model.parameters(), lr=args.lr, weight_decay=0.01, nvme_path=nvme, match_torch=True,
        sub_group_size=size, gradients="nvme" if stream else "cpu", **single.optimizer_buffers(size),
    )  # fmt: skip
    tier = offload_params(model, nvme, opt, window=args.window, empty_shards=True)
    init_like_build(model, args.seed)
    grads = stream_gradients(model, opt, tier) if stream else None
    dist.barrier()  # set-up ends on every rank before the first step is timed
    return model, opt, tier, grads, largest


def _tiered(args: argparse.Namespace, rank: int, device: Any, nvme: list[str], rates: Any) -> dict[str, Any]:
    """The run with both tiers, printing each step; its figures."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    stream = streams_gradients(args, dist.get_world_size())
    model, opt, tier, grads, largest_param = _set_up(args, device, nvme, stream)
    setup, setup_rss = time.perf_counter() - t0, single.peak_rss()
    print(
        f"[rank {rank}] set-up {setup:.1f} s (meta-device build, shards filled group by group), peak RSS "
        f"{single.gib(setup_rss)}; fp32 gradients {'streamed to the drive' if stream else 'in memory'} "
        "until the step",
        flush=True,
    )
    losses: list[float] = []
    times: list[float] = []
    moved: list[tuple[int, int]] = []
    phases: list[tuple[float, float, float]] = []
    io: list[tuple[int, ...]] = []
    try:
        for step in range(args.steps):
            r0, w0 = _drive_bytes(tier, opt)
            io0 = proc_io()
            t = time.perf_counter()
            losses.append(_step(args, model, opt, step, rank, device, grads, phases))
            times.append(time.perf_counter() - t)
            r1, w1 = _drive_bytes(tier, opt)
            moved.append((r1 - r0, w1 - w0))
            io.append(tuple(b - a for a, b in zip(io0, proc_io(), strict=True)))
            pinned = tier.stats()["pinned_bytes"] + opt.swap_stats().get("pinned_buffer_bytes", 0)
            _print_step(rank, step, losses[-1], times[-1], moved[-1], pinned, rates, phases[-1])
        stats = {"tier": tier.stats(), "optimizer": opt.swap_stats(), "peak_rss": single.peak_rss()}
        stats["gradients"] = grads.stats() if grads is not None else None
        largest = max(g.nbytes for g in tier.groups)
    finally:
        if grads is not None:
            grads.close()
        tier.close(restore=False)  # the model is done with: its shards are not read back
        opt.close()
    return {
        "losses": losses, "step_s": times, "bytes": moved, "pinned_bytes": pinned, "setup_s": setup,
        "phases_s": phases, "proc_io_bytes": io,
        "setup_peak_rss": setup_rss,
        "largest_group_bytes": largest, "largest_param_numel": largest_param, "streamed": stream, **stats,
    }  # fmt: skip


def proc_io() -> tuple[int, int]:
    """This process's bytes read from and written to storage so far
    (/proc/self/io; zeros where it is not available)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def _print_step(
    rank: int,
    step: int,
    loss: float,
    dt: float,
    moved: tuple[int, int],
    pinned: int,
    rates: Any,
    phases: tuple[float, float, float],
) -> None:
    gib = single.gib
    line = (
        f"[rank {rank}] step {step + 1:3d}  loss {loss:.4f}  {dt * 1000:7.0f} ms (forward / backward / step "
        f"{' / '.join(f'{s:.1f}' for s in phases)} s)  drive read {gib(moved[0])} "
        f"written {gib(moved[1])}  peak RSS {gib(single.peak_rss())}  pinned {gib(pinned)}"
    )
    if rates:
        floor = moved[0] / (rates["read"] * 1e9) + moved[1] / (rates["write"] * 1e9)
        line += f"  floor {floor:.2f} s  step / floor {dt / floor if floor else 0:.2f}"
    print(line, flush=True)


# What the estimate leaves out: torch's kernels and gloo's buffers loaded at
# the first forward and backward, and the allocator's slack (glibc arenas of
# gloo's threads). Measured here, 2 ranks: 60-170 MiB at 2-4 layers, width 64-1024.
RSS_SLACK = 192 << 20


def predicted_peak_rss(args: argparse.Namespace, world: int, run: dict[str, Any]) -> int:
    """A rank's peak RSS over its RSS before the model was built: the pinned
    buffers plus the larger of set-up -- window + 1 groups' shards and one
    layer's parameters full-size (the model is built on the meta device and
    filled a layer at a time) -- and training: the largest group gathered
    whole 4 times over (its parameters, FSDP's all-gather buffer, their
    gradients and the reduce-scatter input), 2 more with
    ``--backward-prefetch`` (the next group's buffer and parameters), window +
    1 groups' shards, the activations and, unless they are streamed to the
    drive, two gradient copies of the shard (FSDP's reduced gradient and the
    optimizer's held one); plus RSS_SLACK."""
    n = single.gpt_params(args.vocab, args.width, args.layers, args.seq)
    group = run["largest_group_bytes"]
    setup = (args.window + 1) * group + 4 * run["largest_param_numel"] * world
    acts = single.gpt_activation_bytes(argparse.Namespace(**{**vars(args), "dtype": "fp32"}))
    held = 0 if run["streamed"] else 8 * n // world
    gathered = 4 + 2 * bool(args.backward_prefetch)
    training = held + gathered * group * world + (args.window + 1) * group + acts
    return run["pinned_bytes"] + max(setup, training) + RSS_SLACK


def _in_memory(args: argparse.Namespace, rank: int, device: Any) -> list[float]:
    import torch

    model = _build(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
    return [_step(args, model, opt, step, rank, device) for step in range(args.steps)]


def baseline_fits(args: argparse.Namespace, world: int) -> bool:
    """Whether the in-memory FSDP2 run fits: per rank the full model once
    (built before sharding) plus 16 bytes per local parameter (shard,
    gradient, two moments), within half this rank's share of available memory."""
    import psutil

    n = single.gpt_params(args.vocab, args.width, args.layers, args.seq)
    need = 4 * n + 16 * n // world
    share = psutil.virtual_memory().available // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return need < share // 2


def _rank_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    rank, world, device = _init_dist()
    tmp = None if args.nvme_path else tempfile.mkdtemp(prefix="aio-fsdp-train-")
    nvme = args.nvme_path or [tmp]
    try:
        rates = _floor(args, nvme[0]) if args.floor else None
        start = single.rss()
        run = _tiered(args, rank, device, nvme, rates)
        run.update(rank=rank, world=world, drive_gbps=rates, start_rss=start)
        run["predicted_peak_rss"] = start + predicted_peak_rss(args, world, run)
        _report(args, rank, run)
        if args.baseline and baseline_fits(args, world):
            mem = _in_memory(args, rank, device)
            run["losses_in_memory"] = mem
            same = mem == run["losses"]
            if rank == 0:
                print(f"in-memory FSDP2 losses {' '.join(f'{v:.4f}' for v in mem)}", flush=True)
                print(
                    f"losses bit-identical to the in-memory FSDP2 run: {'yes' if same else 'NO'}", flush=True
                )
            run["bit_identical"] = same
        if args.json:
            with open(args.json.replace("{rank}", str(rank)), "w") as f:
                json.dump(run, f, indent=1, default=str)
        dist.barrier()
        return 0 if run.get("bit_identical", True) else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.destroy_process_group()


def _floor(args: argparse.Namespace, where: str) -> dict[str, float]:
    from ..quickcheck import drive_rates

    return drive_rates(where, args.floor_mib << 20)


def _report(args: argparse.Namespace, rank: int, run: dict[str, Any]) -> None:
    gib = single.gib
    t, o = run["tier"], run["optimizer"]
    print(
        f"[rank {rank}] done: peak RSS {gib(run['peak_rss'])} (predicted at most "
        f"{gib(run['predicted_peak_rss'])}), pinned {gib(run['pinned_bytes'])}; "
        f"parameter shards on the drive {gib(t['shard_bytes'])} ({t['groups']} FSDP groups, window "
        f"{t['window']}, {t['params_from_master']} read from the optimizer's master weights, "
        f"{t['sync_fetches']} synchronous reads); optimizer state on the drive {gib(o['drive_bytes'])}; "
        f"median step {sorted(run['step_s'])[len(run['step_s']) // 2] * 1000:.0f} ms",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
