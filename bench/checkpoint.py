#!/usr/bin/env python3
"""Checkpoint save/load speed: aio.zero's drive-to-drive checkpoint against
torch.save of the same state and DeepSpeed ZeRO-3's NVMe checkpoint of the
same model and config; bytes on disk and GB/s, measured in one run.

    PYTHONPATH=. python bench/checkpoint.py [--dir /local_nvme] [--rounds 5]
        [--width 512 --layers 8 --vocab 8192 --seq 64 --heads 8 --batch 1]
        [--steps 2] [--fp32] [--variants aio,torch,deepspeed] [--json out.json]

One GPT (aio.train.build_gpt; the defaults give 29.4M parameters and a
checkpoint of ~410 MB), trained ``--steps`` steps in each variant with the
same data and seed, then checkpointed ``--rounds`` times. Variants:

  aio        aio.zero, parameters and optimizer offloaded to NVMe under
             ``--dir``; ``engine.save_checkpoint`` / ``load_checkpoint``
             (durable: every file fsynced, ``complete`` marker last, renamed
             into place; the load verifies every CRC before it changes
             anything, then copies into the swap files)
  torch      the same state held in memory -- an in-memory torch AdamW
             trained the same steps: fp32 parameters, exp_avg, exp_avg_sq
             and (in bf16, the default) a bf16 copy of the parameters,
             as aio's checkpoint holds the low-precision parameters too --
             ``torch.save`` to one file, ``os.fsync`` of it and its folders
             (as durable as aio's), then ``torch.load(weights_only=True)``
             and ``load_state_dict`` into the model and optimizer
  deepspeed  DeepSpeed ZeRO-3 with parameters and optimizer on NVMe (its
             own async_io op), the identical config dict (bench/train_step.py's
             ``full_config``); ``engine.save_checkpoint`` / ``load_checkpoint``.
             DeepSpeed does not fsync its checkpoint: "save s" here includes
             an fsync of every file and folder it wrote afterwards (its own
             time is in the JSON as ``own_s``), so all three are durable.
             If DeepSpeed refuses or fails, its exception is printed and the
             row left out.

Method: every variant runs in its own long-lived worker process (engines
built and trained once). Each round saves twice in every variant, in the
order A B C C B A (so each variant runs once early and once late: on this
disk one variant's writes still slow the next one down after 1 s idle),
then loads each of those checkpoints in the same order, with ~1 s idle
before each timed call; the order is reversed every other round. Before
each load the checkpoint's files are dropped from the page cache
(``posix_fadvise(DONTNEED)`` after the fsync), so every load reads from the
drive. A round's figure for a variant is the mean of its two runs; the
table gives medians over rounds, and the ratios aio/torch and
aio/deepspeed are of GB/s, taken per round (> 1: aio faster). A fresh
folder per save, removed at the end of its round.

Columns: bytes = the sum of the file sizes in the checkpoint folder; GB/s
= bytes / seconds (1 GB = 1e9 bytes). aio's save and load are also split
into their parts (parameter export, optimizer export; verify and apply of
each on load), and each round's saved CRCs are compared across rounds and
the parameters after every load with those before the first save (a load
that changed anything fails the run).

bf16 is the default because DeepSpeed 0.19.8 on its CPU accelerator cannot
train an fp32 model with NVMe parameter offload (see bench/train_step.py);
``--fp32`` runs fp32 and leaves DeepSpeed out.
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
sys.path.insert(0, HERE)

import train_step  # noqa: E402

VARIANTS = ("aio", "torch", "deepspeed")
TS_VARIANT = {"aio": "zero-nvme", "torch": "memory", "deepspeed": "ds-nvme"}
LABELS = {
    "aio": "aio.zero (NVMe, drive to drive)",
    "torch": "torch.save / torch.load + fsync",
    "deepspeed": "DeepSpeed ZeRO-3 NVMe",
}
MODEL_FLAGS = ("width", "layers", "vocab", "seq", "heads", "batch")
PROTO = "@@ "  # the worker's replies on its private stdout


# -- helpers shared by parent and workers --------------------------------------------------
def tree_bytes(path: str) -> int:
    """Sum of the sizes of the files under `path`."""
    total = 0
    for d, _, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(d, name)).st_size
    return total


def files_by_entry(path: str) -> dict[str, int]:
    """Bytes under `path` per top-level entry (a file, or a folder's total)."""
    out = {}
    for name in sorted(os.listdir(path)):
        p = os.path.join(path, name)
        out[name] = tree_bytes(p) if os.path.isdir(p) else os.lstat(p).st_size
    return out


def fsync_tree(path: str) -> None:
    """fsync every file and folder under `path` (folders after their files), and `path`'s parent."""
    for d, dirs, files in os.walk(path, topdown=False):
        for name in files:
            _fsync(os.path.join(d, name), 0)
        for name in dirs:
            _fsync(os.path.join(d, name), os.O_DIRECTORY)
    _fsync(path, os.O_DIRECTORY)
    _fsync(os.path.dirname(os.path.abspath(path)), os.O_DIRECTORY)


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: str) -> None:
    """Evict the (clean, fsynced) pages of every file under `path` from the page cache."""
    for d, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -- the worker: one variant, one engine, commands on stdin ----------------------------------
