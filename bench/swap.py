#!/usr/bin/env python3
"""Swapper benchmarks.

(a) Optimizer step over N sub-groups of Adam state: in memory, swapped
    without pipelining, swapped with pipeline_read + pipeline_write. Overlap
    efficiency = max(io_time, compute_time) / pipelined_step_time, where
    io_time is the time the same handle settings take to read and write the
    same bytes on their own (measured in the same run) and compute_time is
    the in-memory step. 1.0 = perfect overlap; sum-of-parts gives ~0.5.
(b) Parameter prefetch: fetching M partitions in use order through the
    ParamSwapper (prefetching buffer_count-1 ahead) vs raw reads of the same
    bytes with one handle.

Rounds interleave the variants (A B C .. C B A order); medians are reported.

    python bench/swap.py --dir /local_nvme --subgroups 8 --numel 8M --rounds 5
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import aio  # noqa: E402
from aio.quickcheck import parse_size  # noqa: E402
from aio.swap import OptimizerSwapper, ParamSwapper  # noqa: E402


def optimizer_bench(a: argparse.Namespace, base: str) -> dict:
    n, k = a.numel, a.subgroups
    torch.manual_seed(0)
    init = [torch.randn(n) for _ in range(k)]
    grads = [torch.randn(n) * 1e-3 for _ in range(k)]
    hyper = {"lr": 1e-3}
    aio_kw = {"block_size": a.block_size, "queue_depth": a.queue_depth, "thread_count": a.threads}

    # In-memory reference: the same Adam over the same sub-groups.
    params = [torch.nn.Parameter(t.clone()) for t in init]
    mem_opt = torch.optim.Adam(params, **hyper)

    def in_memory() -> float:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        t0 = time.perf_counter()
        mem_opt.step()
        return time.perf_counter() - t0

    swappers = {}
    for name, pipe in (("plain", False), ("pipelined", True)):
        d = os.path.join(base, name)
        os.makedirs(d)
        sw = OptimizerSwapper(
            d,
            torch.optim.Adam,
            hyper,
            # Adam steps a sub-group with 4 buffers (gradient, master, two
            # moments); reading ahead and writing behind in full takes 11.
            buffer_count=11 if pipe else 4,
            pipeline_read=pipe,
            pipeline_write=pipe,
            aio=aio_kw,
        )
        for i, t in enumerate(init):
            sw.register_subgroup(i, n)
            sw.initialize(i, t)
        swappers[name] = sw

    def swapped(name: str) -> float:
        sw = swappers[name]
        for i, g in enumerate(grads):  # gradients arrive during backward, untimed
            sw.write_gradient(i, g)
        for g in sw.groups.values():
            if g.grad_future is not None:
                g.grad_future.result()
                g.grad_future = None
        t0 = time.perf_counter()
        sw.step()
        return time.perf_counter() - t0

    # Raw I/O of the same bytes with the same settings: one read handle and
    # one write handle, reading every region and writing every write-back.
    sw = swappers["plain"]
    g0 = sw.groups[0]
    # Its extent is grad, param, states: a step reads all of it and writes
    # back everything from the parameter on.
    region, wb = g0.nbytes, g0.nbytes - g0.parts["param"][0]
    rbuf = aio.new_locked_tensor(region, torch.uint8)
    rh, wh = aio.AsyncIOHandle(**aio_kw), aio.AsyncIOHandle(**aio_kw)
    raw_path = os.path.join(base, "raw.bin")
    for i in range(k):
        wh.sync_pwrite(rbuf, raw_path, i * region)

    def io_only() -> float:
        t0 = time.perf_counter()
        for i in range(k):
            rh.sync_pread(rbuf, raw_path, i * region)
        for i in range(k):
            wh.sync_pwrite(rbuf[:wb], raw_path, i * region)
        return time.perf_counter() - t0

    runs = {
        "in_memory": in_memory,
        "io_only": io_only,
        "plain": lambda: swapped("plain"),
        "pipelined": lambda: swapped("pipelined"),
    }
    names = list(runs)
    samples: dict[str, list[float]] = {x: [] for x in names}
    for r in range(a.rounds):
        for x in names + names[::-1]:
            time.sleep(a.gap)
            samples[x].append(runs[x]())
        print(
            f"  round {r + 1}/{a.rounds}: "
            + ", ".join(f"{x} {statistics.median(samples[x]):.3f}s" for x in names),
            file=sys.stderr,
        )
    med = {x: statistics.median(v) for x, v in samples.items()}
    eff = max(med["io_only"], med["in_memory"]) / med["pipelined"]
    for s in swappers.values():
        s.close()
    gb = k * (region + wb) / 1e9
    return {
        "subgroups": k,
        "numel": n,
        "bytes_per_step": k * (region + wb),
        "median_s": med,
        "spread_s": {x: [min(v), max(v)] for x, v in samples.items()},
        "overlap_efficiency": eff,
        "pipelined_vs_plain_speedup": med["plain"] / med["pipelined"],
        "pipelined_GBps": gb / med["pipelined"],
    }


def prefetch_bench(a: argparse.Namespace, base: str) -> dict:
    m, n = a.partitions, a.partition_numel
    d = os.path.join(base, "params")
    os.makedirs(d)
    ps = ParamSwapper(
        d,
        dtype=torch.float16,
        buffer_count=a.param_buffers,
        buffer_size=n,
        max_in_cpu=0,
        aio={"block_size": a.block_size, "queue_depth": a.queue_depth, "thread_count": a.threads},
    )
    for i in range(m):
        ps.register(i, n)
        ps.write(i, torch.full((n,), float(i % 7), dtype=torch.float16))
    buf = aio.new_locked_tensor(n, torch.float16)
    h = aio.AsyncIOHandle(block_size=a.block_size, queue_depth=a.queue_depth, thread_count=a.threads)
    nbytes = n * 2

    def fetch_in_order() -> float:
        ahead = a.param_buffers - 1
        t0 = time.perf_counter()
        ps.prefetch(list(range(min(ahead, m))))
        for i in range(m):
            (t,) = ps.swap_in([i])
            ps.release([i])
            if i + ahead < m:
                ps.prefetch([i + ahead])
        return time.perf_counter() - t0

    # The same bytes read straight from the swap file (one drive: one piece each).
    swap_file = ps.space.drives[0].file.path
    where = [ps.space.pieces(ps.parts[i].offset, ps.parts[i].nbytes)[0][1] for i in range(m)]

    def raw() -> float:
        t0 = time.perf_counter()
        for i in range(m):
            h.sync_pread(buf, swap_file, where[i])
        return time.perf_counter() - t0

    samples: dict[str, list[float]] = {"swapper": [], "raw": []}
    for _ in range(a.rounds):
        for name, fn in (
            ("swapper", fetch_in_order),
            ("raw", raw),
            ("raw", raw),
            ("swapper", fetch_in_order),
        ):
            time.sleep(a.gap)
            samples[name].append(fn())
    ps.close()
    med = {x: statistics.median(v) for x, v in samples.items()}
    return {
        "partitions": m,
        "partition_bytes": nbytes,
        "median_s": med,
        "swapper_over_raw_time": med["swapper"] / med["raw"],
        "swapper_GBps": m * nbytes / med["swapper"] / 1e9,
        "raw_GBps": m * nbytes / med["raw"] / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="drive directory (default: a temporary directory)")
    ap.add_argument("--subgroups", type=int, default=8)
    ap.add_argument("--numel", type=parse_size, default=parse_size("8M"), help="elements per sub-group")
    ap.add_argument("--partitions", type=int, default=32)
    ap.add_argument("--partition-numel", type=parse_size, default=parse_size("4M"))
    ap.add_argument("--param-buffers", type=int, default=5)
    ap.add_argument("--block-size", type=parse_size, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gap", type=float, default=0.5)
    ap.add_argument("--only", choices=["optimizer", "prefetch"])
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="aio-swap-bench-", dir=a.dir)
    try:
        out = {}
        if a.only in (None, "optimizer"):
            print(
                f"optimizer step: {a.subgroups} sub-groups x {a.numel} elements (Adam)",
                file=sys.stderr,
            )
            r = out["optimizer"] = optimizer_bench(a, tmp)
            m = r["median_s"]
            print(f"optimizer step ({r['bytes_per_step'] / 1e9:.2f} GB moved per step), median seconds:")
            for x in ("in_memory", "io_only", "plain", "pipelined"):
                print(f"  {x:10s} {m[x]:.3f}")
            print(f"  overlap efficiency max(io, compute) / pipelined = {r['overlap_efficiency']:.3f}")
            print(f"  pipelined speed-up over plain = {r['pipelined_vs_plain_speedup']:.2f}x")
        if a.only in (None, "prefetch"):
            print(
                f"parameter prefetch: {a.partitions} partitions x {a.partition_numel} fp16",
                file=sys.stderr,
            )
            r = out["prefetch"] = prefetch_bench(a, tmp)
            print(
                f"parameter fetch in use order: swapper {r['swapper_GBps']:.2f} GB/s, raw reads "
                f"{r['raw_GBps']:.2f} GB/s, time ratio swapper/raw = {r['swapper_over_raw_time']:.3f}"
            )
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
