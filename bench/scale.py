#!/usr/bin/env python3
"""Scale benchmark: one model size, aio.zero at aio-train's defaults against
DeepSpeed ZeRO-3 NVMe offload on the same config dict, each in its own process;
and on several ranks, aio's FSDP2 main job against DeepSpeed at the same world size.

    python bench/scale.py [--dir /local_nvme]
        [--variants aio,ds,ds-safe[,ds-hf][,fsdp,ds-ranks,ds-safe-ranks]]
        [--params 2e9 | --layers 24 --width 2560 --heads 20 --vocab 32000]
        [--warmup 1] [--steps 3] [--world 2] [--timeout 5400] [--json out.json]
        [any other aio-train size or precision flag: --seq, --batch, --dtype, ...]

The model is aio-train's GPT (aio.train.build_gpt) and its synthetic batches.
The size and precision flags are aio-train's own (its parser reads them,
with its defaults for batch, seq, dtype, ...), except that the default size is
~2B parameters (24 layers, width 2560, 20 heads, vocab 32000: 1.97B);
``--params N`` picks the number of layers closest to N parameters at the
given width and vocabulary.

The config is the one ``aio-train`` builds from those flags
(aio.train.make_config: both offload blocks on the drive, its buffer counts
and sub-group size) plus the two keys DeepSpeed needs and aio.zero ignores
(``train_micro_batch_size_per_gpu``, ``steps_per_print``). Each variant gets
it with ``nvme_path`` set to a fresh folder of its own under ``--dir``:

  aio      aio.zero as aio-train runs it: model built under aio.zero.Init,
           aio.zero.initialize(model, config)
  ds       DeepSpeed ZeRO-3: model built under deepspeed.zero.Init(config)
           (as aio-train builds under aio.zero.Init; it also keeps DeepSpeed
           off the path where its CPU accelerator partitions an fp32 model
           in bf16, see bench/train_step.py), deepspeed.initialize
  ds-safe  ds with ``offload_optimizer.pipeline_read/pipeline_write`` false
           and ``stage3_max_reuse_distance`` 0: DeepSpeed 0.19 asserts
           (``new_alloc_buffers is not None``) at 2B with its pipelining.
           (aio-train's config already turns the optimizer's pipelining off
           where 7 buffers would pass 2 GiB, as at the default 2B size: there
           the two differ in the reuse distance alone.)
  ds-hf    DeepSpeed ZeRO-3 NVMe at HF Transformers' documented block:
           parameter/optimizer ``buffer_count`` 5/4, pipelining on,
           ``stage3_max_reuse_distance`` and ``max_live_parameters`` 1e9,
           prefetch bucket 0.9 h^2, persistence threshold 10 h. DeepSpeed's
           own swappers assert there; it runs on aio's handle with aio's
           buffer rules in DeepSpeed's swappers (aio.integrations.ds_swappers),
           whatever ``--ds-io`` says. (``ds`` and ``ds-safe`` on aio's handle
           get those rules too, since aio.integrations.deepspeed.enable()
           installs them.)

On ``--world`` ranks of this host (torchrun, gloo; torchrun gives each rank
one OpenMP thread), the whole job's figures summed over its ranks in the
main table, each rank's in a second:

  fsdp           aio's FSDP2 main job (``aio-train --nproc N``,
                 aio.fsdp.train) at its defaults: the GPT built on the meta
                 device, each Linear, each block (its layer norms) and the
                 root fully_shard-ed (``--unit linear``), shards on the drive
                 (aio.fsdp.offload_params), NVMeAdamW, fp32 gradients
                 streamed to the drive when they pass half the memory
                 (``--gradients auto``); same size, batch, clip, lr and seed
  ds-ranks       ds on the same ranks (model under deepspeed.zero.Init,
                 each rank its own micro-batches)
  ds-safe-ranks  ds-safe on the same ranks

DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``) in a
one-process gloo group, optimizer DeepSpeedCPUAdam. Its JIT-built ops
(cpu_adam; async_io with its own op) are loaded before set-up is timed: the
first build takes minutes, once per machine, and is not DeepSpeed's set-up
(the JSON has each load's seconds as ``ds_op_load_s``). ``--ds-io`` picks
its I/O: ``own`` (its async_io op; needs libaio-dev to build), ``aio`` (the
same swappers on aio's handle, aio.integrations.deepspeed), ``auto`` (own
where libaio.h is installed, else aio); the label says which ran.

Columns (figures over the ``--steps`` timed steps after ``--warmup``):

  set-up s       model build under Init + engine/trainer construction
  s/step         median whole step (forward, backward, step())
  peak RSS GiB   VmHWM of the worker process at the end
  predicted GiB  aio: the peak RSS aio-train predicts before allocating
                 (aio.train.estimate_run, what ``aio-config estimate`` adds
                 up), and measured / predicted
  pinned GiB     aio: trainer.pinned_bytes(); DeepSpeed: the bytes it asks its
                 accelerator to pin plus VmLck (bench/train_step.py's count)
  read/written GB/step  mean /proc/self/io read_bytes/write_bytes per step,
                 the same meter for both engines (GB = 1e9 bytes)
  drive GB/s     read / write, aio.quickcheck.drive_rates (what aio-train
                 --floor uses) on ``--drive-mib`` in ``--dir``, measured
                 right before each variant
  floor s        read / drive read rate + written / drive write rate
  step/floor     s/step / floor s (I/O efficiency: 1.0 is the drive's speed)

aio's bytes by category (trainer.io_bytes_by_category(): parameters, master,
gradients, exp_avg, exp_avg_sq) follow in a second table with their sum
beside /proc/self/io's. DeepSpeed has no such count: its row gives totals.

A variant that fails (exception, assert, killed by a signal such as the OOM
killer's SIGKILL, or past ``--timeout``) is reported with its exact error
(exception type, message and the line that raised it; or the signal; and
the last progress line) and the others still run. Exit status: 0 when every
variant ran, 1 when any failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import train_step as ts  # noqa: E402  (a sibling script, not a package)

VARIANTS = ("aio", "ds", "ds-safe")  # the default run
RANKED = ("fsdp", "ds-ranks", "ds-safe-ranks")  # run on --world ranks (torchrun)
ALL_VARIANTS = (*VARIANTS, "ds-hf", *RANKED)
LABELS = {
    "aio": "aio.zero",
    "ds": "DeepSpeed ZeRO-3",
    "ds-safe": "DeepSpeed ZeRO-3, safe",
    "ds-hf": "DeepSpeed ZeRO-3 NVMe at HF's block",
    "fsdp": "aio FSDP2 (offload_params + NVMeAdamW)",
    "ds-ranks": "DeepSpeed ZeRO-3",
    "ds-safe-ranks": "DeepSpeed ZeRO-3, safe",
}
# aio-train's size flags for the default ~2B model; later flags on the command line win.
DEFAULT_SIZE = ["--layers", "24", "--width", "2560", "--heads", "20", "--vocab", "32000"]
# ds-safe's changes to the shared config: (path in the dict, value).
SAFE_CHANGES = (
    (("zero_optimization", "offload_optimizer", "pipeline_read"), False),
    (("zero_optimization", "offload_optimizer", "pipeline_write"), False),
    (("zero_optimization", "stage3_max_reuse_distance"), 0),
)
# aio-train flags with no meaning here (flag, its dest), and what to use instead.
REFUSED = {
    ("--config", "config"): "the config is aio-train's built-in one (this benchmark's subject)",
    ("--nvme-path", "nvme_path"): "use --dir",
    ("--offload", "offload"): "both offload blocks are on the drive",
    ("--floor", "floor"): "the floor is always measured",
    ("--floor-mib", "floor_mib"): "use --drive-mib",
    ("--no-baseline", "baseline"): "there is no in-memory run",
    ("--warmup-steps", "warmup_steps"): "the lr stays fixed (a timing run)",
}
PROGRESS = "@@ "  # marks the worker's progress lines in its log
LIBAIO_H = "/usr/include/libaio.h"


# -- arguments ------------------------------------------------------------------------------
def own_parser() -> argparse.ArgumentParser:
    """This script's options; the model's size and precision are aio-train's flags."""
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        add_help=False,
        allow_abbrev=False,  # an abbreviated aio-train flag stays aio-train's
        epilog="Model size and precision: aio-train's flags, listed below (default size: "
        + " ".join(DEFAULT_SIZE)
        + ").",
    )
    ap.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    ap.add_argument("--dir", help="drive directory (default: a temporary directory)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(ALL_VARIANTS)}")
    ap.add_argument("--params", type=float, help="pick --layers for about this many parameters (e.g. 2e9)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps; s/step is their median (default 3)")
    ap.add_argument(
        "--ds-io", choices=("auto", "own", "aio"), default="auto", help="DeepSpeed's I/O op (default: auto)"
    )
    ap.add_argument(
        "--timeout", type=float, default=5400, help="seconds per variant before it is killed (default: 5400)"
    )
    ap.add_argument(
        "--drive-mib", type=int, default=1024, help="MiB each way for the drive's rates (default 1024)"
    )
    ap.add_argument(
        "--world", type=int, default=2, help=f"ranks of the variants {', '.join(RANKED)} (default 2)"
    )
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a job file: run one variant in this process
    return ap


