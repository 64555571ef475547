"""NVMeAdamW's public entry points for other modules (aio.fsdp): lay_out(),
the frozen layout() view, the swapper property, and the gradient-source
protocol (aio.optim.grad_source) the step asks instead of reading p.grad --
bit-identical (torch.equal) to the p.grad path, one source at a time,
detach giving p.grad back, no new layout under an attached source. In one
process; aio.fsdp's multi-rank stream: tests/fsdp."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aio.optim import GradientSource, Layout, NVMeAdamW
from aio.swap import OptimizerSwapper


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 63), torch.nn.ReLU(), torch.nn.Linear(63, 5))


def _groups(m: torch.nn.Module) -> list[dict]:
    named = list(m.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 5e-3},
    ]


def _backward(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 12, generator=g), torch.randn(4, 5, generator=g)
    model.zero_grad(set_to_none=True)
    ((model(x) - y) ** 2).mean().backward()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _same_state(sa: dict, sb: dict) -> bool:
    names = ("step", "exp_avg", "exp_avg_sq")
    return set(sa["state"]) == set(sb["state"]) and all(
        torch.equal(sa["state"][k][n], sb["state"][k][n]) for k in sa["state"] for n in names
    )


class _Source:
    """A gradient source fed by hand: `grads` (parameter index -> flat
    gradient) put into the sub-groups' gradient slots through the public
    layout() and swapper (written to the drive, or held in memory)."""

    def __init__(self, opt: NVMeAdamW, fill: bool = True) -> None:
        self.opt, self.fill = opt, fill
        self.grads: dict[int, torch.Tensor] = {}
        self.scale: torch.Tensor | None = None
        self.calls: list[str] = []

    def local_grads(self):
        self.calls.append("local_grads")
        return set(self.grads) or None

    def take_grads(self) -> None:
        self.calls.append("take_grads")
        lay, sw = self.opt.layout(), self.opt.swapper
        bufs = [torch.zeros(n) for n in lay.subgroup_numels]
        for k, g in self.grads.items():
            for pc in lay.pieces[k]:
                bufs[pc.subgroup][pc.offset : pc.offset + pc.count].copy_(g[pc.start : pc.start + pc.count])
        for i, buf in enumerate(bufs if self.fill else []):
            if self.opt.options.gradients == "nvme":
                sw.write_gradient(i, buf, async_op=False)
            else:
                sw.hold_gradient(i, buf)

    def grad_scale(self):
        self.calls.append("grad_scale")
        return self.scale

    def step_done(self) -> None:
        self.calls.append("step_done")
        self.grads = {}

    def discard(self) -> None:
        self.calls.append("discard")
        self.grads = {}


def test_layout_view_and_swapper_are_public_and_frozen(tmp_path) -> None:
    m = _model()
    opt = NVMeAdamW(_groups(m), nvme_path=str(tmp_path), sub_group_size=500)
    assert opt.swapper is None and opt.master_mode is None
    with pytest.raises(ValueError, match=r"layout\(\): .*not laid out yet; call lay_out\(\)"):
        opt.layout()
    opt.lay_out()
    lay = opt.layout()
    params = [p for g in opt.param_groups for p in g["params"]]
    assert isinstance(lay, Layout) and isinstance(opt.swapper, OptimizerSwapper)
    assert len(lay.params) == len(params) and all(map(lambda a, b: a is b, lay.params, params))
    assert [lay.numel(k) for k in range(len(params))] == [p.numel() for p in params]
    assert sum(lay.subgroup_numels) == sum(p.numel() for p in params)
    assert max(lay.subgroup_numels) <= 500 and len(lay.pieces[0]) > 1  # 756 elements: cut in two
    filled = [0] * len(lay.subgroup_numels)
    for ps in lay.pieces:
        start = 0
        for pc in ps:  # each parameter's pieces in order, end to end
            assert pc.start == start and pc.offset + pc.count <= lay.subgroup_numels[pc.subgroup]
            start += pc.count
            filled[pc.subgroup] += pc.count
    assert filled == list(lay.subgroup_numels)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.params = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.pieces[0][0].count = 1  # type: ignore[misc]
    sw = opt.swapper
    opt.lay_out()  # laid out already: a no-op
    assert opt.swapper is sw
    opt.close()


@pytest.mark.parametrize("gradients", ["nvme", "cpu"])
@pytest.mark.parametrize("master", ["params", "drive"])
def test_a_gradient_source_feeds_the_step_bit_identically(tmp_path, gradients, master) -> None:
    """The step takes the gradients and the scale from an attached source
    (p.grad, set to other values, is not read): the same bits as the p.grad
    path with each gradient multiplied by the scale first (clip_grad_norm_);
    detached, the step reads p.grad again."""
    a, b = _model(), _model()
    kw = {"lr": 1e-2, "match_torch": True, "sub_group_size": 500, "gradients": gradients, "master": master}
    oa = NVMeAdamW(_groups(a), nvme_path=str(tmp_path), **kw)
    ob = NVMeAdamW(_groups(b), nvme_path=str(tmp_path), **kw)
    oa.lay_out()
    src = _Source(oa)
    oa.attach_gradient_source(src)
    assert oa.gradient_source is src and isinstance(src, GradientSource)
    params = list(oa.layout().params)
    for step in range(4):
        scale = None if step == 0 else torch.tensor(0.25 * step)
        for m in (a, b):
            _backward(m, step)
        src.grads = {k: p.grad.reshape(-1).clone() for k, p in enumerate(params)}
        src.scale, src.calls = scale, []
        for p in params:
            p.grad.mul_(1000.0)  # what the step would take if it read p.grad
        if scale is not None:
            for p in b.parameters():
                p.grad.mul_(scale)  # as clip_grad_norm_ does
        oa.step()
        ob.step()
        assert src.calls == ["local_grads", "take_grads", "grad_scale", "step_done"]
        assert _same(a, b) and src.grads == {}
    oa.detach_gradient_source(src)
    assert oa.gradient_source is None
    for m in (a, b):
        _backward(m, 4)
    oa.step()
    ob.step()
    assert _same(a, b) and _same_state(oa.state_dict(), ob.state_dict()) and len(src.calls) == 4
    oa.close()
    ob.close()


def test_a_source_with_nothing_leaves_the_step_to_p_grad(tmp_path) -> None:
    a, b = _model(), _model()
    oa = NVMeAdamW(a.parameters(), nvme_path=str(tmp_path), match_torch=True, gradients="nvme")
    ob = NVMeAdamW(b.parameters(), nvme_path=str(tmp_path), match_torch=True, gradients="nvme")
    oa.lay_out()
    src = _Source(oa)
    oa.attach_gradient_source(src)
    for m in (a, b):
        _backward(m, 0)
    oa.step()
    ob.step()
    assert src.calls == ["local_grads", "grad_scale", "step_done"] and _same(a, b)
    src.calls = []
    oa.zero_grad()  # drops p.grad and what the source holds
    oa.step()  # no gradient anywhere: nothing happens
    assert src.calls == ["discard", "local_grads"] and _same(a, b)
    oa.close()
    ob.close()


def test_step_done_runs_when_the_update_raises(tmp_path) -> None:
    """A source that fills no slot: the swapper refuses the update, and the
    source is told the step is over all the same; nothing changed."""
    m = _model()
    opt = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), gradients="cpu", sub_group_size=500)
    opt.lay_out()
    src = _Source(opt, fill=False)
    opt.attach_gradient_source(src)
    _backward(m, 0)
    src.grads = {k: p.grad.reshape(-1).clone() for k, p in enumerate(opt.layout().params)}
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match="has no gradient"):
        opt.step()
    assert src.calls == ["local_grads", "take_grads", "grad_scale", "step_done"] and src.grads == {}
    assert all(map(torch.equal, before, m.parameters()))
    opt.close()


def test_attach_detach_misuse_is_refused(tmp_path) -> None:
    m = _model()
    opt = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), gradients="nvme")
    src = _Source(opt)
    with pytest.raises(ValueError, match=r"before the NVMeAdamW's sub-groups are laid out: call lay_out\(\)"):
        opt.attach_gradient_source(src)
    opt.lay_out()
    with pytest.raises(TypeError, match="must implement aio.optim.grad_source.GradientSource"):
        opt.attach_gradient_source(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not the gradient source attached"):
        opt.detach_gradient_source(src)
    opt.attach_gradient_source(src)
    with pytest.raises(ValueError, match=r"already has a gradient source \(_Source\)"):
        opt.attach_gradient_source(_Source(opt))
    assert opt.gradient_source is src
    opt.detach_gradient_source(src)
    opt.attach_gradient_source(_Source(opt))  # one at a time: free again
    opt.close()


def test_no_new_layout_under_an_attached_source(tmp_path) -> None:
    m, twin = _model(), _model()
    opt = NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), gradients="nvme")
    opt.lay_out()
    src = _Source(opt)
    opt.attach_gradient_source(src)
    lay = opt.layout()
    opt.param_groups[0]["params"] = list(twin.parameters())
    _backward(twin, 0)
    with pytest.raises(ValueError, match="an attached gradient source"):
        opt.step()
    now = opt.layout()  # the same layout (a Layout compares by identity: a new view each call)
    assert (now.params, now.pieces, now.subgroup_numels) == (lay.params, lay.pieces, lay.subgroup_numels)
    assert now.params[0] is m[0].weight
    opt.param_groups[0]["params"] = list(m.parameters())  # given back: steps again
    _backward(m, 0)
    opt.step()
    opt.detach_gradient_source(src)
    opt.close()


def test_stream_gradients_in_one_process_is_bit_identical_and_detaches(tmp_path) -> None:
    """aio.fsdp's GradientStream on plain tensors: gradients streamed to the
    drive from the hooks, clipped by the stream, through the public
    protocol only; the same bits as clip_grad_norm_ and the p.grad path. A
    second stream is refused; close() gives the step p.grad back."""
    from aio.fsdp import TierError, stream_gradients

    a, b = _model(), _model()
    kw = {"lr": 1e-2, "match_torch": True, "sub_group_size": 40, "gradients": "nvme"}
    oa = NVMeAdamW(a.parameters(), nvme_path=str(tmp_path), **kw)
    ob = NVMeAdamW(b.parameters(), nvme_path=str(tmp_path), **kw)
    stream = stream_gradients(a, oa)
    assert oa.gradient_source is stream
    with pytest.raises(TierError, match="already has a gradient stream"):
        stream_gradients(a, oa)
    for step in range(3):
        for m in (a, b):
            _backward(m, step)
        assert all(p.grad is None for p in a.parameters())
        assert torch.equal(stream.clip_grad_norm_(0.05), torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05))
        oa.step()
        ob.step()
        assert _same(a, b)
    stream.close()
    assert oa.gradient_source is None
    for m in (a, b):
        _backward(m, 3)
    oa.step()
    ob.step()
    assert _same(a, b) and _same_state(oa.state_dict(), ob.state_dict())
    oa.close()
    ob.close()
