"""aio.optim.NVMeAdamW in one process: bit-identical (torch.equal) to
torch.optim.AdamW(foreach=False) with param groups and a LambdaLR, torch <->
aio state_dict interchange both ways, the lazy layout, the per-rank budget
and nvme_path templates, the master weights in the parameters or on the drive
(``master=``: bytes on the drive and moved per step, both interchangeable),
and its errors (typed, naming the parameter, nothing changed). Multi-rank
engines: test_distributed.py."""

from __future__ import annotations

import os

import pytest
import torch

from aio.optim import CPUAdamW, NVMeAdam, NVMeAdamW, is_bit_exact

bits = pytest.mark.skipif(not is_bit_exact(), reason="aio's kernel does not reproduce torch's sqrt here")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 63), torch.nn.ReLU(), torch.nn.Linear(63, 5))


def _groups(m: torch.nn.Module) -> list[dict]:
    named = list(m.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 5e-3},
    ]


def _steps(pairs: list, start: int, n: int) -> None:
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 12, generator=g), torch.randn(4, 5, generator=g)
        for model, opt, sched in pairs:
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            if sched is not None:
                sched.step()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _zero_state(opt) -> dict:
    """A state_dict for `opt` as after one step that moved nothing."""
    params = [p for g in opt.param_groups for p in g["params"]]
    zero = {k: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            for k, p in enumerate(params)}  # fmt: skip
    return {"state": zero, "param_groups": opt.state_dict()["param_groups"]}


def _same_state(sa: dict, sb: dict) -> bool:
    names = ("step", "exp_avg", "exp_avg_sq")
    return set(sa["state"]) == set(sb["state"]) and all(
        torch.equal(sa["state"][k][n], sb["state"][k][n]) for k in sa["state"] for n in names
    )


@bits
@pytest.mark.parametrize("master", ["params", "drive"])
def test_plain_loop_groups_lambda_lr_and_interchange(tmp_path, master) -> None:
    other = {"params": "drive", "drive": "params"}[master]
    a, b = _model(), _model()
    oa = torch.optim.AdamW(_groups(a), lr=1e-2, foreach=False)
    ob = NVMeAdamW(
        _groups(b), lr=1e-2, nvme_path=str(tmp_path), match_torch=True, sub_group_size=500, master=master
    )
    warm = lambda s: min(1.0, (s + 1) / 3)  # noqa: E731
    pairs = [
        (a, oa, torch.optim.lr_scheduler.LambdaLR(oa, warm)),
        (b, ob, torch.optim.lr_scheduler.LambdaLR(ob, warm)),
    ]
    _steps(pairs, 0, 5)
    assert _same(a, b)
    assert ob.swap_stats()["subgroups"] > 2  # a tensor spans sub-groups
    assert ob.master_mode == ob.swap_stats()["master"] == master
    sa, sb = oa.state_dict(), ob.state_dict()
    assert _same_state(sa, sb)
    # torch's checkpoint into aio (the other master), aio's into torch and into
    # aio with the other master: all continue as torch does.
    c, d, e = _model(), _model(), _model()
    for m in (c, d, e):
        m.load_state_dict(a.state_dict())
    oc = NVMeAdamW(_groups(c), lr=1e-2, nvme_path=str(tmp_path), match_torch=True, master=other)
    oc.load_state_dict(sa)
    od = torch.optim.AdamW(_groups(d), lr=1e-2, foreach=False)
    od.load_state_dict(sb)
    oe = NVMeAdamW(_groups(e), lr=1e-2, nvme_path=str(tmp_path), match_torch=True, master=other)
    oe.load_state_dict(sb)
    _steps([(a, oa, None), (c, oc, None), (d, od, None), (e, oe, None)], 5, 3)
    assert _same(a, c) and _same(a, d) and _same(a, e)
    for o in (ob, oc, oe):
        o.close()