def layers_for(params: float, width: int, vocab: int, seq: int) -> int:
    """The number of layers (at least 1) whose GPT has closest to `params` parameters."""
    from aio.train import gpt_params

    fixed = gpt_params(vocab, width, 0, seq)
    per_layer = gpt_params(vocab, width, 1, seq) - fixed
    return max(1, round((params - fixed) / per_layer))


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(this script's options, aio-train's namespace for the model and config)."""
    import aio.train

    ap = own_parser()
    own, rest = ap.parse_known_args(argv)
    if own.help:
        ap.print_help()
        print(
            f"\naio-train's flags (refused here: {', '.join(f for f, _ in REFUSED)}; "
            "--steps and --json are this script's):"
        )
        aio.train.build_parser().print_help()
        raise SystemExit(0)
    if own.worker:
        return own, argparse.Namespace()
    if own.params is not None and any(t.startswith("--lay") for t in rest):  # argparse takes "--lay"
        ap.error("give --params or --layers, not both")
    targs = aio.train.build_parser().parse_args(DEFAULT_SIZE + rest)
    # By value, not by name: aio-train's parser also takes abbreviations ("--nvme").
    default = aio.train.build_parser().parse_args(DEFAULT_SIZE)
    for (flag, dest), why in REFUSED.items():
        if getattr(targs, dest) != getattr(default, dest):
            ap.error(f"{flag} does not apply here: {why}")
    if own.params is not None:
        targs.layers = layers_for(own.params, targs.width, targs.vocab, targs.seq)
    if targs.width % targs.heads:
        ap.error(f"--width {targs.width} is not a multiple of --heads {targs.heads}")
    targs.lr = aio.train.lr_of(targs)
    own.variant_list = [v for v in own.variants.split(",") if v]
    bad = set(own.variant_list) - set(ALL_VARIANTS)
    if bad or not own.variant_list or len(set(own.variant_list)) < len(own.variant_list):
        ap.error(f"--variants {own.variants}: a comma list of {', '.join(ALL_VARIANTS)}, each at most once")
    if own.steps < 1 or own.warmup < 0 or own.drive_mib < 1 or own.timeout <= 0 or own.world < 1:
        ap.error("--steps, --drive-mib, --timeout and --world must be positive, --warmup at least 0")
    return own, targs


# -- the config -----------------------------------------------------------------------------
def variant_config(targs: argparse.Namespace, variant: str, nvme: str) -> dict:
    """aio-train's config for these flags on `nvme`, with DeepSpeed's batch keys
    (aio.zero ignores them), and for ds-safe :data:`SAFE_CHANGES`."""
    from aio.train import make_config

    cfg = make_config(targs, nvme)
    cfg["train_micro_batch_size_per_gpu"] = targs.batch  # DeepSpeed refuses a config without a batch size
    cfg["steps_per_print"] = 10**9  # DeepSpeed's per-step log lines off
    base = variant.removesuffix("-ranks")  # the same config on --world ranks
    changes = SAFE_CHANGES if base == "ds-safe" else hf_changes(targs.width) if base == "ds-hf" else ()
    for path, value in changes:
        node = cfg
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return cfg


def hf_changes(width: int) -> tuple[tuple[tuple[str, ...], Any], ...]:
    """ds-hf's changes: HF Transformers' documented ZeRO-3 NVMe values (the
    Trainer's ``auto`` ones for hidden size `width`)."""
    z, p, o = (
        ("zero_optimization",),
        ("zero_optimization", "offload_param"),
        ("zero_optimization", "offload_optimizer"),
    )
    return (
        (p + ("buffer_count",), 5),
        (o + ("buffer_count",), 4),
        (o + ("pipeline_read",), True),
        (o + ("pipeline_write",), True),
        (z + ("stage3_max_reuse_distance",), 1_000_000_000),
        (z + ("stage3_max_live_parameters",), 1_000_000_000),
        (z + ("stage3_prefetch_bucket_size",), int(0.9 * width * width)),
        (z + ("stage3_param_persistence_threshold",), 10 * width),
    )


def ds_io(choice: str) -> str:
    """'own' (DeepSpeed's async_io op) or 'aio' (aio's handle) for --ds-io `choice`."""
    if choice != "auto":
        return choice
    return "own" if os.path.exists(LIBAIO_H) else "aio"  # DeepSpeed's op builds only against libaio.h


def variant_io(own: argparse.Namespace, variant: str) -> str:
    """The I/O a variant runs on: aio's variants and ds-hf on aio's, the others as --ds-io says."""
    return "aio" if variant in ("aio", "fsdp", "ds-hf") else ds_io(own.ds_io)


def label(variant: str, io: str, world: int = 1) -> str:
    """The table's name for a variant; DeepSpeed's names its I/O op, a ranked one its ranks."""
    ranks = f", {world} ranks" if variant in RANKED else ""
    if variant in ("aio", "fsdp"):
        return LABELS[variant] + (f" ({world} ranks)" if ranks else "")
    return f"{LABELS[variant]} ({'own async_io op' if io == 'own' else 'on aio handle'}{ranks})"


# -- the worker: one variant in this (fresh) process -------------------------------------------
def progress(fd: int | None, variant: str, text: str) -> None:
    """A progress line: live on the parent's terminal (`fd`) and in this
    worker's log (marked, so that a killed run's last phase is known)."""
    line = f"[{variant}] {text}"
    print(PROGRESS + line, flush=True)
    if fd is not None:
        os.write(fd, (line + "\n").encode())


def prepare(variant: str, io: str) -> dict[str, float]:
    """Everything before set-up is timed: imports (at a tiny size they would be
    most of it) and, for DeepSpeed, its I/O routed to aio (`io` 'aio'), its
    process group and its JIT-built ops loaded (a one-time build of about a
    minute, not DeepSpeed's set-up); returns each op's load seconds."""
    import torch  # noqa: F401

    if variant == "aio":
        import aio.zero  # noqa: F401

        return {}
    if io == "aio":
        import aio.integrations.deepspeed as aio_ds

        aio_ds.enable()  # imports DeepSpeed; before it loads its swappers' op
    import deepspeed
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    deepspeed.init_distributed(dist_backend="gloo")
    loads = {}
    for name, builder in (("cpu_adam", CPUAdamBuilder), ("async_io", AsyncIOBuilder)):
        if name == "async_io" and io == "aio":
            continue  # aio's handle stands in for it
        t0 = time.perf_counter()
        builder().load()  # cached by DeepSpeed: its engine's own load() is then instant
        loads[name] = time.perf_counter() - t0
    return loads


def build_aio(targs: argparse.Namespace, cfg: dict) -> tuple[Any, dict]:
    """aio-train's set-up: the model under aio.zero.Init (unless --no-init) and its trainer."""
    from aio.train import build_trainer  # aio-train's own set-up, so "defaults" stay aio-train's

    _model, trainer = build_trainer(targs, cfg)
    return trainer, {}


def build_ds(targs: argparse.Namespace, cfg: dict, say: Any = None) -> tuple[Any, dict]:
    """DeepSpeed's engine for `cfg`, the model built under deepspeed.zero.Init
    (unless --no-init); extras: its pin counter. `say` marks each phase (a
    run killed in set-up then says where)."""
    import contextlib

    import deepspeed
    import torch

    from aio.train import build_gpt

    pins = ts.PinCounter()  # before Init: it allocates the swap buffers
    torch.manual_seed(targs.seed)
    init = deepspeed.zero.Init(config_dict_or_path=cfg) if targs.init else contextlib.nullcontext()
    if say is not None:
        say("set-up: building the model under deepspeed.zero.Init")
    with init:
        model = build_gpt(targs.vocab, targs.width, targs.layers, targs.heads, targs.seq)
    if say is not None:
        say("set-up: deepspeed.initialize")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, {"pins": pins}


def run_steps(engine: Any, targs: argparse.Namespace, n: int, say: Any) -> dict[str, list]:
    """`n` steps of aio-train's batches (on several ranks each rank its own
    micro-batches): per step its time, /proc/self/io bytes, loss and (aio)
    bytes by category."""
    import torch

    from aio.train import batch, step_bytes

    rank = int(os.environ.get("RANK", "0"))
    lf = torch.nn.functional.cross_entropy
    by_cat = getattr(engine, "io_bytes_by_category", None)
    rec: dict[str, list] = {"step_s": [], "read_b": [], "write_b": [], "loss": [], "by_category": []}
    for step in range(n):
        r0, w0 = ts.proc_io()
        c0 = by_cat() if by_cat else None
        t0 = time.perf_counter()
        for micro in range(targs.gas):
            x, y = batch(step, rank * targs.gas + micro, targs.batch, targs.seq, targs.vocab)
            loss = lf(engine(x).flatten(0, 1).float(), y.flatten())
            engine.backward(loss)
            engine.step()
        dt = time.perf_counter() - t0
        r1, w1 = ts.proc_io()
        rec["step_s"].append(dt)
        rec["read_b"].append(r1 - r0)
        rec["write_b"].append(w1 - w0)
        rec["loss"].append(float(loss.item()))
        if by_cat and c0 is not None:
            rec["by_category"].append(step_bytes(c0, by_cat()))
        moved = f"read {(r1 - r0) / 1e9:.2f} GB, written {(w1 - w0) / 1e9:.2f} GB"
        say(f"step {step + 1}/{n}: {dt:.1f} s, {moved}, loss {rec['loss'][-1]:.4f}")
    return rec


def mean_categories(steps: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, float]]:
    """Mean bytes per step for each direction and category over `steps`."""
    out: dict[str, dict[str, float]] = {"read": {}, "written": {}}
    for d in out:
        for s in steps:
            for k, v in s.get(d, {}).items():
                out[d][k] = out[d].get(k, 0.0) + v / len(steps)
    return out


