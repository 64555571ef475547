#!/usr/bin/env python3
"""Several drives: a swap space striped over all directories against one
directory, measured side by side in one run (issue 16).

    python bench/striped_io.py [--dirs D1 D2 ...] [--rounds 5]
        [--extents 16 --extent-mib 32 --parts 3 --group 4]
        [--layers 6 --width 256 --train-rounds 5 --steps 4] [--json out.json]

Without ``--dirs``: one temporary directory under /tmp and one under
/dev/shm. On a box with one disk those are NOT two drives: /dev/shm is
tmpfs (memory), so the "set" mixes a drive and RAM; it shows that striping
works and what it costs, not what two real drives give. For that, pass one
directory per physical drive.

Part 1, raw swap-space I/O (aio.swap.SwapSpace, the layer both swappers use):

  one drive   SwapSpace([D1])                    the reference
  Di alone    SwapSpace([Di]) for every other Di
  set         SwapSpace([D1, D2, ...])          striped over every directory
  split       SwapSpace of len(dirs) folders, all on D1's drive: the cost of
              striping alone (more, smaller requests; one handle pair per
              folder) where no second device can help
  raw         one AsyncIOHandle pair on one preallocated file in D1, the same
              requests at the same offsets: the cost of the SwapSpace layer

Each variant allocates ``--extents`` extents of ``--extent-mib`` MiB, as the
optimizer swapper allocates one extent per sub-group, each holding
``--parts`` tensors (fp32 master weights, exp_avg, exp_avg_sq by default).
A pass writes every extent, then reads every extent back, ``--group``
extents at a time through a pool of pinned, page-aligned buffers
(aio.swap.pool.BufferPool, as the swappers get theirs): one request per
tensor, all of a group's requests started before any is waited for
(group x parts requests in flight). Only the time from the first submit to
the last completion of each group is counted: filling the buffers with the
pass's pattern (before writing), poisoning them (before reading) and
checksumming (crc32 of each extent written, compared with the crc32 of the
same extent read back; a mismatch aborts the run) are outside it. Every pass
writes a different pattern, so stale data from an earlier pass cannot match.
Files are preallocated (SwapSpace.allocate uses fallocate) and each variant
gets one untimed warm-up pass first. Rounds interleave the variants (A B C,
then C B A, ...), ``--idle`` seconds before each timed pass; GB/s are the
medians over rounds, the ratios the medians of per-round ratios.

Part 2, one aio.zero training step (aio-train's GPT, aio.train.make_config:
parameters and optimizer state on the drive, pipelined optimizer swapper)
with nvme_path = D1 against nvme_path = [D1, D2, ...]. Both engines are
built from the same seed and trained on the same batches, alternating
``--steps`` steps each per round (A B, then B A), ``--idle`` s before each
run of steps; s/step is the median over all timed steps. Bytes per step per
drive come from engine.stats() (the parameter and optimizer swappers'
per-drive bytes_read/bytes_written). I/O eff. = s/step / (bytes read per
step / read GB/s + bytes written per step / write GB/s), with the GB/s of the
matching part-1 variant (one drive, or set): 1.0 means the step runs at the
speed of the drive(s), 2.0 that it takes twice the I/O time. The losses of
the two engines are compared (striping must not change the training).
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
import zlib
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from aio import AsyncIOHandle  # noqa: E402
from aio.pinned import Lease  # noqa: E402
from aio.swap.drives import SwapSpace  # noqa: E402
from aio.swap.pool import BufferPool  # noqa: E402
from aio.sweep import disk_of, fs_type, same_filesystem  # noqa: E402

ALIGN = 4096
POISON = 0xA5


# -- part 1: raw swap-space I/O ----------------------------------------------------------------
class Layout:
    """Extent and tensor sizes: `extents` extents of `parts` aligned tensors."""

    def __init__(self, extents: int, extent_mib: float, parts: int) -> None:
        part = int(extent_mib * 2**20) // parts // ALIGN * ALIGN
        if part <= 0:
            raise SystemExit(f"--extent-mib {extent_mib} is too small for --parts {parts}")
        self.extents = extents
        self.parts = parts
        self.part_bytes = part
        self.extent_bytes = part * parts

    @property
    def total_bytes(self) -> int:
        """Bytes of one pass in each direction."""
        return self.extents * self.extent_bytes


class Target:
    """Where a variant's extents live: a SwapSpace, or one plain file (raw)."""

    name: str
    label: str
    offsets: list[int]

    def read(self, buf: Any, off: int) -> Any:
        raise NotImplementedError

    def write(self, buf: Any, off: int) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SpaceTarget(Target):
    """A SwapSpace over `dirs`, with the layout's extents allocated."""

    def __init__(self, name: str, label: str, dirs: list[str], aio_kw: dict, lay: Layout) -> None:
        self.name, self.label, self.dirs = name, label, dirs
        self.space = SwapSpace(dirs, "optimizer", "striped_io.swp", aio_kw)
        self.offsets = [self.space.allocate(lay.extent_bytes) for _ in range(lay.extents)]

    def read(self, buf: Any, off: int) -> Any:
        return self.space.read(buf, off)

    def write(self, buf: Any, off: int) -> Any:
        return self.space.write(buf, off)

    def close(self) -> None:
        self.space.close()