class Timed:
    """Wraps a bound method on an instance, adding its wall time to ``phases[name]``."""

    def __init__(self, obj: Any, method: str, name: str, phases: dict[str, float]) -> None:
        self.fn = getattr(obj, method)
        self.name, self.phases = name, phases
        setattr(obj, method, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.phases[self.name] = self.phases.get(self.name, 0.0) + time.perf_counter() - t0


class Worker:
    def __init__(self, a: argparse.Namespace) -> None:
        self.v = a.worker
        self.ts = ts_namespace(a, self.v, a.dir)
        if self.v == "deepspeed":
            train_step.ds_environment(self.ts)
        import torch

        self.torch = torch
        model, data, loss_fn = train_step.build(self.ts)
        self.model, self.data, self.loss_fn = model, data, loss_fn
        config = train_step.full_config(self.ts, self.ts.variant, a.dir)
        self.engine, self.opt, _ = train_step.make_engine(self.ts, model, config)
        rec = train_step.run_steps(self.ts, self.engine, self.opt, model, data, loss_fn)
        self.info: dict[str, Any] = {"losses": rec["loss"], "step_s": rec["step_s"]}
        self.phases: dict[str, float] = {}
        if self.v == "aio":
            store, opt = self.engine.store, self.engine.zero_optimizer
            for obj, part in ((store, "params"), (opt, "optimizer")):
                for m in ("export", "verify", "apply"):
                    Timed(obj, f"{m}_checkpoint", f"{part} {m}", self.phases)
            import aio.swap.copy
            import aio.swap.storage

            # Inside the parts above (marked *): the CRC32 of every chunk, the fsync of every file.
            Timed(aio.swap.copy, "_crc", "crc32*", self.phases)
            Timed(aio.swap.storage, "_sync_tree", "fsync*", self.phases)
            self.before = {k: t.clone() for k, t in self.engine.state_dict().items()}
        if self.v == "torch":
            state: dict[str, Any] = {
                "params": model.state_dict(),
                "optimizer": self.opt.state_dict(),
            }
            if self.ts.bf16:
                # aio's checkpoint holds the bf16 parameters beside the fp32 masters (the tied
                # embedding/head once, as named_parameters() lists it)
                state["params_bf16"] = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
            self.state = state

    def save(self, d: str, tag: str) -> dict[str, Any]:
        self.phases.clear()
        out: dict[str, Any] = {}
        io0 = train_step.proc_io()
        t0 = time.perf_counter()
        if self.v == "torch":
            folder = os.path.join(d, tag)
            os.makedirs(folder)
            with open(os.path.join(folder, "state.pt"), "wb") as f:
                self.torch.save(self.state, f)
                f.flush()
                t1 = time.perf_counter()
                os.fsync(f.fileno())
            _fsync(folder, os.O_DIRECTORY)
            _fsync(d, os.O_DIRECTORY)
            self.phases["torch.save"] = t1 - t0
        else:
            self.engine.save_checkpoint(d, tag)
            if self.v == "deepspeed":
                t1 = time.perf_counter()
                out["own_s"] = t1 - t0
                fsync_tree(d)  # DeepSpeed writes through the page cache and never fsyncs
        out["save_s"] = time.perf_counter() - t0
        if self.v == "torch":
            self.phases["fsync"] = out["save_s"] - self.phases["torch.save"]
        if self.v == "deepspeed":
            self.phases = {"DeepSpeed save": out["own_s"], "fsync": out["save_s"] - out["own_s"]}
        out["io"] = [b - a for a, b in zip(io0, train_step.proc_io(), strict=True)]
        out["bytes"] = tree_bytes(d)
        out["files"] = files_by_entry(os.path.join(d, tag))
        out["phases"] = dict(self.phases)
        if self.v == "aio":
            out["crcs"] = saved_crcs(os.path.join(d, tag))
        return out

    def load(self, d: str, tag: str) -> dict[str, Any]:
        self.phases.clear()
        io0 = train_step.proc_io()
        t0 = time.perf_counter()
        if self.v == "torch":
            sd = self.torch.load(os.path.join(d, tag, "state.pt"), map_location="cpu", weights_only=True)
            t1 = time.perf_counter()
            self.model.load_state_dict(sd["params"])
            self.opt.load_state_dict(sd["optimizer"])
            self.phases = {"torch.load": t1 - t0, "load_state_dict": time.perf_counter() - t1}
        else:
            self.engine.load_checkpoint(d, tag)
        out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "phases": dict(self.phases)}
        out["io"] = [b - a for a, b in zip(io0, train_step.proc_io(), strict=True)]
        if self.v == "aio":
            after = self.engine.state_dict()
            bad = [k for k, t in self.before.items() if not self.torch.equal(t, after[k])]
            if bad:
                raise RuntimeError(f"aio: parameters differ after load_checkpoint: {bad[:5]}")
        return out

    def check(self, d: str, tag: str) -> dict[str, Any]:
        """aio only, untimed: save, train one more step (the state changes), load,
        and compare: the parameters with those saved, the CRCs of a second save
        with the first's."""
        first = self.save(d, tag)["crcs"]
        train_step.run_steps(self.ts, self.engine, None, self.model, self.data[:1], self.loss_fn)
        moved = self.engine.state_dict()
        if all(self.torch.equal(t, moved[k]) for k, t in self.before.items()):
            raise RuntimeError("the extra training step changed no parameter: the check proves nothing")
        self.load(d, tag)  # raises if a parameter differs from the saved one
        again = self.save(d, tag + "-again")["crcs"]
        if again != first:
            bad = [k for k in first["optimizer"] if first["optimizer"][k] != again["optimizer"].get(k)]
            raise RuntimeError(
                f"aio: state after load_checkpoint differs from the saved one (sub-groups {bad})"
            )
        return {"restored": True}

    def serve(self, reply: Any) -> None:
        reply({"ok": True, **self.info})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            try:
                res = getattr(self, cmd["op"])(cmd["dir"], cmd["tag"])
                reply({"ok": True, **res})
            except Exception as e:  # noqa: BLE001 - reported to the parent, verbatim
                import traceback

                traceback.print_exc()
                reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
        if hasattr(self.engine, "close"):
            self.engine.close()


