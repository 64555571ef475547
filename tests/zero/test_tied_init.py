"""Tied weights and names under ``aio.zero.Init``: the partition of a weight
replaced by a tied one is given back at initialize(), parameters carry the
model's own names, and parameter checkpoints map partitions by state-dict
key (a model whose build order differs loads each value into its own
parameter), still reading checkpoints of the older, id-keyed kind."""

import pytest
import torch

import aio.zero
from aio.zero import checkpoint

from .common import cfg_for

tf = pytest.importorskip("transformers", reason="transformers is in the test extras")


def _gpt2(zero):
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=96, n_positions=16)
    with aio.zero.Init(zero):
        return tf.GPT2LMHeadModel(cfg)


def _step(engine, seed):
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)  # the same dropout masks in a resumed run
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_the_replaced_tied_weight_is_given_back_and_names_are_the_models(tmp_path):
    zero = cfg_for(tmp_path, gas=1, clip=0)
    model = _gpt2(zero)
    unique = {id(p) for p in model.parameters()}
    with aio.zero.initialize(model, zero) as engine:
        assert len(engine.store.swapper.parts) == len(unique)  # lm_head's own weight is gone
        assert model.lm_head.weight.aio_name == "transformer.wte.weight"
        assert model.transformer.h[0].attn.c_attn.weight.aio_name == "transformer.h.0.attn.c_attn.weight"
        _step(engine, 0)


class _TwoLinears(torch.nn.Module):
    """Two same-shaped frozen layers whose build order is `order` while their
    names (and so named_parameters() order) stay ``a``, ``b``; a trainable
    head. Frozen: their values come from the parameter checkpoint alone (a
    trainable one is also restored from its master weights)."""

    def __init__(self, order):
        super().__init__()
        built = {name: torch.nn.Linear(8, 8) for name in order}
        self.a, self.b = built["a"], built["b"]
        self.a.requires_grad_(False)
        self.b.requires_grad_(False)
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.b(torch.relu(self.a(x))))


def _two(zero, order, seed):
    torch.manual_seed(seed)
    with aio.zero.Init(zero):
        return _TwoLinears(order)


def test_a_checkpoint_loads_by_name_whatever_the_build_order(tmp_path):
    zero = cfg_for(tmp_path / "drive", gas=1, clip=0)
    model = _two(zero, "ab", seed=0)
    with aio.zero.initialize(model, zero) as engine:
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    other = _two(zero, "ba", seed=1)  # b adopted first: id-keyed, a's values would land in b
    with aio.zero.initialize(other, zero) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        got = other.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_an_id_keyed_checkpoint_with_the_orphan_still_resumes_exactly(tmp_path, monkeypatch):
    zero = cfg_for(tmp_path / "drive", gas=1, clip=0)
    model = _gpt2(zero)
    with aio.zero.initialize(model, zero) as engine:
        full = [_step(engine, s) for s in range(3)]
    # As an older aio wrote it: the orphan partition kept, build names, no keys.
    with monkeypatch.context() as m:
        m.setattr(aio.zero.params.ParamStore, "forget_orphans", lambda self: [])
        m.setattr(aio.zero.params.ParamStore, "adopt", _adopt_keeping_build_names(m))
        meta = checkpoint._meta
        m.setattr(checkpoint, "_meta", lambda t: {k: v for k, v in meta(t).items() if k != "state_dict"})
        model = _gpt2(zero)
        with aio.zero.initialize(model, zero) as engine:
            assert len(engine.store.swapper.parts) == len({id(p) for p in model.parameters()}) + 1
            assert _step(engine, 0) == full[0]
            engine.save_checkpoint(str(tmp_path / "old"))
            assert engine.store.params and model.lm_head.weight.aio_name.startswith("Embedding")
    model = _gpt2(zero)
    with aio.zero.initialize(model, zero) as engine:
        engine.load_checkpoint(str(tmp_path / "old"))
        assert [_step(engine, s) for s in (1, 2)] == full[1:]


def _adopt_keeping_build_names(m):
    orig = aio.zero.params.ParamStore.adopt

    def adopt(self, param, name=""):
        if getattr(param, "_aio_store", None) is self:
            return None
        return orig(self, param, name)

    return adopt


def test_a_replaced_module_still_alive_does_not_stop_its_own_checkpoint_loading(tmp_path):
    zero = cfg_for(tmp_path / "drive", gas=1, clip=0)
    model = _two(zero, "ab", seed=0)
    kept = model.head  # still referenced: its partition stays registered
    model.head = torch.nn.Linear(8, 8)
    with aio.zero.initialize(model, zero) as engine:
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        got = model.state_dict()
    assert kept is not None and all(torch.equal(got[k], v) for k, v in want.items())