class RawTarget(Target):
    """One preallocated file in a private folder of `directory`, one reader and
    one writer handle: the same requests without the SwapSpace layer."""

    def __init__(self, name: str, label: str, directory: str, aio_kw: dict, lay: Layout) -> None:
        self.name, self.label = name, label
        self.folder = tempfile.mkdtemp(prefix="striped-io-raw-", dir=directory)
        self.path = os.path.join(self.folder, "raw.swp")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, lay.total_bytes)
        finally:
            os.close(fd)
        self.reader, self.writer = AsyncIOHandle(**aio_kw), AsyncIOHandle(**aio_kw)
        self.offsets = [i * lay.extent_bytes for i in range(lay.extents)]

    def read(self, buf: Any, off: int) -> Any:
        return self.reader.async_pread(buf, self.path, off)

    def write(self, buf: Any, off: int) -> Any:
        return self.writer.async_pwrite(buf, self.path, off)

    def close(self) -> None:
        try:
            self.reader.close()
            self.writer.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


class Buffers:
    """`group` pinned extent buffers from a BufferPool, held for the whole run."""

    def __init__(self, lay: Layout, group: int) -> None:
        self.lay = lay
        self.pool = BufferPool(group, lay.extent_bytes, True, "--group", "--extent-mib")
        self.leases: list[Lease] = [self.pool.acquire() for _ in range(group)]
        self.bytes = [BufferPool.view(x, torch.uint8, lay.extent_bytes) for x in self.leases]
        # One tensor per part of the extent: the requests.
        self.parts = [
            [b[k * lay.part_bytes : (k + 1) * lay.part_bytes] for k in range(lay.parts)] for b in self.bytes
        ]

    def fill(self, slot: int, tag: int) -> int:
        """Fill a buffer with this pass's pattern for one extent; its crc32."""
        words = self.bytes[slot].view(torch.int64)
        torch.arange(tag, tag + words.numel(), dtype=torch.int64, out=words)
        return self.crc(slot)

    def poison(self, slot: int) -> None:
        self.bytes[slot].fill_(POISON)

    def crc(self, slot: int) -> int:
        return zlib.crc32(self.leases[slot].buffer()[: self.lay.extent_bytes])

    def close(self) -> None:
        for x in self.leases:
            x.release()


def one_pass(t: Target, bufs: Buffers, tag: int) -> tuple[float, float]:
    """Write every extent, then read every extent back, `group` extents at a
    time; (write seconds, read seconds), I/O windows only. Checksums verified."""
    lay, group = bufs.lay, len(bufs.leases)
    batches = [list(range(i, min(i + group, lay.extents))) for i in range(0, lay.extents, group)]
    crcs: dict[int, int] = {}

    def io(op: Callable[[Any, int], Any], batch: list[int]) -> float:
        t0 = time.perf_counter()
        futs = [
            op(part, t.offsets[e] + k * lay.part_bytes)
            for slot, e in enumerate(batch)
            for k, part in enumerate(bufs.parts[slot])
        ]
        for f in futs:
            f.result()
        return time.perf_counter() - t0

    w = 0.0
    for batch in batches:
        for slot, e in enumerate(batch):
            crcs[e] = bufs.fill(slot, (tag << 40) + (e << 32))
        w += io(t.write, batch)
    r = 0.0
    for batch in batches:
        for slot in range(len(batch)):
            bufs.poison(slot)
        r += io(t.read, batch)
        for slot, e in enumerate(batch):
            got = bufs.crc(slot)
            if got != crcs[e]:
                raise RuntimeError(
                    f"{t.name}: extent {e} read back with crc32 {got:#010x}, written {crcs[e]:#010x}"
                )
    return w, r


