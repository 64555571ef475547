"""aio-check: a quick read/write throughput check of AsyncIOHandle.

Writes then reads a file in a temporary directory (or --dir) with direct
async I/O and prints GB/s. For a proper comparison against fio and buffered
I/O, see bench/throughput.py; to tune settings for a drive, aio-sweep.

``aio-check --gpu`` checks aio's GPU path instead (aio.gpucheck): host <->
GPU copy rates from aio's pinned memory, drive reads straight into CUDA
tensors, and an aio.zero training step on the GPU against the same step in
GPU memory; PASS/FAIL lines, exit status 0 only if all pass, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._cli import (
    CliParser,
    check_directory,
    check_interrupt,
    check_memory,
    int_in,
    open_scratch,
    parse_size,
    remove_scratch,
    run_cli,
    scratch_buffer,
    signals_deferred,
)
from .handle import AsyncIOHandle

# A sample at least this large is taken as the drive's sustained rate (no hint printed).
SUSTAINED_SIZE = 16 << 30


def build_parser() -> CliParser:
    """The aio-check command line."""
    ap = CliParser(prog="aio-check", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dir", help="directory on the drive to test (default: a temporary directory)")
    ap.add_argument(
        "--size",
        type=parse_size,
        default=parse_size("256M"),
        help="bytes to move each way (default 256M), through a buffer of at most 256M; caches between "
        "aio and the drive (a VM host's page cache) serve a small sample: a size past them (e.g. 16G) "
        "gives the drive's sustained rates",
    )
    ap.add_argument(
        "--block-size",
        type=parse_size,
        default=1 << 20,
        help="bytes per submitted I/O: a multiple of 4096 up to 1G (default 1M)",
    )
    ap.add_argument("--queue-depth", type=int_in(1, 65536), default=8, help="I/Os in flight per thread")
    ap.add_argument(
        "--threads", type=int_in(1, 1024), default=1, help="worker threads (intra_op_parallelism)"
    )
    ap.add_argument(
        "--repeat", type=int_in(1, 1_000_000), default=3, help="runs per direction; the best is shown"
    )
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="self-check of aio's GPU path: pinned-memory copy rates, drive reads into CUDA tensors, "
        "an aio.zero step on the GPU (--size bytes per copy; exit 2 without CUDA)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """aio-check: write then read a scratch file on the drive and report GB/s; exit status."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.block_size % 4096 or args.block_size > 1 << 30:
        # aio-sweep's and the config's rule (aio.block_size): direct I/O moves whole blocks
        ap.error(f"--block-size: {args.block_size} is not a positive multiple of 4096 up to 1G")
    if args.gpu:
        from .gpucheck import gpu_main

        return run_cli("aio-check", lambda: gpu_main(args), "scratch files removed")
    return run_cli("aio-check", lambda: _check(args), "scratch file removed")


# The most memory a check's buffer takes: a larger sample (one past the
# caches between aio and the drive, as a VM host's page cache) is written and
# read through it piece by piece.
BUFFER_LIMIT = 256 << 20


def timed_rates(h: AsyncIOHandle, buf: Any, fd: int, repeat: int, nbytes: int = 0) -> dict[str, float]:
    """Best-of-`repeat` GB/s writing then reading the first `nbytes` of `fd`
    (0: `buf`'s size) through `buf`, a buffer's worth at a time (written once
    first, so the timed runs overwrite allocated blocks)."""
    total = nbytes or buf.numel() * buf.element_size()
    _whole_file(h.sync_pwrite, buf, fd, total)
    rates = {}
    for name, fn in (("write", h.sync_pwrite), ("read", h.sync_pread)):
        best = 0.0
        for _ in range(repeat):
            check_interrupt()
            t0 = time.perf_counter()
            _whole_file(fn, buf, fd, total)
            best = max(best, total / (time.perf_counter() - t0) / 1e9)
        rates[name] = best
    return rates


def _whole_file(fn: Callable[[Any, int, int], int], buf: Any, fd: int, total: int) -> None:
    # One call per buffer's worth: the handle keeps queue_depth I/Os in flight
    # within each; the sync gap between calls is one per 256 MiB.
    size = buf.numel() * buf.element_size()
    for off in range(0, total, size):
        n = min(size, total - off)
        fn(buf if n == size else buf[:n], fd, off)
        if off + n < total:
            check_interrupt()


def drive_rates(directory: str, nbytes: int, repeat: int = 2, **handle_kw: Any) -> dict[str, float]:
    """Write and read GB/s of `nbytes` through a fresh O_DIRECT scratch file in
    `directory` (private, removed after), moved through a buffer of at most
    :data:`BUFFER_LIMIT`: the rates a step's bytes are held against
    (aio-train --floor). A sample larger than the host's caches gives the
    drive's sustained rates."""
    check_directory(directory, nbytes, "the drive check")
    check_memory(min(nbytes, BUFFER_LIMIT), "the drive check")
    with signals_deferred():
        fd, path, _ = open_scratch(directory, "aio-floor-")
    h = None
    try:
        h = AsyncIOHandle(**handle_kw)
        buf, _ = scratch_buffer(min(nbytes, BUFFER_LIMIT), lambda _msg: None)
        buf.random_(0, 256)
        return timed_rates(h, buf, fd, repeat, nbytes)
    finally:
        if h is not None:
            h.close()
        remove_scratch(fd, path)


def _check(args: argparse.Namespace) -> int:
    tmp = None
    if args.dir:
        base = args.dir
    else:
        tmp = base = tempfile.mkdtemp(prefix="aio-check-")
    h = None
    fd, path = -1, ""
    try:
        check_directory(base, args.size, "--size")
        check_memory(min(args.size, BUFFER_LIMIT), "--size")
        with signals_deferred():  # a Ctrl-C here must still leave fd and path to remove
            fd, path, direct = open_scratch(base, "aio-check-")
        buf, locked = scratch_buffer(min(args.size, BUFFER_LIMIT), print)
        buf.random_(0, 256)
        h = AsyncIOHandle(block_size=args.block_size, queue_depth=args.queue_depth, thread_count=args.threads)
        print(f"aio-check: {args.size / 2**20:.0f} MiB at {path}")
        print(f"  engine {h.engine} ({h.stats()['engine_reason']})")
        print(f"  block_size={args.block_size} queue_depth={args.queue_depth} thread_count={args.threads}")
        print(f"  buffer: {'locked' if locked else 'NOT locked (mlock refused)'}, O_DIRECT: {direct}")
        for name, best in timed_rates(h, buf, fd, args.repeat, args.size).items():
            print(f"  {name:5s} {best:6.2f} GB/s (best of {args.repeat})")
        if args.size < SUSTAINED_SIZE:
            # Seen on a VM: 256 MiB read at 3.2 GB/s from the host's cache while
            # training moved 1.2 GB/s (docs/performance.md).
            print(
                f"  note: {args.size / 2**20:.0f} MiB can come from a cache below aio (a VM host's page "
                f"cache, a controller's); --size {SUSTAINED_SIZE >> 30}G --repeat 1 measures sustained rates"
            )
        st = h.stats()
        print(
            f"  checked completions: {st['ios']} I/Os, {st['retries']} retried, "
            f"{st['short_resumed']} short resumed, buffered fallback: {st['buffered_fallback']}"
        )
        return 0
    finally:
        if h is not None:
            h.close()  # no I/O may still use the descriptor when it is closed
        if fd >= 0:
            remove_scratch(fd, path)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
