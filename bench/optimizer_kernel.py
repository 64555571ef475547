#!/usr/bin/env python3
"""CPU Adam(W) optimizer-kernel time: torch single-tensor AdamW (what aio
stepped with before), torch AdamW(fused=True), DeepSpeedCPUAdam and aio's
fused kernel (aio.optim.adam_update), on the same fp32 tensors' sizes.

Layouts: sub-groups of --group elements totalling about --total (as aio.zero
steps them), one tensor of --total, and (--gpt-list) GPT-2 124M's 148
parameter tensors stepped through the optimizer classes (aio.optim.CPUAdamW
against DeepSpeedCPUAdam and torch's fused AdamW: per-tensor call costs
included), and its 98 biases and norms alone (in cache: what each tensor
costs beyond its update). Each round times every variant once,
in an order that alternates per round (A B C D, then D C B A); a variant's
figure is its median over rounds, and DeepSpeed/aio is the median of the
per-round ratios (> 1: aio is faster). "aio" is the default kernel (the
correctly rounded square root); "aio torch-sqrt" reproduces this machine's
torch bit for bit (match_torch=True); "aio+bf16" also writes a bfloat16
copy of the updated parameters in the same pass.

    DS_ACCELERATOR=cpu python bench/optimizer_kernel.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aio.optim import adam_update, is_bit_exact  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _params(sizes: list[int]) -> list[torch.nn.Parameter]:
    ps = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 1e-2
        ps.append(p)
    return ps


def torch_variant(sizes: list[int], **kw: object) -> Callable[[], None]:
    ps = _params(sizes)
    opt = torch.optim.AdamW(ps, **HYPER, **kw)  # type: ignore[arg-type]
    return opt.step


def deepspeed_variant(sizes: list[int]) -> Callable[[], None] | str:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(_params(sizes), adamw_mode=True, **HYPER)  # type: ignore[arg-type]
    except Exception as e:  # a missing compiler or a failed JIT build: say why, go on
        return f"{type(e).__name__}: {e}"
    return opt.step


def aio_variant(sizes: list[int], threads: int, lowp: bool, match_torch: bool = False) -> Callable[[], None]:
    ps = [(torch.randn(n), torch.randn(n) * 1e-2) for n in sizes]
    state = [
        (torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16) if lowp else None)
        for n in sizes
    ]
    step = [0]
    b1, b2 = HYPER["betas"]  # type: ignore[misc]

    def run() -> None:
        step[0] += 1
        for (p, g), (m, v, low) in zip(ps, state, strict=True):
            adam_update(p, g, m, v, step=step[0], lr=HYPER["lr"], beta1=b1, beta2=b2,
                        eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], decoupled=True,
                        lowp_out=low, threads=threads, match_torch=match_torch)  # fmt: skip

    return run


def gpt2_shapes(d: int = 768, layers: int = 12, vocab: int = 50257, seq: int = 1024) -> list[tuple[int, ...]]:
    """GPT-2 small's parameter shapes (wte, wpe, 12 blocks, final norm)."""
    block = [
        (d,),
        (d,),
        (3 * d, d),
        (3 * d,),
        (d, d),
        (d,),
        (d,),
        (d,),
        (4 * d, d),
        (4 * d,),
        (d, 4 * d),
        (d,),
    ]
    return [(vocab, d), (seq, d)] + block * layers + [(d,), (d,)]