def saved_crcs(path: str) -> dict[str, Any]:
    """The CRC32s aio wrote into its manifests (for the cross-round check)."""
    with open(os.path.join(path, "params", "manifest.json")) as f:
        params = {str(e["id"]): e["crc32"] for e in json.load(f)["partitions"]}
    with open(os.path.join(path, "optimizer", "manifest.json")) as f:
        opt = {k: g["crc32"] for k, g in json.load(f)["groups"].items()}
    return {"params": params, "optimizer": opt}


def worker_main(a: argparse.Namespace) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # everything the libraries print goes to the log, replies stay clean

    def reply(obj: dict) -> None:
        proto.write(PROTO + json.dumps(obj) + "\n")

    try:
        w = Worker(a)
    except Exception as e:  # noqa: BLE001 - reported to the parent, verbatim
        import traceback

        traceback.print_exc()
        reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    w.serve(reply)
    return 0


def ts_namespace(a: argparse.Namespace, variant: str, nvme: str) -> argparse.Namespace:
    """bench/train_step.py's arguments for this model, so its build(), config and engine helpers apply."""
    argv = ["--model", "gpt", "--steps", str(a.steps), "--warmup", "0"]
    for k in MODEL_FLAGS:
        argv += [f"--{k}", str(getattr(a, k))]
    for k in ("sub_group_size", "param_buffers", "optimizer_buffers"):
        if getattr(a, k) is not None:
            argv += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    argv.append("--bf16" if a.bf16 else "--fp32")
    ts = train_step.parse(argv)
    ts.variant, ts.dir = TS_VARIANT[variant], nvme
    return ts


