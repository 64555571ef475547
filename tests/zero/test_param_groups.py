"""Torch parameter groups and LR schedulers under aio.zero (the everyday
Hugging Face recipe): per-group hyper-parameters, schedules read at every
step, checkpoints that keep both -- bit-identical to the same training in
memory with torch's AdamW (``aio_zero.adam_sqrt: torch``)."""

import copy

import pytest
import torch

import aio.zero

from .common import cfg_for, gpt, loss_of, train_engine

STEPS = 4


def hf_groups(model, lr=3e-3):
    """What transformers' Trainer.create_optimizer builds: weight decay on the
    matrices, none on biases and norms; here a second learning rate too."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "wpe" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "wpe" not in n)]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": rest, "weight_decay": 0.0, "lr": lr * 3, "betas": (0.8, 0.99)},
    ]


def warmup_then_decay(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2) * (0.9**s))


def cfg(tmp_path, device):
    c = cfg_for(tmp_path, param=device, opt=device)
    c["aio_zero"] = {"adam_sqrt": "torch"}
    del c["optimizer"]
    return c


def reference(schedule=True, steps=STEPS, groups=hf_groups):
    model = gpt()
    opt = torch.optim.AdamW(groups(model), lr=3e-3)
    sched = warmup_then_decay(opt) if schedule else None
    out = []
    for step in range(steps):
        for micro in range(2):
            loss = loss_of(model, step, micro)
            (loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_two_groups_without_schedule_equal_memory(tmp_path, device):
    model = gpt()
    opt = torch.optim.AdamW(hf_groups(model), lr=3e-3)
    with aio.zero.initialize(model, cfg(tmp_path, device), optimizer=opt) as engine:
        assert [pg["params"] for pg in engine.optimizer.param_groups] == [
            pg["params"] for pg in opt.param_groups
        ]
        got = train_engine(engine, STEPS)
        layout = engine.layout
        # No sub-group mixes the two groups.
        group_of = {id(p): k for k, pg in enumerate(opt.param_groups) for p in pg["params"]}
        for sub in layout.groups:
            assert len({group_of[id(s.param)] for s in sub}) == 1
    assert got == reference(schedule=False)


# Every way in with CPU offload, the usual one with NVMe too (CI time).
WAYS = [
    ("cpu", "user-optimizer"),
    ("cpu", "callable"),
    ("cpu", "engine-optimizer"),
    ("nvme", "user-optimizer"),
]


@pytest.mark.parametrize("device,how", WAYS, ids=[f"{d}-{h}" for d, h in WAYS])
def test_a_schedule_is_honoured_at_every_step(tmp_path, device, how):
    """A scheduler on the optimizer given to initialize (passed as
    lr_scheduler=), a callable building one from engine.optimizer, or one the
    user builds on engine.optimizer and steps itself: all give the losses of
    the same schedule in memory."""
    model = gpt()
    opt = torch.optim.AdamW(hf_groups(model), lr=3e-3)
    kw = {}
    if how == "user-optimizer":
        kw["lr_scheduler"] = warmup_then_decay(opt)
    elif how == "callable":
        kw["lr_scheduler"] = warmup_then_decay
    with aio.zero.initialize(model, cfg(tmp_path, device), optimizer=opt, **kw) as engine:
        own = warmup_then_decay(engine.optimizer) if how == "engine-optimizer" else None
        got = []
        for step in range(STEPS):
            got += train_engine(engine, 1, start=step)
            if own is not None:
                own.step()
        lrs = [pg["lr"] for pg in engine.optimizer.param_groups]
        assert engine.get_lr() == lrs[0]
    assert got == reference()
    mem = gpt()
    mem_opt = torch.optim.AdamW(hf_groups(mem), lr=3e-3)
    sched = warmup_then_decay(mem_opt)
    for _ in range(STEPS):
        mem_opt.step()
        sched.step()
    assert lrs == [pg["lr"] for pg in mem_opt.param_groups]


@pytest.mark.parametrize("device", ["nvme"])
def test_checkpoint_keeps_groups_and_schedule(tmp_path, device):
    model = gpt()
    opt = torch.optim.AdamW(hf_groups(model), lr=3e-3)
    with aio.zero.initialize(
        model, cfg(tmp_path / "a", device), optimizer=opt, lr_scheduler=warmup_then_decay
    ) as engine:
        first = train_engine(engine, 2)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    torch.manual_seed(7)
    fresh = gpt()
    fresh_opt = torch.optim.AdamW(hf_groups(fresh, lr=1.0), lr=1.0)  # values come from the checkpoint
    with aio.zero.initialize(
        fresh, cfg(tmp_path / "b", device), optimizer=fresh_opt, lr_scheduler=warmup_then_decay
    ) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert engine.lr_scheduler.last_epoch == 2
        second = train_engine(engine, 2, start=2)
    assert first + second == reference()


def test_edge_cases_of_groups(tmp_path):
    """An empty group is fine; frozen parameters in a group are not stepped; a
    trainable parameter in no group is refused by name."""
    model = gpt()
    model.wpe.weight.requires_grad_(False)
    frozen = model.wpe.weight.detach().clone()
    groups = hf_groups(model) + [{"params": [], "lr": 1.0}]
    opt = torch.optim.AdamW(groups, lr=3e-3)
    with aio.zero.initialize(model, cfg(tmp_path, "nvme"), optimizer=opt) as engine:
        train_engine(engine, 1)
        assert torch.equal(engine.state_dict()["wpe.weight"], frozen)
    model = gpt()
    only_decay = torch.optim.AdamW(hf_groups(model)[:1], lr=3e-3)
    with pytest.raises(ValueError, match="no param group"):
        aio.zero.initialize(model, cfg(tmp_path / "x", "nvme"), optimizer=only_decay)


def test_an_option_only_one_group_has_picks_the_class_for_all(tmp_path):
    """amsgrad in the second group alone: the fused kernel cannot step it, so
    every group steps with torch's AdamW (it used to be chosen from group 0
    and refuse at the first step); equal to the same groups in memory."""

    def groups(model):
        g = hf_groups(model)
        g[1]["amsgrad"] = True
        return g

    model = gpt()
    with aio.zero.initialize(
        model, cfg(tmp_path, "cpu"), optimizer=torch.optim.AdamW(groups(model), lr=3e-3)
    ) as engine:
        assert engine.zero_optimizer.optimizer_cls is torch.optim.AdamW
        got = train_engine(engine, 2)
    assert got == reference(schedule=False, steps=2, groups=groups)


def test_engine_optimizer_is_a_torch_optimizer(tmp_path):
    model = gpt()
    with aio.zero.initialize(model, cfg_for(tmp_path)) as engine:
        assert isinstance(engine.optimizer, torch.optim.Optimizer)
        assert engine.optimizer.stats()["subgroups"] >= 1  # the backend's, through the face
        with pytest.raises(RuntimeError, match="engine.step"):
            engine.optimizer.step()
    from aio import _C

    parked = _C.omp_parked_threads()
    other = torch.optim.SGD(copy.deepcopy(gpt()).parameters(), lr=1.0)
    with pytest.raises(ValueError, match="another optimizer"):
        aio.zero.initialize(gpt(), cfg_for(tmp_path / "y"), lr_scheduler=warmup_then_decay(other))
    assert _C.omp_parked_threads() == parked  # the refused trainer was closed (no throttle left)
    assert not list((tmp_path / "y").rglob("*.swp"))  # and its swap files removed