def make_targets(a: argparse.Namespace, lay: Layout, aio_kw: dict, scratch: list[str]) -> list[Target]:
    dirs = a.dirs
    targets: list[Target] = [SpaceTarget("one", f"one drive: SwapSpace([{dirs[0]}])", [dirs[0]], aio_kw, lay)]
    for i, d in enumerate(dirs[1:], start=2):
        targets.append(SpaceTarget(f"d{i}", f"D{i} alone: SwapSpace([{d}])", [d], aio_kw, lay))
    if len(dirs) > 1:
        targets.append(SpaceTarget("set", f"set: SwapSpace(all {len(dirs)} dirs)", list(dirs), aio_kw, lay))
    if not a.no_split:
        n = max(2, len(dirs))
        folders = [tempfile.mkdtemp(prefix="striped-io-split-", dir=dirs[0]) for _ in range(n)]
        scratch += folders
        targets.append(SpaceTarget("split", f"split: SwapSpace of {n} folders in D1", folders, aio_kw, lay))
    if not a.no_raw:
        targets.append(RawTarget("raw", "raw: one handle pair, one file in D1", dirs[0], aio_kw, lay))
    return targets


def io_bench(a: argparse.Namespace, lay: Layout, aio_kw: dict, scratch: list[str]) -> dict[str, Any]:
    bufs = Buffers(lay, min(a.group, lay.extents))
    targets = make_targets(a, lay, aio_kw, scratch)
    tag = 1
    try:
        for t in targets:  # untimed warm-up pass (also verified)
            one_pass(t, bufs, tag)
            tag += 1
        samples: dict[str, dict[str, list[float]]] = {t.name: {"write": [], "read": []} for t in targets}
        for r in range(a.rounds):
            order = targets if r % 2 == 0 else targets[::-1]
            for t in order:
                time.sleep(a.idle)
                w, rd = one_pass(t, bufs, tag)
                tag += 1
                samples[t.name]["write"].append(lay.total_bytes / w / 1e9)
                samples[t.name]["read"].append(lay.total_bytes / rd / 1e9)
            print(
                f"  io round {r + 1}/{a.rounds}: "
                + ", ".join(
                    f"{n} w {s['write'][-1]:.2f} r {s['read'][-1]:.2f} GB/s" for n, s in samples.items()
                ),
                file=sys.stderr,
                flush=True,
            )
        stripes = {
            t.name: [len(t.space.pieces(t.offsets[0], lay.part_bytes))] if isinstance(t, SpaceTarget) else [1]
            for t in targets
        }
    finally:
        for t in targets:
            t.close()
        bufs.close()
    return {
        "variants": [{"name": t.name, "label": t.label} for t in targets],
        "samples_GBps": samples,
        "pieces_per_request": {k: v[0] for k, v in stripes.items()},
    }


def ratio_stats(samples: dict[str, dict[str, list[float]]], names: list[str], mode: str) -> dict[str, float]:
    """Median over rounds of set / one drive, set / best single, set / sum of
    singles, set / (n x slowest single) (the ceiling of equal stripes)."""
    out: dict[str, float] = {}
    for d in ("write", "read"):
        rounds = len(samples["one"][d])
        per: dict[str, list[float]] = {"one": [], "best": [], "sum": [], "even": []}
        for r in range(rounds):
            singles = [samples[n][d][r] for n in names]
            x = samples[mode][d][r]
            per["one"].append(x / samples["one"][d][r])
            per["best"].append(x / max(singles))
            per["sum"].append(x / sum(singles))
            # Equal stripes on every drive: a request ends when the slowest
            # drive's share does, so n x the slowest single is the ceiling.
            per["even"].append(x / (len(singles) * min(singles)))
        for k, v in per.items():
            out[f"{d}_vs_{k}"] = statistics.median(v)
    return out


