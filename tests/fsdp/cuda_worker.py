"""One FSDP2 rank on a GPU (NCCL, world size 1) with aio's NVMe tiers: the
GPU acceptance items of issue 44 (``aio.optim.NVMeAdamW``) and issue 45
(``aio.fsdp.offload_params``). Run as a script:

    python cuda_worker.py DEVICE OUTDIR [CASE ...]

DEVICE ``cuda`` runs on the GPU with NCCL; ``cpu`` runs the very same cases
on gloo (the twin that checks this script on a machine without a GPU).
Each case writes ``OUTDIR/<case>.json`` before the next starts: the verdicts
are judged from those files, never from the exit status.

Every case trains the same small model twice on the same engine and data
and reports whether losses and full parameters are bit-identical
(``torch.equal``), with peak GPU memory (``torch.cuda.max_memory_allocated``),
the bytes aio locked (``aio.pinned.locked_bytes``) and the tier's counters
(with device-resident shards: the groups copied up on its side stream, their
bytes, the host waits that blocked on a copy, whether its staging is
CUDA-registered; ``aio/fsdp/upload.py``).
One comparison is not expected to be bit-identical on a GPU:
``optim_resident`` (parameters in GPU memory) steps torch's AdamW on the
GPU and aio's on the CPU, whose rounding may differ (fused multiply-adds);
it reports the largest difference beside the verdict.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

STEPS = 4
LR = 1e-2
WIDTHS = (32, 96, 80, 48, 8)  # four FSDP groups, the last in the root


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(len(WIDTHS) - 1):
        layers.append(torch.nn.Linear(WIDTHS[i], WIDTHS[i + 1]))
        if i < len(WIDTHS) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).to(device)


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(16, WIDTHS[0], generator=g), torch.randn(16, WIDTHS[-1], generator=g)
    return x.to(device), y.to(device)


def _shard(model: torch.nn.Module, device: torch.device, offload: bool) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": init_device_mesh(device.type, (1,))}
    if offload:  # a CPU-only torch cannot pin
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    for lin in linears[:-1]:
        fully_shard(lin, **kw)
    return fully_shard(model, **kw)


def _optimizer(kind: str, model: torch.nn.Module, tmp: str, master: str = "auto") -> Any:
    if kind == "nvme":
        from aio.optim import NVMeAdamW

        drive = os.path.join(tmp, "drive")
        return NVMeAdamW(model.parameters(), lr=LR, nvme_path=drive, match_torch=True, master=master)
    return torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)


def _train(model: torch.nn.Module, opt: Any, device: torch.device) -> list[float]:
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, device)
        opt.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().cpu() for p in model.parameters()]


def _run(
    device: torch.device, tmp: str, opt_kind: str, offload: bool, tier: bool, master: str = "auto"
) -> dict:
    """One training run; its losses, full parameters and memory figures."""
    from aio import pinned
    from aio.fsdp import offload_params

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    model = _shard(_model(device), device, offload)
    opt = _optimizer(opt_kind, model, tmp, master)
    t = offload_params(model, os.path.join(tmp, "drive"), opt) if tier else None
    losses = _train(model, opt, device)
    if t is not None:
        with t.resident(modified=False):
            full = _full(model)
        stats = t.stats()
        t.close()
    else:
        full, stats = _full(model), None
    out = {
        "losses": losses,
        "full": full,
        "master_mode": getattr(opt, "master_mode", None),
        "pinned_bytes": pinned.locked_bytes(),
        "tier": stats,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else 0,
    }
    if hasattr(opt, "close"):
        opt.close()
    return out


def _verdict(a: dict, b: dict) -> dict:
    """Bit-identity of two runs, the largest parameter difference and both runs' figures."""
    diff = max(
        float((x.double() - y.double()).abs().max()) for x, y in zip(a["full"], b["full"], strict=True)
    )
    strip = lambda r: {k: v for k, v in r.items() if k != "full"}  # noqa: E731
    return {
        "equal": a["losses"] == b["losses"] and all(map(torch.equal, a["full"], b["full"])),
        "max_abs_diff": diff,
        "reference": strip(a),
        "aio": strip(b),
    }


def case_optim_offload(device: torch.device, tmp: str) -> dict:
    """FSDP2 + CPUOffloadPolicy (pinned on a GPU): NVMeAdamW, master in the
    parameters (auto) and on the drive, against torch's AdamW on the same
    CPU shards: bit-identical."""
    ref = _run(device, tmp, "torch", offload=True, tier=False)
    return {m: _verdict(ref, _run(device, tmp, "nvme", True, False, m)) for m in ("auto", "drive")}


def case_optim_resident(device: torch.device, tmp: str) -> dict:
    """FSDP2 with the shards in device memory: NVMeAdamW (master on the
    drive: the parameters are not float32 CPU tensors on a GPU) against
    torch's AdamW stepping on the device."""
    return {
        "auto": _verdict(_run(device, tmp, "torch", False, False), _run(device, tmp, "nvme", False, False))
    }


def case_tier(device: torch.device, tmp: str) -> dict:
    """The parameter tier, shards in device memory and with CPUOffloadPolicy,
    under torch's AdamW and under NVMeAdamW (parameters read from its master):
    each bit-identical to the same training without the tier."""
    out = {}
    for kind in ("torch", "nvme"):
        for offload in (False, True):
            ref = _run(device, tmp, kind, offload, tier=False)
            out[f"{kind}{'_offload' if offload else ''}"] = _verdict(
                ref, _run(device, tmp, kind, offload, tier=True)
            )
    return out


CASES = ("optim_offload", "optim_resident", "tier")


def main(device_name: str, out: str, cases: list[str]) -> None:
    """Join a one-rank group on `device_name` and run `cases`, one JSON each."""
    device = torch.device(device_name)
    os.environ.update(RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", WORLD_SIZE="1")
    os.makedirs(os.path.join(out, "drive"), exist_ok=True)
    torch.set_num_threads(1)
    kw: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(0)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        kw["device_id"] = torch.device("cuda", 0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{out}/store", rank=0, world_size=1, **kw)
    for name in cases or CASES:
        try:
            res = {"ok": True, **globals()[f"case_{name}"](device, out)}
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            res = {"ok": False, "error": traceback.format_exc()}
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(res, f, default=str)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # every result is written: gloo/NCCL teardown never decides a verdict


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
