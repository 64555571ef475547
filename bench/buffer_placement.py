"""Does O_DIRECT read speed depend on which buffer it lands in?

On a real NVMe drive it should barely: the drive DMAs into any pinned page.
On the dev box's virtio disk it did, by up to 4x, for identical page-locked
buffers in one process: each 1 MiB read was handed 256 scattered 4 KiB
pages, and how scattered depended on where the buffer landed. aio's pinned
buffers now sit on transparent huge pages (csrc/core/pinned.cpp), so each
read gets physically contiguous memory. This script shows both: one file,
one handle, several fresh buffers of each kind -- aio's locked buffers and
plain 4 KiB-page buffers (mmap with MADV_NOHUGEPAGE) -- the same reads into
each.

Run it before trusting an NVMe step comparison on a VM: when the GB/s here
spread widely, a swapper whose pool lands in slow memory loses to one whose
pool does not, whatever its code does (see docs/performance.md).

    python bench/buffer_placement.py [--dir DIR] [--buffers 12] [--mib 64] [--kinds locked,small-pages]
"""

from __future__ import annotations

import argparse
import mmap
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


def small_page_buffer(nbytes: int) -> torch.Tensor:
    """Page-aligned, pageable memory on 4 KiB pages (no huge pages), touched."""
    m = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(0)
    return t


def new_buffer(kind: str, nbytes: int) -> torch.Tensor:
    if kind == "locked":
        return aio.new_locked_tensor(nbytes, torch.uint8)
    return small_page_buffer(nbytes)


def main(argv: list[str] | None = None) -> int:
    """Print the read GB/s into each of `--buffers` locked buffers."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="directory for the test file (default: a temp dir)")
    ap.add_argument("--buffers", type=int, default=12)
    ap.add_argument("--mib", type=int, default=64, help="file and buffer size")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kinds", default="locked,small-pages", help="locked, small-pages or both")
    a = ap.parse_args(argv)
    kinds = a.kinds.split(",")
    for k in kinds:
        if k not in ("locked", "small-pages"):
            ap.error(f"unknown kind {k!r}")
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = os.path.join(d, "placement.bin")
        h = aio.AsyncIOHandle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=1)
        try:
            src = aio.new_locked_tensor(a.mib << 20, torch.uint8)
            src.random_(0, 256)
            h.sync_pwrite(src, path)
            speeds: dict[str, list[float]] = {k: [] for k in kinds}
            held = [src]  # every buffer stays allocated, so each new one lands elsewhere
            for i in range(a.buffers):
                for kind in kinds:  # interleaved, so drive mood hits both kinds alike
                    buf = new_buffer(kind, a.mib << 20)
                    held.append(buf)
                    speeds[kind].append(read_speed(h, buf, path, a.repeat))
                    print(f"{kind:11s} buffer {i:2d} at {buf.data_ptr():#x}: {speeds[kind][-1]:.2f} GB/s")
            for kind, got in speeds.items():
                lo, hi, med = min(got), max(got), statistics.median(got)
                print(f"{kind:11s} median {med:.2f} GB/s, range {lo:.2f}..{hi:.2f} (max/min {hi / lo:.1f}x)")
        finally:
            h.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
