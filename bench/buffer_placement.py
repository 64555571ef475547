"""Does O_DIRECT read speed depend on which buffer it lands in?

On a real NVMe drive it should not: the drive DMAs into any pinned page at
the same speed. On the dev box's virtio disk it does, by up to 4x, for
identical page-locked buffers in one process (the host's backing of guest
memory, not anything aio controls). This script shows it: one file, one
handle, several freshly locked buffers, the same reads into each.

Run it before trusting an NVMe step comparison on a VM: when the GB/s here
spread widely, a swapper whose pool lands in slow memory loses to one whose
pool does not, whatever its code does (see docs/performance.md).

    python bench/buffer_placement.py [--dir DIR] [--buffers 12] [--mib 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import aio


def read_speed(handle: aio.AsyncIOHandle, buf: torch.Tensor, path: str, repeat: int) -> float:
    """GB/s of `repeat` whole-file O_DIRECT reads into `buf`."""
    t = time.perf_counter()
    for _ in range(repeat):
        handle.sync_pread(buf, path)
    return repeat * buf.nbytes / (time.perf_counter() - t) / 1e9


def main(argv: list[str] | None = None) -> int:
    """Print the read GB/s into each of `--buffers` locked buffers."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="directory for the test file (default: a temp dir)")
    ap.add_argument("--buffers", type=int, default=12)
    ap.add_argument("--mib", type=int, default=64, help="file and buffer size")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = os.path.join(d, "placement.bin")
        h = aio.AsyncIOHandle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=1)
        try:
            src = aio.new_locked_tensor(a.mib << 20, torch.uint8)
            src.random_(0, 256)
            h.sync_pwrite(src, path)
            speeds = []
            held = [src]  # every buffer stays allocated, so each new one lands elsewhere
            for k in range(a.buffers):
                buf = aio.new_locked_tensor(a.mib << 20, torch.uint8)
                held.append(buf)
                speeds.append(read_speed(h, buf, path, a.repeat))
                print(f"buffer {k:2d} at {buf.data_ptr():#x}: {speeds[-1]:.2f} GB/s")
            lo, hi = min(speeds), max(speeds)
            med = statistics.median(speeds)
            print(f"median {med:.2f} GB/s, range {lo:.2f}..{hi:.2f} (max/min {hi / lo:.1f}x)")
        finally:
            h.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
