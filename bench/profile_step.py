"""Where one training step's time goes: forward, backward and step() wall
times (medians of 2 steps, synchronised) and a ``torch.profiler`` table of 2
more, for one variant of bench/train_step.py (same model, data and config).

    python bench/profile_step.py zero-cpu --cuda --model gpt [train_step flags]

Writes the tables to stdout and a Chrome trace to ``--trace`` when given.
On the H200 (docs/performance.md) this found aio.zero's backward spent on
landing gradients on the host."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as ts  # noqa: E402  (a sibling script, not a package)


def timed_step(a: argparse.Namespace, engine: Any, loss_fn: Any, x: Any, y: Any) -> tuple[float, ...]:
    """(forward, backward, step(), whole) seconds of one engine step."""
    dev = "cuda" if a.cuda else "cpu"
    x, y = x.to(dev), y.to(dev)
    ts.sync(a)
    t0 = time.perf_counter()
    loss = loss_fn(engine(x), y)
    ts.sync(a)
    t1 = time.perf_counter()
    engine.backward(loss)
    ts.sync(a)
    t2 = time.perf_counter()
    engine.step()
    ts.sync(a)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t3 - t0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: profile_step.py VARIANT [train_step.py flags] [--trace FILE]"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__}\nVARIANT: one of {', '.join(ts.ALL_VARIANTS[1:])}")
        return 0
    if not argv or argv[0] not in ts.ALL_VARIANTS[1:]:
        print(f"{usage}\nVARIANT: one of {', '.join(ts.ALL_VARIANTS[1:])}", file=sys.stderr)
        return 2
    variant, rest = argv[0], argv[1:]
    trace = None
    if "--trace" in rest:
        i = rest.index("--trace")
        trace, rest = rest[i + 1], rest[:i] + rest[i + 2 :]
    a = ts.parse(rest + ["--steps", "4", "--warmup", "2"])
    a.variant = variant
    a.dir = a.dir or "/tmp/aio-profile-step"
    os.makedirs(a.dir, exist_ok=True)
    if variant.startswith("ds"):
        ts.ds_environment(a)
    from torch.profiler import ProfilerActivity, profile

    model, data, loss_fn = ts.build(a)
    engine, _, _ = ts.make_engine(a, model, ts.full_config(a, variant, a.dir))
    rows = [timed_step(a, engine, loss_fn, x, y) for x, y in data[:4]][2:]
    medians = [round(statistics.median(c), 4) for c in zip(*rows, strict=True)]
    print(f"{variant} forward / backward / step() / whole, s: {medians}", flush=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.cuda else [])
    with profile(activities=acts) as prof:
        for x, y in data[4:6]:
            timed_step(a, engine, loss_fn, x, y)
    for key in ("cpu_time_total", "self_cpu_time_total"):
        print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))
    if trace:
        prof.export_chrome_trace(trace)
    if hasattr(engine, "stats"):
        print(json.dumps(engine.stats(), default=str))
    if hasattr(engine, "close"):
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