def describe_exception(e: BaseException) -> str:
    """``Type: message (file:line: source)`` of the frame that raised `e`: a bare
    assert's message is empty, the line says which one failed."""
    msg = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())  # one line for the table's notes
    text = type(e).__name__ + (f": {msg[:600]}" if msg else "")
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        f = frames[-1]
        text += f" ({os.path.basename(f.filename)}:{f.lineno}: {(f.line or '').strip()})"
    return text


def measure(job: dict, say: Any, res: dict[str, Any]) -> None:
    """Build, train and measure the job's variant into `res` (filled as it goes:
    a run that fails in its steps keeps its set-up figures)."""
    from aio.train import peak_rss

    targs, cfg, v = argparse.Namespace(**job["targs"]), job["config"], job["variant"]
    res["ds_op_load_s"] = prepare(v, job["io"])
    if v == "aio":  # before anything is allocated, as aio-train prints it
        from aio.train import estimate_run

        res["predicted_peak_rss"] = int(estimate_run(targs, cfg).peak_rss_bytes)
    t0 = time.perf_counter()
    engine, extra = build_aio(targs, cfg) if v == "aio" else build_ds(targs, cfg, say)
    res["setup_s"] = time.perf_counter() - t0
    res["peak_rss_setup"] = peak_rss()
    say(f"set-up {res['setup_s']:.1f} s, peak RSS {res['peak_rss_setup'] / 2**30:.2f} GiB")
    try:
        rec = run_steps(engine, targs, job["warmup"] + job["steps"], say)
        timed = slice(job["warmup"], None)
        res["step_s"] = statistics.median(rec["step_s"][timed])
        res["read_b"] = statistics.mean(rec["read_b"][timed])
        res["write_b"] = statistics.mean(rec["write_b"][timed])
        res.update(step_times=rec["step_s"], losses=rec["loss"])
        if rec["by_category"]:
            res["by_category"] = mean_categories(rec["by_category"][timed])
        res["peak_rss"] = peak_rss()
        res["vmlck"] = ts.vm_locked()
        if "pins" in extra:
            res["pinned"] = extra["pins"].bytes + res["vmlck"]
        else:
            res["pinned"] = int(engine.pinned_bytes())
    finally:
        if hasattr(engine, "close"):
            engine.close()  # aio.zero: swap files removed, I/O finished


