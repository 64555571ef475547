"""NVMeAdamW's step copies no element in memory it need not: with the master
weights in the parameters (master="params") the update runs on the
parameters' own storage and reads the gradients where they are (one Adam
task per piece: aio/swap/pieces.py), so a step copies nothing per element
(it was 12 bytes: parameter -> buffer, buffer -> parameter, gradient ->
packed buffer); with the master on the drive only the new weights are
copied into the parameters (4 bytes; was 8). Counted with a torch dispatch
mode, which sees every copy torch makes (the drive's I/O and aio's Adam
kernel are not torch ops). Bit-identical to torch.optim.AdamW either way,
on a layout whose pieces are cut everywhere."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aio.optim import NVMeAdamW, is_bit_exact

bits = pytest.mark.skipif(not is_bit_exact(), reason="aio's kernel does not reproduce torch's sqrt here")

COPIES = {"copy_", "clone", "_to_copy", "cat", "index_copy_", "slice_scatter"}


class CopyCounter(TorchDispatchMode):
    """Bytes written by torch's copying ops while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in COPIES and isinstance(out, torch.Tensor):
            self.bytes += out.numel() * out.element_size()
        return out


SIZES = [1, 3000, 7, 4096, 1, 20000, 513]  # pieces cut inside and across sub-groups of 4096


def _run(tmp_path, master: str | None, gradients: str = "cpu", steps: int = 4):
    """`steps` AdamW steps on SIZES; the parameters and the bytes each step copied."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    if master is None:
        opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    else:
        opt = NVMeAdamW(
            params, lr=1e-2, nvme_path=str(tmp_path), match_torch=True, sub_group_size=4096,
            master=master, gradients=gradients, pipeline_read=True, pipeline_write=True,
        )  # fmt: skip
    copied = []
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        with CopyCounter() as counter:
            opt.step()
        copied.append(counter.bytes)
    if master is not None:
        opt.close()
    return params, copied


@bits
@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
@pytest.mark.parametrize(
    "master,gradients,per_element",
    [("params", "cpu", 0), ("drive", "cpu", 4), ("params", "nvme", 4), ("drive", "nvme", 8)],
)
def test_bytes_copied_per_step_and_bits(tmp_path, master, gradients, per_element) -> None:
    want, _ = _run(tmp_path, None)
    got, copied = _run(tmp_path, master, gradients)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    n = sum(SIZES)
    for c in copied[1:]:  # after the first step (it makes the layout)
        # Each sub-group's step count is copied (a few bytes per segment), never an element.
        assert per_element * n <= c < per_element * n + 4096, (master, gradients, copied)


def _in_place_opt(tmp_path, sizes=(3000, 5000)):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = NVMeAdamW(params, lr=1e-2, nvme_path=str(tmp_path), sub_group_size=4096, master="params")
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    for p in params:
        p.grad = torch.randn(p.shape)
    return params, opt


def test_an_interrupt_right_after_an_in_place_update_says_the_weights_changed(tmp_path, monkeypatch) -> None:
    """The update changes the parameters themselves: a Ctrl-C right after
    the kernel returns (before the sub-group's bookkeeping) must be
    reported as weights changed, not "unchanged" (whose remedy, a state
    load alone, would train on a mix of two steps)."""
    import aio.optim as ao

    params, opt = _in_place_opt(tmp_path)
    before = [p.detach().clone() for p in params]
    real = ao.step_scaled

    def update_then_interrupt(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(ao, "step_scaled", update_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True))
    with pytest.raises(Exception, match="load the model's weights") as e:
        opt.step()
    assert "unchanged" not in str(e.value)
    opt.close()


def test_a_failed_step_lets_go_of_the_gradients_held_as_pieces(tmp_path, monkeypatch) -> None:
    import aio.optim as ao

    params, opt = _in_place_opt(tmp_path, sizes=(4096, 4096, 4096))

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(ao, "step_scaled", boom)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    # Not one view of p.grad kept: the next backward's gradients would sit beside them.
    assert all(g.grad_mem is None for g in opt.swapper.groups.values())
    opt.close()


def test_parameters_sharing_memory_keep_the_master_on_the_drive(tmp_path) -> None:
    """Updated in place, a parameter sharing bytes with another would be
    stepped from the other's new values: refused with master='params',
    and 'auto' keeps the master weights on the drive."""
    buf = torch.randn(64)
    a, b = torch.nn.Parameter(buf), torch.nn.Parameter(buf[16:48])
    opt = NVMeAdamW([a, b], lr=1e-2, nvme_path=str(tmp_path), master="params")
    for p in (a, b):
        p.grad = torch.randn(p.shape)
    with pytest.raises(ValueError, match="parameter 0 .*and parameter 1 .*share memory"):
        opt.step()
    auto = NVMeAdamW([a, b], lr=1e-2, nvme_path=str(tmp_path))
    auto.step()
    assert auto.master_mode == "drive"
    opt.close()
    auto.close()
