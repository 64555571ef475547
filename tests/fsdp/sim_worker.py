"""The parameter tier's GPU path, driven by real FSDP2 training on the
CUDA simulator (tests/zero/cuda_sim.py). Run as a script:

    python sim_worker.py OUTDIR SCHEDULER SEED [GROUPS [SYNC_READS]]

One gloo rank trains tests/fsdp/cuda_worker.py's model (``GROUPS`` FSDP
groups, default its 4; ``SYNC_READS`` 1: every drive read of the tier has
landed when ``SwapSpace.read`` returns, so the order of reads, uploads and
slot reuse does not depend on the drive's timing) without the tier,
then with it under ``CudaSim``, its FSDP shards adopted as device storages
(so the tier sees device-resident shards and moves them up through
aio/fsdp/upload.py, its copies queued on the simulated side stream). Writes
``OUTDIR/result.json``: whether the two runs are bit-identical, the tier's
counters, the simulator's, or the error (a ``Hazard`` when an ordering step
is missing)."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for zero.*

import cuda_worker as w  # noqa: E402
from zero.cuda_sim import CudaSim  # noqa: E402


def _widths(groups: int) -> tuple[int, ...]:
    """Layer widths giving `groups` FSDP groups (one per Linear, the last in the root)."""
    return tuple(w.WIDTHS[i % (len(w.WIDTHS) - 1)] for i in range(groups)) + (w.WIDTHS[-1],)


def _sync_reads() -> None:
    """Each SwapSpace read waited for before it returns (a finished future)."""
    from aio.swap.drives import SwapSpace

    read = SwapSpace.read

    def synchronous(space, buf, offset):
        fut = read(space, buf, offset)
        fut.result()
        return fut

    SwapSpace.read = synchronous


def _tier_run(out: str, scheduler: str, seed: int) -> tuple[dict, dict, dict]:
    from aio.fsdp import offload_params

    dev = torch.device("cpu")
    with CudaSim(scheduler=scheduler, seed=seed) as sim:
        model = w._shard(w._model(dev), dev, offload=False)
        for p in model.parameters():
            sim.adopt(p.to_local())  # the shard's storage: a device one from here on
        opt = w._optimizer("torch", model, out)
        t = offload_params(model, os.path.join(out, "drive"), opt)
        losses = w._train(model, opt, dev)
        with t.resident(modified=False):
            full = [p.full_tensor().detach().cpu().clone() for p in model.parameters()]
        stats = t.stats()
        t.close()
        return {"losses": losses, "full": full, "tier": stats}, stats, sim.stats()


def main(out: str, scheduler: str, seed: int, groups: int = 0, sync_reads: bool = False) -> None:
    """One gloo rank: the reference run, then the tier's run on the simulator."""
    if groups:
        w.WIDTHS = _widths(groups)  # read by cuda_worker's _model and _batch at each call
    if sync_reads:
        _sync_reads()
    os.makedirs(os.path.join(out, "drive"), exist_ok=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1)
    try:
        ref = w._run(torch.device("cpu"), out, "torch", False, tier=False)
        run, stats, sim = _tier_run(out, scheduler, seed)
        v = w._verdict(ref, run)
        res = {"ok": True, "equal": v["equal"], "tier": stats, "sim": sim}
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        res = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(res, f, default=str)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    extra = [int(a) for a in sys.argv[4:6]]
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *extra[:1], *map(bool, extra[1:2]))
