"""aio.zero.linear: the F.linear replacement under torch.autocast, against plain F.linear."""

import pytest
import torch

import aio.zero
from aio.optim import CPUAdamW
from aio.zero import linear

from .common import cfg_for, gpt, loss_of


def _cpu_autocast_supports(dtype):
    try:
        with torch.autocast("cpu", dtype=dtype):
            return torch.nn.functional.linear(torch.ones(1, 2), torch.ones(3, 2)).dtype == dtype
    except (RuntimeError, ValueError):
        return False


AMP_DTYPES = [
    pytest.param(None, id="no-autocast"),  # unchanged behaviour
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(
        torch.float16,
        id="fp16",
        marks=pytest.mark.skipif(
            not _cpu_autocast_supports(torch.float16), reason="CPU autocast has no float16 in this torch"
        ),
    ),
]


def _amp(dtype):
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def _run(fn, shape, bias, amp, in_dtype, seed=0):
    """Forward and backward of fn(x, w, b) on fresh leaves: output, grads."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, 16, generator=g).to(in_dtype).requires_grad_()
    w = torch.nn.Parameter(torch.randn(8, 16, generator=g))
    b = torch.nn.Parameter(torch.randn(8, generator=g)) if bias else None
    with _amp(amp):
        y = fn(x, w, b)
    y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
    return [y, x.grad, w.grad] + ([b.grad] if bias else [])


@pytest.mark.parametrize("amp", AMP_DTYPES)
@pytest.mark.parametrize("shape", [(6,), (2, 3)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["x32", "x16"])
def test_linear_matches_f_linear_bit_for_bit(amp, shape, bias, in_dtype):
    """Outputs and every gradient (values and dtypes) of _Linear equal plain
    F.linear's, with and without autocast: the weight's gradient is float32
    for a float32 parameter, the input's in the input's own dtype."""
    if amp is None and in_dtype != torch.float32:
        pytest.skip("a bfloat16 input with a float32 weight needs autocast")
    linear.install_linear()
    got = _run(linear._LinearFn.apply, shape, bias, amp, in_dtype)
    want = _run(linear._orig_linear, shape, bias, amp, in_dtype)
    assert got[0].grad_fn.name().endswith("_LinearBackward")
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs"


def test_backward_inside_autocast_matches():
    """backward() called inside the autocast region (torch advises against
    it, but it works in memory): the same bits as plain F.linear."""
    linear.install_linear()

    def run(fn):
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
        w = torch.nn.Parameter(torch.ones(8, 16) / 3)
        with _amp(torch.bfloat16):
            fn(x, w, None).float().square().sum().backward()
        return x.grad, w.grad

    for a, b in zip(run(linear._LinearFn.apply), run(linear._orig_linear), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_weight_reused_in_one_region_matches_uncached_autocast():
    """A weight used by two F.linear calls in one autocast region: in memory,
    autocast's weight cache makes autograd add the two low-precision weight
    gradients before one conversion; _Linear keeps no cast copy between
    forward and backward, converts each and adds in float32 -- the bits of
    in-memory autocast with cache_enabled=False (docs/zero.md)."""
    linear.install_linear()

    def run(fn, cache):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 32, generator=g, requires_grad=True)
        w = torch.nn.Parameter(torch.randn(32, 32, generator=g) / 6)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            y = fn(fn(x, w, None), w, None)
        y.float().sum().backward()
        return y, x.grad, w.grad

    got = run(linear._LinearFn.apply, True)
    for a, b in zip(got, run(linear._orig_linear, False), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _amp_loss(model, step, micro, dtype=torch.bfloat16):
    with torch.autocast("cpu", dtype=dtype):
        return loss_of(model, step, micro)


def _train_amp(model, engine, steps, gas=2, clip=0.5, dtype=torch.bfloat16):
    """Losses of `steps` steps: through the engine, or in memory (engine None)
    with the AdamW step aio.zero takes by default."""
    opt = None if engine else CPUAdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    out = []
    for step in range(steps):
        for micro in range(gas):
            loss = _amp_loss(engine or model, step, micro, dtype)
            if engine:
                engine.backward(loss)
                engine.step()
            else:
                (loss / gas).backward()
        if not engine:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


@pytest.mark.parametrize("opt", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_training_matches_in_memory(tmp_path, opt, dtype):
    """bf16 or fp16 autocast around forward and loss, fp32 parameters on the
    drive: the losses of the same autocast training in memory, bit for bit."""
    if dtype == torch.float16 and not _cpu_autocast_supports(dtype):
        pytest.skip("this torch's CPU autocast has no float16")
    want = _train_amp(gpt(), None, 6, dtype=dtype)
    with aio.zero.initialize(gpt(), cfg_for(tmp_path, "nvme", opt)) as engine:
        got = _train_amp(engine.module, engine, 6, dtype=dtype)
        assert engine.stats()["fetcher"].get("saved_copies", 0) == 0
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5
    assert got == want


def _cpu_autocast_supports(dtype):
    try:
        with torch.autocast("cpu", dtype=dtype):
            return torch.ones(2, 2).mm(torch.ones(2, 2)).dtype == dtype
    except (RuntimeError, ValueError):
        return False


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_forward_without_backward_frees_its_graph(tmp_path, device):
    """Forwards whose loss is never back-propagated (a validation pass left
    under grad mode, a loss thrown away) free their autograd graphs as in
    memory: the saved-tensor guard's identity pack made each saved output
    hold its own graph in a cycle Python's collector cannot see, so every
    such forward kept its activations (and a GPU job its device memory)
    until the process ended."""
    import contextlib
    import gc
    import weakref

    from aio.train import batch

    from .common import B, S, V
    from .cuda_sim import CudaSim

    x, _ = batch(0, 0, B, S, V)
    refs = []
    with CudaSim(scheduler="lazy") if device == "cuda" else contextlib.nullcontext():
        with aio.zero.initialize(gpt(), cfg_for(tmp_path), device=device) as engine:
            block = engine.module.blocks[0]
            hook = block.register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
            for _ in range(3):
                refs.append(weakref.ref(engine(x.to(device))))
            hook.remove()
            gc.collect()
            assert [r for r in refs if r() is not None] == []