@bits
def test_hidden_step_before_the_first_is_torchs(tmp_path) -> None:
    """Before any step both have empty state: DCP's helpers' lr=0 step
    gives the same (zero moments, step 1) and changes no parameter."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    a, b = _model(), _model()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    ob = NVMeAdamW(b.parameters(), lr=1e-2, nvme_path=str(tmp_path), match_torch=True)
    sa, sb = get_optimizer_state_dict(a, oa), get_optimizer_state_dict(b, ob)
    assert _same(a, b) and set(sa["state"]) == set(sb["state"])
    for k in sa["state"]:
        for n in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["state"][k][n], sb["state"][k][n])
    # Now state exists: no further hidden step.
    get_optimizer_state_dict(b, ob)
    assert {float(s["step"]) for s in ob.state.values()} == {1.0}
    ob.close()


def test_lazy_layout_follows_swapped_params(tmp_path) -> None:
    stale = _model()
    opt = NVMeAdamW(stale.parameters(), nvme_path=str(tmp_path))
    fresh = _model()
    opt.param_groups[0]["params"] = list(fresh.parameters())
    _steps([(fresh, opt, None)], 0, 1)
    assert _same(stale, _model()) and not _same(fresh, _model())
    with pytest.raises(ValueError, match="add_param_group after the first step"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    opt.close()


@bits
def test_a_load_of_an_empty_state_lays_nothing_out(tmp_path) -> None:
    """Accelerate's AcceleratedOptimizer loads the optimizer's own state
    (empty: never stepped) before its FSDP2 prepare swaps the parameters in
    param_groups: the load takes the hyper-parameters only, and the first
    step lays the sub-groups out on the swapped-in parameters. (It laid
    them out on the stale ones and trained those, in silence: issue 44.)"""
    stale, fresh, ref = _model(), _model(), _model()
    opt = NVMeAdamW(stale.parameters(), lr=1e-3, nvme_path=str(tmp_path), match_torch=True)
    bad = opt.state_dict()
    bad["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(bad)
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = 1e-2
    opt.load_state_dict(sd)
    assert opt.master_mode is None and opt.swap_stats() == {} and not opt.state
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["amsgrad"] is False
    opt.param_groups[0]["params"] = list(fresh.parameters())  # fsdp2_switch_optimizer_parameters
    oref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    _steps([(ref, oref, None), (fresh, opt, None)], 0, 3)
    assert _same(ref, fresh) and _same(stale, _model())
    assert _same_state(oref.state_dict(), opt.state_dict())
    opt.close()


def _swap(opt, model: torch.nn.Module) -> None:
    """Each param group's parameters swapped for `model`'s, in place."""
    for g, new in zip(opt.param_groups, _groups(model), strict=True):
        g["params"] = new["params"]


@bits
@pytest.mark.parametrize("master", ["params", "drive"])
def test_parameters_swapped_after_the_layout_take_its_state_by_position(tmp_path, master) -> None:
    """A state stepped, or loaded (a checkpoint loaded before Accelerate's
    swap, then its own state_dict() reloaded), follows the parameters by
    position when param_groups' are swapped for others: the sub-groups are
    laid out again for them, the state read from the drive and written for
    them, the old swap folder removed. Training goes on as torch's would."""
    a, b = _model(), _model()
    oa = torch.optim.AdamW(_groups(a), lr=1e-2, foreach=False)
    kw = {
        "lr": 1e-2,
        "nvme_path": str(tmp_path),
        "match_torch": True,
        "sub_group_size": 500,
        "master": master,
    }
    ob = NVMeAdamW(_groups(b), **kw)
    _steps([(a, oa, None), (b, ob, None)], 0, 2)
    c, d, e = _model(), _model(), _model()
    for m in (c, d, e):
        m.load_state_dict(a.state_dict())  # the replacements: other tensors, the same values
    od = NVMeAdamW(_groups(d), **kw)
    od.load_state_dict(oa.state_dict())
    od.load_state_dict(od.state_dict())  # what AcceleratedOptimizer does
    folders = [o.swap_stats()["swap_dir"] for o in (ob, od)]
    kept = [p.detach().clone() for p in b.parameters()]
    _swap(ob, c)
    _swap(od, e)
    _steps([(a, oa, None), (c, ob, None), (e, od, None)], 2, 2)
    assert _same(a, c) and _same(a, e) and all(map(torch.equal, kept, b.parameters()))
    for o, folder in zip((ob, od), folders, strict=True):
        assert _same_state(oa.state_dict(), o.state_dict()) and o.master_mode == master
        assert not os.path.exists(folder) and o.swap_stats()["swap_dir"] != folder
        o.close()


def test_a_swap_the_state_cannot_follow_is_refused_and_changes_nothing(tmp_path) -> None:
    m = _model()
    opt = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), master="drive")
    _steps([(m, opt, None)], 0, 1)
    good, folder = opt.state_dict(), opt.swap_stats()["swap_dir"]
    other = torch.nn.Sequential(torch.nn.Linear(12, 63), torch.nn.ReLU(), torch.nn.Linear(63, 4))
    opt.param_groups[0]["params"] = list(other.parameters())
    with pytest.raises(ValueError, match=r"parameter 2 .*local shape \(5, 63\) at the layout, \(4, 63\) now"):
        opt.step()
    opt.param_groups[0]["params"] = list(other.parameters())[:3]
    with pytest.raises(ValueError, match=r"hold \[3\] parameters, \[4\] when"):
        opt.state_dict()
    # A load replaces the state: laid out afresh for the parameters now held,
    # and only once it is whole (a bad one keeps the old layout and state).
    twin = _model()
    opt.param_groups[0]["params"] = list(twin.parameters())
    bad = {**good, "state": {**good["state"], 2: {**good["state"][2], "exp_avg": torch.zeros(7)}}}
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 2"):
        opt.load_state_dict(bad)
    assert opt.swap_stats()["swap_dir"] == folder and opt._params[0] is m[0].weight
    opt.param_groups[0]["params"] = list(m.parameters())  # given back: nothing changed
    assert _same_state(opt.state_dict(), good) and opt.swap_stats()["swap_dir"] == folder
    opt.param_groups[0]["params"] = list(twin.parameters())
    opt.load_state_dict(good)
    assert opt._params[0] is twin[0].weight and _same_state(opt.state_dict(), good)
    # aio.fsdp's tier and gradient stream hold the layout: no new one under them.
    opt.skip_freed_parameters = True
    opt.param_groups[0]["params"] = list(m.parameters())
    with pytest.raises(ValueError, match="aio.fsdp"):
        opt.step()
    opt.close()


@bits
def test_flattened_dcp_optimizer_state_round_trips_as_torchs(tmp_path) -> None:
    """torchtitan's flatten_optimizer_state_dict=True: set_optimizer_state_dict
    rebuilds each parameter's state from the keys of optim.state[p], which
    are torch's (the moments' values stand-ins that cost no memory), so the
    flattened state saves as torch's, loads (torch's into aio, aio's into a
    fresh aio) and training continues bit-identically (issue 44)."""
    import copy
    import pickle

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from aio.optim.nvme import ON_DRIVE

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    a, b = _model(), _model()
    oa = torch.optim.AdamW(_groups(a), lr=1e-2, foreach=False)
    kw = {"lr": 1e-2, "nvme_path": str(tmp_path), "match_torch": True}
    ob = NVMeAdamW(_groups(b), **kw)
    _steps([(a, oa, None), (b, ob, None)], 0, 2)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert list(ob.state[q]) == list(oa.state[p])
        assert ob.state[q]["exp_avg"] is ON_DRIVE and ob.state[q]["exp_avg_sq"] is ON_DRIVE
    assert copy.deepcopy(ON_DRIVE) is ON_DRIVE and pickle.loads(pickle.dumps(ON_DRIVE)) is ON_DRIVE
    sa, sb = get_optimizer_state_dict(a, oa, options=flat), get_optimizer_state_dict(b, ob, options=flat)
    assert sorted(sa) == sorted(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))
    assert {float(s["step"]) for s in ob.state.values()} == {2.0}  # no hidden step
    c, e = _model(), _model()
    for m in (c, e):
        m.load_state_dict(a.state_dict())
    oc, oe = NVMeAdamW(_groups(c), **kw), NVMeAdamW(_groups(e), **kw)
    set_optimizer_state_dict(c, oc, sa, options=flat)  # fresh: DCP's hidden step lays it out first
    set_optimizer_state_dict(e, oe, sb, options=flat)
    _steps([(a, oa, None), (c, oc, None), (e, oe, None)], 2, 2)
    assert _same(a, c) and _same(a, e)
    assert _same_state(oa.state_dict(), oc.state_dict()) and _same_state(oa.state_dict(), oe.state_dict())
    for o in (ob, oc, oe):
        o.close()


