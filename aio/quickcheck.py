"""aio-check: a quick read/write throughput check of AsyncIOHandle.

Writes then reads a file in a temporary directory (or --dir) with direct
async I/O and prints GB/s. For a proper comparison against fio and buffered
I/O, see bench/throughput.py; to tune settings for a drive, aio-sweep.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from .handle import AsyncIOHandle
from .pinned import new_locked_tensor


def parse_size(text: str) -> int:
    """'256M', '1G', '4096', '1.5G' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 256K, 1M, 2G)") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="aio-check", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="directory on the drive to test (default: a temporary directory)")
    ap.add_argument(
        "--size", type=parse_size, default=parse_size("256M"), help="bytes to move (default 256M)"
    )
    ap.add_argument("--block-size", type=parse_size, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="runs per direction; the best is shown")
    args = ap.parse_args(argv)
    if args.size <= 0:
        ap.error("--size must be positive")

    import torch

    tmp = None
    if args.dir:
        if not os.path.isdir(args.dir):
            ap.error(f"--dir {args.dir!r} is not a directory")
        base = args.dir
    else:
        tmp = tempfile.mkdtemp(prefix="aio-check-")
        base = tmp
    path = os.path.join(base, f"aio-check-{os.getpid()}.bin")
    try:
        h = AsyncIOHandle(block_size=args.block_size, queue_depth=args.queue_depth, thread_count=args.threads)
        buf = new_locked_tensor(args.size, torch.uint8)
        buf.random_(0, 256)
        print(f"aio-check: {args.size / 2**20:.0f} MiB at {path}")
        print(f"  engine {h.engine} ({h.stats()['engine_reason']})")
        print(f"  block_size={args.block_size} queue_depth={args.queue_depth} thread_count={args.threads}")
        h.sync_pwrite(buf, path)  # create + allocate once; timed runs overwrite
        results = {}
        for name, fn in (("write", h.sync_pwrite), ("read", h.sync_pread)):
            best = 0.0
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                fn(buf, path)
                dt = time.perf_counter() - t0
                best = max(best, args.size / dt / 1e9)
            results[name] = best
            print(f"  {name:5s} {best:6.2f} GB/s (best of {args.repeat})")
        st = h.stats()
        print(
            f"  checked completions: {st['ios']} I/Os, {st['retries']} retried, "
            f"{st['short_resumed']} short resumed, buffered fallback: {st['buffered_fallback']}"
        )
        return 0
    finally:
        if os.path.exists(path):
            os.unlink(path)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
