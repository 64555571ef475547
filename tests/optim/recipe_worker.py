"""The framework recipes of docs/fsdp.md, run for tests/optim/test_recipes.py
as a script: ``python recipe_worker.py OUTDIR CASE...``. Two ranks join one
gloo group, spawned here with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID), so every framework takes
the group as torchrun would have made it. Each rank runs every case in order
and writes ``OUTDIR/<case>.rank<r>.json`` before the next starts: the results
are judged from those files, never from the exit status (gloo may abort at
teardown).

Every case runs its framework twice, with torch.optim.AdamW(foreach=False)
and with aio.optim.NVMeAdamW(match_torch=True), and reports whether the
losses and the full parameters are bit-identical (torch.equal), and where
NVMeAdamW's swap files are (each rank's own drive folder, ``nvme{local_rank}``)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 3
LR = 1e-2
WORLD = 2


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    # 63 rows: uneven shards on 2 ranks.
    return torch.nn.Sequential(torch.nn.Linear(12, 63), torch.nn.ReLU(), torch.nn.Linear(63, 2))


def _data(rank: int, n: int = STEPS * 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 12, generator=g), torch.randn(n, 2, generator=g)


def _nvme_path(tmp: str) -> str:
    return os.path.join(tmp, "nvme{local_rank}")  # aio fills in each rank's own drive


def _aio(params: Any, tmp: str) -> torch.optim.Optimizer:
    from aio.optim import NVMeAdamW

    return NVMeAdamW(params, lr=LR, nvme_path=_nvme_path(tmp), match_torch=True)


def _torch(params: Any, tmp: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, foreach=False)


def _full(params: Any) -> list[torch.Tensor]:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in params]


def _fsdp2(model: torch.nn.Module, mesh: Any = None) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _files(opt: Any, tmp: str, rank: int) -> dict:
    """Where this rank's NVMeAdamW keeps its state (read before close())."""
    inner = getattr(opt, "optimizer", opt)  # Accelerate's AcceleratedOptimizer
    st = inner.swap_stats()
    d = st["swap_dir"]
    return {
        "swap_dir": os.path.realpath(d),
        "drive": os.path.realpath(os.path.join(tmp, f"nvme{rank}")),
        "files": len(os.listdir(d)),
        "drive_bytes": st.get("drive_bytes"),
    }


def _compare(
    run: Callable[[Callable], tuple[list[float], list[torch.Tensor], Any]], tmp: str, rank: int
) -> dict:
    (lt, pt, _), (la, pa, oa) = run(_torch), run(_aio)
    res = {"losses_torch": lt, "losses_aio": la, "equal": lt == la and all(map(torch.equal, pt, pa))}
    res.update(_files(oa, tmp, rank))
    getattr(oa, "optimizer", oa).close()
    return res


def case_lightning_fsdp2(rank: int, tmp: str) -> dict:
    """Lightning's ModelParallelStrategy (FSDP2): configure_model shards,
    configure_optimizers returns the optimizer."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    class Module(pl.LightningModule):
        def __init__(self, make_opt: Callable) -> None:
            super().__init__()
            self.net, self.make_opt, self.losses = _net(), make_opt, []

        def configure_model(self) -> None:
            _fsdp2(self.net, self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return self.make_opt(self.parameters(), tmp)

    def run(make_opt: Callable) -> tuple:
        module = Module(make_opt)
        trainer = pl.Trainer(
            accelerator="cpu", devices=WORLD, max_steps=STEPS,
            strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False,
        )  # fmt: skip
        trainer.fit(module, DataLoader(TensorDataset(*_data(rank)), batch_size=4))
        return module.losses, _full(module.parameters()), trainer.optimizers[0]

    return _compare(run, tmp, rank)


def _accelerate_loop(make_opt: Callable, tmp: str, rank: int, sharded: list, fsdp2: bool = False) -> tuple:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    if fsdp2:
        _force_fsdp2(accelerator)
    model = _net()
    opt = make_opt(model.parameters(), tmp)  # before prepare, as Accelerate wants
    model, opt = accelerator.prepare(model, opt)
    sharded.append(all(hasattr(p, "full_tensor") for p in model.parameters()))
    losses = []
    x, y = _data(rank)
    for s in range(STEPS):
        loss = ((model(x[4 * s : 4 * s + 4]) - y[4 * s : 4 * s + 4]) ** 2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = _full(model.parameters())
    if fsdp2:
        _unforce(accelerator)
    return losses, params, opt


def case_accelerate(rank: int, tmp: str) -> dict:
    """Accelerate on CPU: the optimizer built before accelerator.prepare."""
    sharded: list[bool] = []
    res = _compare(lambda make: _accelerate_loop(make, tmp, rank, sharded), tmp, rank)
    return {**res, "sharded": sharded}


def _force_fsdp2(accelerator: Any) -> None:
    # Accelerate honours an FSDP plugin only on an accelerator device (its
    # state keeps MULTI_CPU on CPU, and prepare wraps the model in DDP). Set
    # here, before each prepare, it takes the FSDP2 path a GPU run takes:
    # fully_shard, then fsdp2_switch_optimizer_parameters.
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)


def _unforce(accelerator: Any) -> None:
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.MULTI_CPU
    accelerator.state.fsdp_plugin = None


def case_accelerate_fsdp2(rank: int, tmp: str) -> dict:
    """Accelerate's FSDP2 prepare (forced on CPU, see _force_fsdp2)."""
    sharded: list[bool] = []
    res = _compare(lambda make: _accelerate_loop(make, tmp, rank, sharded, fsdp2=True), tmp, rank)
    return {**res, "sharded": all(sharded) and len(sharded) == 2}