def test_errors_name_the_setting_or_parameter(tmp_path) -> None:
    m = _model()
    with pytest.raises(ValueError, match="nvme_path: required"):
        NVMeAdamW(m.parameters())
    with pytest.raises(ValueError, match="amsgrad"):
        NVMeAdamW(m.parameters(), amsgrad=True, nvme_path=str(tmp_path))
    with pytest.raises(TypeError, match="unexpected keyword"):
        NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), buffer_size=3)
    with pytest.raises(TypeError, match="always decouples"):
        NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), decoupled_weight_decay=False)
    with pytest.raises(TypeError, match="float32"):
        NVMeAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="gradients"):
        NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), gradients="gpu")
    # Too few buffers to step a sub-group: refused when made, by the name it was given by.
    with pytest.raises(ValueError, match=r"^buffer_count is 3: .* at least 4"):
        NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), buffer_count=3)
    block = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2}
    with pytest.raises(ValueError, match=r"^offload_optimizer.buffer_count is 2: "):
        NVMeAdamW(m.parameters(), offload_optimizer=block)
    with pytest.raises(FileNotFoundError):
        opt = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path / "missing"))
        _steps([(m, opt, None)], 0, 1)


def test_missing_gradient_and_bad_state_change_nothing(tmp_path) -> None:
    m = _model()
    opt = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path))
    _steps([(m, opt, None)], 0, 1)
    good = opt.state_dict()
    before = [p.detach().clone() for p in m.parameters()]
    m[0].bias.grad = None
    with pytest.raises(ValueError, match=r"parameter 1 .* has no gradient"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(before, m.parameters(), strict=True))
    bad = opt.state_dict()
    bad["state"][2]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 2"):
        opt.load_state_dict(bad)
    assert _same_state(opt.state_dict(), good)
    opt.close()


def _write_as_zero(opt, sd: dict) -> None:
    """What ZeroRedundancyOptimizer.load_state_dict does to its local
    optimizer: each parameter's state assigned to ``opt.state[p]`` (copies,
    as its _recursive_copy_to_device makes on another device) and the
    hyper-parameters to param_groups; opt.load_state_dict is never called."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for k, st in sd["state"].items():
        opt.state[params[k]] = {n: v.clone() for n, v in st.items()}
    for g, saved in zip(opt.param_groups, sd["param_groups"], strict=True):
        g.update({n: v for n, v in saved.items() if n != "params"})


@bits
@pytest.mark.parametrize("master", ["params", "drive"])
def test_a_state_written_into_state_as_zero_loads_it_reaches_the_drive(tmp_path, master) -> None:
    """ZeroRedundancyOptimizer's load_state_dict writes each parameter's
    loaded state straight into the local optimizer's state[p]: the next
    step or state_dict() loads it (into an optimizer never stepped and into
    one that has: a rollback), and training goes on as torch's AdamW, which
    uses such a state as it is. It trained on the old or fresh moments in
    silence (issue 44)."""
    a = _model()
    oa = torch.optim.AdamW(_groups(a), lr=1e-2, foreach=False)
    _steps([(a, oa, None)], 0, 2)
    saved = oa.state_dict()
    weights = {k: v.clone() for k, v in a.state_dict().items()}
    kw = {
        "lr": 1e-3,
        "nvme_path": str(tmp_path),
        "match_torch": True,
        "sub_group_size": 500,
        "master": master,
    }
    fresh, stepped = _model(), _model()
    of, ost = NVMeAdamW(_groups(fresh), **kw), NVMeAdamW(_groups(stepped), **kw)
    _steps([(stepped, ost, None)], 0, 3)
    for m, o in ((fresh, of), (stepped, ost)):
        m.load_state_dict(weights)
        _write_as_zero(o, saved)
    assert _same_state(of.state_dict(), saved) and _same_state(ost.state_dict(), saved)
    _steps([(a, oa, None), (fresh, of, None), (stepped, ost, None)], 2, 2)
    assert _same(a, fresh) and _same(a, stepped)
    for o in (of, ost):
        assert _same_state(oa.state_dict(), o.state_dict()) and o.master_mode == master
        o.close()


def _other_state(p: torch.Tensor, step: float, seed: int) -> dict:
    """Another run's state for `p`."""
    g = torch.Generator().manual_seed(seed)
    return {
        "step": torch.tensor(step),
        "exp_avg": 0.01 * torch.randn(p.shape, generator=g),
        "exp_avg_sq": 1e-4 * torch.rand(p.shape, generator=g),
    }


