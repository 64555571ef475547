"""aio.zero's GPU path under the strict CUDA simulator (tests/zero/cuda_sim.py),
in every scheduler mode: training equal to the same training in memory,
module buffers on the device, bounded device memory, no pageable copies."""

import pytest
import torch

import aio.zero
from aio.train import batch

from .common import B, S, V, cfg_for, gpt, train_in_memory
from .cuda_sim import CudaSim

MODES = [("lazy", 0), ("eager", 0), ("random", 1), ("random", 2)]


@pytest.fixture(params=MODES, ids=[f"{m}-{s}" for m, s in MODES])
def sim(request):
    mode, seed = request.param
    with CudaSim(scheduler=mode, seed=seed) as s:
        yield s


def device_loss(engine, step, micro):
    x, y = batch(step, micro, B, S, V)
    out = engine(x.to("cuda"))
    return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), y.to("cuda").flatten())


def train_on_device(engine, steps, gas=2):
    out = []
    for step in range(steps):
        for micro in range(gas):
            loss = device_loss(engine, step, micro)
            engine.backward(loss)
            engine.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("param,opt", [("nvme", "nvme"), ("cpu", "cpu"), ("nvme", "cpu")])
def test_training_on_simulated_gpu_equals_memory(sim, tmp_path, param, opt):
    want = train_in_memory(3)
    with aio.zero.initialize(gpt(), cfg_for(tmp_path, param=param, opt=opt), device="cuda") as engine:
        got = train_on_device(engine, 3)
    assert got == want
    assert sim.stats()["pageable_h2d"] == 0