# -- part 2: one aio.zero training step -------------------------------------------------------
def train_args(a: argparse.Namespace) -> argparse.Namespace:
    """aio-train's own arguments (its defaults: fp32, AdamW lr 1e-3, clip 1.0,
    no accumulation) with this script's model sizes: what make_config reads."""
    from aio.train import build_parser

    flags = ["--layers", a.layers, "--width", a.width, "--heads", a.heads, "--vocab", a.vocab]
    flags += ["--seq", a.seq, "--batch", a.batch, "--sub-group-size", a.sub_group_size, "--seed", a.seed]
    return build_parser().parse_args([str(x) for x in flags])


def drive_bytes(engine: Any) -> dict[str, list[int]]:
    """nvme_path -> [bytes read, bytes written] so far, parameters and optimizer together."""
    st = engine.stats()
    out: dict[str, list[int]] = {}
    for part in ("params", "optimizer"):
        for d in (st.get(part) or {}).get("drives", []):
            acc = out.setdefault(d["nvme_path"], [0, 0])
            acc[0] += d["bytes_read"]
            acc[1] += d["bytes_written"]
    return out


def train_bench(a: argparse.Namespace, io_gbps: dict[str, dict[str, float]]) -> dict[str, Any]:
    import aio.zero
    from aio.train import batch, build_gpt, gpt_params, make_config

    ta = train_args(a)
    paths: dict[str, str | list[str]] = {"one": a.dirs[0], "set": list(a.dirs)}
    engines: dict[str, Any] = {}
    steps_done: dict[str, int] = {}
    losses: dict[str, list[float]] = {}
    ce = torch.nn.functional.cross_entropy

    def run(name: str, n: int) -> list[float]:
        eng = engines[name]
        times = []
        for _ in range(n):
            s = steps_done[name]
            t0 = time.perf_counter()
            x, y = batch(s, 0, a.batch, a.seq, a.vocab)
            loss = ce(eng(x).flatten(0, 1).float(), y.flatten())
            eng.backward(loss)
            eng.step()
            times.append(time.perf_counter() - t0)
            losses[name].append(float(loss.item()))
            steps_done[name] = s + 1
        return times

    try:
        for name, nv in paths.items():
            torch.manual_seed(a.seed)
            model = build_gpt(a.vocab, a.width, a.layers, a.heads, a.seq)
            engines[name] = aio.zero.initialize(model, make_config(ta, nv))
            steps_done[name], losses[name] = 0, []
        for name in paths:
            run(name, a.warmup)
        times: dict[str, list[float]] = {n: [] for n in paths}
        moved: dict[str, dict[str, list[int]]] = {n: {} for n in paths}
        round_ratio = []
        for r in range(a.train_rounds):
            order = list(paths) if r % 2 == 0 else list(paths)[::-1]
            med: dict[str, float] = {}
            for name in order:
                time.sleep(a.idle)
                b0 = drive_bytes(engines[name])
                ts = run(name, a.steps)
                b1 = drive_bytes(engines[name])
                times[name] += ts
                med[name] = statistics.median(ts)
                for p, (rd, wr) in b1.items():
                    acc = moved[name].setdefault(p, [0, 0])
                    acc[0] += rd - b0.get(p, [0, 0])[0]
                    acc[1] += wr - b0.get(p, [0, 0])[1]
            round_ratio.append(med["one"] / med["set"])
            print(
                f"  train round {r + 1}/{a.train_rounds}: "
                + ", ".join(f"{n} {med[n] * 1000:.0f} ms/step" for n in paths),
                file=sys.stderr,
                flush=True,
            )
    finally:
        for e in engines.values():
            e.close()
    timed = a.train_rounds * a.steps
    res: dict[str, Any] = {
        "params": gpt_params(a.vocab, a.width, a.layers, a.seq),
        "losses_identical": losses["one"] == losses["set"],
        "losses": losses,
        "one_over_set_step_time": statistics.median(round_ratio),
        "variants": {},
    }
    for name in paths:
        per_drive = {p: [v[0] / timed, v[1] / timed] for p, v in moved[name].items()}
        rd = sum(v[0] for v in per_drive.values())
        wr = sum(v[1] for v in per_drive.values())
        g = io_gbps[name]
        io_s = rd / (g["read"] * 1e9) + wr / (g["write"] * 1e9)
        step = statistics.median(times[name])
        res["variants"][name] = {
            "nvme_path": paths[name],
            "step_s": step,
            "step_times": times[name],
            "read_per_step": rd,
            "written_per_step": wr,
            "per_drive_per_step": per_drive,
            "io_s": io_s,
            "io_efficiency": step / io_s,
        }
    return res


