"""aio.zero.hooks: the Fetcher fetches what each module uses."""

import copy

import torch

import aio.zero

from .common import cfg_for


def test_external_parameter_is_fetched(tmp_path):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(200, 96)
            self.out = torch.nn.Module()
            aio.zero.register_external_parameter(self.out, self.emb.weight)

        def forward(self, x):
            return torch.nn.functional.linear(self.emb(x), self.emb.weight)

    torch.manual_seed(0)
    m = Net()
    m.out.forward = lambda h: torch.nn.functional.linear(h, m.emb.weight)
    x = torch.randint(0, 200, (3, 5))
    ref = copy.deepcopy(m)
    expect = ref.out(ref.emb(x))
    with aio.zero.initialize(m, cfg_for(tmp_path, gas=1, clip=0)) as engine:
        engine.fetcher.begin_forward()
        got = m.out(m.emb(x))
    assert torch.equal(got, expect)
