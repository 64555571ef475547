"""aio-check --gpu: a seconds-long self-check of aio's GPU path.

Three parts, each printed as PASS/FAIL lines (exit status 0 only if every
check passes, 1 otherwise; 2 without a CUDA device):

1. Host <-> GPU copy rates (GB/s, best of ``--repeat``, interleaved) from
   aio's pinned memory (``new_locked_tensor`` and a ``PinnedPool`` slot)
   against torch's pinned memory and plain pageable memory, with ratios to
   torch's pinned memory; every copy is checked bytewise.
2. A drive read straight into a CUDA tensor through ``AsyncIOHandle`` (and a
   write from one), compared bytewise with what was written.
3. Two tiny ``aio.zero`` training steps on the GPU (fp32): NVMe offload
   against CPU offload, and against the same training in GPU memory with the
   optimizer aio.zero steps with (CPUAdamW on an fp32 CPU master copy);
   losses and updated parameters must be bit-identical. Attention runs on
   the math kernel, whose backward is deterministic.

The training helpers here (:func:`zero_config`, :func:`train_zero`,
:func:`train_reference`) are shared with ``scripts/gpu_stress.py``.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ._cli import (
    CliError,
    check_directory,
    check_interrupt,
    check_memory,
    open_scratch,
    remove_scratch,
    signals_deferred,
)
from .handle import AsyncIOHandle

NO_CUDA_EXIT = 2
# aio's own pinned memory must copy at least this fraction of torch's pinned rate.
PINNED_MIN_RATIO = 0.7
DRIVE_BYTES_MAX = 64 << 20
MIN_BYTES = 1 << 20  # the drive part reads at an odd offset well inside the file
TORCH_PINNED = "torch pin_memory=True"


@dataclass
class Check:
    """One PASS/FAIL line."""

    name: str
    ok: bool
    detail: str = ""

    def line(self) -> str:
        """``PASS name: detail`` or ``FAIL name: detail``."""
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}" + (f": {self.detail}" if self.detail else "")


@dataclass
class RateRow:
    """Copy rates between one kind of host memory and the GPU."""

    label: str
    pinned: bool
    h2d: float = 0.0  # GB/s, best of the runs
    d2h: float = 0.0
    exact: bool = True


def cuda_unavailable_reason() -> str | None:
    """Why this process cannot use CUDA, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    try:
        if torch.cuda.is_available():
            return None
    except Exception as e:  # a broken driver setup
        return f"torch.cuda.is_available() raised {type(e).__name__}"
    return "torch.cuda.is_available() is False"


def ratio(x: float, ref: float) -> float:
    """x / ref, 0.0 when there is no reference rate."""
    return x / ref if ref > 0 else 0.0


def format_rate_table(rows: list[RateRow], nbytes: int, repeat: int) -> list[str]:
    """The copy-rate table: one line per kind of host memory, ratios to torch's pinned memory."""
    ref = next((r for r in rows if r.label == TORCH_PINNED), None)
    w = max([len(r.label) for r in rows] + [len("host memory")])
    out = [
        f"host <-> GPU copies, {nbytes / 2**20:.0f} MiB, best of {repeat}:",
        f"  {'host memory':<{w}}  pinned  H2D GB/s  x torch  D2H GB/s  x torch  exact",
    ]
    for r in rows:
        rh = f"{ratio(r.h2d, ref.h2d):6.2f}x" if ref else "      -"
        rd = f"{ratio(r.d2h, ref.d2h):6.2f}x" if ref else "      -"
        out.append(
            f"  {r.label:<{w}}  {'yes' if r.pinned else 'no':>6}  {r.h2d:8.2f}  {rh}  {r.d2h:8.2f}  {rd}  "
            f"{'yes' if r.exact else 'NO':>5}"
        )
    return out


def rate_checks(rows: list[RateRow]) -> tuple[list[Check], list[str]]:
    """The checks (and notes) on measured copy rates: every copy exact; aio's
    new_locked_tensor pinned and at least PINNED_MIN_RATIO of torch's pinned rate."""
    bad = [r.label for r in rows if not r.exact]
    checks = [Check("host <-> GPU copies are exact", not bad, "differ: " + ", ".join(bad) if bad else "")]
    ref = next((r for r in rows if r.label == TORCH_PINNED), None)
    notes = []
    for r in rows:
        if ref is None or not r.label.startswith("aio "):
            continue
        rh, rd = ratio(r.h2d, ref.h2d), ratio(r.d2h, ref.d2h)
        text = f"H2D {rh:.2f}x, D2H {rd:.2f}x torch's pinned memory, is_pinned {r.pinned}"
        if r.label.startswith("aio new_locked_tensor"):
            ok = r.pinned and min(rh, rd) >= PINNED_MIN_RATIO
            checks.append(
                Check(f"{r.label} copies at pinned speed", ok, f"{text}; >= {PINNED_MIN_RATIO}x needed")
            )
        elif min(rh, rd) < PINNED_MIN_RATIO or not r.pinned:
            notes.append(f"note: {r.label}: {text} (copies from it are pageable-memory copies)")
    return checks, notes