# -- the parent ----------------------------------------------------------------------------
class Proc:
    """A worker process and its log."""

    def __init__(self, a: argparse.Namespace, v: str, root: str) -> None:
        self.v = v
        swap = os.path.join(root, f"swap-{v}")
        os.makedirs(swap)
        self.log_path = os.path.join(root, f"{v}.log")
        self.log = open(self.log_path, "w")  # closed in close()
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", v, "--dir", swap]
        for k in (*MODEL_FLAGS, "steps", "sub_group_size", "param_buffers", "optimizer_buffers"):
            if getattr(a, k) is not None:
                cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
        cmd.append("--bf16" if a.bf16 else "--fp32")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        self.p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )

    def receive(self) -> dict:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith(PROTO):
                return dict(json.loads(line[len(PROTO) :]))
        return {"ok": False, "error": f"worker exited (code {self.p.wait()}); see the log below"}

    def ask(self, op: str, d: str, tag: str) -> dict:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"op": op, "dir": d, "tag": tag}) + "\n")
        self.p.stdin.flush()
        return self.receive()

    def log_tail(self, n: int = 3000) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def close(self) -> None:
        if self.p.poll() is None and self.p.stdin is not None:
            try:
                self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.p.stdin.close()
                self.p.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()
        self.log.close()


def mean_of(x: dict, y: dict) -> dict:
    """One round's figure for a variant from its two runs (A B C C B A): the mean of
    times, bytes and parts (a ratio of such means is the ratio of sums); both runs kept."""
    out: dict[str, Any] = {"runs": [x, y], "crcs": x.get("crcs")}
    for k in ("bytes", "save_s", "load_s", "own_s"):
        if k in x:
            out[k] = (x[k] + y[k]) / 2
    for k in ("save_phases", "load_phases"):
        out[k] = {n: (x[k][n] + y[k].get(n, 0.0)) / 2 for n in x[k]}
    for k in ("save_io", "load_io"):
        out[k] = [(a + b) / 2 for a, b in zip(x[k], y[k], strict=True)]
    out["files"] = x["files"]
    return out


def gbps(nbytes: float, s: float) -> float:
    return nbytes / s / 1e9