# -- reporting ---------------------------------------------------------------------------
def notes_for(dirs: Sequence[str]) -> list[str]:
    """Why these directories may not be separate drives."""
    notes = []
    for g in same_filesystem(dirs):
        if len(g) > 1:
            notes.append(f"{' and '.join(g)} are on one filesystem: one drive, not several")
    disks: dict[str, list[str]] = {}
    for d in dirs:
        disk = disk_of(os.stat(d).st_dev)
        kind = fs_type(d)
        if disk is not None:
            disks.setdefault(disk, []).append(d)
        if kind in ("tmpfs", "ramfs"):
            notes.append(f"{d} is on {kind}: memory, not a drive")
    for disk, ds in disks.items():
        if len(set(ds)) > 1 and len(same_filesystem(ds)) > 1:
            notes.append(f"{' and '.join(ds)} are on one disk ({disk})")
    return notes


def report(a: argparse.Namespace, lay: Layout, io: dict[str, Any], tr: dict[str, Any] | None) -> None:
    s = io["samples_GBps"]
    med = {n: {d: statistics.median(v[d]) for d in ("write", "read")} for n, v in s.items()}
    print(
        f"\nPart 1: swap-space I/O, {lay.extents} extents x {lay.extent_bytes / 2**20:.1f} MiB "
        f"({lay.parts} tensors of {lay.part_bytes / 2**20:.2f} MiB), {min(a.group, lay.extents)} extents "
        f"({min(a.group, lay.extents) * lay.parts} requests) in flight, {a.rounds} rounds, medians"
    )
    for i, d in enumerate(a.dirs, start=1):
        print(f"  D{i} = {d} ({fs_type(d) or '?'})")
    print(
        "| variant | write GB/s | read GB/s | write vs one drive [min..max] | read vs one drive [min..max] "
        "| pieces/request |"
        "\n|---|---|---|---|---|---|"
    )
    for v in io["variants"]:
        n = v["name"]
        rw = []
        for d in ("write", "read"):
            q = [x / y for x, y in zip(s[n][d], s["one"][d], strict=True)]
            rw.append(f"{statistics.median(q):.3f} [{min(q):.2f}..{max(q):.2f}]")
        print(
            f"| {v['label']} | {med[n]['write']:.2f} | {med[n]['read']:.2f} | {rw[0]} | {rw[1]} "
            f"| {io['pieces_per_request'][n]} |"
        )
    singles = ["one"] + [f"d{i}" for i in range(2, len(a.dirs) + 1)]
    if "set" in s:
        r = ratio_stats(s, singles, "set")
        io["set_ratios"] = r
        print(
            f"\nset / one drive: write {r['write_vs_one']:.3f}, read {r['read_vs_one']:.3f}; "
            f"set / best single: write {r['write_vs_best']:.3f}, read {r['read_vs_best']:.3f}; "
            f"set / sum of singles: write {r['write_vs_sum']:.3f}, read {r['read_vs_sum']:.3f}; "
            f"set / (n x slowest single), the ceiling of equal stripes: write {r['write_vs_even']:.3f}, "
            f"read {r['read_vs_even']:.3f} (medians of per-round ratios)"
        )
    for n in a.notes:
        print(f"note: {n}")
    if tr is None:
        return
    print(
        f"\nPart 2: aio.zero training step, GPT {tr['params'] / 1e6:.1f}M parameters ({a.layers} layers, "
        f"width {a.width}, vocab {a.vocab}, seq {a.seq}, batch {a.batch}), fp32, {a.train_rounds} rounds "
        f"x {a.steps} steps after {a.warmup} warm-up, median"
    )
    print(
        "| nvme_path | s/step | read MB/step | written MB/step | per drive R/W MB/step | I/O s | I/O eff. |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, v in tr["variants"].items():
        label = "one dir (D1)" if name == "one" else f"list of {len(a.dirs)} (D1..D{len(a.dirs)})"
        idx = {d: i for i, d in enumerate(a.dirs, start=1)}
        per = ", ".join(
            f"D{idx.get(p, '?')} {rd / 1e6:.1f}/{wr / 1e6:.1f}"
            for p, (rd, wr) in v["per_drive_per_step"].items()
        )
        print(
            f"| {label} | {v['step_s'] * 1000:.0f} ms | {v['read_per_step'] / 1e6:.1f} | "
            f"{v['written_per_step'] / 1e6:.1f} | {per} | {v['io_s'] * 1000:.0f} ms | "
            f"{v['io_efficiency']:.2f} |"
        )
    print(
        f"\none dir / list step time: {tr['one_over_set_step_time']:.3f} (median of per-round ratios; "
        f"> 1: the list is faster); losses identical: {'yes' if tr['losses_identical'] else 'NO'}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--dirs", nargs="+", metavar="DIR", help="one directory per drive (default: /tmp + /dev/shm)"
    )
    ap.add_argument("--rounds", type=int, default=5, help="I/O rounds")
    ap.add_argument("--idle", type=float, default=1.0, help="seconds idle before each timed run")
    ap.add_argument("--extents", type=int, default=16)
    ap.add_argument("--extent-mib", type=float, default=32.0)
    ap.add_argument("--parts", type=int, default=3, help="tensors per extent (one request each)")
    ap.add_argument("--group", type=int, default=4, help="extents in flight (pinned buffers)")
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="intra_op_parallelism")
    ap.add_argument("--no-split", action="store_true", help="skip the split-on-one-drive variant")
    ap.add_argument("--no-raw", action="store_true", help="skip the raw-handle variant")
    ap.add_argument("--no-train", action="store_true", help="part 1 only")
    ap.add_argument("--train-rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--sub-group-size", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every sample to this file")
    a = ap.parse_args(argv)
    for k in ("rounds", "extents", "parts", "group", "train_rounds", "steps"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.warmup < 0 or a.idle < 0 or a.extent_mib <= 0:
        ap.error("--warmup and --idle must be >= 0, --extent-mib > 0")
    if a.width % a.heads:
        ap.error(f"--width {a.width} is not a multiple of --heads {a.heads}")
    for d in a.dirs or []:
        if not os.path.isdir(d):
            ap.error(f"--dirs: {d} is not a directory")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    scratch: list[str] = []
    try:
        if a.dirs is None:
            a.dirs = [tempfile.mkdtemp(prefix="striped-io-", dir="/tmp")]
            if os.access("/dev/shm", os.W_OK):
                a.dirs.append(tempfile.mkdtemp(prefix="striped-io-", dir="/dev/shm"))
            scratch += a.dirs
            defaults = "default directories: a temp dir under /tmp and one under /dev/shm (tmpfs)"
            a.notes = [f"{defaults}; these are not separate drives, real gains need separate physical drives"]
        else:
            a.dirs = [os.path.abspath(d) for d in a.dirs]
            a.notes = []
        a.notes += notes_for(a.dirs)
        lay = Layout(a.extents, a.extent_mib, a.parts)
        aio_kw = {"block_size": a.block_size, "queue_depth": a.queue_depth, "intra_op_parallelism": a.threads}
        io = io_bench(a, lay, aio_kw, scratch)
        gbps = {
            n: {d: statistics.median(v[d]) for d in ("write", "read")} for n, v in io["samples_GBps"].items()
        }
        tr = None if a.no_train or len(a.dirs) < 2 else train_bench(a, gbps)
        report(a, lay, io, tr)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "io": io, "train": tr}, f, indent=1)
    finally:
        for d in scratch:
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
