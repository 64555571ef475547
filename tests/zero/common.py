"""Shared helpers of the aio.zero tests: a small GPT, configs, in-memory reference training."""

import os

import torch

from aio.optim import CPUAdamW
from aio.train import batch, build_gpt

V, W, L, H, S, B = 64, 64, 2, 2, 8, 2


def gpt():
    torch.manual_seed(0)
    return build_gpt(V, W, L, H, S)


def cfg_for(drive, param="nvme", opt="nvme", gas=2, clip=0.5, pipeline=True, **extra):
    os.makedirs(drive, exist_ok=True)
    z = {
        "stage": 3,
        "sub_group_size": 40_000,
        "stage3_prefetch_bucket_size": 40_000,
        "stage3_param_persistence_threshold": 0,
    }
    if param == "nvme":
        z["offload_param"] = {
            "device": "nvme",
            "nvme_path": str(drive),
            "buffer_count": 6,
            "buffer_size": 20_000,
            "max_in_cpu": 0,
        }
    else:
        z["offload_param"] = {"device": param}
    if opt == "nvme":
        z["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": str(drive),
            "buffer_count": 11 if pipeline else 4,  # AdamW: 4 to step, 11 to overlap fully
            "pipeline_read": pipeline,
            "pipeline_write": pipeline,
        }
    else:
        z["offload_optimizer"] = {"device": opt}
    cfg = {
        "zero_optimization": z,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
    }
    cfg.update(extra)
    return cfg


def loss_of(model, step, micro):
    x, y = batch(step, micro, B, S, V)
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def train_in_memory(steps, gas=2, clip=0.5, model=None, before_step=None):
    """Losses of plain in-memory training with the AdamW step aio.zero takes
    by default (aio.optim's kernel: torch's AdamW with the correctly rounded
    square root), so an offloaded run must give the same bits.
    `before_step(step, model)` runs at the start of each step."""
    model = model or gpt()
    opt = CPUAdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    out = []
    for step in range(steps):
        if before_step is not None:
            before_step(step, model)
        for micro in range(gas):
            loss = loss_of(model, step, micro)
            (loss / gas if gas > 1 else loss).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def train_engine(engine, steps, gas=2, start=0, loss_fn=None):
    """Losses of `steps` steps through `engine` (`loss_fn(engine, step, micro)`, default loss_of)."""
    loss_fn = loss_fn or loss_of
    out = []
    for step in range(start, start + steps):
        for micro in range(gas):
            loss = loss_fn(engine, step, micro)
            engine.backward(loss)
            engine.step()
        out.append(loss.item())
    return out


def drive_is_empty(path):
    return not os.path.exists(path) or not any(os.scandir(path))
