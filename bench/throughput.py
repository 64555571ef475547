#!/usr/bin/env python3
"""Read and write throughput of AsyncIOHandle against references measured in
the same run: fio (libaio, O_DIRECT, same file and settings) when installed,
DeepSpeed's own async_io op when importable, and plain buffered I/O.

Method (shared/DESIGN.md, "Measuring"): every timed run gets the same idle
gap before it; each round runs the tools in order A B C .. C B A; a tool's
round figure is bytes / summed time of its two runs; the ratio to aio is
taken per round and the median over rounds reported, with the spread.

    python bench/throughput.py --dir /local_nvme --size 1G --rounds 7
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
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import aio  # noqa: E402
from aio.quickcheck import parse_size  # noqa: E402

Runner = Callable[[str], float]  # direction -> seconds


def make_aio(path: str, size: int, a: argparse.Namespace) -> Runner:
    import torch

    h = aio.AsyncIOHandle(
        block_size=a.block_size,
        queue_depth=a.queue_depth,
        thread_count=a.threads,
        single_submit=a.single_submit,
        overlap_events=not a.no_overlap,
    )
    buf = aio.new_locked_tensor(size, torch.uint8)
    buf.random_(0, 256)

    def run(direction: str) -> float:
        t0 = time.perf_counter()
        (h.sync_pread if direction == "read" else h.sync_pwrite)(buf, path)
        return time.perf_counter() - t0

    return run


def make_deepspeed(path: str, size: int, a: argparse.Namespace) -> Runner | None:
    try:
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible():
            print("  deepspeed: async_io op not compatible here (libaio-dev missing?)")
            return None
        op = AsyncIOBuilder().load(verbose=False)
    except Exception as e:  # noqa: BLE001 - optional reference
        print(f"  deepspeed: not available ({type(e).__name__}: {str(e)[:120]})")
        return None
    h = op.aio_handle(a.block_size, a.queue_depth, a.single_submit, not a.no_overlap, a.threads)
    # Its own locked buffer: a foreign one sends the op through its slow bounce path.
    buf = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    buf.random_(0, 256)

    def run(direction: str) -> float:
        t0 = time.perf_counter()
        if direction == "read":
            h.sync_pread(buf, path)
        else:
            h.sync_pwrite(buf, path)
        return time.perf_counter() - t0

    return run


def make_fio(path: str, size: int, a: argparse.Namespace) -> Runner | None:
    fio = shutil.which("fio")
    if not fio:
        print("  fio: not installed (apt-get install fio) -- no device reference")
        return None
    if a.single_submit or a.no_overlap:
        print("  fio: note, fio has no single_submit/overlap_events equivalents; using its defaults")

    def run(direction: str) -> float:
        per = size // a.threads
        cmd = [
            fio,
            "--name=aio-bench",
            f"--filename={path}",
            f"--rw={direction}",
            f"--bs={a.block_size}",
            f"--iodepth={a.queue_depth}",
            "--ioengine=libaio",
            "--direct=1",
            f"--size={per}",
            f"--numjobs={a.threads}",
            f"--offset_increment={per}",
            "--group_reporting",
            "--output-format=json",
            "--thread",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        job = json.loads(out[out.index("{") :])["jobs"][0][direction]
        # fio's own clock (runtime in ms) so process start-up is not counted.
        return job["io_bytes"] / job["bw_bytes"] if job["bw_bytes"] else float("inf")

    return run


def make_buffered(path: str, size: int, a: argparse.Namespace) -> Runner:
    buf = np.empty(size, np.uint8)
    buf[:] = 7

    def run(direction: str) -> float:
        if direction == "read":
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold cache, like direct I/O
            t0 = time.perf_counter()
            with os.fdopen(fd, "rb", buffering=0) as f:
                mv = memoryview(buf)
                got = 0
                while got < size:
                    n = f.readinto(mv[got:])
                    if not n:
                        raise OSError("short file")
                    got += n
            return time.perf_counter() - t0
        t0 = time.perf_counter()
        with open(path, "r+b", buffering=0) as f:
            f.write(memoryview(buf))
            os.fsync(f.fileno())  # durable, as a direct write is on return
        return time.perf_counter() - t0

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="directory on the drive (default: a temporary directory)")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ap.add_argument("--block-size", type=parse_size, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--single-submit", action="store_true")
    ap.add_argument("--no-overlap", action="store_true", help="overlap_events=False")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gap", type=float, default=1.0, help="idle seconds before every timed run")
    ap.add_argument("--tools", default="aio,fio,deepspeed,buffered")
    ap.add_argument("--directions", default="read,write")
    ap.add_argument("--json", help="write all samples and summaries here")
    a = ap.parse_args(argv)

    tmp = None
    base = a.dir or (tmp := tempfile.mkdtemp(prefix="aio-bench-"))
    path = os.path.join(base, f"aio-bench-{os.getpid()}.bin")
    try:
        print(
            f"file {path}, {a.size / 2**30:.2f} GiB, block_size={a.block_size} "
            f"queue_depth={a.queue_depth} threads={a.threads} rounds={a.rounds} gap={a.gap}s"
        )
        makers = {
            "aio": make_aio,
            "fio": make_fio,
            "deepspeed": make_deepspeed,
            "buffered": make_buffered,
        }
        tools: dict[str, Runner] = {}
        for name in a.tools.split(","):
            if name not in makers:
                ap.error(f"unknown tool {name!r}; choose from {sorted(makers)}")
        # aio first: it preallocates the file that every tool then overwrites/reads.
        tools["aio"] = make_aio(path, a.size, a)
        tools["aio"]("write")
        for name in a.tools.split(","):
            if name != "aio":
                r = makers[name](path, a.size, a)
                if r is not None:
                    tools[name] = r
        names = list(tools)
        summary: dict = {"settings": vars(a), "directions": {}}
        for direction in a.directions.split(","):
            samples: dict[str, list[float]] = {n: [] for n in names}  # GB/s per round
            ratios: dict[str, list[float]] = {n: [] for n in names if n != "aio"}
            for _ in range(a.rounds):
                spent = dict.fromkeys(names, 0.0)
                for n in names + names[::-1]:
                    time.sleep(a.gap)
                    spent[n] += tools[n](direction)
                for n in names:
                    samples[n].append(2 * a.size / spent[n] / 1e9)
                for n in ratios:
                    ratios[n].append(spent[n] / spent["aio"])  # aio speed / reference speed
            print(f"\n{direction}: median GB/s over {a.rounds} rounds [min..max]")
            for n in names:
                s = samples[n]
                print(f"  {n:10s} {statistics.median(s):6.2f}  [{min(s):.2f}..{max(s):.2f}]")
            for n, r in ratios.items():
                print(f"  aio / {n:10s} = {statistics.median(r):.3f}  [{min(r):.3f}..{max(r):.3f}]")
            summary["directions"][direction] = {
                "gbps": samples,
                "ratio_aio_over": ratios,
                "median_ratio": {n: statistics.median(r) for n, r in ratios.items()},
            }
        if a.json:
            with open(a.json, "w") as f:
                json.dump(summary, f, indent=1)
        return 0
    finally:
        if os.path.exists(path):
            os.unlink(path)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
