"""Many small DeepSpeed ZeRO-3 runs in one process group, for the swapper
tests (test_ds_swappers.py) and for reproducing DeepSpeed's swapper asserts.

    python ds_swapper_train.py CASES.json OUT.json

CASES.json is a list of cases (see ``CASE_DEFAULTS``); each is trained in a
fresh engine, one after the other, in this rank's process. OUT.json gets,
after every case (so a later abort keeps the earlier results), a mapping
name -> {"losses", "error", "param_counters", "optimizer_counters",
"seconds", "first_step_state"}. ``error`` is ``"Type: message"`` of an exception raised while
building or training (the case then stops; the next one still runs).

Rank and world size come from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.
``swappers`` picks the classes at DeepSpeed's construction sites: "aio"
(aio.integrations.ds_swappers, what enable() installs), "ds" (DeepSpeed's
own), "naive" (aio's with the naive eviction: a mutation the loss
comparison must catch).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29613")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
os.environ.setdefault("WORLD_SIZE", "1")

CASE_DEFAULTS: dict[str, Any] = {
    "name": "case",
    "model": "mlp",  # mlp | gpt
    "width": 512,
    "layers": 6,
    "offload": "nvme",  # nvme | cpu
    "swappers": "aio",  # aio | ds | naive
    "steps": 3,
    "param_buffers": 5,  # HF's block
    "optimizer_buffers": 4,
    "pipeline": False,
    "sub_group_size": 1_000_000_000,
    "reuse": 1_000_000_000,
    "max_live": 1_000_000_000,
    "prefetch": "auto",  # "auto" (HF: 0.9 h^2) or a number
    "persistence": 0,  # or "auto" (HF: 10 h)
    "max_in_cpu": 0,
    "host_budget": None,  # aio_zero.host_memory_budget: the held cap (None: aio's default)
    "checkpointing": None,  # None | "reentrant" | "plain": activation checkpointing per layer
    "save_at": 0,  # save a checkpoint after this step, or each step of a list (to "ckpt")
    "load": False,  # resume from "ckpt" at its step
    "load_tag": None,  # which of its checkpoints (DeepSpeed's "global_step<N>"; None: the latest)
    "ckpt": "",
}


def build_model(torch: Any, c: dict[str, Any]) -> Any:
    """The case's model, seeded: an MLP of Linear(h, h) + tanh (the last layer is
    the output, so it is used twice in a row at the turn to backward), or
    aio's tied GPT."""
    torch.manual_seed(1234)
    if c["model"] == "gpt":
        from aio.train import build_gpt

        return build_gpt(vocab=c["width"] * 2, width=c["width"], layers=c["layers"], heads=4, seq=16)
    ckpt = c["checkpointing"]

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                [torch.nn.Linear(c["width"], c["width"]) for _ in range(c["layers"])]
            )

        def forward(self, x: Any) -> Any:
            from torch.utils.checkpoint import checkpoint

            for i, lin in enumerate(self.layers):
                # The first layer is not checkpointed: reentrant checkpointing
                # needs an input that requires grad.
                if ckpt is None or i == 0:
                    x = torch.tanh(lin(x))
                else:
                    x = checkpoint(lambda t, f=lin: torch.tanh(f(t)), x, use_reentrant=ckpt == "reentrant")
            return x

    return MLP()


