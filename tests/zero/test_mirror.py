"""aio.zero.mirror: float32 parameters read from the optimizer's master
weights train exactly as with a copy of their own, write no parameter bytes
after set-up, and are read from the master weights again after
gathered(modify=True) and checkpoint loads, which store them there too."""

import pytest
import torch

import aio.zero

from .common import cfg_for, gpt, train_engine


def _engine(tmp_path, from_master, gradients="auto", **kw):
    cfg = cfg_for(tmp_path, aio_zero={"params_from_master": from_master, "gradients": gradients}, **kw)
    return aio.zero.initialize(gpt(), cfg)


@pytest.mark.parametrize("gradients", ["cpu", "nvme"])
def test_trains_as_with_own_copies_and_writes_no_parameters(tmp_path, reference, gradients):  # noqa: F811
    with _engine(tmp_path / "own", False, gradients) as own:
        own_losses = train_engine(own, 4)
        own_weights = own.state_dict()
    with _engine(tmp_path / "mirror", True, gradients) as engine:
        drive = engine.store.on_drive_part_ids(engine.module.parameters())
        assert engine.mirrored == engine.store.stats()["aliased"] == len(drive) > 0
        set_up = engine.io_bytes_by_category()["written"]["parameters"]
        losses = train_engine(engine, 4)
        written = engine.io_bytes_by_category()["written"]
        assert written["parameters"] == set_up  # nothing after set-up: the master weights are the copy
        weights = engine.state_dict()
    assert losses == own_losses == reference[:4]
    assert all(torch.equal(weights[k], own_weights[k]) for k in own_weights)


@pytest.mark.parametrize(
    "why",
    ["bf16 parameters", "optimizer in memory", "params_from_master false"],
    ids=lambda w: w.replace(" ", "-"),
)
def test_parameters_keep_their_own_copy_where_it_differs_or_is_asked(tmp_path, why):
    kw = {
        "bf16 parameters": {"bf16": {"enabled": True}},
        "optimizer in memory": {"opt": "cpu"},
        "params_from_master false": {"from_master": False},
    }[why]
    from_master = kw.pop("from_master", True)
    with _engine(tmp_path, from_master, **kw) as engine:
        assert engine.mirrored == 0
        set_up = engine.io_bytes_by_category()["written"]["parameters"]
        train_engine(engine, 1)
        assert engine.store.stats()["aliased"] == 0
        assert engine.io_bytes_by_category()["written"]["parameters"] > set_up  # written back after the step


def test_modified_parameter_keeps_its_values_and_checkpoint_restores(tmp_path, reference):  # noqa: F811
    with _engine(tmp_path / "d", True) as engine:
        first = train_engine(engine, 3)
        engine.save_checkpoint(str(tmp_path / "ck"))
        p = next(q for q in engine.module.parameters() if engine.store.mirrors(q))
        before = engine.store.read(p)
        with engine.gathered([p], modify=True):
            p.data.add_(1.0)
        # Stored as the parameter and as its master weights, which it is read from again.
        assert engine.store.mirrors(p) and torch.equal(engine.store.read(p), before + 1.0)
        with engine.gathered([p]):
            assert torch.equal(p.data.reshape(-1), before + 1.0)
        mirrored = engine.mirrored
        engine.load_checkpoint(str(tmp_path / "ck"))
        assert engine.store.stats()["aliased"] == engine.mirrored == mirrored
        rest = train_engine(engine, 3, start=3)
    assert first + rest == reference[:6]


@pytest.mark.parametrize("opt", ["nvme", "cpu"])
def test_modified_parameters_are_where_training_goes_on(tmp_path, opt):
    """gathered(modify=True) between steps stores the values as the
    parameters and their master weights: training continues from them exactly
    as in memory (it used to be overwritten by the next step's master weights)."""
    from .common import train_in_memory

    def change(model_params):
        model_params[3].data.mul_(0.5)
        model_params[5].data.fill_(0.25)

    want = train_in_memory(4, before_step=lambda step, m: change(list(m.parameters())) if step == 2 else None)
    with aio.zero.initialize(gpt(), cfg_for(tmp_path, opt=opt)) as engine:
        got = train_engine(engine, 2)
        params = list(engine.module.parameters())
        with engine.gathered([params[3], params[5]], modify=True):
            change(params)
        got += train_engine(engine, 2, start=2)
        if opt == "nvme":
            assert engine.mirrored == engine.store.stats()["aliased"] > 0  # the master weights again
    assert got == want
