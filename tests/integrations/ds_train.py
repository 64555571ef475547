"""A small ZeRO-3 training run under DeepSpeed on CPU, used by the
integration tests and bench/deepspeed_step.py.

    python ds_train.py --io aio|dsop --offload nvme|cpu --nvme DIR --steps 10 --out losses.json
                       [--pipeline] [--save CKPT --save-at N [--save-twice] [--reload]] [--load CKPT]

--reload: after the last step, load CKPT back into the same (trained) engine
and replay the steps after N (their losses: "replay_losses").

Rank and world size come from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
(defaults: one process). Prints nothing on success but the JSON it writes.
It ends with a barrier and destroy_process_group (see shutdown_distributed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29611")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
os.environ.setdefault("WORLD_SIZE", "1")


def build_model(torch, width: int, layers: int):
    torch.manual_seed(1234)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    mods.append(torch.nn.Linear(width, 16))
    return torch.nn.Sequential(*mods)


def shutdown_distributed(dist) -> None:
    """Barrier, then destroy the process groups, before the interpreter exits.

    `dist` is ``deepspeed.comm`` (which also drops DeepSpeed's references to
    the groups) or ``torch.distributed``. Without this, gloo's worker threads
    may still be finishing a collective when the interpreter finalizes; one
    that releases the collective's tensors then passes torch's
    ``Py_IsInitialized`` check, waits for the GIL, and is ended by CPython
    inside a noexcept destructor: ``terminate called without an active
    exception``, SIGABRT. After the barrier every rank's collectives are
    complete, so no such thread is left; a group nothing else holds is
    destroyed here and its threads are joined.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def gloo_threads() -> list[str]:
    """Names of this process's gloo and c10d-gloo threads still running (Linux)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(n for n in names if "gloo" in n)


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--io", choices=["aio", "dsop"], default="aio")
    ap.add_argument("--offload", choices=["nvme", "cpu"], default="nvme")
    ap.add_argument("--nvme", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pipeline", action="store_true")
    ap.add_argument("--max-in-cpu", type=int, default=0, help="offload_param.max_in_cpu")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--save")
    ap.add_argument("--save-at", type=int, default=0)
    # As HF's Trainer does (the model, then the optimizer): two saves of one tag.
    ap.add_argument("--save-twice", action="store_true")
    ap.add_argument("--load")
    ap.add_argument("--reload", action="store_true")
    ap.add_argument("--sub-group-size", type=int, default=400_000)
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def ds_config(a: argparse.Namespace, world: int) -> dict:
    """The DeepSpeed config: ZeRO-3, offload to NVMe (a.nvme) or CPU memory."""
    # Parameter prefetch off: with NVMe parameter offload DeepSpeed 0.19 asserts
    # ("param already assigned swap buffer") on its own op as well.
    zero: dict = {
        "stage": 3,
        "sub_group_size": a.sub_group_size,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 0,
    }
    if a.offload == "nvme":
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": a.nvme,
            "buffer_count": 32,
            "buffer_size": max(300_000, a.width * a.width),
            "max_in_cpu": a.max_in_cpu,
            "pin_memory": True,
        }
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": a.nvme,
            "buffer_count": 16,
            "pipeline_read": a.pipeline,
            "pipeline_write": a.pipeline,
            "pin_memory": True,
        }
    else:
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 8 * world,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "aio": {
            "block_size": 262144,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def one_step(torch, engine, batch, rank: int) -> float:
    """Forward, backward and step on this rank's slice of `batch`; the loss."""
    x, y = batch
    x, y = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def train(a: argparse.Namespace, torch, deepspeed, rank: int, world: int) -> dict:
    """Train for a.steps steps (resuming from a.load); the results to write."""
    model = build_model(torch, a.width, a.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(a, world))
    start = 0
    if a.load:
        _, client = engine.load_checkpoint(a.load)
        start = int(client["step"])
    g = torch.Generator().manual_seed(99)
    batches = [
        (torch.randn(8 * world, a.width, generator=g), torch.randn(8 * world, 16, generator=g))
        for _ in range(a.steps)
    ]
    losses, times = [], []
    for step in range(start, a.steps):
        t0 = time.perf_counter()
        losses.append(one_step(torch, engine, batches[step], rank))
        times.append(time.perf_counter() - t0)
        if a.save and step + 1 == a.save_at:
            for _ in range(2 if a.save_twice else 1):
                engine.save_checkpoint(a.save, client_state={"step": step + 1})
    replay = []
    if a.reload:
        engine.load_checkpoint(a.save)
        replay = [one_step(torch, engine, batches[step], rank) for step in range(a.save_at, a.steps)]
    from deepspeed.runtime.swap_tensor import partitioned_param_swapper as pps

    out = {
        "rank": rank,
        "losses": losses,
        "replay_losses": replay,
        "loss_scale": float(engine.optimizer.loss_scaler.cur_scale),
        "step_s": times,
        "start": start,
        "aio_served": pps.AsyncIOBuilder.__module__.startswith("aio"),
        "params": sum(p.ds_numel for p in engine.module.parameters()),
    }
    engine.destroy() if hasattr(engine, "destroy") else None
    return out


def main() -> int:
    """Train, tear the process groups down, write the JSON; the exit status."""
    a = parse_args()
    import torch

    if a.io == "aio":
        import aio.integrations.deepspeed as aio_ds

        aio_ds.enable()
    import deepspeed
    import deepspeed.comm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    deepspeed.init_distributed(dist_backend="gloo")
    out = train(a, torch, deepspeed, rank, world)
    shutdown_distributed(deepspeed.comm)
    out["process_group_at_exit"] = deepspeed.comm.is_initialized()
    with open(a.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