def ds_config(c: dict[str, Any], nvme: str, world: int) -> dict[str, Any]:
    """HF Transformers' documented ZeRO-3 NVMe block, with the case's values."""
    h = c["width"]
    zero: dict[str, Any] = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": c["sub_group_size"],
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h) if c["prefetch"] == "auto" else int(c["prefetch"]),
        "stage3_param_persistence_threshold": 10 * h if c["persistence"] == "auto" else c["persistence"],
        "stage3_max_live_parameters": c["max_live"],
        "stage3_max_reuse_distance": c["reuse"],
        "stage3_gather_16bit_weights_on_model_save": False,
    }
    if c["offload"] == "nvme":
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme,
            "pin_memory": True,
            "buffer_count": c["param_buffers"],
            "buffer_size": 4 * h * h,
            "max_in_cpu": c["max_in_cpu"],
        }
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": nvme,
            "pin_memory": True,
            "buffer_count": c["optimizer_buffers"],
            "fast_init": False,
            "pipeline_read": c["pipeline"],
            "pipeline_write": c["pipeline"],
        }
    else:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    extra = {} if c["host_budget"] is None else {"aio_zero": {"host_memory_budget": c["host_budget"]}}
    return {
        **extra,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 4 * world,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "aio": {
            "block_size": 262144,
            "queue_depth": 32,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def batches(torch: Any, c: dict[str, Any], rank: int) -> list[tuple[Any, Any]]:
    """This rank's batch of every step (the same on every run of the case)."""
    g = torch.Generator().manual_seed(99 + rank)
    h = c["width"]
    if c["model"] == "gpt":
        return [
            (torch.randint(0, 2 * h, (4, 16), generator=g), torch.randint(0, 2 * h, (4, 16), generator=g))
            for _ in range(c["steps"])
        ]
    return [(torch.randn(4, h, generator=g), torch.randn(4, h, generator=g)) for _ in range(c["steps"])]


def loss_of(torch: Any, c: dict[str, Any], out: Any, y: Any) -> Any:
    """Cross-entropy for the GPT, mean squared error for the MLP."""
    if c["model"] == "gpt":
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    return torch.nn.functional.mse_loss(out, y)


def select_swappers(kind: str) -> None:
    """Put the case's swapper classes at DeepSpeed's construction sites."""
    from aio.integrations import ds_swappers

    ds_swappers.uninstall()  # nothing left from the case before
    if kind == "ds":
        return
    if kind == "aio":
        ds_swappers.install()  # as enable() does (AIO_DEEPSPEED_SWAPPERS=0: DeepSpeed's classes)
    elif kind == "naive":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from ds_swapper_mutants import NaiveEvictionSwapper

        ds_swappers.install(force=True, param_swapper=NaiveEvictionSwapper)
    else:
        raise ValueError(f"swappers: {kind!r}")


def counters(engine: Any) -> tuple[dict[str, int], dict[str, int]]:
    """The aio swappers' counters (empty for DeepSpeed's own classes)."""
    swapper = next(
        (p.nvme_swapper for p in engine.module.parameters() if getattr(p, "nvme_swapper", None)), None
    )
    opt_swapper = getattr(engine.optimizer, "optimizer_swapper", None)
    return dict(getattr(swapper, "counters", {})), dict(getattr(opt_swapper, "counters", {}))


def swapped_state(torch: Any, engine: Any) -> dict[str, Any]:
    """What the optimizer holds in ordinary memory for its NVMe-swapped
    sub-groups now: "numels", each state tensor's element count (Adam's
    moments; its 0-dim ``step`` aside), and "elements", the sub-groups'
    fp32 elements (Adam's state is 2 x 4 bytes of each)."""
    opt = engine.optimizer
    if not getattr(opt, "swap_optimizer", False):
        return {"numels": [], "elements": 0}
    flats = opt.fp32_partitioned_groups_flat
    groups = [sg for sg in range(len(flats)) if opt._swappable_optimizer_subgroup(sg)]
    numels = [
        int(v.numel())
        for sg in groups
        for v in opt.optimizer.state[flats[sg]].values()
        if torch.is_tensor(v) and v.dim() > 0
    ]
    elements = sum(int(opt.fp16_partitioned_groups_flat_numel[sg]) for sg in groups)
    return {"numels": numels, "elements": elements}


def run_case(torch: Any, deepspeed: Any, c: dict[str, Any], rank: int, world: int, tmp: str) -> dict:
    """Train one case; its record (losses until any error, the error, counters)."""
    rec: dict[str, Any] = {"losses": [], "error": None, "param_counters": {}, "optimizer_counters": {}}
    t0 = time.perf_counter()
    select_swappers(c["swappers"])
    nvme = os.path.join(tmp, c["name"])
    os.makedirs(nvme, exist_ok=True)
    engine = None
    try:
        config = ds_config(c, nvme, world)
        # Parameter ids from 0, as in a fresh process: DeepSpeed names the
        # swap files, and so the checkpoint's offloaded tensors, after them.
        deepspeed.zero.Init.param_id = 0
        # Under zero.Init with the config, as HF's from_pretrained builds a
        # ZeRO-3 model: partitions in the model's dtype (DeepSpeed's module=
        # conversion picks bf16 on the CPU accelerator).
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_model(torch, c)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        start = 0
        if c["load"]:
            _, client = engine.load_checkpoint(c["ckpt"], tag=c["load_tag"])
            start = int(client["step"])
        data = batches(torch, c, rank)
        saves = c["save_at"] if isinstance(c["save_at"], list) else [c["save_at"]]
        for step in range(start, c["steps"]):
            x, y = (t.to(engine.device) for t in data[step])
            loss = loss_of(torch, c, engine(x), y)
            engine.backward(loss)
            engine.step()
            rec["losses"].append(loss.item())
            if step == 0:  # the state Adam has just created: where is it now?
                rec["first_step_state"] = swapped_state(torch, engine)
            if step + 1 in saves:
                engine.save_checkpoint(c["ckpt"], client_state={"step": step + 1})
    except Exception as e:  # noqa: BLE001 - the record says what failed; the next case still runs
        rec["error"] = f"{type(e).__name__}: {e}"
        # Where it was raised: "file.py:line" of the innermost frame.
        tb = traceback.extract_tb(e.__traceback__)
        rec["where"] = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else None
        rec["traceback"] = traceback.format_exc()
    if engine is not None:
        rec["param_counters"], rec["optimizer_counters"] = counters(engine)
        from aio import pinned

        rec["pinned_bytes"] = pinned.locked_bytes()  # the swappers' buffers, held since initialize
        if torch.cuda.is_available() and engine.device.type == "cuda":
            rec["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        engine.destroy()
    del engine
    gc.collect()
    rec["seconds"] = time.perf_counter() - t0
    return rec


def main() -> int:
    """Run every case of argv[1]; write the records to argv[2] as they come."""
    cases_path, out_path = sys.argv[1], sys.argv[2]
    hang = float(os.environ.get("DS_SWAPPER_HANG_S", "0"))
    if hang:  # a rank stuck in a collective: print every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(hang, exit=True)
    with open(cases_path) as f:
        cases = [dict(CASE_DEFAULTS, **c) for c in json.load(f)]
    import warnings

    # torch warns at every reduce-scatter DeepSpeed makes: thousands of lines.
    warnings.filterwarnings("ignore", category=FutureWarning)
    import logging

    import torch

    import aio.integrations.deepspeed as aio_ds

    # aio's INFO lines (the swappers' summary at exit) on stderr.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    logging.getLogger("aio").addHandler(handler)
    logging.getLogger("aio").setLevel(logging.INFO)
    aio_ds.enable()
    import deepspeed
    import deepspeed.comm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = os.environ["DS_ACCELERATOR"] == "cuda"  # the GPU acceptance run (test_ds_swappers_cuda.py)
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    results: dict[str, Any] = {}
    # Beside the results (the test's own folder): a rank killed part-way
    # leaves its swap files there, not in the shared /tmp.
    beside = os.path.dirname(os.path.abspath(out_path))
    with tempfile.TemporaryDirectory(prefix=f"ds-swappers-{rank}-", dir=beside) as tmp:
        for c in cases:
            results[c["name"]] = run_case(torch, deepspeed, c, rank, world, tmp)
            with open(out_path + ".tmp", "w") as f:
                json.dump(results, f)
            os.replace(out_path + ".tmp", out_path)
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