def worker(job_path: str) -> int:
    """Run the job file's variant; its result (or its error) next to the job file."""
    with open(job_path) as f:
        job = json.load(f)
    fd = job.get("progress_fd")

    ranked = f"rank {os.environ.get('RANK', '0')}: " if job["variant"] in RANKED else ""

    def say(text: str) -> None:
        progress(fd, job["variant"], ranked + text)

    if job["variant"] != "aio":
        ts.ds_environment(argparse.Namespace(cuda=False))  # before DeepSpeed picks an accelerator
    out: dict[str, Any] = {"ok": False}
    try:
        measure(job, say, out)
        out["ok"] = True
    except Exception as e:
        traceback.print_exc()  # the whole traceback stays in the log
        out["error"] = describe_exception(e)
    name = "result.json" if job["variant"] not in RANKED else f"result.rank{os.environ.get('RANK', '0')}.json"
    with open(os.path.join(os.path.dirname(job_path), name), "w") as f:
        json.dump(out, f)
    return 0 if out["ok"] else 1


# -- the parent: one worker per variant, the report ----------------------------------------------
def skip_reason(variant: str, targs: argparse.Namespace | None = None) -> str | None:
    """Why `variant` cannot run here at all, or None."""
    if variant == "fsdp":
        if targs is not None and (targs.dtype != "fp32" or targs.gas != 1):
            return "the FSDP2 main job (aio-train --nproc) trains fp32, one micro-batch per step"
        return None
    if variant != "aio" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    return None


