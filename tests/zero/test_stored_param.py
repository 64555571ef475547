"""Reads of a stored parameter between uses (aio/zero/stored_param.py): the
values, bit for bit as the same training in memory, or a ValueError naming
the way that works -- never the empty placeholder."""

import copy
import io

import pytest
import torch

import aio.zero
from aio.optim import CPUAdamW
from aio.zero.stored_param import StoredParameter

from .common import cfg_for, gpt, loss_of, train_engine


def _ref_step(model, opt, step, gas=2, clip=0.5):
    for micro in range(gas):
        (loss_of(model, step, micro) / gas).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.fixture
def pair(tmp_path):
    """An aio.zero engine (parameters on the drive) and the same model in
    memory, both after 2 steps."""
    ref = gpt()
    opt = CPUAdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    for step in range(2):
        _ref_step(ref, opt, step)
    engine = aio.zero.initialize(gpt(), cfg_for(tmp_path / "drive"))
    train_engine(engine, 2)
    yield engine, ref, opt
    engine.close()


def _named(model):
    return dict(model.named_parameters())


def test_reads_between_steps_give_the_trained_values(pair):
    engine, ref, _ = pair
    got, want = _named(engine.module), _named(ref)
    assert all(isinstance(p, StoredParameter) for p in got.values())
    for name, p in got.items():
        assert p.shape == (0,), name  # still a placeholder: nothing was kept fetched
        r = want[name].detach()
        assert torch.equal(p.clone(), r), name
        assert torch.equal(p.norm(), r.norm()), name
        assert torch.equal(p.float().sum(), r.float().sum()), name
        assert torch.equal(p.to(torch.float64), r.to(torch.float64)), name
        assert torch.equal(p.cpu(), r), name
        assert torch.equal(p * 2, r * 2), name
        assert p.shape == (0,), name
    total = torch.stack([p.norm() for p in engine.module.parameters()]).norm()
    assert torch.equal(total, torch.stack([p.norm() for p in ref.parameters()]).norm())
    assert "tensor(" in repr(next(iter(got.values())))


def test_ema_update_and_training_go_on_bit_identical(pair):
    engine, ref, opt = pair
    params = list(engine.module.parameters())
    ema = [torch.zeros(p.aio_shape) for p in params]
    ref_ema = [torch.zeros_like(p) for p in ref.parameters()]
    with torch.no_grad():
        torch._foreach_lerp_(ema, params, 0.1)
        torch._foreach_lerp_(ref_ema, [p.detach() for p in ref.parameters()], 0.1)
        for e, p in zip(ema, params, strict=True):
            e.lerp_(p, 0.5)
        for e, p in zip(ref_ema, ref.parameters(), strict=True):
            e.lerp_(p.detach(), 0.5)
    assert all(torch.equal(a, b) for a, b in zip(ema, ref_ema, strict=True))
    assert all(p.shape == (0,) for p in params)
    train_engine(engine, 2, start=2)
    for step in range(2, 4):
        _ref_step(ref, opt, step)
    for name, p in _named(engine.module).items():
        assert torch.equal(p.clone(), _named(ref)[name].detach()), name


@pytest.mark.parametrize(
    "use",
    [
        lambda p: p.data,
        lambda p: p.detach(),
        lambda p: p[0],
        lambda p: p.view(-1),
        lambda p: p.t(),
        lambda p: torch.save(p, io.BytesIO()),
        lambda p: copy.deepcopy(p),
    ],
    ids=["data", "detach", "getitem", "view", "t", "torch.save", "deepcopy"],
)
def test_views_are_refused_naming_gathered(pair, use):
    engine, _, _ = pair
    p = engine.module.head.weight if hasattr(engine.module, "head") else next(engine.module.parameters())
    with pytest.raises(ValueError, match=r"between uses.*engine\.gathered|between uses.*state_dict"):
        use(p)
    assert p.shape == (0,)
    assert not engine.store.refs  # nothing left fetched


def test_writes_after_training_began_are_refused(pair):
    engine, ref, _ = pair
    p = next(engine.module.parameters())
    before = p.clone()
    for write in (lambda: p.mul_(2), lambda: p.copy_(torch.zeros(p.aio_shape)), lambda: p.__iadd__(1)):
        with pytest.raises(ValueError, match=r"modify=True"):
            with torch.no_grad():
                write()
    assert torch.equal(p.clone(), before)
    with engine.gathered([p], modify=True), torch.no_grad():
        p.mul_(2)  # the documented way
    assert torch.equal(p.clone(), before * 2)


def test_writes_before_training_are_stored(tmp_path):
    cfg = cfg_for(tmp_path / "drive")
    with aio.zero.Init(cfg):
        model = gpt()
    p = next(model.parameters())
    want = p.clone() * 3
    with torch.no_grad():
        p.mul_(3)
    assert p.shape == (0,)
    assert torch.equal(p.clone(), want)
    model.to(torch.device("cpu"))  # Module._apply: conversions stay placeholders, nothing read
    model.float()
    assert p.shape == (0,)
    with aio.zero.initialize(model, cfg) as engine:
        assert torch.equal(next(engine.module.parameters()).clone(), want)