@bits
def test_a_state_written_for_some_parameters_keeps_the_others(tmp_path) -> None:
    """A state written into state[p] for one parameter (sharing sub-groups
    with others): it is loaded, the others keep theirs, as torch's AdamW
    given the same write; also for parameters swapped in param_groups
    since the layout (laid out again, the written state replacing what
    their position carries)."""
    a, b = _model(), _model()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    ob = NVMeAdamW(b.parameters(), lr=1e-2, nvme_path=str(tmp_path), match_torch=True, sub_group_size=300)
    _steps([(a, oa, None), (b, ob, None)], 0, 2)
    for o, m in ((oa, a), (ob, b)):
        o.state[m[2].weight] = _other_state(m[2].weight, 2.0, 5)
    _steps([(a, oa, None), (b, ob, None)], 2, 1)
    assert _same(a, b) and _same_state(oa.state_dict(), ob.state_dict())
    c = _model()
    c.load_state_dict(b.state_dict())
    ob.param_groups[0]["params"] = list(c.parameters())
    for o, m in ((oa, a), (ob, c)):
        o.state[m[0].bias] = _other_state(m[0].bias, 3.0, 6)
    _steps([(a, oa, None), (c, ob, None)], 3, 2)
    assert _same(a, c) and _same_state(oa.state_dict(), ob.state_dict())
    ob.close()


def test_a_written_state_that_cannot_be_loaded_is_refused_until_replaced(tmp_path) -> None:
    m = _model()
    opt = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), sub_group_size=300)
    _steps([(m, opt, None)], 0, 1)
    good = opt.state_dict()
    before = [p.detach().clone() for p in m.parameters()]
    opt.state[m[2].weight] = {
        "step": torch.tensor(1.0),
        "exp_avg": torch.zeros(7),
        "exp_avg_sq": torch.zeros(7),
    }
    for _ in range(2):  # refused at every step, nothing changed
        with pytest.raises(ValueError, match=r"written into its \.state .*state 'exp_avg' of parameter 2"):
            _steps([(m, opt, None)], 1, 1)
    assert all(torch.equal(p, q) for p, q in zip(before, m.parameters(), strict=True))
    # Another step count than the parameters sharing its sub-groups.
    opt.state[m[2].weight] = _other_state(m[2].weight, 5.0, 7)
    # Named by the parameter that differs, each count with its first parameter.
    with pytest.raises(ValueError, match=r"step counts \(.*parameter 2 \(in param_groups order\): 5"):
        opt.state_dict()
    opt.load_state_dict(good)  # a load replaces what was written
    assert _same_state(opt.state_dict(), good)
    _steps([(m, opt, None)], 1, 1)
    opt.close()


@bits
def test_an_interrupted_load_of_a_written_state_refuses_until_written_again(tmp_path, monkeypatch) -> None:
    """A load of a written state that fails part-way (a write error) leaves
    the optimizer refusing to step, as an interrupted load_state_dict does,
    until the state is written (ZeRO's load_state_dict run) again."""
    a, b = _model(), _model()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    ob = NVMeAdamW(b.parameters(), lr=1e-2, nvme_path=str(tmp_path), match_torch=True, sub_group_size=300)
    _steps([(a, oa, None), (b, ob, None)], 0, 2)
    saved = oa.state_dict()
    _steps([(b, ob, None)], 2, 1)
    real, calls = type(ob._swapper).write_state, {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # after the first sub-group took the written state
            raise OSError("write failed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(ob._swapper), "write_state", failing)
    _write_as_zero(ob, saved)
    with pytest.raises(OSError, match="write failed"):
        _steps([(b, ob, None)], 2, 1)
    monkeypatch.undo()
    with pytest.raises(Exception, match="interrupted part-way"):
        _steps([(b, ob, None)], 2, 1)
    b.load_state_dict(a.state_dict())
    _write_as_zero(ob, saved)
    _steps([(a, oa, None), (b, ob, None)], 2, 2)
    assert _same(a, b) and _same_state(oa.state_dict(), ob.state_dict())
    ob.close()


def test_gradients_on_drive_bf16_states_and_adam(tmp_path) -> None:
    a, b = _model(), _model()
    oa = torch.optim.Adam(a.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    ob = NVMeAdam(b.parameters(), lr=1e-2, weight_decay=0.1, nvme_path=str(tmp_path), gradients="nvme",
                  match_torch=is_bit_exact())  # fmt: skip
    _steps([(a, oa, None), (b, ob, None)], 0, 3)
    if is_bit_exact():
        assert _same(a, b)
    oc = NVMeAdamW(_model().parameters(), nvme_path=str(tmp_path), optimizer_states="bf16")
    assert oc.options.state_dtype == "bf16"
    for o in (ob, oc):
        o.close()


def test_budget_per_rank_and_nvme_path_template(tmp_path, monkeypatch) -> None:
    for r in range(2):
        os.makedirs(tmp_path / f"nvme{r}")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    m = _model()
    opt = NVMeAdamW(
        m.parameters(), nvme_path=str(tmp_path / "nvme{local_rank}"), host_memory_budget=8 * 2**20
    )
    assert opt.options.nvme_path == [str(tmp_path / "nvme1")]
    assert opt.options.pinned_share == 2**20
    _steps([(m, opt, None)], 0, 1)
    assert opt.swap_stats()["swap_dir"].startswith(str(tmp_path / "nvme1"))
    opt.close()
    # A 16 KiB share: 4 buffers of a 1,157-element sub-group (8 KiB each) do not fit ...
    big = NVMeAdamW(
        m.parameters(), nvme_path=str(tmp_path), host_memory_budget=8 * 16384, sub_group_size=2048
    )
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=8"):
        _steps([(m, big, None)], 0, 1)
    # ... the size chosen by default (1,024 elements: 4 KiB buffers) does.
    auto = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), host_memory_budget=8 * 16384)
    _steps([(m, auto, None)], 0, 1)
    assert auto.swap_stats()["subgroups"] == 2
    auto.close()


def test_swapper_read_and_write_state(tmp_path) -> None:
    from aio.swap import OptimizerSwapper

    sw = OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-2}, state_dtype="bf16")
    sw.register_subgroup(0, 1000)
    master = torch.randn(1000)
    sw.initialize(0, master)
    assert sw.state_names() == ["param", "exp_avg", "exp_avg_sq"]
    assert torch.equal(sw.read_state(0, "param"), master)
    assert torch.equal(sw.read_state(0, "exp_avg"), torch.zeros(1000))  # before the first step
    with pytest.raises(ValueError, match="has not been stepped"):
        sw.write_state(0, {"exp_avg": torch.ones(1000)})
    m, v = torch.randn(1000), torch.rand(1000)
    sw.write_state(0, {"exp_avg": m, "exp_avg_sq": v}, {"step": torch.tensor(3.0)})
    assert torch.equal(sw.read_state(0, "exp_avg"), m.to(torch.bfloat16).float())  # stored as bf16
    with pytest.raises(ValueError, match="no tensor 'grad'"):
        sw.read_state(0, "grad")
    with pytest.raises(TypeError, match="float32 CPU tensor"):
        sw.write_state(0, {"param": torch.zeros(1000, dtype=torch.float64)})
    sw.close()