def drive(root: str, mib: int) -> dict:
    """The drive's ``read`` and ``write`` GB/s in `root` now, or ``error``
    (the run goes on without a floor)."""
    from aio.quickcheck import drive_rates

    try:
        return dict(drive_rates(root, mib << 20))
    except Exception as e:
        return {"error": describe_exception(e)}


def last_exception_line(log: str) -> str | None:
    """The exception of the last traceback in `log`, on one line: the first
    unindented line after its frames and the indented lines continuing its
    message (None without a traceback)."""
    log = re.sub(r"(?m)^\[rank\d+\]: ?", "", log)  # torchrun's prefix on a rank's lines
    i = log.rfind("Traceback (most recent call last):")
    if i < 0:
        return None
    found: list[str] = []
    for line in log[i:].splitlines()[1:]:
        indented = line.startswith((" ", "\t"))
        if found and (not indented or not line.strip()):
            break
        if found or (line.strip() and not indented):
            found.append(line.strip())
    return " ".join(found) or None


def rank_signal(log: str) -> str | None:
    """torchrun's report of a rank killed by a signal, as 'rank R killed by
    SIG...' (None when no rank was): a ranked variant's exit status is
    torchrun's own."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?\n.*?exitcode\s*:\s*-(\d+)", log)
    # SIGTERM is torchrun stopping the other ranks after one failed: not a cause.
    found = [(rank, num) for rank, num in found if int(num) != signal.SIGTERM]
    if not found:
        return None
    parts = []
    for rank, num in found:
        try:
            name = signal.Signals(int(num)).name
        except ValueError:
            name = f"signal {num}"
        oom = " (what the kernel's OOM killer sends when memory runs out)"
        oom = oom if int(num) == signal.SIGKILL else ""
        parts.append(f"rank {rank} killed by {name}{oom}")
    return "; ".join(parts)


def last_progress(log: str) -> str | None:
    """The worker's last progress line in `log`, without its marker."""
    lines = [ln[len(PROGRESS) :] for ln in log.splitlines() if ln.startswith(PROGRESS)]
    return lines[-1] if lines else None


