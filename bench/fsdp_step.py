#!/usr/bin/env python3
"""FSDP2 step benchmark: the same GPT and world size with each optimizer
tier, every variant in a process group of its own (gloo on CPU; NCCL where
``--backend nccl`` and GPUs are there).

    python bench/fsdp_step.py [--world 2] [--variants torch,cpu-adam,nvme,nvme-drive,ds-nvme]
        [--layers 4 --width 512 --heads 8 --vocab 8192 --seq 64 --batch 2]
        [--warmup 1] [--steps 3] [--dir /local_nvme [--dir /nvme1 ...]] [--drive-mib 256]
        [--rounds 1] [--no-replay] [--json out.json]
        [--sub-group-size 1000000] [--buffer-count 4]
        [--aio-block-size B] [--aio-queue-depth N] [--aio-threads N]

Variants:

  torch     FSDP2 + CPUOffloadPolicy + torch.optim.AdamW (its default, foreach
            where torch picks it)
  cpu-adam  the same with aio.optim.CPUAdamW (aio's fused CPU kernel)
  nvme      FSDP2 + aio.optim.NVMeAdamW at its default (master="auto": here,
            with fp32 parameters in CPU memory, "params"): each rank's Adam
            moments on its drive (a folder per rank under --dir), the fp32
            master weights the parameters themselves
  nvme-params  the same with master="params" asked for
  nvme-drive   the same with master="drive": the fp32 master weights on the
            drive beside the moments (12 bytes per element, 24 moved per step,
            against 8 and 16)
  ds-nvme   DeepSpeed ZeRO-3 with ``offload_optimizer: nvme`` on aio's handle
            (aio.integrations.deepspeed), DS_ACCELERATOR=cpu; its JIT-built
            cpu_adam op loads before anything is timed (a first build takes
            minutes, once per machine)

Columns, per rank (the median over ranks; figures over the timed steps):

  s/step          whole step (forward, backward, optimizer step), median
  opt s           the optimizer step alone, median (FSDP: opt.step(); DeepSpeed:
                  engine.step(), which also reduces)
  peak RSS GiB    VmHWM of the rank at the end
  pinned MiB      aio.pinned.locked_bytes() (what aio locked; a CPU build of
                  torch pins nothing itself)
  drive MB/step   /proc/self/io read_bytes + write_bytes per step (the same
                  meter for every variant; MB = 1e6 bytes; writes the page
                  cache absorbs are not in it)
  aio MB/step     what aio's optimizer read and wrote per step, by its count
  floor s         the job's drive floor: the time its drives need for the
                  bytes aio's optimizer moves in one step. Ranks whose folders
                  are on one device share that device's rates, so its floor is
                  the bytes of ALL of them (read / read GB/s + written / write
                  GB/s, each rank's median bytes summed); ranks on different
                  devices (one --dir per rank: rank r uses the r-th --dir,
                  modulo their count) run in parallel, so the job's floor is
                  the largest device's. Rates: aio.quickcheck.drive_rates in
                  each device's --dir just before and just after the
                  variant's run, averaged (a shared disk's speed drifts).
  step / floor    s/step against that floor
  opt / floor     the optimizer step alone against it (on a CPU box the
                  forward and backward dominate s/step). 1.0 = the drive's
                  speed; all ranks of one drive stepping at once is what the
                  drive sees, so one rank's bytes alone would understate the
                  floor by the number of ranks sharing it
  replay s        the same bytes again, right after each timed step: every
                  rank at once (a barrier first) writes then reads the bytes
                  aio's optimizer wrote and read in that step, in a scratch
                  file of its own in its folder (O_DIRECT, a fresh handle at
                  aio's defaults, as the rates above), one call per 64 MiB;
                  the job's time is the slowest rank's. The floor measured
                  at the very minute of the step, on the drive as it is then
                  (a shared disk's rate moves minute to minute, so rates taken
                  before and after a run can be far off); --no-replay skips it
  opt / replay    per timed step, the slowest rank's optimizer step against
                  that step's replay; the median over steps. 1.0 = the step
                  moved its bytes as fast as serial whole-file I/O did then

--sub-group-size and --buffer-count are NVMeAdamW's (elements per sub-group;
pinned buffers of one sub-group tensor each: pinned MiB is about their
product times 4 bytes); --aio-block-size, --aio-queue-depth and
--aio-threads its swap handle's block_size, queue_depth and thread_count
(``aio=``; unset: aio's defaults, 1 MiB, 8 and 1, those the drive's rates
are measured with).

--rounds N runs the variant list N times and prints each variant's median
over rounds of opt / floor, opt / replay, opt s and s/step, and the per-round ratio of
the first two variants' optimizer steps, median [min..max] (interleaved
A/B: list them as A,B or A,B,B,A).

Each rank writes its figures to a JSON file before the group is torn down
(gloo may abort at exit); the table is built from those files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

VARIANTS = ("torch", "cpu-adam", "nvme", "nvme-params", "nvme-drive", "ds-nvme")
MASTER = {"nvme": "auto", "nvme-params": "params", "nvme-drive": "drive"}  # NVMeAdamW's master=
LR = 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (processes) per variant")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS[:3]), help=f"comma-separated, of {','.join(VARIANTS)}"
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--dir", action="append",
        help="folder on the drive (default: a temporary one); repeat for one drive per rank (rank r "
        "uses the r-th, modulo their count)",
    )  # fmt: skip
    ap.add_argument("--drive-mib", type=int, default=256, help="MiB each way for the drive's rates (0: none)")
    ap.add_argument("--rounds", type=int, default=1, help="run the variant list this many times")
    ap.add_argument(
        "--no-replay", dest="replay", action="store_false",
        help="do not move each step's optimizer bytes again after it (the replay s column)",
    )  # fmt: skip
    ap.add_argument("--sub-group-size", type=int, default=1_000_000, help="nvme: elements per sub-group")
    ap.add_argument(
        "--buffer-count", type=int, default=4, help="nvme: pinned sub-group buffers (few: the state pages)"
    )
    for name, what in (("block-size", "bytes per request"), ("queue-depth", "requests in flight"),
                       ("threads", "I/O threads")):  # fmt: skip
        ap.add_argument(f"--aio-{name}", type=int, help=f"nvme: the swap handle's {what} (default: aio's)")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--json", help="write every rank's figures here")
    a = ap.parse_args(argv)
    a.variants = [v for v in a.variants.split(",") if v]
    bad = sorted(set(a.variants) - set(VARIANTS))
    if bad:
        ap.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    return a


# -- one rank ---------------------------------------------------------------------------------


def _gpt(a: argparse.Namespace) -> Any:
    import torch

    from aio.train import build_gpt

    torch.manual_seed(0)
    return build_gpt(a.vocab, a.width, a.layers, a.heads, a.seq)


def _fsdp(a: argparse.Namespace, model: Any) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=False)}
    for block in getattr(model, "blocks", []):
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def _optimizer(a: argparse.Namespace, variant: str, params: Any, folder: str) -> Any:
    import torch

    if variant == "torch":
        return torch.optim.AdamW(params, lr=LR)
    if variant == "cpu-adam":
        from aio.optim import CPUAdamW

        return CPUAdamW(params, lr=LR)
    from aio.optim import NVMeAdamW

    handle = {k: v for k, v in (("block_size", a.aio_block_size), ("queue_depth", a.aio_queue_depth),
                                ("thread_count", a.aio_threads)) if v is not None}  # fmt: skip
    return NVMeAdamW(
        params, lr=LR, nvme_path=folder, sub_group_size=a.sub_group_size, buffer_count=a.buffer_count,
        master=MASTER[variant], **({"aio": handle} if handle else {}),
    )  # fmt: skip


def _ds_engine(a: argparse.Namespace, folder: str) -> Any:
    import deepspeed

    import aio.integrations.deepspeed as aio_ds

    aio_ds.enable()
    cfg = {
        "train_micro_batch_size_per_gpu": a.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": folder, "pipeline_read": False,
                                  "pipeline_write": False},
            "stage3_max_reuse_distance": 0,
        },
        "steps_per_print": 10**9,
    }  # fmt: skip
    engine, _, _, _ = deepspeed.initialize(model=_gpt(a), model_parameters=None, config=cfg)
    return engine


def _io_bytes() -> int:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]) + int(fields["write_bytes"])


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    return 0


REPLAY_CHUNK = 64 << 20  # bytes a replay call moves (the handle keeps its queue depth within)


class Replay:
    """Moves a step's bytes again, in a scratch file of this rank's own, to
    time what the drive gives whole-file I/O of that size right now (the
    ``replay s`` column). Opened in `folder` (the rank's private swap
    folder), O_DIRECT, removed by close()."""

    def __init__(self, folder: str) -> None:
        import fcntl

        import torch

        from aio.handle import AsyncIOHandle
        from aio.pinned import locked_nbytes, new_locked_tensor

        self.fd, self.path = tempfile.mkstemp(prefix="replay-", suffix=".bin", dir=folder)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_DIRECT)
        self.h = AsyncIOHandle()
        self.buf = new_locked_tensor(REPLAY_CHUNK, torch.uint8)
        self.locked = locked_nbytes(self.buf)
        self.buf.random_(0, 256)
        self.size = 0

    def _each(self, fn: Any, nbytes: int) -> None:
        for off in range(0, nbytes, REPLAY_CHUNK):
            n = min(REPLAY_CHUNK, nbytes - off)
            fn(self.buf[:n], self.fd, off)

    def __call__(self, read: int, written: int) -> float:
        """Seconds to write `written` then read `read` bytes (each rounded up
        to 4 KiB), every rank of the group starting together."""
        import torch.distributed as dist

        read, written = (-(-n // 4096) * 4096 for n in (read, written))
        if max(read, written) > self.size:  # allocated first, untimed (a first write allocates)
            self.size = max(read, written)
            self._each(self.h.sync_pwrite, self.size)
        dist.barrier()
        t0 = time.perf_counter()
        self._each(self.h.sync_pwrite, written)
        self._each(self.h.sync_pread, read)
        return time.perf_counter() - t0

    def close(self) -> None:
        from aio.pinned import free_locked_tensor

        self.h.close()
        free_locked_tensor(self.buf)
        os.close(self.fd)
        os.unlink(self.path)


def _steps(
    a: argparse.Namespace, rank: int, fwd_bwd: Any, opt_step: Any, aio_io: Any = None, replay: Any = None
) -> dict[str, list[float]]:
    """Warm-up then timed steps: per step its seconds, the optimizer's, its
    drive bytes (/proc/self/io) and, for aio's optimizer, the bytes it read
    and wrote by its own count (`aio_io()`: (read, written) so far) and,
    given `replay` (a :class:`Replay`), the seconds those bytes took again
    right after the step."""
    import torch.distributed as dist

    from aio.train import batch

    out: dict[str, list[float]] = {"step_s": [], "opt_s": [], "io": [], "loss": [], "aio_r": [], "aio_w": []}
    out["replay_s"] = []
    for step in range(a.warmup + a.steps):
        x, y = batch(step, rank, a.batch, a.seq, a.vocab)
        dist.barrier()
        io0, t0 = _io_bytes(), time.perf_counter()
        r0, w0 = aio_io() if aio_io else (0, 0)
        loss = fwd_bwd(x, y)
        t1 = time.perf_counter()
        opt_step()
        t2 = time.perf_counter()
        r1, w1 = aio_io() if aio_io else (0, 0)
        if step >= a.warmup:
            out["step_s"].append(t2 - t0)
            out["opt_s"].append(t2 - t1)
            out["io"].append(_io_bytes() - io0)
            out["aio_r"].append(r1 - r0)
            out["aio_w"].append(w1 - w0)
            out["loss"].append(float(loss))
            if replay is not None:
                out["replay_s"].append(replay(r1 - r0, w1 - w0))
    return out


def _aio_counter(opt: Any) -> Any:
    """(bytes read, bytes written) so far by aio's optimizer, or None."""
    if not hasattr(opt, "swap_stats"):
        return None

    def count() -> tuple[int, int]:
        st = opt.swap_stats()
        return int(st.get("bytes_read", 0)), int(st.get("bytes_written", 0))

    return count


