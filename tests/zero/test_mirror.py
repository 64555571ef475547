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
        set_up = engine.io_bytes_by_category()
        # Set-up wrote no master weights: the first step reads them from the
        # parameters, writes them, and the parameters are read from them after.
        assert set_up["written"].get("master", 0) == set_up["read"].get("master", 0) == 0
        assert engine.mirrored == engine.store.stats()["aliased"] == 0
        losses = train_engine(engine, 1)
        assert engine.mirrored == engine.store.stats()["aliased"] == len(drive) > 0
        losses += train_engine(engine, 3, start=1)
        written = engine.io_bytes_by_category()["written"]
        # nothing after set-up: the master weights are the copy
        assert written["parameters"] == set_up["written"]["parameters"]
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


def test_modify_mid_window_with_gradients_on_the_drive_does_not_wait_forever(tmp_path):
    """Mid accumulation window the gradient writes in flight held every
    optimizer buffer, and update_master() waited for one forever (review of
    383302c): gathered(modify=True) now lets those writes land first."""
    import threading

    from .common import loss_of

    cfg = cfg_for(tmp_path, pipeline=False, aio_zero={"gradients": "nvme"})  # 4 optimizer buffers
    cfg["zero_optimization"]["sub_group_size"] = 17_000  # more sub-groups than buffers
    with aio.zero.initialize(gpt(), cfg) as engine:
        engine.backward(loss_of(engine, 0, 0))
        engine.step()  # micro-step 1 of 2: the gradients' writes are in flight
        p = list(engine.module.parameters())[3]
        before = engine.store.read(p)
        outcome = []

        def modify():
            try:
                with engine.gathered([p], modify=True):
                    p.data.mul_(0.5)
                outcome.append("done")
            except BaseException as e:  # noqa: BLE001 - reported below
                outcome.append(e)

        t = threading.Thread(target=modify, daemon=True)
        t.start()
        t.join(60)
        assert outcome == ["done"], outcome or "gathered(modify=True) still waiting after 60 s"
        assert torch.equal(engine.store.read(p), before * 0.5)
        engine.backward(loss_of(engine, 1, 0))
        engine.step()  # the window's second micro-step and its optimizer step
        assert engine.global_steps == 1


@pytest.mark.parametrize("opt", ["nvme", "cpu"])
def test_modify_keeps_fp32_master_weights_of_values_left_alone(tmp_path, opt):
    """bf16 parameters: gathered(modify=True) stores as master weights only
    the values the block changed; the others keep their fp32 precision (a
    copy of the bf16 values rounded 4.5 % of the master weights)."""
    cfg = cfg_for(tmp_path, opt=opt, bf16={"enabled": True})
    with aio.zero.initialize(gpt(), cfg) as engine:
        train_engine(engine, 2)
        opt_ = engine.zero_optimizer
        groups = range(len(engine.layout.groups))
        before = [opt_.read_master(gi) if opt == "nvme" else opt_.master[gi].clone() for gi in groups]
        params = list(engine.module.parameters())[:4]
        with engine.gathered(params, modify=True):
            params[0].data.view(-1)[0] = 0.5  # one value changed
        after = [opt_.read_master(gi) if opt == "nvme" else opt_.master[gi].clone() for gi in groups]
        s = engine.layout.places[params[0].aio_id]
        changed = [int((a != b).sum()) for a, b in zip(before, after, strict=True)]
        assert sum(changed) == changed[s.group] == 1
        assert after[s.group][s.offset].item() == 0.5


def test_failed_master_update_makes_parameters_read_from_it_refuse(tmp_path):
    """A failed write of gathered(modify=True)'s master weights leaves that
    sub-group's drive copy untrusted: parameters read from master weights
    refuse (until a checkpoint is loaded), as after a failed step, and no
    checkpoint is saved from it."""
    import errno

    with _engine(tmp_path / "d", True) as engine:
        train_engine(engine, 1)
        params = [q for q in engine.module.parameters() if engine.store.mirrors(q)]
        p = params[0]
        group = engine.layout.places[p.aio_id].group
        other = next(q for q in params if engine.layout.places[q.aio_id].group != group)
        engine.opt.drop_cached()  # nothing kept: the next optimizer write is the master weights'
        engine.opt.space.drives[0].writer._c.inject_fault("error", errno.EIO, "write", 1, 1)
        with pytest.raises(OSError), engine.gathered([p], modify=True):
            p.data.mul_(0.5)
        engine.opt.space.drives[0].writer._c.clear_fault()
        assert engine.mirrored == 0
        with pytest.raises(Exception, match="invalid"):
            engine.store.read(other)
        with pytest.raises(Exception, match="cannot checkpoint"):
            engine.save_checkpoint(str(tmp_path / "ck"))
        with pytest.raises(Exception, match="no complete state"):  # the optimizer refuses too
            engine.zero_optimizer.export_checkpoint(str(tmp_path / "opt"))


@pytest.mark.parametrize("gradients", ["cpu", "nvme"])
def test_changed_and_saved_before_the_first_step_trains_as_in_memory(tmp_path, gradients):
    """Before the first step the master weights are still read from the
    parameters (set-up wrote none): parameters changed then are where training
    starts, a checkpoint saved then holds them, and loading it starts again."""
    from .common import train_in_memory

    def change(model_params):
        model_params[3].data.mul_(0.5)

    want = train_in_memory(3, before_step=lambda step, m: change(list(m.parameters())) if step == 0 else None)
    with _engine(tmp_path / "d", True, gradients) as engine:
        params = list(engine.module.parameters())
        with engine.gathered([params[3]], modify=True):
            change(params)
        engine.save_checkpoint(str(tmp_path / "ck"))
        got = train_engine(engine, 3)
        assert engine.mirrored == engine.store.stats()["aliased"] > 0
        engine.load_checkpoint(str(tmp_path / "ck"))  # as before the first step
        again = train_engine(engine, 3)
    assert got == again == want


def test_a_failure_mirroring_in_the_first_step_leaves_no_silent_garbage(tmp_path, monkeypatch):
    """The first step aliases each sub-group's parameters as it writes its
    master weights; an error part-way (here the third alias) fails the step,
    and the parameters aliased before it refuse to be read, as after any
    failed step, rather than read master weights that were never written."""
    from aio.swap import ParamSwapper, SwapStateError

    calls = []
    alias = ParamSwapper.alias

    def failing_alias(self, *args):
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return alias(self, *args)

    with _engine(tmp_path, True) as engine:
        monkeypatch.setattr(ParamSwapper, "alias", failing_alias)
        with pytest.raises(RuntimeError, match="injected"):
            train_engine(engine, 1)
        with pytest.raises(SwapStateError):
            engine.state_dict()
