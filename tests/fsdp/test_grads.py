"""aio.fsdp.stream_gradients in one process (plain tensors: torch calls the
same post-accumulate-grad hooks FSDP2 calls): gradient accumulation over
several backwards adds up as ``p.grad`` does, bit for bit, and a backward
that leaves a parameter out is refused before anything is stepped. The
FSDP2 cases (2 and 3 ranks) are in test_param_tier.py (``stream_accum``)."""

from __future__ import annotations

import errno

import pytest
import torch

from aio.fsdp import TierError, stream_gradients
from aio.optim import NVMeAdamW

KW = {"lr": 1e-2, "match_torch": True, "sub_group_size": 40, "gradients": "nvme"}


class _Two(torch.nn.Module):
    """Two heads; `both=False` runs the first only (the second gets no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(12, 30)
        self.b = torch.nn.Linear(30, 5)

    def forward(self, x: torch.Tensor, both: bool = True) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(h) if both else h[:, :5]


def _micro(model: torch.nn.Module, step: int, j: int, micro: int, both: bool = True) -> None:
    g = torch.Generator().manual_seed(100 * step + j)
    x, y = torch.randn(4, 12, generator=g), torch.randn(4, 5, generator=g)
    (((model(x, both) - y) ** 2).mean() / micro).backward()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("micro", [2, 3])
def test_accumulated_backwards_add_up_as_p_grad_does(tmp_path, micro: int) -> None:
    a, b = _Two(), _Two()
    oa, ob = (
        NVMeAdamW(a.parameters(), nvme_path=str(tmp_path), **KW),
        NVMeAdamW(b.parameters(), nvme_path=str(tmp_path), **KW),
    )
    stream = stream_gradients(a, oa)
    for step in range(3):
        ob.zero_grad()
        for j in range(micro):
            for m in (a, b):
                _micro(m, step, j, micro)
        assert all(p.grad is None for p in a.parameters())
        # The accumulated norms: the same bits as clip_grad_norm_ over the summed p.grad.
        assert torch.equal(stream.clip_grad_norm_(0.05), torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05))
        oa.step()
        ob.step()
        assert _same(a, b)
    st = stream.stats()
    assert st["micro_batches"] == 3 * micro
    assert st["accumulated_bytes"] == st["bytes"] * (micro - 1) // micro > 0
    stream.close()
    oa.close()
    ob.close()


def test_a_backward_that_leaves_a_parameter_out_is_refused(tmp_path) -> None:
    model = _Two()
    opt = NVMeAdamW(model.parameters(), nvme_path=str(tmp_path), **KW)
    stream = stream_gradients(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    unchanged = lambda: all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))  # noqa: E731
    _micro(model, 0, 0, 2, both=False)  # b gets no gradient
    with pytest.raises(ValueError, match="b.weight has no gradient while others have"):
        opt.step()
    with pytest.raises(TierError, match="a second gradient in one backward"):
        _micro(model, 0, 1, 2, both=False)  # a's second gradient while b never had its first
    assert any(p.grad is not None for p in model.parameters())  # left by the backward the hook stopped
    stream.discard()
    assert all(p.grad is None for p in model.parameters())
    _micro(model, 0, 0, 2)  # complete
    _micro(model, 0, 1, 2, both=False)  # then one without b: its sum would be one backward short
    with pytest.raises(TierError, match="each backward must give every one a gradient"):
        opt.step()
    assert unchanged()  # nothing stepped
    stream.discard()  # a fresh start: a complete backward steps
    _micro(model, 1, 0, 1)
    opt.step()
    assert not unchanged()
    stream.close()
    opt.close()


def test_zero_grad_between_backwards_drops_the_streamed_gradients(tmp_path) -> None:
    """backward; opt.zero_grad(); backward; step: torch steps on the second
    batch alone, so must the stream (it holds the first on the drive)."""
    a, b = _Two(), _Two()
    oa, ob = (NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), **KW) for m in (a, b))
    stream = stream_gradients(a, oa)
    for m, o in ((a, oa), (b, ob)):
        _micro(m, 0, 0, 1)
        o.zero_grad()  # a bad batch, skipped
        _micro(m, 0, 1, 1)
        o.step()
    assert _same(a, b) and stream.stats()["accumulated_bytes"] == 0
    stream.close()
    oa.close()
    ob.close()


def test_clip_norms_are_summed_in_parameters_order(tmp_path) -> None:
    """The optimizer holds the weights first, then the biases (param
    groups); clip_grad_norm_ sums the norms in model.parameters() order, and
    the order changes the bits of the total."""
    a, b = _Two(), _Two()
    named = list(a.named_parameters())
    groups = [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]
    opt = NVMeAdamW(groups, nvme_path=str(tmp_path), **KW)
    stream = stream_gradients(a, opt)
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(4, 12, generator=g) * (1 + seed), torch.randn(4, 5, generator=g)
        for m in (a, b):
            ((m(x) - y) ** 2).mean().backward()
        assert torch.equal(stream.clip_grad_norm_(0.05), torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05))
        opt.zero_grad()
        b.zero_grad()
    stream.close()
    opt.close()


class _FailedWrite:
    """A gradient write that failed after it started (its future's error)."""

    def __init__(self) -> None:
        self.e = OSError(errno.EIO, "injected write failure")

    def result(self, timeout: float | None = None) -> None:
        raise self.e

    def exception(self, timeout: float | None = None) -> OSError:
        return self.e

    def done(self) -> bool:
        return True


@pytest.mark.parametrize("how", ["started", "submit"])
def test_a_failed_gradient_write_then_discard_gives_every_buffer_back(tmp_path, how: str) -> None:
    a, b = _Two(), _Two()
    oa, ob = (NVMeAdamW(m.parameters(), nvme_path=str(tmp_path), **KW) for m in (a, b))
    stream = stream_gradients(a, oa)
    space = oa.swapper.space
    real = space.write

    def write(buf, off):  # the next gradient write fails, once
        space.write = real
        if how == "submit":
            raise OSError(errno.EIO, "injected submission failure")
        return _FailedWrite()

    space.write = write
    with pytest.raises(OSError, match="injected"):
        _micro(a, 0, 0, 1)
        oa.step()
    stream.discard()
    for m, o in ((a, oa), (b, ob)):
        o.zero_grad()
        _micro(m, 1, 0, 1)
        o.step()  # needs every buffer: none lost to the failed write
    assert _same(a, b)
    stream.close()
    oa.close()
    ob.close()


def test_frozen_parameters_and_a_closed_optimizer_are_refused_at_the_start(tmp_path) -> None:
    model = _Two()
    model.b.bias.requires_grad_(False)
    opt = NVMeAdamW(model.parameters(), nvme_path=str(tmp_path), **KW)
    with pytest.raises(TierError, match="b.bias does not require a gradient"):
        stream_gradients(model, opt)
    assert opt.gradient_source is None
    opt.close()
    with pytest.raises(ValueError, match="is closed"):
        stream_gradients(_Two(), opt)
    assert not any(tmp_path.iterdir())  # no swap folder made after close


def test_parameters_swapped_before_the_stream_are_the_ones_it_hooks(tmp_path) -> None:
    """Laid out, then param_groups given other tensors (Accelerate's swap),
    then the stream: it lays out anew and hooks the new parameters."""
    old, a, b = _Two(), _Two(), _Two()
    opt = NVMeAdamW(old.parameters(), nvme_path=str(tmp_path), **KW)
    ref = NVMeAdamW(b.parameters(), nvme_path=str(tmp_path), **KW)
    opt.lay_out()
    opt.param_groups[0]["params"] = list(a.parameters())
    stream = stream_gradients(a, opt)
    for m, o in ((a, opt), (b, ref)):
        _micro(m, 0, 0, 1)
        o.step()
    assert _same(a, b) and stream.stats()["bytes"] > 0
    stream.close()
    opt.close()
    ref.close()