def _run_rank(a: argparse.Namespace, variant: str, rank: int, folder: str) -> dict[str, Any]:
    import torch

    from aio.pinned import locked_bytes

    lf = torch.nn.functional.cross_entropy
    if variant == "ds-nvme":
        engine = _ds_engine(a, folder)

        def ds_fwd_bwd(x: Any, y: Any) -> Any:
            loss = lf(engine(x).flatten(0, 1).float(), y.flatten())
            engine.backward(loss)
            return loss.item()

        res = _steps(a, rank, ds_fwd_bwd, engine.step)
    else:
        model = _fsdp(a, _gpt(a))
        opt = _optimizer(a, variant, model.parameters(), folder)

        def fwd_bwd(x: Any, y: Any) -> Any:
            opt.zero_grad()
            loss = lf(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            return loss.item()

        counter = _aio_counter(opt)
        replay = Replay(folder) if a.replay and counter else None
        try:
            res = _steps(a, rank, fwd_bwd, opt.step, counter, replay)
            # What aio's optimizer locked: the replay's own buffer is not its.
            pinned = locked_bytes() - (replay.locked if replay is not None else 0)
        finally:
            if replay is not None:
                replay.close()
        return {**res, "peak_rss": _peak_rss(), "pinned": pinned}
    return {**res, "peak_rss": _peak_rss(), "pinned": locked_bytes()}


def _worker(rank: int, a: argparse.Namespace, variant: str, roots: list[str], port: int) -> None:
    import torch.distributed as dist

    world = str(a.world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=world)
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=world)
    dist.init_process_group(a.backend, rank=rank, world_size=a.world)
    folder = os.path.join(roots[rank % len(roots)], f"rank{rank}")
    os.makedirs(folder, exist_ok=True)
    try:
        res = _run_rank(a, variant, rank, folder)
    except Exception:
        res = {"error": traceback.format_exc(limit=8)}
    with open(os.path.join(roots[0], f"{variant}.rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


# -- the parent ---------------------------------------------------------------------------------


def run_variant(a: argparse.Namespace, variant: str, roots: list[str], port: int) -> list[dict[str, Any]]:
    """`variant` in a process group of `a.world` ranks, rank r's folder
    under ``roots[r % len(roots)]``; each rank's figures."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if variant == "ds-nvme":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        mp.spawn(_worker, args=(a, variant, roots, port), nprocs=a.world, join=True)
    except Exception as e:  # gloo may abort at teardown: the files say what ran
        print(f"fsdp_step: {variant}: the group ended with {type(e).__name__}", file=sys.stderr)
    out = []
    for rank in range(a.world):
        path = os.path.join(roots[0], f"{variant}.rank{rank}.json")
        out.append(json.load(open(path)) if os.path.exists(path) else {"error": "no result written"})
    return out


Rates = dict[int, dict[str, float]]  # device (st_dev) -> {"read": GB/s, "write": GB/s}


def devices(dirs: list[str], world: int) -> list[int]:
    """The device (st_dev) each rank's folder is on: rank r's is the r-th of
    `dirs`, modulo their count."""
    return [os.stat(dirs[r % len(dirs)]).st_dev for r in range(world)]


def measure_rates(dirs: list[str], mib: int) -> Rates:
    """Each device's read and write GB/s, measured once per device (in the
    first of `dirs` on it); empty with `mib` 0."""
    from aio.quickcheck import drive_rates

    out: Rates = {}
    for d in dirs:
        dev = os.stat(d).st_dev
        if mib and dev not in out:
            out[dev] = dict(drive_rates(d, mib << 20))
    return out


def job_floor(ranks: list[dict[str, Any]], devs: list[int], rates: Rates) -> float | None:
    """Seconds the job's drives need for one step's bytes of aio's optimizer
    (each rank's median read and written, by its own count). The ranks on
    one device share its rates, so that device's floor is the bytes of all
    of them; devices work in parallel, so the job's floor is the largest.
    None without rates for a device, or with no bytes."""
    med = statistics.median
    moved: dict[int, list[float]] = {}
    for r, dev in zip(ranks, devs, strict=True):
        acc = moved.setdefault(dev, [0.0, 0.0])
        acc[0] += med(r["aio_r"])
        acc[1] += med(r["aio_w"])
    floors = []
    for dev, (read, written) in moved.items():
        rt = rates.get(dev) or {}
        if not (rt.get("read") and rt.get("write")):
            return None
        floors.append(read / 1e9 / rt["read"] + written / 1e9 / rt["write"])
    return max(floors) or None


def row(variant: str, ranks: list[dict[str, Any]], devs: list[int], rates: Rates) -> dict[str, Any]:
    """One table row: the median over ranks of each rank's medians; the
    floor the whole job's (:func:`job_floor`)."""
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"variant": variant, "error": errors[0].strip().splitlines()[-1]}
    med = statistics.median
    step = med(med(r["step_s"]) for r in ranks)
    io = med(med(r["io"]) for r in ranks)
    aio_r, aio_w = (med(med(r[k]) for r in ranks) for k in ("aio_r", "aio_w"))
    out = {
        "variant": variant,
        "s/step": step,
        "opt s": med(med(r["opt_s"]) for r in ranks),
        "peak RSS GiB": med(r["peak_rss"] for r in ranks) / 2**30,
        "pinned MiB": med(r["pinned"] for r in ranks) / 2**20,
        "drive MB/step": io / 1e6,
        "aio MB/step": (aio_r + aio_w) / 1e6,
        "losses": ranks[0]["loss"],
    }
    floor = job_floor(ranks, devs, rates) if aio_r + aio_w else None
    if floor:
        out["floor s"] = floor
        out["step / floor"] = step / floor
        out["opt / floor"] = out["opt s"] / floor
    out.update(replay_ratio(ranks))
    return out


def replay_ratio(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """The job's replay s (each step's slowest rank; median over steps) and
    opt / replay (per step, the slowest rank's optimizer step against that
    step's replay; median over steps); empty without replays."""
    if not all(r.get("replay_s") for r in ranks):
        return {}
    steps = range(min(len(r["replay_s"]) for r in ranks))
    replay = [max(r["replay_s"][k] for r in ranks) for k in steps]
    opt = [max(r["opt_s"][k] for r in ranks) for k in steps]
    ratio = [o / p for o, p in zip(opt, replay, strict=True) if p > 0]
    out = {"replay s": statistics.median(replay)}
    if ratio:
        out["opt / replay"] = statistics.median(ratio)
    return out


COLUMNS = [
    "s/step", "opt s", "peak RSS GiB", "pinned MiB", "drive MB/step", "aio MB/step", "floor s",
    "step / floor", "opt / floor", "replay s", "opt / replay",
]  # fmt: skip


def print_table(rows: list[dict[str, Any]], a: argparse.Namespace, rates: Rates, devs: list[int]) -> None:
    """The table, and the ratios the issue's targets are about."""
    shared = len(devs) - len(set(devs))
    print(
        f"\nFSDP2 step, world {a.world} ({a.backend}), GPT {a.layers}x{a.width} vocab {a.vocab}; "
        f"drive GB/s {list(rates.values())}; {len(set(devs))} device(s) for {a.world} ranks"
        + (" (the floor counts the bytes of every rank on a device)" if shared else "")
    )
    print(f"| variant | {' | '.join(COLUMNS)} |\n|---|{'---|' * len(COLUMNS)}")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error']} |")
            continue
        cells = [f"{r[c]:.3f}" if isinstance(r.get(c), float) else "-" for c in COLUMNS]
        print(f"| {r['variant']} | {' | '.join(cells)} |")
    by = {r["variant"]: r for r in rows if "error" not in r}
    if "torch" in by and "cpu-adam" in by:
        print(f"torch AdamW step / aio CPUAdamW step: {by['torch']['opt s'] / by['cpu-adam']['opt s']:.2f}x")
    if "nvme-drive" in by and ("nvme-params" in by or "nvme" in by):
        params = by.get("nvme-params") or by["nvme"]
        print(
            "NVMeAdamW optimizer step, master on the drive / in the parameters: "
            f"{by['nvme-drive']['opt s'] / params['opt s']:.2f}x "
            f"({by['nvme-drive']['aio MB/step']:.1f} / {params['aio MB/step']:.1f} MB moved)"
        )
    if "nvme" in by and "ds-nvme" in by:
        ds, nv = by["ds-nvme"], by["nvme"]
        # Both: the optimizer step is what the tiers differ in (DeepSpeed's engine.step()
        # also reduces the gradients); the whole step is dominated by forward and backward
        # on a CPU box.
        print(
            f"DeepSpeed NVMe / NVMeAdamW: optimizer step {ds['opt s'] / nv['opt s']:.2f}x, "
            f"whole step {ds['s/step'] / nv['s/step']:.2f}x"
            + _ratio("drive bytes a rank (/proc/self/io)", ds.get("drive MB/step"), nv.get("drive MB/step"))
        )


def _ratio(what: str, a: Any, b: Any) -> str:
    """', {what} {a/b}x' when both are numbers and b is not 0, else ''."""
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
    return f", {what} {a / b:.2f}x" if ok else ""


def summary(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Over rounds: each variant's median opt / floor, opt / replay, opt s and s/step, and
    the per-round ratio of the first variant's optimizer step to the
    second's (interleaved A/B), median [min..max]."""
    med = statistics.median
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["variant"] for rows in rounds for r in rows):
        rs = [r for rows in rounds for r in rows if r["variant"] == name and "error" not in r]
        cols = [c for c in ("opt / floor", "opt / replay", "opt s", "s/step") if rs and c in rs[0]]
        out[name] = {c: med(r[c] for r in rs) for c in cols}
    names = list(out)
    if len(names) >= 2:
        a, b = names[:2]
        ratios = []
        for rows in rounds:
            sa = [r["opt s"] for r in rows if r["variant"] == a and "error" not in r]
            sb = [r["opt s"] for r in rows if r["variant"] == b and "error" not in r]
            if sa and sb:
                ratios.append(sum(sa) / sum(sb))
        if ratios:
            out[f"opt s {a} / {b}"] = [med(ratios), min(ratios), max(ratios)]
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every variant (every round) and print the tables (exit 1 if one
    failed). Each variant's folders go once its figures are read, and the
    default temporary folder at the end: nothing is left behind."""
    a = parse_args(argv)
    own = None if a.dir else tempfile.mkdtemp(prefix="fsdp-step-")
    try:
        return _run(a, a.dir or [own])
    finally:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


def _run(a: argparse.Namespace, dirs: list[str]) -> int:
    devs = devices(dirs, a.world)
    rounds, raw, all_rates = [], [], []
    for k in range(a.rounds):
        rows, rates = [], measure_rates(dirs, a.drive_mib)
        for i, variant in enumerate(a.variants):
            roots = [tempfile.mkdtemp(prefix=f"{variant}-", dir=d) for d in dirs]
            try:
                ranks = run_variant(a, variant, roots, 29500 + (os.getpid() + 7 * k) % 1000 + i)
            finally:
                for root in roots:  # swap folders and each rank's figures (read by now)
                    shutil.rmtree(root, ignore_errors=True)
            # The rates just before and just after the run, averaged: a shared disk drifts.
            after = measure_rates(dirs, a.drive_mib)
            both = {dev: {x: (r[x] + after[dev][x]) / 2 for x in r} for dev, r in rates.items()}
            raw.append({"round": k, "variant": variant, "ranks": ranks, "rates": [rates, after]})
            rows.append(row(variant, ranks, devs, both))
            rates = after
        print_table(rows, a, rates, devs)
        rounds.append(rows)
        all_rates.append(rates)
    summ = summary(rounds) if a.rounds > 1 else {}
    if summ:
        print("\nmedian over rounds:", json.dumps(summ, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            out = {"args": vars(a), "rates": [{str(d): r for d, r in x.items()} for x in all_rates],
                   "rounds": rounds, "summary": summ, "ranks": raw}  # fmt: skip
            json.dump(out, f, indent=1)
    return 1 if any("error" in r for rows in rounds for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
