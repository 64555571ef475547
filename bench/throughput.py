#!/usr/bin/env python3
"""Read and write throughput of AsyncIOHandle against references measured in
the same run: fio's libaio and io_uring engines (O_DIRECT, same file and
settings) when installed, DeepSpeed's own async_io op when importable, plain
buffered I/O, and the handle on each of its engines.

Two patterns. ``seq``: the whole file in block_size I/Os, queue_depth deep
(the swappers' pattern). ``rand``: --rand-bs blocks at random aligned
offsets, each block once, as separate requests with queue_depth of them in
flight (fio's randread/randwrite at that iodepth): aio submits them
queue_depth at a time with ``async_pread_pieces`` on an O_DIRECT
descriptor, as fio opens the file once.

Per tool: GB/s (rand: also thousands of I/Os per second) and CPU seconds per
GB moved (user + system time: the process's for aio and buffered I/O, its
worker threads included; fio's own usr_cpu/sys_cpu for fio).

Method (shared/DESIGN.md, "Measuring"): every timed run gets the same idle
gap before it; each round runs the tools in order A B C .. C B A; a tool's
round figure is bytes / summed time of its two runs; the ratio of the first
tool to each other one is taken per round and the median over rounds
reported, with the spread.

    python bench/throughput.py --dir /local_nvme --size 1G --rounds 7
    python bench/throughput.py --dir /local_nvme --pattern rand --queue-depth 64 \
        --size 256M --directions read --tools aio-io_uring,aio-kernel_aio,fio-io_uring,fio
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import aio  # noqa: E402
from aio.quickcheck import parse_size  # noqa: E402

Runner = Callable[[str], tuple[float, float]]  # direction -> (seconds, CPU seconds)
# aio's tools: the handle on one engine each ("aio": engine="auto").
AIO_ENGINES = {
    "aio": "auto",
    "aio-kernel_aio": "kernel_aio",
    "aio-io_uring": "io_uring",
    "aio-posix": "posix",
}
FIO_ENGINES = {"fio": "libaio", "fio-io_uring": "io_uring"}
CALLS = 4  # rand: async_pread_pieces calls outstanding
DEFAULT_TOOLS = {
    "seq": "aio,aio-io_uring,fio,fio-io_uring,deepspeed,buffered",
    "rand": "aio,aio-io_uring,fio,fio-io_uring",
}


def cpu_seconds() -> float:
    """User + system time of this process, all its threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of fn()."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