def test_bad_launcher_values_paths_and_duplicates_are_refused_at_construction(tmp_path, monkeypatch) -> None:
    m = _model()
    for bad in ("0", "-3", "abc", "2.0"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
            NVMeAdamW(m.parameters(), nvme_path=str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(FileNotFoundError, match="nvme_path"):
        NVMeAdamW(m.parameters(), nvme_path=str(tmp_path / "missing"))
    for bad in (5, str(tmp_path).encode(), {str(tmp_path)}):  # a set: no drive order
        with pytest.raises(TypeError, match="nvme_path must be a directory path or a list"):
            NVMeAdamW(m.parameters(), nvme_path=bad)
    w = m[0].weight
    with pytest.raises(ValueError, match="twice"):
        NVMeAdamW([w, w], nvme_path=str(tmp_path))


def test_an_interrupted_load_refuses_to_step_until_loaded_again(tmp_path, monkeypatch) -> None:
    a, b = _model(), _model()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    ob = NVMeAdamW(b.parameters(), lr=1e-2, nvme_path=str(tmp_path), match_torch=True, sub_group_size=300)
    _steps([(a, oa, None), (b, ob, None)], 0, 2)
    saved = ob.state_dict()
    _steps([(b, ob, None)], 2, 2)
    sw = ob._swapper
    calls = {"n": 0}
    real = type(sw).write_state

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # after the first sub-group took the loaded state
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(sw), "write_state", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ob.load_state_dict(saved)
    monkeypatch.undo()
    with pytest.raises(Exception, match="interrupted part-way"):
        _steps([(b, ob, None)], 2, 1)  # a mix of loaded and old sub-groups: refused
    ob.load_state_dict(saved)  # a whole load restores it
    ob.close()


@bits
def test_state_dict_counts_steps_from_the_drive_after_an_interrupted_count(tmp_path, monkeypatch) -> None:
    a, b = _model(), _model()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    ob = NVMeAdamW(b.parameters(), lr=1e-2, nvme_path=str(tmp_path), match_torch=True, sub_group_size=300)
    _steps([(a, oa, None), (b, ob, None)], 0, 1)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # a Ctrl-C right after the swapped step

    monkeypatch.setattr(NVMeAdamW, "_count_steps", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _steps([(b, ob, None)], 1, 1)
    monkeypatch.undo()
    _steps([(a, oa, None)], 1, 1)
    assert _same(a, b) and _same_state(oa.state_dict(), ob.state_dict())  # step 2 beside step-2 moments
    ob.close()


def _sgd_like_steps(params: list, opt, start: int, n: int) -> list[dict]:
    """`n` steps on fixed random gradients; each step's swap counters."""
    out = []
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        out.append(dict(opt.swap_stats()) if hasattr(opt, "swap_stats") else {})
    return out


@bits
def test_master_in_the_parameters_moves_16_bytes_a_step_and_keeps_8_on_the_drive(tmp_path) -> None:
    """master="params": 8 bytes per element on the drive (two moments) and
    16 of I/O per step (each read and written once), against 12 and 24 with
    the master on the drive -- for every element the step does not find in
    its buffers (the sub-group the last step kept). Bit-identical to torch
    either way, a change made to the parameters between steps included."""
    n, size = 8192, 1024  # 8 sub-groups of whole 4 KiB blocks: the counts are exact
    torch.manual_seed(0)
    init = [torch.randn(n // 2) for _ in range(2)]
    runs = {}
    for master in ("params", "drive", "torch"):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        if master == "torch":
            opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
        else:
            opt = NVMeAdamW(params, lr=1e-2, nvme_path=str(tmp_path), match_torch=True,
                            sub_group_size=size, master=master)  # fmt: skip
        stats = _sgd_like_steps(params, opt, 0, 2)
        with torch.no_grad():
            params[0].mul_(0.5)  # the parameters changed outside step() (torch steps from them)
        stats += _sgd_like_steps(params, opt, 2, 3)
        runs[master] = (params, stats, opt)
    ref = runs["torch"][0]
    assert all(torch.equal(p, q) for p, q in zip(ref, runs["params"][0], strict=True))
    assert not torch.equal(ref[0], runs["drive"][0][0])  # the drive's master overrode the change
    for master, per_element in (("params", 8), ("drive", 12)):
        _, stats, opt = runs[master]
        assert stats[-1]["drive_bytes"] == per_element * n and stats[-1]["master"] == master
        for before, after in zip(stats[1:], stats[2:], strict=False):  # steps 3 to 5: steady
            cached = after["cached_subgroups"] - before["cached_subgroups"]
            moved = per_element * (n - cached * size)
            assert after["bytes_read"] - before["bytes_read"] == moved, (master, before, after)
            assert after["bytes_written"] - before["bytes_written"] == moved, (master, before, after)
        if master == "params":  # the master weights: not one byte on the drive
            by_part = stats[-1]["bytes_by_part"]
            assert by_part["read"].get("param", 0) == 0 and "param" not in by_part["written"]
        opt.close()


def test_master_option_errors(tmp_path) -> None:
    m = _model()
    with pytest.raises(ValueError, match="master must be one of"):
        NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), master="cpu")
    for p, what in (
        (torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)), "float32"),
        (torch.nn.Parameter(torch.zeros(3, device="meta")), "is on meta"),  # a CUDA one alike
    ):
        with pytest.raises(TypeError, match=what):
            NVMeAdamW([p], nvme_path=str(tmp_path), master="params")
    # auto keeps the master weights on the drive for parameters that cannot be it
    from aio.optim.nvme_master import resolve_master

    on_gpu = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, device="meta"))]
    assert resolve_master("auto", on_gpu, False, str) == "drive"
    assert resolve_master("auto", on_gpu[:1], False, str) == "params"
    assert resolve_master("auto", on_gpu[:1], True, str) == "drive"  # a tier reads the master
    opt = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), master="params")
    _steps([(m, opt, None)], 0, 1)
    before = [p.detach().clone() for p in m.parameters()]
    m[0].weight.untyped_storage().resize_(0)  # as an offload tier frees a shard
    with pytest.raises(ValueError, match=r"parameter 0 .*storage is freed"):
        opt.step()  # the gradients of step 1 are still there
    m[0].weight.untyped_storage().resize_(before[0].numel() * 4)
    with torch.no_grad():
        m[0].weight.copy_(before[0])
    assert {float(s["step"]) for s in opt.state.values()} == {1.0}  # nothing was stepped
    _steps([(m, opt, None)], 1, 1)  # and nothing is broken
    m[2].bias.data = m[2].bias.data.to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"parameter 3 .*bfloat16"):
        opt.step()
    opt.close()


