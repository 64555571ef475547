"""aio.fsdp.train.free_comm_buffers on 2 gloo ranks: the all-gather output
FSDP2 keeps after a forward copy-out and the reduce-scatter input it keeps
after a reduction are gone by the next module's forward / backward; without
it FSDP2 holds them (the check's control); the losses are the same bits."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.timeout(180)


def _kept(model: torch.nn.Module, free: bool) -> tuple[list[bool], list[int], float, list[int]]:
    """One forward and backward of the sharded GPT: whether FSDP2 holds an
    all-gather result as each Linear's forward begins, the reduce-scatter
    inputs it holds as each Linear's backward begins, and the loss."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from aio.fsdp.train import shard_gpt

    if free:
        shard_gpt(model, torch.device("cpu"), "linear", backward_prefetch=False)
    else:  # the same groups and prefetch, FSDP2's own buffer handling
        for block in model.blocks:
            for layer in (block.attn.qkv, block.attn.proj, block.fc, block.out):
                fully_shard(layer)
            fully_shard(block)
        fully_shard(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_modules_to_backward_prefetch([m])

    def ctx() -> Any:
        return model._get_fsdp_state()._fsdp_param_groups[0].comm_ctx

    held: list[int] = []
    gathered: list[bool] = []

    def probe_backward(_m: Any, _args: Any, out: Any) -> None:
        # As the module's backward begins: a gradient hook on its output, after shard_gpt's.
        torch.autograd.graph.register_multi_grad_hook(
            [out], lambda _g: held.append(len(ctx().reduce_scatter_states)), mode="any"
        )

    at_gather: list[int] = []  # reduce-scatter inputs held as each group's backward gathers it

    def watch(pg: Any) -> None:
        pre_backward = pg.pre_backward

        def counted(*a: Any, **k: Any) -> Any:
            at_gather.append(len(ctx().reduce_scatter_states))
            return pre_backward(*a, **k)

        pg.pre_backward = counted

    for m in model.modules():
        if isinstance(m, FSDPModule):
            for pg in m._get_fsdp_state()._fsdp_param_groups:
                watch(pg)
    for block in model.blocks:
        for layer in (block.attn.qkv, block.fc):  # registered after shard_gpt's: run after them
            layer.register_forward_pre_hook(lambda *_: gathered.append(ctx().all_gather_state is not None))
            layer.register_forward_hook(probe_backward)
    x = torch.arange(16).reshape(1, 16) % 32
    loss = model(x).float().pow(2).mean()
    loss.backward()
    return gathered, held, float(loss.detach()), at_gather


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from aio.train import build_gpt

        res = {}
        for free in (True, False):
            torch.manual_seed(0)
            res[free] = _kept(build_gpt(32, 64, 2, 4, 16), free)
        out[rank] = res
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_free_comm_buffers_drops_fsdp2s_kept_buffers() -> None:
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(_port(), out), nprocs=2, join=True)
    for rank in (0, 1):
        freed, kept = out[rank][True], out[rank][False]
        assert freed[0] and not any(freed[0]) and all(kept[0]), (freed, kept)
        assert freed[1] and all(n == 0 for n in freed[1]), freed
        assert any(n > 0 for n in kept[1]), kept
        assert freed[2] == kept[2]  # the same loss, bit for bit
        # dropped before FSDP2 gathers the next group for its backward, not after
        assert freed[3] and all(n == 0 for n in freed[3]), freed[3]
        assert any(n > 0 for n in kept[3]), kept[3]