def test_state_dict_and_load_still_work(tmp_path):
    cfg = cfg_for(tmp_path / "drive")
    with aio.zero.Init(cfg):
        model = gpt()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(v.numel() > 0 for v in sd.values())
    model.load_state_dict({k: v * 0 for k, v in sd.items()})
    assert all(torch.equal(p.clone(), torch.zeros(p.aio_shape)) for p in model.parameters())
    assert all(isinstance(v, StoredParameter) for v in model.state_dict(keep_vars=True).values())
    with pytest.raises(ValueError, match="detach"):
        next(model.parameters()).detach()  # the state-dict pass is over


def test_reads_after_close_raise(tmp_path):
    engine = aio.zero.initialize(gpt(), cfg_for(tmp_path / "drive"))
    train_engine(engine, 1)
    p = next(engine.module.parameters())
    engine.close()
    with pytest.raises(ValueError, match="before close"):
        p.norm()
    assert "closed" in repr(p)


def test_reading_more_parameters_at_once_than_buffers_is_refused(pair):
    engine, _, _ = pair
    params = list(engine.module.parameters())
    assert len(params) > engine.store.swapper_buffer_count()
    with pytest.raises(ValueError, match="a few at a time"):
        torch.cat(params)
    assert not engine.store.refs


def test_a_conversion_that_changes_nothing_gives_the_values(pair):
    engine, ref, _ = pair
    for name, p in _named(engine.module).items():
        for w in (p.float(), p.cpu(), p.to(p.dtype), p.contiguous()):
            assert w is not p and w.shape == p.aio_shape, name
            assert torch.equal(w, _named(ref)[name].detach()), name


def test_views_under_other_names_are_refused(pair):
    engine, _, _ = pair
    p = next(engine.module.parameters())
    views = (lambda: p.reshape(-1), lambda: p.flatten(), lambda: p.narrow(0, 0, 1), lambda: p.unsqueeze(0))
    for use in views:
        with pytest.raises(ValueError, match="viewed"):
            use()
    assert not engine.store.refs


def test_assigning_data_is_stored_before_training_and_refused_after(tmp_path):
    cfg = cfg_for(tmp_path / "drive")
    with aio.zero.Init(cfg):
        model = gpt()
    p = next(model.parameters())
    p.data = torch.full(p.aio_shape, 7.0)
    assert p.shape == (0,) and torch.equal(p.clone(), torch.full(p.aio_shape, 7.0))
    with aio.zero.initialize(model, cfg) as engine:
        train_engine(engine, 1)
        with pytest.raises(ValueError, match=r"assigned.*modify=True"):
            p.data = torch.zeros(p.aio_shape)
        assert not torch.equal(p.clone(), torch.zeros(p.aio_shape))


def test_detach_outside_state_dict_is_refused_even_after_a_failed_state_dict(tmp_path):
    with aio.zero.Init(cfg_for(tmp_path / "drive")):
        model = gpt()

    def boom(*_):
        raise RuntimeError("a user's state-dict hook fails")

    handle = list(model.children())[-1].register_state_dict_post_hook(boom)
    with pytest.raises(RuntimeError, match="hook fails"):
        model.state_dict()
    handle.remove()
    with pytest.raises(ValueError, match="detach"):
        next(model.parameters()).detach()
    assert all(v.numel() > 0 for v in model.state_dict().values())


def test_model_to_under_other_torch_function_modes_reads_nothing(tmp_path):
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with aio.zero.Init(cfg_for(tmp_path / "drive")):
        model = gpt()
    swapper = next(model.parameters())._aio_store.swapper
    reads = swapper.counters["swap_in"]
    with torch.device("cpu"), Passthrough():
        model.to(torch.float32)
        model.float()
    assert all(p.shape == (0,) for p in model.parameters())
    assert swapper.counters["swap_in"] == reads
    next(model.parameters()).norm()  # the counter counts reads
    assert swapper.counters["swap_in"] == reads + 1


def test_a_read_from_another_thread_is_refused(pair):
    import threading

    engine, _, _ = pair
    p = next(engine.module.parameters())
    errors = []

    def read():
        errors.append(repr(p))  # a debugger's repr: no fetch, no error
        try:
            p.norm()
        except ValueError as e:
            errors.append(str(e))

    t = threading.Thread(target=read)
    t.start()
    t.join()
    assert "not read from this thread" in errors[0]
    assert len(errors) == 2 and "another thread" in errors[1]
    assert not engine.store.refs


def test_parameters_a_cpu_model_keeps_in_memory_stay_plain(tmp_path):
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "drive", param="cpu")) as engine:
        assert all(type(p) is torch.nn.Parameter for p in engine.module.parameters())