def test_master_and_the_parameter_tier_api(tmp_path) -> None:
    """aio.fsdp.offload_params reads parameters from the master on the drive:
    auto, told so before its layout, keeps them there; with the master in
    the parameters there is nothing to read (empty index, a warning)."""
    m = _model()
    auto = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path))
    auto.skip_freed_parameters = True  # what offload_params sets
    _steps([(m, auto, None)], 0, 1)
    assert auto.master_mode == "drive" and auto.parameter_index()
    auto.close()
    plain = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path))
    _steps([(m, plain, None)], 0, 1)
    assert plain.master_mode == "params" and plain.parameter_index() == {}
    slices, missing = plain.master_slices()
    assert slices == {} and missing == {0, 1, 2, 3}
    plain.flush_master()
    with pytest.warns(UserWarning, match="params_from_master"):
        plain.skip_freed_parameters = True
    plain.close()
    with pytest.warns(UserWarning, match="params_from_master"):
        NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), master="params").skip_freed_parameters = True
    # A load of a state lays the sub-groups out (so does DCP's set_state_dict,
    # and its get_state_dict before a first step): auto is decided there, not
    # at a step. A load of an empty state (never stepped) does not.
    from aio.fsdp.master import skip_released_write_back

    late = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path))
    late.load_state_dict(late.state_dict())
    assert late.master_mode is None
    late.load_state_dict(_zero_state(late))
    assert late.master_mode == "params"
    with pytest.warns(UserWarning, match=r"before its sub-groups are laid out.*load_state_dict") as rec:
        skip_released_write_back(late)  # what offload_params does, from inside aio
    assert [w.filename for w in rec] == [__file__]  # the user's line, not aio's
    late.close()


def test_swapper_without_a_master_slot(tmp_path) -> None:
    from aio.swap import OptimizerSwapper

    class Outside(OptimizerSwapper):
        def master_slot(self) -> bool:
            return False

    sw = Outside(str(tmp_path), torch.optim.Adam, {"lr": 1e-2})
    sw.register_subgroup(0, 1024)
    with pytest.raises(ValueError, match="initialize_from"):
        sw.initialize(0, torch.zeros(1024))
    master = torch.randn(1024)
    sw.initialize_from(0, lambda out: [out.copy_(master)][:0])
    # gradient and two moments, no master weights
    assert sw.stats()["drive_bytes"] == 12 * 1024 and sw.master_extent(0) is None
    assert torch.equal(sw.read_state(0, "param"), master)
    with pytest.raises(ValueError, match="not on the drive"):
        sw.write_state(0, {"param": master})
    with pytest.raises(ValueError, match="not on the drive"):
        sw.update_master(0, lambda t: None)
    with pytest.raises(ValueError, match="checkpoint"):
        sw.export_checkpoint(str(tmp_path / "ckpt"))
    sw.close()


def test_a_step_walks_the_layout_a_bounded_number_of_times(tmp_path, monkeypatch) -> None:
    """Many small tensors: each step looks each parameter's size up (computed
    at the layout) instead of rescanning every sub-group per piece, which
    made a step quadratic in the number of tensors (2,000 x 64 elements:
    3.3 s a step)."""
    import aio.optim.layout as layout
    import aio.optim.nvme as nvme

    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(200)]
    walked = {"pieces": 0}
    real = layout.pieces_of

    def counted(subgroups):
        for item in real(subgroups):
            walked["pieces"] += 1
            yield item

    monkeypatch.setattr(nvme, "pieces_of", counted)
    for master in ("params", "drive"):
        opt = NVMeAdamW(params, nvme_path=str(tmp_path), master=master, sub_group_size=64)
        _sgd_like_steps(params, opt, 0, 1)
        walked["pieces"] = 0
        _sgd_like_steps(params, opt, 1, 2)
        assert walked["pieces"] <= 2 * 2 * len(params), (master, walked)  # one walk a step
        opt.close()