def class_variants(
    shapes: list[tuple[int, ...]], deepspeed: bool = True
) -> dict[str, Callable[[], None] | str]:
    """Each optimizer class over its own copy of the same parameters."""
    from aio.optim import CPUAdamW

    def params() -> list[torch.nn.Parameter]:
        ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape) * 1e-2
        return ps

    out: dict[str, Callable[[], None] | str] = {
        "torch fused": torch.optim.AdamW(params(), **HYPER, fused=True).step,  # type: ignore[arg-type]
        "aio": CPUAdamW(params(), **HYPER).step,  # type: ignore[arg-type]
    }
    if not deepspeed:
        return out
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        out["deepspeed"] = DeepSpeedCPUAdam(params(), adamw_mode=True, **HYPER).step  # type: ignore[arg-type]
    except Exception as e:  # a missing compiler or a failed JIT build: say why, go on
        out["deepspeed"] = f"{type(e).__name__}: {e}"
    return out


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def kernel_variants(sizes: list[int], a: argparse.Namespace) -> dict[str, Callable[[], None] | str]:
    variants: dict[str, Callable[[], None] | str] = {}
    if not a.skip_torch:
        variants["torch single"] = torch_variant(sizes, foreach=False)
    variants["torch fused"] = torch_variant(sizes, fused=True)
    if not a.skip_deepspeed:
        variants["deepspeed"] = deepspeed_variant(sizes)
    variants["aio"] = aio_variant(sizes, a.threads, lowp=False)
    variants["aio torch-sqrt"] = aio_variant(sizes, a.threads, lowp=False, match_torch=True)
    variants["aio+bf16"] = aio_variant(sizes, a.threads, lowp=True)
    return variants


def bench_layout(
    label: str, sizes: list[int], found: dict[str, Callable[[], None] | str], a: argparse.Namespace
) -> None:
    variants: dict[str, Callable[[], None]] = {}
    for k, fn in found.items():
        if isinstance(fn, str):
            print(f"  {k} unavailable: {fn}")
        else:
            variants[k] = fn
    for fn in variants.values():  # first touch of the state, JIT, pools
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(a.rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            times[k].append(timed(variants[k]))
    print(f"{label}: {len(sizes)} tensors, {sum(sizes):,} elements, median of {a.rounds} rounds")
    for k in names:
        print(f"  {k:14s} {statistics.median(times[k]):8.2f} ms")
    for ours in ("aio", "aio torch-sqrt", "aio+bf16"):
        if "deepspeed" in times and ours in times:
            ratios = [d / o for d, o in zip(times["deepspeed"], times[ours], strict=True)]
            print(f"  deepspeed/{ours:14s} {statistics.median(ratios):6.2f}")
    if "torch single" in times:
        ratios = [t / o for t, o in zip(times["torch single"], times["aio"], strict=True)]
        print(f"  torch single/aio {statistics.median(ratios):6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total", type=int, default=48_900_000, help="elements in all (default 48.9M)")
    ap.add_argument("--group", type=int, default=2_000_000, help="sub-group elements (default 2M)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="aio kernel threads")
    ap.add_argument("--skip-torch", action="store_true", help="leave out torch's slow single-tensor AdamW")
    ap.add_argument(
        "--skip-deepspeed",
        action="store_true",
        help="leave out DeepSpeedCPUAdam (its JIT build takes ~1 min)",
    )
    ap.add_argument("--gpt-list", action="store_true", help="also GPT-2 124M's tensors through the classes")
    a = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, aio threads {a.threads}, "
          f"torch-sqrt bit-exact with torch here: {is_bit_exact()}")  # fmt: skip
    groups = max(1, a.total // a.group)
    sizes = [a.group] * groups
    bench_layout("sub-groups", sizes, kernel_variants(sizes, a), a)
    bench_layout("one tensor", [a.total], kernel_variants([a.total], a), a)
    if a.gpt_list:
        shapes = gpt2_shapes()
        sizes = [torch.Size(s).numel() for s in shapes]
        bench_layout("GPT-2 124M through the classes", sizes, class_variants(shapes, not a.skip_deepspeed), a)
        # Its biases and norms alone: in cache, the per-tensor cost of a step.
        small = [s for s in shapes if len(s) == 1]
        sizes = [torch.Size(s).numel() for s in small]
        bench_layout(
            "GPT-2 124M's biases and norms through the classes",
            sizes,
            class_variants(small, not a.skip_deepspeed),
            a,
        )


if __name__ == "__main__":
    main()
