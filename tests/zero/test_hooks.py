"""aio.zero.hooks: the Fetcher fetches what each module uses."""

import copy

import pytest
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


def test_undeclared_external_parameter_is_named(tmp_path):
    """A forward that uses another module's parameter without declaring it
    fails with the parameter's name and the remedy, not deep in torch."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(200, 96)
            self.head = torch.nn.Linear(96, 96)

        def forward(self, x):
            return self.head(torch.nn.functional.linear(self.emb(x), self.head.weight))

    torch.manual_seed(0)
    with aio.zero.initialize(Net(), cfg_for(tmp_path, gas=1, clip=0)) as engine:
        with pytest.raises(ValueError, match=r"head\.weight.*register_external_parameter"):
            engine(torch.randint(0, 200, (3, 5)))


def test_the_first_step_prefetches_along_a_guessed_order(tmp_path):
    """No trace is recorded before the first pass: forward guesses the
    modules' registration order and backward the reverse of forward's trace,
    so step 1 prefetches too (it fetched every module on demand, about 2x
    slower than step 2 at 3.2B); the same losses."""
    from .common import gpt, train_engine, train_in_memory

    with aio.zero.initialize(gpt(), cfg_for(tmp_path, gas=1)) as engine:
        got = train_engine(engine, 1, gas=1)
        st = engine.stats()
    assert st["params"]["prefetch"] > 10 and st["params"]["hits"] == st["params"]["prefetch"]
    assert st["fetcher"]["guess_misses"] == 0 and st["fetcher"]["trace_misses"] == 0
    assert got == train_in_memory(1, gas=1)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_forward_that_raises_releases_what_it_acquired(tmp_path, grad):
    """A module whose forward raises (out of memory, caught by a retry loop
    that runs the forward again inside its except clause): its parameters,
    and those of the modules around it, go back at once; the retry and then
    training give the same losses as a run without the failure."""
    from aio.zero.params import module_params

    from .common import gpt, train_engine

    def losses(fail):
        model = gpt()
        block = model.blocks[1].fc  # a module with parameters of its own
        real = block.forward
        state = {"fail": fail}

        def flaky(*args, **kwargs):
            if state["fail"]:
                state["fail"] = False
                raise torch.OutOfMemoryError("out of memory (simulated)")
            return real(*args, **kwargs)

        block.forward = flaky
        with aio.zero.initialize(model, cfg_for(tmp_path / str(fail), gas=1, clip=0)) as engine:
            x = torch.randint(0, 64, (2, 8))
            with torch.set_grad_enabled(grad):
                try:
                    engine(x)
                except torch.OutOfMemoryError:
                    assert dict(engine.store.refs) == {}  # nothing left acquired
                    out = engine(x)  # the retry, inside the except clause
                    assert out.shape[0] == 2
            engine.fetcher.end_backward() if grad else None
            assert dict(engine.store.refs) == {}
            # The failed call is not counted, the retry's is (until backward).
            assert [getattr(p, "aio_calls", 0) for p in module_params(block)] == [int(grad)] * 2
            return train_engine(engine, 2, gas=1)

    assert losses(True) == losses(False)