def summarise(runs: dict[str, list[dict]], failed: dict[str, str], drives: list[dict]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for v, rs in runs.items():
        if v in failed or not rs:
            continue
        row: dict[str, Any] = {
            "bytes": statistics.median(r["bytes"] for r in rs),
            "save_s": statistics.median(r["save_s"] for r in rs),
            "load_s": statistics.median(r["load_s"] for r in rs),
            "save_GBps": statistics.median(gbps(r["bytes"], r["save_s"]) for r in rs),
            "load_GBps": statistics.median(gbps(r["bytes"], r["load_s"]) for r in rs),
        }
        for op in ("save", "load"):
            phases: dict[str, list[float]] = {}
            for r in rs:
                for k, t in r[f"{op}_phases"].items():
                    phases.setdefault(k, []).append(t)
            row[f"{op}_phases"] = {k: statistics.median(ts) for k, ts in phases.items()}
        if v == "aio" and len(drives) == len(rs):
            # The drive's time for aio's bytes, serial: save reads the swap and writes the
            # checkpoint; load reads the checkpoint twice and writes the swap once.
            def need(r: dict, d: dict, reads: int) -> float:
                return r["bytes"] * (reads / d["read_Bps"] + 1 / d["write_Bps"])

            row["drive"] = {
                "save": statistics.median(
                    r["save_s"] / need(r, d, 1) for r, d in zip(rs, drives, strict=True)
                ),
                "load": statistics.median(
                    r["load_s"] / need(r, d, 2) for r, d in zip(rs, drives, strict=True)
                ),
            }
        for op in ("save", "load"):
            row[f"{op}_io"] = [statistics.median(r[f"{op}_io"][i] for r in rs) for i in (0, 1)]
        if "own_s" in rs[0]:
            row["own_save_s"] = statistics.median(r["own_s"] for r in rs)
        row["rounds"] = rs
        rows[v] = row
    ratios: dict[str, Any] = {}
    for other in ("torch", "deepspeed"):
        if "aio" not in rows or other not in rows:
            continue
        per: dict[str, Any] = {}
        for k in ("save", "load"):
            vals = [
                gbps(x["bytes"], x[f"{k}_s"]) / gbps(y["bytes"], y[f"{k}_s"])
                for x, y in zip(runs["aio"], runs[other], strict=True)
            ]
            per[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        ratios[f"aio/{other}"] = per
    return {"variants": rows, "ratios": ratios, "failed": failed}


def print_table(s: dict[str, Any], a: argparse.Namespace, drives: list[dict], info: dict) -> None:
    from aio.train import gpt_params

    n = gpt_params(a.vocab, a.width, a.layers, a.seq)
    print()
    print(
        f"GPT {n / 1e6:.1f}M params (width {a.width}, {a.layers} layers, vocab {a.vocab}, seq {a.seq}), "
        f"{'bf16' if a.bf16 else 'fp32'}, AdamW; {a.steps} steps trained; median of {a.rounds} rounds"
    )
    if drives:
        rd = statistics.median(d["read_Bps"] for d in drives) / 1e9
        wr = statistics.median(d["write_Bps"] for d in drives) / 1e9
        print(
            f"drive (aio handle, {a.drive_size >> 20} MiB O_DIRECT, median over rounds): "
            f"write {wr:.2f} GB/s, read {rd:.2f} GB/s"
        )
    print()
    print("| variant | bytes (MB) | save s | save GB/s | load s | load GB/s |")
    print("|---|---|---|---|---|---|")
    for v, r in s["variants"].items():
        print(
            f"| {LABELS[v]} | {r['bytes'] / 1e6:.1f} | {r['save_s']:.3f} | {r['save_GBps']:.2f} "
            f"| {r['load_s']:.3f} | {r['load_GBps']:.2f} |"
        )
    print()
    for pair, per in s["ratios"].items():
        parts = [f"{k} {x['median']:.2f} [{x['min']:.2f}..{x['max']:.2f}]" for k, x in per.items()]
        print(f"{pair} GB/s (per-round ratio, median [min..max]): " + "; ".join(parts))
    for v, r in s["variants"].items():
        for op in ("save", "load"):
            parts = [f"{k} {t:.3f}" for k, t in r[f"{op}_phases"].items()]
            if parts:
                print(f"{v} {op} parts, s (median; * = inside the others): " + ", ".join(parts))
    for v, r in s["variants"].items():
        parts = [
            f"{op} read {r[f'{op}_io'][0] / 1e6:.0f}, written {r[f'{op}_io'][1] / 1e6:.0f}"
            for op in ("save", "load")
        ]
        print(f"{v} block-layer MB (/proc/self/io of the worker, median): " + "; ".join(parts))
    if "aio" in s["variants"] and drives:
        d = s["variants"]["aio"]["drive"]
        print(
            f"aio against the drive measured in the same round (median over rounds): save takes "
            f"{d['save']:.2f}x the time to write its bytes and read them back from the swap file, "
            f"one after the other; load {d['load']:.2f}x the time to read them twice "
            "(verify, then apply) and write them once into the swap files"
        )
    for v, r in s["variants"].items():
        files = r["rounds"][0]["files"]
        big = [f"{k} {n / 1e6:.1f}" for k, n in files.items() if n >= 1e6]
        print(f"{v} checkpoint folder, MB: " + ", ".join(big))
    if "deepspeed" in s["variants"]:
        r = s["variants"]["deepspeed"]
        print(f"deepspeed save without the fsync (as DeepSpeed does it): {r['own_save_s']:.3f} s")
    for v, why in s["failed"].items():
        print(f"{v}: FAILED: {why}")
    for v, i in info.items():
        losses = ", ".join(f"{x:.4f}" for x in i["losses"])
        check = ""
        if "restore_check" in i:
            check = f"; restore check (save, train a step, load, save again): {i['restore_check']}"
        print(f"{v} training losses: {losses}{check}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--dir", help="drive directory (default: a temporary directory under /tmp)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (each runs every variant twice)")
    ap.add_argument("--steps", type=int, default=2, help="training steps before checkpointing")
    for k, d in (("width", 512), ("layers", 8), ("vocab", 8192), ("seq", 64), ("heads", 8), ("batch", 1)):
        ap.add_argument(f"--{k}", type=int, default=d)
    ap.add_argument("--sub-group-size", type=int, help="default: bench/train_step.py's")
    ap.add_argument("--param-buffers", type=int, help="offload_param.buffer_count (train_step's default)")
    ap.add_argument("--optimizer-buffers", type=int, help="offload_optimizer.buffer_count")
    prec = ap.add_mutually_exclusive_group()
    prec.add_argument("--bf16", dest="bf16", action="store_true", default=True, help="bf16 (the default)")
    prec.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 (DeepSpeed left out)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--idle", type=float, default=1.0, help="seconds idle before each timed call")
    ap.add_argument(
        "--drive-size", type=int, default=512 << 20, help="bytes for the drive measurement (0: none)"
    )
    ap.add_argument("--json", help="write every measurement and the summary here")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        return worker_main(a)
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    failed: dict[str, str] = {}
    if "deepspeed" in variants:
        why = train_step.available("ds-nvme", ts_namespace(a, "deepspeed", "."))
        if why:
            failed["deepspeed"] = why
    base = a.dir or "/tmp"
    root = tempfile.mkdtemp(prefix="aio-ckpt-bench-", dir=base)
    procs: dict[str, Proc] = {}
    info: dict[str, Any] = {}
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    drives: list[dict] = []
    try:
        t_start = time.perf_counter()
        for v in variants:
            if v not in failed:
                procs[v] = Proc(a, v, root)
        for v, p in procs.items():  # built and trained concurrently; wait for each
            res = p.receive()
            if not res["ok"]:
                failed[v] = res["error"]
                print(f"{v}: could not start: {res['error']}\n{p.log_tail()}", file=sys.stderr)
            else:
                info[v] = {"losses": res["losses"], "step_s": res["step_s"]}
        print(f"workers ready after {time.perf_counter() - t_start:.0f} s", flush=True)
        drive_args = argparse.Namespace(idle=a.idle, drive_size=a.drive_size)
        for r in range(a.rounds):
            live = [v for v in variants if v in procs and v not in failed]
            order = live if r % 2 == 0 else live[::-1]
            seq = [(v, 0) for v in order] + [(v, 1) for v in order[::-1]]  # A B C C B A
            if a.drive_size:
                drives.append(train_step.measure_drive(drive_args, root))
            dirs = {k: os.path.join(root, f"ck-{k[0]}-{r}-{k[1]}") for k in seq}
            got: dict[tuple[str, int], dict] = {k: {} for k in seq}
            for op in ("save", "load"):
                for k in seq:
                    v = k[0]
                    if v in failed:
                        continue
                    if op == "load":
                        drop_cache(dirs[k])
                    time.sleep(a.idle)
                    res = procs[v].ask(op, dirs[k], "tag")
                    if not res.pop("ok"):
                        failed[v] = f"{op}_checkpoint: {res['error']}"
                        print(f"{v}: {op} failed: {res['error']}\n{procs[v].log_tail()}", file=sys.stderr)
                        continue
                    res[f"{op}_phases"] = res.pop("phases")
                    res[f"{op}_io"] = res.pop("io")
                    got[k].update(res)
                    secs = res[f"{op}_s"]
                    size = got[k]["bytes"]
                    print(
                        f"round {r + 1} {op} {v:9s} {secs:7.3f} s  {gbps(size, secs):5.2f} GB/s", flush=True
                    )
            for k in seq:
                shutil.rmtree(dirs[k], ignore_errors=True)
            for v in order:
                if v not in failed:
                    runs[v].append(mean_of(got[(v, 0)], got[(v, 1)]))
        crcs = {json.dumps(x["crcs"], sort_keys=True) for r in runs.get("aio", []) for x in r["runs"]}
        if len(crcs) > 1:
            failed["aio"] = "the saved CRCs differ between rounds: a load did not restore what was saved"
        if "aio" in procs and "aio" not in failed:
            res = procs["aio"].ask("check", os.path.join(root, "ck-check"), "tag")
            info["aio"]["restore_check"] = "ok" if res["ok"] else res["error"]
            if not res["ok"]:
                failed["aio"] = f"restore check: {res['error']}"
    finally:
        for p in procs.values():
            p.close()
        shutil.rmtree(root, ignore_errors=True)
    s = summarise(runs, failed, drives)
    print_table(s, a, drives, info)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": s, "drives": drives, "train": info, "args": vars(a)}, f, indent=1)
    return 1 if "aio" in failed else 0


if __name__ == "__main__":
    sys.exit(main())
