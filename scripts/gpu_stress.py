#!/usr/bin/env python3
"""Stress aio.zero's asynchronous GPU path; losses must not change.

Trains a small GPT (aio.train.build_gpt, fp32, gradient accumulation 2,
clipping 1.0) with aio.zero on CUDA for --steps steps, with parameters and
optimizer state on the drive (nvme) and in CPU memory (cpu), three times each:

  default      plain run, default stream
  stressed     every side-stream copy queued behind a GPU sleep
               (torch.cuda._sleep), the compute stream lagging (a sleep before
               every module's forward), and recycled host memory poisoned with
               NaN bytes: a staging-ring region as soon as it is given back, a
               pinned-pool slot as soon as its I/O is done at release
  user stream  the whole run inside ``with torch.cuda.stream(torch.cuda.Stream()):``

A copy that is not ordered right, or host memory reused while a copy still
reads or writes it, changes the losses (NaN, usually). Each run's losses and
final parameters must be bit-identical to the default run's. Attention runs
on the math kernel (deterministic backward). Prints a table; exit status 0
when all match, 1 otherwise, 77 without a CUDA device.

    python scripts/gpu_stress.py [--dir /local_nvme] [--steps 10] [--cycles 1000000]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

SKIP_EXIT = 77
POISON = 0xFF  # every float32 / bfloat16 / float16 made of these bytes is NaN


def _need(owner: Any, name: str, where: str) -> Any:
    if not hasattr(owner, name):
        raise RuntimeError(
            f"gpu_stress: {where} has no attribute {name!r} (renamed?); update stress_patches() "
            "in scripts/gpu_stress.py"
        )
    return getattr(owner, name)


@contextlib.contextmanager
def stress_patches(cycles: int, counts: dict[str, int]) -> Iterator[None]:
    """Delay copies and compute, poison recycled host memory (see the module docstring).

    ALL monkeypatching of aio internals lives here, and only here: the names
    below (aio.zero.streams.CudaBackend.copy, PinnedRing.give_back and its
    ``buf``/``live``, aio.pinned.Lease.release and its ``_released``/``ptr``/
    ``nbytes``, aio._buffers.wait_range_idle) are internals that may be
    renamed; a missing one raises RuntimeError here instead of silently
    running an unstressed "stressed" run (and main() fails if a patch never
    fired)."""
    import torch

    from aio import _buffers, pinned
    from aio.zero import streams

    sleep = _need(torch.cuda, "_sleep", "torch.cuda")
    copy = _need(streams.CudaBackend, "copy", "aio.zero.streams.CudaBackend")
    give_back = _need(streams.PinnedRing, "give_back", "aio.zero.streams.PinnedRing")
    release = _need(pinned.Lease, "release", "aio.pinned.Lease")
    wait_idle = _need(_buffers, "wait_range_idle", "aio._buffers")

    def slow_copy(self: Any, dst: Any, src: Any) -> None:
        sleep(cycles)  # on the current stream: the side stream the copy is queued on
        counts["copies delayed"] += 1
        copy(self, dst, src)

    def poisoned_give_back(self: Any) -> None:
        start, end = self.live[0]
        give_back(self)
        self.buf[start:end].fill_(POISON)
        counts["ring regions poisoned"] += 1

    def poisoned_release(self: Any) -> None:
        if not self._released:
            wait_idle(self.ptr, self.nbytes)  # as release() does; then nobody may read it
            ctypes.memset(self.ptr, POISON, self.nbytes)
            counts["pool slots poisoned"] += 1
        release(self)

    def lagging_forward(module: Any, args: Any) -> None:
        sleep(cycles)
        counts["forwards delayed"] += 1

    hook = torch.nn.modules.module.register_module_forward_pre_hook(lagging_forward)
    streams.CudaBackend.copy = slow_copy  # type: ignore[method-assign]
    streams.PinnedRing.give_back = poisoned_give_back  # type: ignore[method-assign]
    pinned.Lease.release = poisoned_release  # type: ignore[method-assign]
    try:
        yield
    finally:
        hook.remove()
        streams.CudaBackend.copy = copy  # type: ignore[method-assign]
        streams.PinnedRing.give_back = give_back  # type: ignore[method-assign]
        pinned.Lease.release = release  # type: ignore[method-assign]


def run_one(kind: str, drive: str, offload: str, spec: Any, cycles: int) -> tuple[Any, dict[str, int]]:
    """One training run of `kind` (default, stressed, user stream): ((losses, params), patch counts)."""
    import torch

    from aio.gpucheck import train_zero

    counts = {
        "copies delayed": 0,
        "forwards delayed": 0,
        "ring regions poisoned": 0,
        "pool slots poisoned": 0,
    }
    if kind == "stressed":
        ctx: Any = stress_patches(cycles, counts)
    elif kind == "user stream":
        ctx = torch.cuda.stream(torch.cuda.Stream())
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        result = train_zero(drive, offload, "cuda", spec)
    torch.cuda.synchronize()
    return result, counts


def patch_problems(offload: str, counts: dict[str, int]) -> list[str]:
    """Patches of a stressed run that never fired (the stress would be vacuous)."""
    need = ["copies delayed", "forwards delayed", "ring regions poisoned"]
    if offload == "nvme":
        need.append("pool slots poisoned")
    return [f"{k}: 0" for k in need if counts[k] == 0]


def table(rows: list[tuple[str, str, list[float], str]]) -> list[str]:
    """The results: offload, run, first and last loss, verdict."""
    out = [f"{'offload':8s} {'run':12s} {'loss[0]':>12s} {'loss[-1]':>12s}  vs default"]
    for offload, kind, losses, verdict in rows:
        first, last = (f"{losses[0]:.8f}", f"{losses[-1]:.8f}") if losses else ("-", "-")
        out.append(f"{offload:8s} {kind:12s} {first:>12s} {last:>12s}  {verdict}")
    return out


def stress(base: str, offloads: list[str], spec: Any, cycles: int) -> int:
    """Run every offload x kind, print the table; 0 if all match the default runs."""
    from aio.gpucheck import compare_runs

    rows, failures = [], []
    for offload in offloads:
        ref = None
        for kind in ("default", "stressed", "user stream"):
            drive = os.path.join(base, f"{offload}-{kind.replace(' ', '-')}")
            try:
                result, counts = run_one(kind, drive, offload, spec, cycles)
            except Exception as e:  # a run that breaks is a finding too: report it, run the rest
                text = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                rows.append((offload, kind, [], f"ERROR {text}"))
                failures.append(f"{offload} {kind}: {text}")
                if ref is None:
                    break  # nothing to compare the other runs with
                continue
            if ref is None:
                ref, verdict = result, "-"
            else:
                diff = compare_runs(ref, result)
                verdict = "bit-identical" if diff is None else f"DIFFERENT: {diff}"
                if diff is not None:
                    failures.append(f"{offload} {kind}: {diff}")
            if kind == "stressed":
                print(f"{offload} stressed: " + ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
                failures += [
                    f"{offload} stressed: patch never fired: {p}" for p in patch_problems(offload, counts)
                ]
            rows.append((offload, kind, result[0], verdict))
    print("\n".join(table(rows)))
    for f in failures:
        print(f"FAIL {f}")
    print("gpu_stress: " + ("PASS" if not failures else f"FAIL ({len(failures)} problems)"))
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run; the exit status."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dir", help="directory on the drive (default: a temporary directory)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cycles", type=int, default=1_000_000, help="GPU clock cycles per injected sleep")
    ap.add_argument("--offload", default="nvme,cpu", help="comma list of nvme, cpu")
    args = ap.parse_args(argv)
    offloads = args.offload.split(",")
    if not set(offloads) <= {"nvme", "cpu"} or args.steps < 1 or args.cycles < 0:
        ap.error("--offload takes nvme and/or cpu; --steps >= 1; --cycles >= 0")
    from aio.gpucheck import Spec, cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"gpu_stress: no CUDA device ({reason}); nothing to run")
        return SKIP_EXIT
    # cuBLAS documents bit-wise reproducible results with several streams (the
    # user-stream run) only for a fixed-size workspace per stream (read when
    # its first handle is made).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    spec = Spec(layers=4, seq=64, steps=args.steps, gas=2, clip=1.0)
    base = tempfile.mkdtemp(prefix="aio-gpu-stress-", dir=args.dir)
    try:
        return stress(base, offloads, spec, args.cycles)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