def case_hf_trainer(rank: int, tmp: str) -> dict:
    """HF Trainer with optimizer_cls_and_kwargs: its two param groups (decay
    and no decay), its linear LR schedule and its gradient clipping."""
    from transformers import Trainer, TrainingArguments

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.losses = _net(), []

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
            loss = ((self.net(x) - labels) ** 2).mean()
            self.losses.append(loss.item())
            return {"loss": loss}

    x, y = _data(0, 24)
    data = [{"x": a, "labels": b} for a, b in zip(x, y, strict=True)]

    def run(make_opt: Callable) -> tuple:
        from aio.optim import NVMeAdamW

        model = Net()
        if make_opt is _aio:
            cls_kw = (NVMeAdamW, {"lr": LR, "nvme_path": _nvme_path(tmp), "match_torch": True})
        else:
            cls_kw = (torch.optim.AdamW, {"lr": LR, "foreach": False})
        args = TrainingArguments(
            output_dir=os.path.join(tmp, "hf"), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=4,
            weight_decay=0.1, max_grad_norm=0.5, report_to="none", save_strategy="no",
            logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=cls_kw)
        trainer.train()
        return model.losses, _full(model.parameters()), trainer.optimizer

    return _compare(run, tmp, rank)


def _dcp(rank: int, tmp: str, flatten: bool) -> dict:
    """torchtitan-style: FSDP2, a Stateful app state through get_state_dict /
    set_state_dict, dcp.save after 2 steps, then the same 2 more steps both
    continued and resumed in a fresh model and optimizer from the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)

    class AppState(Stateful):
        def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            self.model, self.opt = model, opt

        def state_dict(self) -> dict:
            model_sd, optim_sd = get_state_dict(self.model, self.opt, options=options)
            return {"model": model_sd, "optim": optim_sd}

        def load_state_dict(self, sd: dict) -> None:
            set_state_dict(
                self.model,
                self.opt,
                model_state_dict=sd["model"],
                optim_state_dict=sd["optim"],
                options=options,
            )

    x, y = _data(rank, 16)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
        out = []
        for s in steps:
            opt.zero_grad()
            loss = ((model(x[4 * s : 4 * s + 4]) - y[4 * s : 4 * s + 4]) ** 2).mean()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    res: dict = {}
    runs = {}
    for kind, make in (("torch", _torch), ("aio", _aio)):
        ckpt = os.path.join(tmp, f"ckpt_{kind}_{int(flatten)}")
        model = _fsdp2(_net())
        opt = make(model.parameters(), tmp)
        first = train(model, opt, range(2))
        dcp.save({"app": AppState(model, opt)}, checkpoint_id=ckpt)
        cont = train(model, opt, range(2, 4))
        full = _full(model.parameters())
        model2 = _fsdp2(_net())
        opt2 = make(model2.parameters(), tmp)
        try:
            dcp.load({"app": AppState(model2, opt2)}, checkpoint_id=ckpt)
            resumed = train(model2, opt2, range(2, 4))
            same = cont == resumed and all(map(torch.equal, full, _full(model2.parameters())))
            if kind == "aio":
                res.update(_files(opt2, tmp, rank))
        finally:
            for o in (opt, opt2):
                getattr(o, "close", lambda: None)()
        runs[kind] = (first + cont, full, same)
        res[f"resumed_equal_{kind}"] = same
    (lt, pt, st), (la, pa, sa) = runs["torch"], runs["aio"]
    res.update(losses_torch=lt, losses_aio=la, equal=st and sa and lt == la and all(map(torch.equal, pt, pa)))
    return res


def case_dcp(rank: int, tmp: str) -> dict:
    """The DCP loop with torch's default (nested) optimizer state."""
    return _dcp(rank, tmp, flatten=False)


def case_dcp_flat(rank: int, tmp: str) -> dict:
    """The same with flatten_optimizer_state_dict=True, as torchtitan's
    OptimizersContainer saves and loads."""
    return _dcp(rank, tmp, flatten=True)


def _worker(rank: int, out: str, cases: list[str]) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
        GROUP_RANK="0", NODE_RANK="0", TORCHELASTIC_RUN_ID="aio-recipes", MASTER_ADDR="127.0.0.1",
    )  # fmt: skip
    torch.set_num_threads(1)
    os.makedirs(os.path.join(out, f"nvme{rank}"), exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    for name in cases:
        start = time.perf_counter()
        try:
            res = {"ok": True, **globals()[f"case_{name}"](rank, out)}
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            res = {"ok": False, "error": traceback.format_exc()}
        res["seconds"] = round(time.perf_counter() - start, 2)  # imports included
        with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(res, f, default=str)
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    outdir, names = sys.argv[1], sys.argv[2:]
    # A free port for frameworks that read MASTER_PORT (the group itself uses a file store).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    # Forked, not spawned: each rank would import torch, FSDP and DCP again (3-6 s of
    # CPU a rank, the CUDA build the most); this process has done only that, no group yet.
    mp.start_processes(_worker, args=(outdir, names), nprocs=WORLD, join=True, start_method="fork")