@pytest.mark.parametrize("master", ["params", "drive"])
def test_a_resized_or_strided_parameter_is_refused_before_anything_changes(tmp_path, master) -> None:
    a, b = torch.nn.Parameter(torch.zeros(1024)), torch.nn.Parameter(torch.zeros(1024))
    opt = NVMeAdamW([a, b], nvme_path=str(tmp_path), master=master, sub_group_size=1024, lr=0.1)
    _sgd_like_steps([a, b], opt, 0, 2)  # the third step steps a first, then b
    kept = b.data
    for bad, grad, what in (
        (torch.zeros(2048), torch.ones(2048), r"parameter 1 .* has 2048 local elements, 1024 when"),
        (torch.zeros(32, 32).t(), torch.ones(32, 32), r"parameter 1 .* not contiguous"),
    ):
        b.data, b.grad, a.grad = bad, grad, torch.ones(1024)
        before = a.detach().clone()
        with pytest.raises(ValueError, match=what):
            opt.step()
        assert torch.equal(a, before) and {float(s["step"]) for s in opt.state.values()} == {2.0}
    b.data = kept
    _sgd_like_steps([a, b], opt, 2, 1)  # nothing was broken
    assert {float(s["step"]) for s in opt.state.values()} == {3.0}
    opt.close()


def test_a_mode_refused_at_the_layout_leaves_no_swap_folder(tmp_path) -> None:
    p = torch.nn.Parameter(torch.zeros(8))
    opt = NVMeAdamW([p], nvme_path=str(tmp_path), master="params")
    p.data = p.data.to(torch.bfloat16)  # after construction: found at the layout
    with pytest.raises(TypeError, match=r"parameter 0 .*bfloat16") as ei:
        opt.step()
    # While the error is held (its traceback keeps the frames alive, as a
    # caller logging it does), no swapper may sit open with its folder.
    root = tmp_path / f"aio-swap-{os.geteuid()}"
    assert not root.exists() or os.listdir(root) == [], ei
    assert opt.master_mode is None


def test_the_mode_is_fixed_at_the_layout(tmp_path) -> None:
    """Parameters moved or cast after a layout in params mode: a TypeError
    at every step naming the parameter, nothing broken (torch's AdamW, its
    state left on the CPU, fails after a move to a GPU too)."""
    m = _model()
    opt = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path))  # auto
    _steps([(m, opt, None)], 0, 1)
    assert opt.master_mode == "params"
    w = m[0].weight.data
    m[0].weight.data = w.double()  # as model.double() would (.to("cuda") alike: "on cuda:0")
    for _ in range(2):
        with pytest.raises(TypeError, match=r"parameter 0 .*float64 on cpu now.*fixed at the layout"):
            opt.step()
    m[0].weight.data = w
    _steps([(m, opt, None)], 1, 1)
    assert opt.master_mode == "params" and {float(s["step"]) for s in opt.state.values()} == {2.0}
    opt.close()


def test_refusals_at_construction_name_the_parameter(tmp_path) -> None:
    good, other = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(TypeError, match=r"param group 1, parameter 1 is on meta: master='params'"):
        NVMeAdamW([{"params": [good]}, {"params": [other, meta]}], nvme_path=str(tmp_path), master="params")
    with pytest.raises(TypeError, match=r"param group 0, parameter 1 \('head'\) is on meta"):
        NVMeAdamW([("body", good), ("head", meta)], nvme_path=str(tmp_path), master="params")
    bf16 = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"param group 0, parameter 0 \('x'\): .*dense float32"):
        NVMeAdamW([("x", bf16)], nvme_path=str(tmp_path))


def test_a_failed_step_without_the_master_on_the_drive_names_a_remedy_that_exists(
    tmp_path, monkeypatch
) -> None:
    m = _model()
    opt = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), master="params", sub_group_size=300)
    _steps([(m, opt, None)], 0, 1)
    saved = opt.state_dict()
    real = NVMeAdamW._write_back
    calls = {"n": 0}

    def failing(self, index, master):
        calls["n"] += 1
        if calls["n"] == 2:  # after the first sub-group was stepped
            raise OSError("a failed write")
        return real(self, index, master)

    monkeypatch.setattr(NVMeAdamW, "_write_back", failing)
    with pytest.raises(OSError):
        _steps([(m, opt, None)], 1, 1)
    monkeypatch.undo()
    with pytest.raises(Exception, match=r"load_state_dict\(\)") as ei:
        _steps([(m, opt, None)], 1, 1)
    assert "Restore it with import_checkpoint" not in str(ei.value)
    opt.load_state_dict(saved)  # the remedy named: it works
    _steps([(m, opt, None)], 1, 1)
    opt.close()


def test_gradients_on_the_drive_add_4_bytes_per_element(tmp_path) -> None:
    """docs/fsdp.md's sizing table: 12 bytes per element with the master in
    the parameters and gradients="nvme", 16 with the master on the drive."""
    params = [torch.nn.Parameter(torch.randn(4096))]
    for master, per_element in (("params", 12), ("drive", 16)):
        opt = NVMeAdamW(params, nvme_path=str(tmp_path), master=master, gradients="nvme", sub_group_size=1024)
        _sgd_like_steps(params, opt, 0, 1)
        assert opt.swap_stats()["drive_bytes"] == per_element * 4096, master
        opt.close()