def compare_runs(a: tuple[list[float], dict[str, Any]], b: tuple[list[float], dict[str, Any]]) -> str | None:
    """None when two runs' losses and parameters are bit-identical, else what differs."""
    import torch

    (la, sa), (lb, sb) = a, b
    if la != lb:
        return f"losses differ: {la} vs {lb}"
    if sorted(sa) != sorted(sb):
        return f"parameter names differ: {sorted(set(sa) ^ set(sb))}"
    for name in sorted(sa):
        x, y = sa[name], sb[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{name}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
        if not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item()
            return f"{name} differs (max |diff| {diff:.3g})"
    return None


# -- part 1: copy rates ----------------------------------------------------------------------
@contextmanager
def _host_buffers(nbytes: int) -> Iterator[list[tuple[str, Any]]]:
    """(label, uint8 tensor) for each kind of host memory compared."""
    import torch

    from .pinned import PinnedPool, new_locked_tensor, pinned_kind

    aio_t = new_locked_tensor(nbytes, torch.uint8)
    try:
        pool, how = PinnedPool(1, nbytes, lock=True), "mlock"
    except (OSError, MemoryError):  # RLIMIT_MEMLOCK: the pool as aio.zero would get it unlocked
        pool, how = PinnedPool(1, nbytes, lock=False), "not locked"
    lease = pool.acquire()
    try:
        yield [
            (f"aio new_locked_tensor ({pinned_kind(aio_t)})", aio_t),
            (f"aio PinnedPool slot ({how})", lease.tensor(torch.uint8, nbytes)),
            (TORCH_PINNED, torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
            ("pageable torch.empty", torch.empty(nbytes, dtype=torch.uint8)),
        ]
    finally:
        lease.release()


def _best(rate: float, dst: Any, src: Any) -> float:
    """The better of `rate` and the GB/s of one dst <- src copy."""
    import torch

    nbytes = src.nbytes
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return max(rate, nbytes / (time.perf_counter() - t0) / 1e9)


def measure_copy_rates(nbytes: int, repeat: int) -> list[RateRow]:
    """H2D and D2H rates for each kind of host memory, runs interleaved;
    each D2H then H2D round trip is checked on the GPU."""
    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    with _host_buffers(nbytes) as hosts:
        rows = [RateRow(label, bool(t.is_pinned())) for label, t in hosts]
        for _ in range(repeat):
            for row, (_label, host) in zip(rows, hosts, strict=True):
                check_interrupt()
                dst.zero_()
                row.d2h = _best(row.d2h, host, src)
                row.h2d = _best(row.h2d, dst, host)
                row.exact = row.exact and bool(torch.equal(dst, src))
    return rows


# -- part 2: the drive straight into CUDA tensors ------------------------------------------------
def drive_checks(base: str, nbytes: int, handle_kw: dict[str, Any]) -> list[Check]:
    """Write random bytes to a scratch file, read them straight into CUDA
    tensors (whole, and at an odd offset and length, asynchronously) and
    write from a CUDA tensor; every result compared bytewise."""
    import torch

    n = min(nbytes, DRIVE_BYTES_MAX)
    with signals_deferred():
        fd, path, direct = open_scratch(base, "aio-check-gpu-")
    h = None
    try:
        h = AsyncIOHandle(**handle_kw)
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        h.sync_pwrite(src, fd)
        dev = torch.zeros(n, dtype=torch.uint8, device="cuda")
        t0 = time.perf_counter()
        got = h.sync_pread(dev, fd)
        gbps = n / (time.perf_counter() - t0) / 1e9
        out = [_equal_check(f"drive -> CUDA tensor, sync_pread {_mib(n)} at offset 0", got, n, dev, src)]
        out[0].detail += f" ({gbps:.2f} GB/s, O_DIRECT {direct})"
        off, m = 4096 + 513, n // 2 + 3
        dev2 = torch.zeros(m, dtype=torch.uint8, device="cuda")
        got = h.async_pread(dev2, fd, off).result()
        name = f"drive -> CUDA tensor, async_pread {_mib(m)} at offset {off}"
        out.append(_equal_check(name, got, m, dev2, src[off : off + m]))
        up = torch.randint(0, 256, (m,), dtype=torch.uint8, device="cuda")
        wrote = h.sync_pwrite(up, fd, n + 7)
        back = torch.zeros(m, dtype=torch.uint8)
        h.sync_pread(back, fd, n + 7)
        out.append(_equal_check(f"CUDA tensor -> drive, sync_pwrite {_mib(m)}", wrote, m, up, back))
        return out
    finally:
        if h is not None:
            h.close()
        remove_scratch(fd, path)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n % (1 << 20) else f"{n >> 20} MiB"


def _equal_check(name: str, got: int, n: int, a: Any, b: Any) -> Check:
    import torch

    if got != n:
        return Check(name, False, f"{got} bytes moved, {n} expected")
    same = bool(torch.equal(a.cpu(), b.cpu()))
    return Check(name, same, "bytes equal" if same else "bytes DIFFER from what was written")


# -- part 3: aio.zero on the GPU -------------------------------------------------------------------
@dataclass
class Spec:
    """A small GPT and how to train it (shared with scripts/gpu_stress.py)."""

    vocab: int = 1024
    width: int = 128
    layers: int = 2
    heads: int = 4
    seq: int = 32
    batch: int = 4
    steps: int = 2
    gas: int = 1
    clip: float = 0.05  # active: the norms clipping takes (on the device, gas 1) are checked too
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0
    sub_group: int = 200_000  # elements; >= the largest parameter (vocab * width)


def zero_config(drive: str, offload: str, spec: Spec) -> dict[str, Any]:
    """The aio.zero config: parameters and optimizer state both on the drive
    (`offload` ``"nvme"``) or both in CPU memory (``"cpu"``)."""
    z: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": spec.sub_group,
        "stage3_prefetch_bucket_size": spec.sub_group,
        "stage3_param_persistence_threshold": 0,
    }
    if offload == "nvme":
        os.makedirs(drive, exist_ok=True)
        z["offload_param"] = {
            "device": "nvme",
            "nvme_path": drive,
            "buffer_count": 6,
            "buffer_size": spec.sub_group,
            "max_in_cpu": 0,
        }
        z["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": drive,
            "buffer_count": 11,
            "pipeline_read": True,
            "pipeline_write": True,
        }
    elif offload == "cpu":
        z["offload_param"] = {"device": "cpu"}
        z["offload_optimizer"] = {"device": "cpu"}
    else:
        raise ValueError(f"offload must be 'nvme' or 'cpu', got {offload!r}")
    return {
        "zero_optimization": z,
        "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "weight_decay": spec.weight_decay}},
        "gradient_accumulation_steps": spec.gas,
        "gradient_clipping": spec.clip,
    }


def _model(spec: Spec) -> Any:
    import torch

    from .train import build_gpt

    torch.manual_seed(spec.seed)
    return build_gpt(spec.vocab, spec.width, spec.layers, spec.heads, spec.seq)


def loss_of(model: Any, spec: Spec, step: int, micro: int, device: Any) -> Any:
    """Cross-entropy of `model` on the synthetic batch (step, micro), attention
    on the math kernel (deterministic backward, unlike the fused ones)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .train import batch

    x, y = (t.to(device) for t in batch(step, micro, spec.batch, spec.seq, spec.vocab))
    with sdpa_kernel([SDPBackend.MATH]):
        out = model(x)
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def train_zero(drive: str, offload: str, device: Any, spec: Spec) -> tuple[list[float], dict[str, Any]]:
    """Train the spec's GPT with aio.zero on `device`: (last micro-step's loss
    per step, the parameters afterwards as CPU tensors)."""
    import aio.zero

    losses = []
    with aio.zero.initialize(_model(spec), zero_config(drive, offload, spec), device=device) as engine:
        for step in range(spec.steps):
            for micro in range(spec.gas):
                check_interrupt()
                loss = loss_of(engine, spec, step, micro, device)
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
        state = {k: v.detach().cpu().clone() for k, v in engine.state_dict().items()}
    return losses, state


def train_reference(device: Any, spec: Spec) -> tuple[list[float], dict[str, Any]]:
    """The same training without aio.zero: forward/backward of a copy of the
    model on `device`, gradients copied to the fp32 CPU master (the model),
    stepped there by the optimizer aio.zero steps with, copied back. Clipping
    (if any) with torch's clip_grad_norm_, where aio.zero takes the norms: on
    the device's gradients with one micro-step per window, else on the CPU
    master's."""
    import torch

    from .config import load_train_config
    from .zero.trainer import stepping_optimizer

    master = _model(spec)
    hyper = {"lr": spec.lr, "weight_decay": spec.weight_decay}
    cfg = load_train_config(zero_config("", "cpu", spec))  # what aio.zero reads it from
    cls, hyper = stepping_optimizer(cfg, torch.optim.AdamW, hyper)
    opt = cls(master.parameters(), **hyper)
    work = copy.deepcopy(master).to(device)
    losses = []
    for step in range(spec.steps):
        for micro in range(spec.gas):
            loss = loss_of(work, spec, step, micro, device)
            (loss / spec.gas if spec.gas > 1 else loss).backward()
        # aio.zero takes the norms where the window's whole gradient is: on the
        # device with one micro-step, else in its fp32 buffers on the host.
        if spec.clip and spec.gas == 1:
            torch.nn.utils.clip_grad_norm_(work.parameters(), spec.clip)
        for m, w in zip(master.parameters(), work.parameters(), strict=True):
            m.grad = w.grad.detach().to("cpu", copy=True)
            w.grad = None
        if spec.clip and spec.gas > 1:
            torch.nn.utils.clip_grad_norm_(master.parameters(), spec.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, w in zip(master.parameters(), work.parameters(), strict=True):
                w.copy_(m)
        losses.append(loss.item())
    return losses, {k: v.detach().cpu().clone() for k, v in work.state_dict(keep_vars=False).items()}


def zero_checks(base: str, device: Any, spec: Spec | None = None) -> list[Check]:
    """aio.zero with NVMe offload on `device` against CPU offload, and against
    the reference training (see :func:`train_reference`): bit-identical."""
    from .train import gpt_params

    spec = spec or Spec()
    nvme = train_zero(os.path.join(base, "zero-nvme"), "nvme", device, spec)
    cpu = train_zero(os.path.join(base, "zero-cpu"), "cpu", device, spec)
    ref = train_reference(device, spec)
    n = gpt_params(spec.vocab, spec.width, spec.layers, spec.seq)
    what = f"{spec.steps} fp32 steps of a {n / 1e6:.2f}M-parameter GPT"
    d1, d2 = compare_runs(nvme, cpu), compare_runs(nvme, ref)
    if d2 is not None and compare_runs(ref, train_reference(device, spec)) is not None:
        d2 += "; the in-memory run itself is not reproducible here (nondeterministic kernels)"
    same = "losses and parameters bit-identical"
    return [
        Check(f"aio.zero on {device}: NVMe offload == CPU offload", d1 is None, d1 or f"{what}, {same}"),
        Check(
            f"aio.zero on {device} (NVMe) == in {device} memory, CPUAdamW on an fp32 CPU master",
            d2 is None,
            d2 or f"{what}, {same}; loss {nvme[0][-1]:.6f}",
        ),
    ]


# -- the command ------------------------------------------------------------------------------
def run_section(name: str, fn: Callable[[], list[Check]]) -> list[Check]:
    """Run one part; an exception becomes a FAIL line (the other parts still run)."""
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        return [Check(name, False, f"{type(e).__name__}: {' '.join(str(e).split())[:400]}")]


def gpu_main(args: argparse.Namespace) -> int:
    """aio-check --gpu (see the module docstring): exit status 0, 1, or
    NO_CUDA_EXIT without a CUDA device."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"aio-check --gpu: no CUDA device ({reason}); nothing to check")
        return NO_CUDA_EXIT
    # cuBLAS documents bit-wise reproducible results with several streams only
    # for a fixed-size workspace per stream (read when its first handle is made).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.size < MIN_BYTES:
        raise CliError(f"--gpu needs --size of at least 1 MiB, got {args.size}")
    tmp = None
    base = args.dir or (tmp := tempfile.mkdtemp(prefix="aio-check-gpu-"))
    try:
        check_directory(base, min(args.size, DRIVE_BYTES_MAX) * 2, "--size")
        check_memory(4 * args.size, "--size")
        return _run_all(args, base)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _run_all(args: argparse.Namespace, base: str) -> int:
    import torch

    print(
        f"aio-check --gpu: {torch.cuda.get_device_name()} (torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}), scratch in {base}",
        flush=True,
    )
    rows: list[RateRow] = []

    def rates() -> list[Check]:
        rows.extend(measure_copy_rates(args.size, args.repeat))
        for line in format_rate_table(rows, args.size, args.repeat):
            print(line)
        checks, notes = rate_checks(rows)
        for note in notes:
            print(note)
        return checks

    kw: dict[str, Any] = {
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "thread_count": args.threads,
    }
    checks: list[Check] = []
    for name, fn in (
        ("host <-> GPU copies", rates),
        ("drive <-> CUDA tensors", lambda: drive_checks(base, args.size, kw)),
        ("aio.zero on cuda", lambda: zero_checks(base, "cuda")),
    ):
        part = run_section(name, fn)
        for c in part:
            print(c.line(), flush=True)
        checks += part
    failed = sum(not c.ok for c in checks)
    if failed:
        print(f"aio-check --gpu: {failed} of {len(checks)} checks FAILED")
        return 1
    print(f"aio-check --gpu: all {len(checks)} checks passed")
    return 0