def failure(rc: int, timed_out: bool, timeout: float, log: str, result: dict | None) -> str:
    """The exact error of a failed worker: its exception (as it recorded it,
    else the log's last traceback line), the signal that killed it, or the
    timeout; then its last progress line."""
    killed = rank_signal(log)
    if timed_out:
        why = f"timed out after {timeout:.0f} s (killed)"
    elif killed:
        # A rank killed by a signal is the cause; another rank's error is then a consequence
        # (its collective lost its peer), named after it.
        why = killed + (f"; then {result['error']}" if result and result.get("error") else "")
    elif result and result.get("error"):
        why = result["error"]
    elif rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        why = f"killed by {name}"
        if -rc == signal.SIGKILL:
            why += " (what the kernel's OOM killer sends when memory runs out)"
    else:
        tail = [ln.strip() for ln in log.splitlines() if ln.strip()]
        why = f"exit {rc}: {last_exception_line(log) or (tail[-1] if tail else 'no output')}"
    where = last_progress(log)
    return why + (f"; last progress: {where}" if where else "")


def spawn(job: dict, job_path: str, timeout: float, cmd: list[str] | None = None) -> tuple[int, bool, str]:
    """Run the worker for `job` (written to `job_path`) in its own session,
    its output to a log beside the job; (exit status, timed out, log).
    `cmd`: run that instead (a torchrun of several ranks: no live progress,
    torchrun does not hand its workers our descriptor)."""
    fd: int | None = None
    if cmd is None:
        try:
            sys.stdout.flush()
            fd = os.dup(sys.stdout.fileno())  # the worker's live progress
        except (OSError, ValueError):
            fd = None
    job["progress_fd"] = fd
    with open(job_path, "w") as f:
        json.dump(job, f, default=str)
    log_path = os.path.join(os.path.dirname(job_path), "worker.log")
    env = ts.worker_env()
    cmd = cmd or [sys.executable, os.path.abspath(__file__), "--worker", job_path]
    with open(log_path, "w") as log:
        # Its own session: a timeout kills the worker with whatever it started (a JIT build).
        p = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=() if fd is None else (fd,),
        )
    if fd is not None:
        os.close(fd)
    timed_out = False
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        rc = kill_group(p)
    except BaseException:
        kill_group(p)
        raise
    with open(log_path, errors="replace") as f:
        return rc, timed_out, f.read()