def _replace_locals(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each parameter's tensor replaced by a copy (``p.data = ...``, as a
    load or an offload tier may do between steps): the old tensors."""
    old = [p.data for p in model.parameters()]
    for p in model.parameters():
        p.data = p.data.clone()
    return old


@bits
@pytest.mark.parametrize("master", ["params", "drive"])
def test_a_tensor_replaced_between_steps_is_the_one_stepped(tmp_path, master) -> None:
    """A step resolves each parameter's local tensor once, not once per
    use; what it resolved is forgotten after the step: a tensor replaced
    before the next one (``p.data = ...``; inside a closure, which runs
    first), or parameters swapped in param_groups, are the ones read
    (master="params") and written. Bit-identical to torch."""
    a, b = _model(), _model()
    oa = torch.optim.AdamW(_groups(a), lr=1e-2, foreach=False)
    ob = NVMeAdamW(
        _groups(b), lr=1e-2, nvme_path=str(tmp_path), match_torch=True, sub_group_size=500, master=master
    )
    _steps([(a, oa, None), (b, ob, None)], 0, 2)
    old = _replace_locals(b)
    kept = [t.clone() for t in old]
    _steps([(a, oa, None), (b, ob, None)], 2, 1)
    assert _same(a, b) and all(map(torch.equal, old, kept))

    def closure() -> torch.Tensor:
        old[:] = _replace_locals(b)
        kept[:] = [t.clone() for t in old]
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(4, 12, generator=g), torch.randn(4, 5, generator=g)
        ob.zero_grad()
        loss = ((b(x) - y) ** 2).mean()
        loss.backward()
        return loss

    _steps([(a, oa, None)], 3, 1)
    ob.step(closure)
    assert _same(a, b) and all(map(torch.equal, old, kept))
    c = _model()
    c.load_state_dict(b.state_dict())
    _swap(ob, c)  # a new layout, the state following by position
    _steps([(a, oa, None), (c, ob, None)], 4, 2)
    assert _same(a, c) and _same_state(oa.state_dict(), ob.state_dict())
    ob.close()


@bits
def test_a_param_group_added_before_the_first_step_is_stepped(tmp_path) -> None:
    """add_param_group before the layout: the new group's parameters are
    laid out and stepped with its hyper-parameters, as torch's."""
    a, b = _model(), _model()
    ga, gb = _groups(a), _groups(b)
    oa = torch.optim.AdamW(ga[:1], lr=1e-2, foreach=False)
    ob = NVMeAdamW(gb[:1], lr=1e-2, nvme_path=str(tmp_path), match_torch=True, sub_group_size=500)
    oa.add_param_group(ga[1])
    ob.add_param_group(gb[1])
    _steps([(a, oa, None), (b, ob, None)], 0, 3)
    assert _same(a, b) and _same_state(oa.state_dict(), ob.state_dict())
    ob.close()


@bits
@pytest.mark.parametrize("opt_cls", [NVMeAdamW, CPUAdamW])
def test_a_refused_param_group_is_left_out_whole(tmp_path, opt_cls) -> None:
    """add_param_group of a group that cannot be stepped raises, naming
    what, and leaves param_groups as they were: the next steps are torch's.
    Before: the group stayed in param_groups and every later step raised."""
    a, b = _model(), _model()
    ga, gb = _groups(a), _groups(b)
    kw = {"nvme_path": str(tmp_path)} if opt_cls is NVMeAdamW else {}
    oa = torch.optim.AdamW(ga, lr=1e-2, foreach=False)
    ob = opt_cls(gb, lr=1e-2, match_torch=True, **kw)
    extra = torch.nn.Parameter(torch.zeros(3))
    bad = [
        ({"params": [extra], "amsgrad": True}, ValueError, "amsgrad"),
        ({"params": [extra], "lr": -1.0}, ValueError, "learning rate"),
        ({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]}, TypeError, "float32"),
    ]
    for group, error, what in bad:
        with pytest.raises(error, match=what):
            ob.add_param_group(group)
        assert len(ob.param_groups) == 2
    _steps([(a, oa, None), (b, ob, None)], 0, 2)
    assert _same(a, b) and _same_state(oa.state_dict(), ob.state_dict())
    if opt_cls is NVMeAdamW:
        ob.close()


@pytest.mark.parametrize("master", ["params", "drive"])
def test_a_rank_holding_no_element_steps_as_torch(tmp_path, master) -> None:
    """Every parameter with no local element (a rank FSDP2 gave no rows of
    any): step() counts the steps as torch's AdamW does, no sub-group, no
    error (before: ValueError on that rank alone, the others then waiting in
    their next collective); the state dict is torch's."""
    pa = [torch.nn.Parameter(torch.zeros(0, 3)), torch.nn.Parameter(torch.zeros(0))]
    pb = [torch.nn.Parameter(torch.zeros(0, 3)), torch.nn.Parameter(torch.zeros(0))]
    oa = torch.optim.AdamW(pa, lr=1e-2, foreach=False)
    ob = NVMeAdamW(pb, lr=1e-2, nvme_path=str(tmp_path), match_torch=True, master=master)
    for _ in range(2):
        for p in pa + pb:
            p.grad = torch.zeros_like(p)
        oa.step()
        ob.step()
    assert _same_state(oa.state_dict(), ob.state_dict())
    assert [float(s["step"]) for s in ob.state_dict()["state"].values()] == [2.0, 2.0]
    ob.close()


@pytest.mark.parametrize("master", ["params", "drive"])
def test_a_step_resolves_each_local_tensor_once(tmp_path, monkeypatch, master) -> None:
    """Each parameter's local tensor (a DTensor's to_local(), its flat view,
    the size check) is resolved once a step, not at every use (the gradient
    checks, the master weights' check and pieces, the write-back): the
    drive idles while the step does it."""
    import aio.optim.nvme as nvme

    params = [torch.nn.Parameter(torch.randn(300)) for _ in range(5)]
    opt = NVMeAdamW(params, nvme_path=str(tmp_path), master=master, sub_group_size=256)
    _sgd_like_steps(params, opt, 0, 1)
    calls = {"n": 0}
    real = nvme.local_view

    def counted(p, name):
        calls["n"] += 1
        return real(p, name)

    monkeypatch.setattr(nvme, "local_view", counted)
    _sgd_like_steps(params, opt, 1, 2)
    assert calls["n"] == 2 * len(params), calls
    opt.close()