def random_offsets(size: int, bs: int) -> list[int]:
    """Every bs-aligned block of the file once, in a fixed random order."""
    return (np.random.default_rng(0).permutation(size // bs) * bs).tolist()


def make_aio(path: str, size: int, a: argparse.Namespace, engine: str = "auto") -> Runner:
    import torch

    h = aio.AsyncIOHandle(
        block_size=a.block_size,
        queue_depth=a.queue_depth,
        thread_count=a.threads,
        single_submit=a.single_submit,
        overlap_events=not a.no_overlap,
        engine=engine,
    )
    if a.pattern == "rand":
        return make_aio_random(h, path, size, a)
    buf = aio.new_locked_tensor(size, torch.uint8)
    buf.random_(0, 256)

    def run(direction: str) -> tuple[float, float]:
        return timed(lambda: (h.sync_pread if direction == "read" else h.sync_pwrite)(buf, path))

    return run


def make_aio_random(h: aio.AsyncIOHandle, path: str, size: int, a: argparse.Namespace) -> Runner:
    """Batches of queue_depth pieces (one ``async_pread_pieces`` call each,
    every piece its own request), CALLS batches outstanding so the worker
    always finds the next pieces waiting (the handle still keeps
    queue_depth I/Os in flight, as fio's iodepth); each batch into its own
    part of one locked buffer."""
    import torch

    bs, depth = a.rand_bs, a.queue_depth
    buf = aio.new_locked_tensor(CALLS * depth * bs, torch.uint8)
    buf.random_(0, 256)
    parts = [buf[i * depth * bs : (i + 1) * depth * bs] for i in range(CALLS)]
    offsets = np.array(random_offsets(size, bs), dtype=np.int64)
    batches = [offsets[i : i + depth] for i in range(0, len(offsets), depth)]

    def run(direction: str) -> tuple[float, float]:
        submit = h.async_pread_pieces if direction == "read" else h.async_pwrite_pieces
        fd = os.open(path, (os.O_RDONLY if direction == "read" else os.O_WRONLY) | os.O_DIRECT)

        def go() -> None:
            pending: collections.deque[aio.AioFuture] = collections.deque()
            for i, offs in enumerate(batches):
                if len(pending) == CALLS:
                    pending.popleft().result()  # frees part i % CALLS
                pending.append(submit(parts[i % CALLS][: len(offs) * bs], fd, offs))
            for f in pending:
                f.result()

        try:
            return timed(go)
        finally:
            os.close(fd)

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

    def run(direction: str) -> tuple[float, float]:
        return timed(lambda: (h.sync_pread if direction == "read" else h.sync_pwrite)(buf, path))

    return run


def make_fio(path: str, size: int, a: argparse.Namespace, engine: str = "libaio") -> Runner | None:
    fio = shutil.which("fio")
    if not fio:
        print("  fio: not installed (apt-get install fio) -- no device reference")
        return None
    if a.single_submit or a.no_overlap:
        print("  fio: note, fio has no single_submit/overlap_events equivalents; using its defaults")
    rand = a.pattern == "rand"

    def run(direction: str) -> tuple[float, float]:
        per = size // a.threads
        cmd = [
            fio,
            "--name=aio-bench",
            f"--filename={path}",
            f"--rw={'rand' + direction if rand else direction}",
            f"--bs={a.rand_bs if rand else a.block_size}",
            f"--iodepth={a.queue_depth}",
            f"--ioengine={engine}",
            "--direct=1",
            f"--size={per}",
            f"--numjobs={a.threads}",
            f"--offset_increment={per}",
            "--group_reporting",
            "--output-format=json",
            "--thread",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        job = json.loads(out[out.index("{") :])["jobs"][0]
        io = job[direction]
        # fio's own clock (runtime in ms) so process start-up is not counted;
        # usr_cpu/sys_cpu are percent of that runtime.
        seconds = io["io_bytes"] / io["bw_bytes"] if io["bw_bytes"] else float("inf")
        return seconds, (job["usr_cpu"] + job["sys_cpu"]) / 100 * io["runtime"] / 1000 * a.threads

    return run


def make_buffered(path: str, size: int, a: argparse.Namespace) -> Runner:
    buf = np.empty(size, np.uint8)
    buf[:] = 7

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            mv = memoryview(buf)
            got = 0
            while got < size:
                n = f.readinto(mv[got:])
                if not n:
                    raise OSError("short file")
                got += n

    def write() -> None:
        with open(path, "r+b", buffering=0) as f:
            f.write(memoryview(buf))
            os.fsync(f.fileno())  # durable, as a direct write is on return

    def run(direction: str) -> tuple[float, float]:
        if direction == "read":
            # Cold cache, like direct I/O; the eviction itself is not timed.
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return timed(read if direction == "read" else write)

    return run


def make_tool(name: str, path: str, size: int, a: argparse.Namespace) -> Runner | None:
    """The runner of one tool, or None (with the reason printed) where it cannot run."""
    if name in AIO_ENGINES:
        try:
            return make_aio(path, size, a, AIO_ENGINES[name])
        except OSError as e:  # io_uring refused here: say so, measure the rest
            print(f"  {name}: not available here ({e})")
            return None
    if name in FIO_ENGINES:
        return make_fio(path, size, a, FIO_ENGINES[name])
    if a.pattern == "rand":
        print(f"  {name}: has no random-request mode here; left out")
        return None
    return make_deepspeed(path, size, a) if name == "deepspeed" else make_buffered(path, size, a)


def measure(tools: dict[str, Runner], direction: str, size: int, rounds: int, gap: float) -> dict:
    """ABBA rounds of every tool; GB/s, CPU s per GB and first-tool ratios."""
    names = list(tools)
    gbps: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    for _ in range(rounds):
        spent = dict.fromkeys(names, 0.0)
        spent_cpu = dict.fromkeys(names, 0.0)
        for n in names + names[::-1]:
            time.sleep(gap)
            wall, c = tools[n](direction)
            spent[n] += wall
            spent_cpu[n] += c
        for n in names:
            gbps[n].append(2 * size / spent[n] / 1e9)
            cpu[n].append(spent_cpu[n] / (2 * size / 1e9))
        for n in ratios:
            ratios[n].append(spent[n] / spent[names[0]])  # first tool's speed / this one's
    return {"gbps": gbps, "cpu_s_per_gb": cpu, "ratio": ratios}


def report(direction: str, m: dict, a: argparse.Namespace) -> dict:
    """Prints one direction's table; returns its JSON summary."""
    names = list(m["gbps"])
    print(f"\n{direction} ({a.pattern}): median over {a.rounds} rounds [min..max]")
    for n in names:
        g, c = m["gbps"][n], m["cpu_s_per_gb"][n]
        iops = f"  {statistics.median(g) * 1e9 / a.rand_bs / 1e3:7.1f} kIOPS" if a.pattern == "rand" else ""
        print(
            f"  {n:15s} {statistics.median(g):6.2f} GB/s [{min(g):.2f}..{max(g):.2f}]{iops}"
            f"  CPU {statistics.median(c):.3f} s/GB"
        )
    for n, r in m["ratio"].items():
        print(f"  {names[0]} / {n:15s} = {statistics.median(r):.3f}  [{min(r):.3f}..{max(r):.3f}]")
    return {
        "gbps": m["gbps"],
        "cpu_s_per_gb": m["cpu_s_per_gb"],
        "first": names[0],
        "ratio_aio_over": m["ratio"],
        "median_ratio": {n: statistics.median(r) for n, r in m["ratio"].items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dir", help="directory on the drive (default: a temporary directory)")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ap.add_argument("--pattern", choices=("seq", "rand"), default="seq")
    ap.add_argument("--rand-bs", type=parse_size, default=4096, help="bytes per random request")
    ap.add_argument("--block-size", type=parse_size, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--single-submit", action="store_true")
    ap.add_argument("--no-overlap", action="store_true", help="overlap_events=False")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gap", type=float, default=1.0, help="idle seconds before every timed run")
    ap.add_argument(
        "--tools", help=f"comma-separated; the first is the one compared (default: {DEFAULT_TOOLS})"
    )
    ap.add_argument("--directions", default="read,write")
    ap.add_argument("--json", help="write all samples and summaries here")
    a = ap.parse_args(argv)
    names = (a.tools or DEFAULT_TOOLS[a.pattern]).split(",")
    known = [*AIO_ENGINES, *FIO_ENGINES, "deepspeed", "buffered"]
    for name in names:
        if name not in known:
            ap.error(f"unknown tool {name!r}; choose from {known}")

    tmp = None
    base = a.dir or (tmp := tempfile.mkdtemp(prefix="aio-bench-"))
    path = os.path.join(base, f"aio-bench-{os.getpid()}.bin")
    try:
        print(
            f"file {path}, {a.size / 2**30:.2f} GiB, {a.pattern}, block_size={a.block_size} "
            f"queue_depth={a.queue_depth} threads={a.threads} rounds={a.rounds} gap={a.gap}s"
        )
        # The whole file written once first: every tool then overwrites or reads it.
        aio.AsyncIOHandle().sync_pwrite(np.full(a.size, 7, np.uint8), path)
        tools = {n: r for n in names if (r := make_tool(n, path, a.size, a)) is not None}
        summary: dict = {"settings": vars(a), "directions": {}}
        for direction in a.directions.split(","):
            m = measure(tools, direction, a.size, a.rounds, a.gap)
            summary["directions"][direction] = report(direction, m, a)
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