def kill_group(p: subprocess.Popen) -> int:
    """SIGKILL the worker's process group (its session: it and its children); its exit status."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return p.wait()


def run_variant(own: argparse.Namespace, targs: argparse.Namespace, v: str, root: str) -> dict:
    """One variant in a fresh worker (a torchrun of --world ranks for the
    ranked ones) on a fresh folder under `root` (removed after), the drive
    measured right before; its row: figures (a ranked one's summed over its
    ranks, each rank's in ``ranks``) or error."""
    vdir = tempfile.mkdtemp(prefix=f"{v}-", dir=root)
    io = variant_io(own, v)
    world = own.world if v in RANKED else 1
    cfg = variant_config(targs, v, vdir)
    row: dict[str, Any] = {"variant": v, "label": label(v, io, world), "io": io, "config": cfg}
    row["world"] = world
    try:
        row["drive"] = drive(root, own.drive_mib)
        job = {"variant": v, "io": io, "targs": vars(targs), "config": cfg}
        job.update(warmup=own.warmup, steps=own.steps)
        job_path = os.path.join(vdir, "job.json")
        cmd = ranked_command(own, targs, v, job_path) if v in RANKED else None
        t0 = time.perf_counter()
        rc, timed_out, log = spawn(job, job_path, own.timeout, cmd)
        row["wall_s"] = time.perf_counter() - t0
        results = read_results(vdir, v, world, own.warmup)
        if world > 1:
            row["ranks"] = results
            row.update(merge_ranks([r for r in results if r]))
        else:
            row.update({k: x for k, x in (results[0] or {}).items() if k not in ("ok", "error")})
        if rc == 0 and all(r and r.get("ok") for r in results):
            row["status"] = "ok"
        else:
            failed = next((r for r in results if r and r.get("error")), None)
            row.update(status="failed", exit=rc, error=failure(rc, timed_out, own.timeout, log, failed))
            row["log_tail"] = log[-4000:]
    finally:
        shutil.rmtree(vdir, ignore_errors=True)  # swap files: tens of GB at 2B
    add_floor(row)
    return row


def ranked_command(own: argparse.Namespace, targs: argparse.Namespace, v: str, job_path: str) -> list[str]:
    """torchrun of --world ranks: this script's worker (DeepSpeed), or aio's
    FSDP2 main job (aio-train --nproc) at the same size, batch, clip, lr and
    seed, writing each rank's figures beside the job file."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={own.world}"]
    if v != "fsdp":
        return [*run, os.path.abspath(__file__), "--worker", job_path]
    flags = ["--layers", targs.layers, "--width", targs.width, "--heads", targs.heads, "--vocab", targs.vocab]
    flags += ["--seq", targs.seq, "--batch", targs.batch, "--clip", targs.clip, "--lr", targs.lr]
    flags += ["--seed", targs.seed, "--warmup-steps", 0, "--steps", own.warmup + own.steps, "--no-baseline"]
    vdir = os.path.dirname(job_path)
    flags += ["--nvme-path", vdir, "--json", os.path.join(vdir, "fsdp.rank{rank}.json")]
    return [*run, "-m", "aio.fsdp.train", *map(str, flags)]


def read_results(vdir: str, v: str, world: int, warmup: int) -> list[dict | None]:
    """Each rank's result (None where it wrote none): this script's worker
    files, or the FSDP2 job's own JSON in the same terms."""
    if v not in RANKED:
        names = ["result.json"]
    else:
        names = [f"{'fsdp' if v == 'fsdp' else 'result'}.rank{r}.json" for r in range(world)]
    out: list[dict | None] = []
    for name in names:
        path = os.path.join(vdir, name)
        if not os.path.exists(path):
            out.append(None)
            continue
        with open(path) as f:
            data = json.load(f)
        out.append(fsdp_result(data, warmup) if v == "fsdp" else data)
    return out


def fsdp_result(d: dict, warmup: int) -> dict:
    """One rank of aio.fsdp.train's JSON as this script's worker reports it."""
    timed = slice(warmup, None)
    io = d["proc_io_bytes"][timed]
    return {
        "ok": True, "setup_s": d["setup_s"], "step_s": statistics.median(d["step_s"][timed]),
        "step_times": d["step_s"], "losses": d["losses"], "phases_s": d["phases_s"],
        "read_b": statistics.mean(r for r, _ in io), "write_b": statistics.mean(w for _, w in io),
        "peak_rss": d["peak_rss"], "peak_rss_setup": d["setup_peak_rss"], "pinned": d["pinned_bytes"],
        "predicted_peak_rss": d["predicted_peak_rss"], "counted_b": d["bytes"],
    }  # fmt: skip


def merge_ranks(results: list[dict]) -> dict:
    """A ranked variant's row figures: the whole job's (bytes, RSS, pinned
    summed over ranks; set-up and step the slowest rank's)."""
    out: dict[str, Any] = {}
    for key, how in (("setup_s", max), ("step_s", max), ("read_b", sum), ("write_b", sum)):
        vals = [r[key] for r in results if r.get(key) is not None]
        if vals:
            out[key] = how(vals)
    for key in ("peak_rss", "peak_rss_setup", "pinned", "predicted_peak_rss"):
        vals = [r[key] for r in results if r.get(key) is not None]
        if vals and len(vals) == len(results):
            out[key] = sum(vals)
    if results and results[0].get("losses"):
        out["losses"] = results[0]["losses"]
    return out


def add_floor(row: dict) -> None:
    """The row's drive floor (seconds) and step/floor, where it has both a step and rates."""
    d = row.get("drive", {})
    if row.get("step_s") is None or "read" not in d:
        return
    rates = {"read_Bps": d["read"] * 1e9, "write_Bps": d["write"] * 1e9}
    row["floor_s"] = ts.drive_floor(row["read_b"], row["write_b"], rates)
    row["io_eff"] = row["step_s"] / row["floor_s"] if row["floor_s"] > 0 else None


def fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    """`x` / `scale` formatted with `spec`, or '-' when missing."""
    return "-" if x is None else format(x / scale, spec)


COLUMNS = (
    "variant",
    "status",
    "set-up s",
    "s/step",
    "peak RSS GiB",
    "predicted GiB (measured / predicted)",
    "pinned GiB",
    "read GB/step",
    "written GB/step",
    "drive read / write GB/s",
    "floor s",
    "step/floor",
)


def table_row(r: dict) -> list[str]:
    """One row of the main table (:data:`COLUMNS`)."""
    d = r.get("drive", {})
    rates = f"{d['read']:.2f} / {d['write']:.2f}" if "read" in d else "-"
    peak, predicted = r.get("peak_rss", r.get("peak_rss_setup")), r.get("predicted_peak_rss")
    vs = (
        f"{predicted / 2**30:.2f} ({peak / predicted:.2f})"
        if peak and predicted
        else fmt(predicted, ".2f", 2**30)
    )
    return [
        r["label"],
        r["status"],
        fmt(r.get("setup_s"), ".1f"),
        fmt(r.get("step_s"), ".2f"),
        fmt(peak, ".2f", 2**30),
        vs,
        fmt(r.get("pinned"), ".2f", 2**30),
        fmt(r.get("read_b"), ".2f", 1e9),
        fmt(r.get("write_b"), ".2f", 1e9),
        rates,
        fmt(r.get("floor_s"), ".1f"),
        fmt(r.get("io_eff"), ".2f"),
    ]


def markdown(head: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def rank_rows(rows: list[dict]) -> list[list[str]]:
    """Each rank's figures of the ranked variants."""
    out = []
    for r in rows:
        for k, x in enumerate(r.get("ranks") or []):
            if not x or not x.get("ok", True):
                what = "no result" if not x else "failed"
                out.append([r["label"], str(k), what, "-", "-", "-", "-", "-"])
                continue
            rss = f"{fmt(x.get('peak_rss'), '.2f', 2**30)} ({fmt(x.get('peak_rss_setup'), '.2f', 2**30)})"
            out.append(
                [
                    r["label"], str(k), fmt(x.get("setup_s"), ".1f"), fmt(x.get("step_s"), ".2f"), rss,
                    fmt(x.get("pinned"), ".2f", 2**30), fmt(x.get("read_b"), ".2f", 1e9),
                    fmt(x.get("write_b"), ".2f", 1e9),
                ]
            )  # fmt: skip
    return out


def category_rows(rows: list[dict]) -> list[list[str]]:
    """aio's bytes per step by category, their sum and /proc/self/io's total (GB)."""
    out = []
    for r in rows:
        cats = r.get("by_category")
        if not cats:
            continue
        cells = [", ".join(f"{k} {b / 1e9:.2f}" for k, b in sorted(cats[d].items())) or "-" for d in cats]
        total = sum(sum(c.values()) for c in cats.values())
        out.append([r["label"], *cells, f"{total / 1e9:.2f}", f"{(r['read_b'] + r['write_b']) / 1e9:.2f}"])
    return out


def config_line(cfg: dict) -> str:
    """The shared config's offload settings in one line."""
    z = cfg["zero_optimization"]
    p, o = z["offload_param"], z["offload_optimizer"]
    bf16 = cfg.get("bf16", {}).get("enabled", False)
    return (
        f"config (aio-train's built-in): sub_group_size {z['sub_group_size'] / 1e6:.1f}M, prefetch bucket "
        f"{z['stage3_prefetch_bucket_size'] / 1e6:.1f}M, offload_param {p['buffer_count']} buffers x "
        f"{p['buffer_size'] / 1e6:.1f}M, offload_optimizer {o['buffer_count']} buffers, pipeline "
        f"read/write {o['pipeline_read']}/{o['pipeline_write']}, bf16 {bf16}"
        "; ds-safe: pipeline off, stage3_max_reuse_distance 0"
        "; ds-hf: HF's block (buffers 5/4, pipeline on, reuse and max live 1e9, prefetch 0.9 h^2, "
        "persistence 10 h)"
    )


def report(rows: list[dict], own: argparse.Namespace, targs: argparse.Namespace, root: str) -> None:
    """Print the markdown tables and each failure's exact error."""
    from aio.train import gpt_params

    n = gpt_params(targs.vocab, targs.width, targs.layers, targs.seq)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    print(
        f"\nGPT {size} parameters ({targs.layers} layers, width {targs.width}, {targs.heads} heads, "
        f"vocab {targs.vocab}, seq {targs.seq}, batch {targs.batch}, {targs.dtype}); "
        f"{own.warmup} warm-up + {own.steps} timed steps; drive {root}"
    )
    print(config_line(variant_config(targs, "aio", root)) + "\n")
    print(markdown(COLUMNS, [table_row(r) for r in rows]))
    ranked = rank_rows(rows)
    if ranked:
        head = ["variant", "rank", "set-up s", "s/step", "peak RSS GiB (set-up)", "pinned GiB"]
        head += ["read GB/step", "written GB/step"]
        print("\nper rank (the table above sums the ranks' bytes, RSS and pinned memory):\n")
        print(markdown(head, ranked))
    cats = category_rows(rows)
    if cats:
        head = ["variant", "read GB/step", "written GB/step", "sum GB/step", "/proc/self/io GB/step"]
        print("\nbytes per step by category (trainer.io_bytes_by_category()):\n")
        print(markdown(head, cats))
    for r in rows:
        if r["status"] != "ok":
            print(f"\n{r['variant']}: {r['status']}: {r.get('error')}")
        if r.get("drive", {}).get("error"):
            print(f"\n{r['variant']}: drive not measured: {r['drive']['error']}")


def main(argv: list[str] | None = None) -> int:
    """Run the variants one after another; 1 when any failed."""
    own, targs = parse(argv)
    if own.worker:
        return worker(own.worker)
    root = own.dir or tempfile.mkdtemp(prefix="aio-scale-")
    os.makedirs(root, exist_ok=True)  # --dir may name a folder still to make
    rows = []
    try:
        for v in own.variant_list:
            why = skip_reason(v, targs)
            if why:
                world = own.world if v in RANKED else 1
                name = label(v, variant_io(own, v), world)
                rows.append({"variant": v, "label": name, "status": "skipped", "error": why})
                continue
            print(
                f"[{v}] starting ({own.warmup} + {own.steps} steps, timeout {own.timeout:.0f} s)", flush=True
            )
            rows.append(run_variant(own, targs, v, root))
            r = rows[-1]
            err = f": {r['error']}" if r.get("error") else ""
            print(f"[{v}] {r['status']} after {r.get('wall_s', 0):.0f} s{err}", flush=True)
    finally:
        if not own.dir:
            shutil.rmtree(root, ignore_errors=True)
    report(rows, own, targs, root)
    if own.json:
        with open(own.json, "w") as f:
            json.dump({"args": vars(own), "model": vars(targs), "variants": rows}, f, indent=1, default=str)
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
