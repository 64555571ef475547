"""aio.zero.grads: gradient buffers per sub-group."""

import pytest
import torch

import aio.zero

from .common import cfg_for, gpt, train_engine


def test_gradient_buffers_smaller_than_model_flush_and_read_back(tmp_path, reference):
    # Few optimizer buffers (AdamW's minimum: 4, one tensor each) and more
    # small sub-groups than that: backward has to write partly filled
    # gradient sub-groups out and read them back. (Was buffer_count 1 when a
    # buffer held a whole sub-group.)
    cfg = cfg_for(tmp_path, pipeline=False)
    cfg["zero_optimization"]["sub_group_size"] = 20_000
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 4
    with aio.zero.initialize(gpt(), cfg) as engine:
        assert train_engine(engine, 20) == reference


class _P:
    """A stand-in for an adopted parameter."""

    def __init__(self, aio_id, aio_numel):
        self.aio_id, self.aio_numel = aio_id, aio_numel


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_accumulator_with_one_buffer_flushes_and_reads_back(tmp_path, device):
    """Two sub-groups filled alternately through a single pinned buffer: the
    open one is written out to make room and read back to add to it; over two
    micro-steps the stored gradient is the sum."""
    from aio.config import load_train_config
    from aio.zero.grads import GradientAccumulator
    from aio.zero.optimizer import make_optimizer
    from aio.zero.placement import SubGroupLayout

    opt_blk = {"device": device}
    if device == "nvme":
        # SGD's minimum (gradient + master weights); one is held below, so
        # gradients get a single buffer.
        opt_blk.update(nvme_path=str(tmp_path), buffer_count=2)
    cfg = load_train_config({"zero_optimization": {"stage": 3, "offload_optimizer": opt_blk}})
    opt = make_optimizer(cfg, torch.optim.SGD, {"lr": 1.0})
    a, b, c = _P(0, 3), _P(1, 2), _P(2, 4)
    layout = SubGroupLayout([[a, b], [c]])
    held = None
    try:
        for gi, n in enumerate(layout.group_numel):
            opt.register_subgroup(gi, n)
            opt.initialize(gi, torch.zeros(n))
        if device == "nvme":
            held = opt.acquire_buffer()
        acc = GradientAccumulator(opt, layout, gas=2, record_norms=True)
        for micro in range(2):
            acc.add(a, torch.full((3,), 1.0 + micro))
            acc.add(c, torch.full((4,), 10.0 + micro))  # no buffer free: sub-group 0 goes out
            acc.add(b, torch.full((2,), 100.0 + micro))  # sub-group 0 read back
            acc.finish_backward()
            if micro == 0:
                acc.end_micro_step()
        acc.settle_writes()
        if held is not None:
            held.release()  # the step needs it
        assert len(acc.boundary_norms()) == 3
        got = {}
        opt.step(after=lambda i, m: got.setdefault(i, m.clone()))
        assert got[0].tolist() == [-3.0] * 3 + [-201.0] * 2
        assert got[1].tolist() == [-21.0] * 4
    finally:
        opt.close()


def _accumulate(copies, grads_per_micro, record_norms=True, after_add=lambda acc: None, gas=2):
    """Run a GradientAccumulator (SGD, lr 1, two sub-groups, `gas`) over the given
    gradients with `copies` as its copy implementation; returns the stepped
    master weights (minus the gradient sums) and the boundary norms."""
    from aio.config import load_train_config
    from aio.zero.grads import GradientAccumulator
    from aio.zero.optimizer import make_optimizer
    from aio.zero.placement import SubGroupLayout

    cfg = load_train_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    opt = make_optimizer(cfg, torch.optim.SGD, {"lr": 1.0})
    params = [_P(0, 300), _P(1, 2), _P(2, 77), _P(3, 0)]
    layout = SubGroupLayout([params[:2], params[2:]])
    try:
        for gi, n in enumerate(layout.group_numel):
            opt.register_subgroup(gi, n)
            opt.initialize(gi, torch.zeros(n))
        acc = GradientAccumulator(opt, layout, gas=gas, record_norms=record_norms)
        if copies is not None:
            acc._copies = copies
        for micro, grads in enumerate(grads_per_micro):
            for p, g in zip(params, grads, strict=True):
                acc.add(p, g())
                after_add(acc)
            acc.finish_backward()
            if micro == 0:
                acc.end_micro_step()
        acc.settle_writes()
        norms = [n.item() for n in acc.boundary_norms()]
        got = {}
        opt.step(after=lambda i, m: got.setdefault(i, m.clone()))
        return got, norms, acc
    finally:
        opt.close()


def test_gradients_from_a_device_land_later_with_the_same_sums():
    """With (fake) device copies, chunked through a small staging ring: no hook
    waits for the copy it just started, and the sums and norms are bit-identical
    to adding on the host at once. The fake runs the copy stream first, so a
    copy that did not wait for the gradient to be computed would read zeros."""
    from aio.zero.streams import DeviceCopies, PinnedRing

    from .fake_streams import FakeBackend

    torch.manual_seed(0)
    values = [[torch.randn(n, dtype=torch.bfloat16) * 1e3 for n in (300, 2, 77, 0)] for _ in range(2)]
    host = [[(lambda v=v: v) for v in micro] for micro in values]
    expect, expect_norms, _ = _accumulate(None, host)

    b = FakeBackend(first="side")
    copies = DeviceCopies(b)
    copies.down = PinnedRing(b, 512)
    copies.max_download_bytes = 128  # 64 bf16 elements per chunk

    def produced(v):
        def make():
            g = torch.zeros_like(v)
            b.kernel(lambda: g.copy_(v))  # "computed" on the compute stream
            return g

        return make

    started = []
    download = copies.download

    def tracked(src):
        got = download(src)
        if got is not None:
            started.append(got[1].event)
        return got

    copies.download = tracked

    def newest_still_running(acc):
        # The hook never waited for the copy it had just started.
        assert ("synchronize", started[-1]) not in b.log

    device = [[produced(v) for v in micro] for micro in values]
    got, norms, acc = _accumulate(copies, device, after_add=newest_still_running)
    assert norms == expect_norms
    for gi in expect:
        assert torch.equal(got[gi], expect[gi])
    assert acc.stats()["d2h_copies"] == 2 * (5 + 1 + 2 + 1)
    assert not acc._arriving and not copies.down.live


def _fake_device():
    from aio.zero.streams import DeviceCopies

    from .fake_streams import FakeBackend

    b = FakeBackend(first="side")
    return b, DeviceCopies(b)


def test_one_micro_step_on_a_device_takes_the_norms_there():
    """gas 1 on a (fake) GPU: each gradient's norm is taken on the device, as
    clip_grad_norm_ takes it in GPU memory, with the bits of the host's norm of
    the landed fp32 gradient; the host only copies the gradient in."""
    torch.manual_seed(1)
    values = [torch.randn(n, dtype=torch.bfloat16) * 1e3 for n in (300, 2, 77, 0)]
    expect, expect_norms, host = _accumulate(None, [[lambda v=v: v for v in values]], gas=1)
    assert host.stats()["norms_on_device"] == 0
    b, copies = _fake_device()
    got, norms, acc = _accumulate(copies, [[lambda v=v: v for v in values]], gas=1)
    assert acc.stats()["norms_on_device"] == 4
    assert norms == expect_norms
    for gi in expect:
        assert torch.equal(got[gi], expect[gi])


def _one_buffer_accumulator(copies, gas):
    from aio.config import load_train_config
    from aio.zero.grads import GradientAccumulator
    from aio.zero.optimizer import make_optimizer
    from aio.zero.placement import SubGroupLayout

    cfg = load_train_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    opt = make_optimizer(cfg, torch.optim.SGD, {"lr": 1.0})
    p, q = _P(0, 4), _P(1, 3)
    layout = SubGroupLayout([[p, q]])
    opt.register_subgroup(0, 7)
    opt.initialize(0, torch.full((7,), -0.0))
    acc = GradientAccumulator(opt, layout, gas=gas, record_norms=True)
    if copies is not None:
        acc._copies = copies
    return opt, acc, p, q


@pytest.mark.parametrize("device", [False, True])
def test_a_fresh_buffer_takes_the_gradient_as_autograd_made_it(device):
    """A gradient landing in a zeroed buffer is copied in: -0.0 stays -0.0, as
    in param.grad (added to the zeros it became +0.0)."""
    copies = _fake_device()[1] if device else None
    opt, acc, p, q = _one_buffer_accumulator(copies, gas=1)
    try:
        acc.add(p, torch.tensor([-0.0, 1.0, 2.0, 3.0]))
        acc.add(q, torch.tensor([-0.0, 0.5, 0.5]).bfloat16())
        acc.finish_backward()
        acc.settle_writes()
        norms = acc.boundary_norms()
        want = [torch.tensor(v).norm().item() for v in ([1.0, 2.0, 3.0], [0.5, 0.5])]
        assert [n.item() for n in norms] == want
        assert acc.stats()["norms_on_device"] == (2 if device else 0)
        got = {}
        opt.step(after=lambda i, m: got.setdefault(i, m.clone()))
        # SGD, lr 1, from -0.0: -0.0 - (-0.0) is +0.0; -0.0 - (+0.0) would stay -0.0.
        assert got[0].tolist() == [0.0, -1.0, -2.0, -3.0, 0.0, -0.5, -0.5]
        assert [str(v) for v in got[0][[0, 4]].tolist()] == ["0.0", "0.0"]
    finally:
        opt.close()


@pytest.mark.parametrize("numel", [1, 1000, (1 << 18) + 5, 8 << 20])
def test_add_into_equals_one_add(numel):
    from aio.zero.grads import add_into

    g = torch.Generator().manual_seed(numel)
    dst = torch.randn(numel, generator=g)
    src = torch.randn(numel, generator=g).bfloat16()
    want = dst.clone().add_(src)
    add_into(dst, src)
    assert torch.equal(dst, want)


def test_landing_a_large_bf16_gradient_faults_no_fresh_pages():
    """fp32 += bf16 on the CPU casts the input into a temporary first; a 16 MiB
    download made a 32 MiB one, a fresh mapping faulted in on every landing (1 GB
    of page faults per step for a 277M model on an H200). In chunks the temporary
    is recycled: repeated landings fault (almost) nothing."""
    import resource

    from aio.zero.grads import add_into
    from aio.zero.malloc import TRAIN_MMAP_THRESHOLD, TRAIN_TRIM_THRESHOLD, set_mmap_threshold

    set_mmap_threshold(TRAIN_MMAP_THRESHOLD, TRAIN_TRIM_THRESHOLD)  # as in training
    dst = torch.zeros(8 << 20)
    src = torch.ones(8 << 20, dtype=torch.bfloat16)
    add_into(dst, src)  # the first may grow the heap
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        add_into(dst, src)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # One 32 MiB temporary per landing is 8192 faults; 4 landings 32768.
    assert faults < 2000, f"{faults} minor faults in 4 landings"
    assert torch.equal(dst, torch.full_like(dst, 5.0))


@pytest.mark.parametrize("opt_device", ["cpu", "nvme"])
@pytest.mark.parametrize("device", [False, True])
def test_a_fresh_buffer_is_written_whole_without_being_zeroed_first(
    tmp_path, monkeypatch, opt_device, device
):
    """A sub-group's buffer opened afresh is not zeroed whole (one pass over
    every gradient byte per window, on backward's path): the first gradients
    are copied in and only what got none is zeroed, at close. Buffers come
    back poisoned (NaN) here; a parameter without a gradient, one flushed
    part-way and the accumulated sums must still be exact."""
    from aio.config import load_train_config
    from aio.zero import memory_optimizer, swapped_optimizer
    from aio.zero.grads import GradientAccumulator
    from aio.zero.optimizer import make_optimizer
    from aio.zero.placement import SubGroupLayout

    def poisoning(real):
        def opened(self, index, numel, resume):
            buf = real(self, index, numel, resume)
            if buf is not None and not resume:
                buf.tensor.fill_(float("nan"))
            return buf

        return opened

    for cls in (memory_optimizer.MemoryOptimizer, swapped_optimizer.SwappedOptimizer):
        for name in ("open_gradient", "try_open_gradient"):
            monkeypatch.setattr(cls, name, poisoning(getattr(cls, name)))
    blk = {"device": opt_device}
    if opt_device == "nvme":
        blk.update(nvme_path=str(tmp_path), buffer_count=3)  # SGD's 2 and one for gradients
    cfg = load_train_config(
        {"zero_optimization": {"stage": 3, "offload_optimizer": blk}, "aio_zero": {"gradients": opt_device}}
    )
    opt = make_optimizer(cfg, torch.optim.SGD, {"lr": 1.0})
    a, unused, b, c = _P(0, 3), _P(1, 2), _P(2, 2), _P(3, 4)
    layout = SubGroupLayout([[a, unused, b], [c]])
    try:
        for gi, n in enumerate(layout.group_numel):
            opt.register_subgroup(gi, n)
            opt.initialize(gi, torch.zeros(n))
        acc = GradientAccumulator(opt, layout, gas=2, record_norms=True)
        if device:
            acc._copies = _fake_device()[1]
        for micro in range(2):
            acc.add(a, torch.full((3,), 1.0 + micro))
            acc.add(c, torch.full((4,), 10.0 + micro))
            acc.add(b, torch.full((2,), 100.0 + micro).bfloat16())
            acc.finish_backward()
            if micro == 0:
                acc.end_micro_step()
        acc.settle_writes()
        got = {}
        opt.step(after=lambda i, m: got.setdefault(i, m.clone()))
        assert got[0].tolist() == [-3.0] * 3 + [0.0] * 2 + [-201.0] * 2
        assert got[1].tolist() == [-21.0] * 4
    finally:
        opt.close()


@pytest.mark.parametrize("gas", [1, 2])
def test_weight_gradients_are_computed_in_their_buffers(tmp_path, gas):
    # Each Linear weight's first gradient of a window is computed straight
    # into its sub-group's buffer (no weight-sized tensor made and copied);
    # the head's weight, tied to the embedding, gets the embedding's part
    # added by its hook. The same bits as training in memory.
    from .common import L, train_in_memory

    with aio.zero.initialize(gpt(), cfg_for(tmp_path, gas=gas)) as engine:
        got = train_engine(engine, 4, gas=gas)
        in_place = engine.stats()["grads"]["in_place"]
    assert got == train_in_memory(4, gas=gas)
    assert in_place == 4 * (4 * L + 1)  # the window's first micro-step: 4 Linears a block, and the head


def test_target_is_offered_only_for_a_fresh_float32_first_gradient(tmp_path):
    """GradientAccumulator.target(): a float32 CPU gradient, a parameter's
    first in the backward, into a buffer opened afresh; the gradient hook's
    add() then counts it (adding what else arrived), or finish_backward()
    does when no hook ran. The stored sums and norms are exact."""
    from aio.config import load_train_config
    from aio.zero.grads import GradientAccumulator
    from aio.zero.optimizer import make_optimizer
    from aio.zero.placement import SubGroupLayout

    cfg = load_train_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    opt = make_optimizer(cfg, torch.optim.SGD, {"lr": 1.0})
    a, b, c = _P(0, 3), _P(1, 2), _P(2, 4)
    layout = SubGroupLayout([[a, b], [c]])
    try:
        for gi, n in enumerate(layout.group_numel):
            opt.register_subgroup(gi, n)
            opt.initialize(gi, torch.zeros(n))
        acc = GradientAccumulator(opt, layout, gas=2, record_norms=True)
        assert acc.target(a, torch.bfloat16, "cpu") is None
        assert acc.target(a, torch.float32, "meta") is None
        acc.target(a, torch.float32, "cpu").fill_(1.0)
        assert acc.target(a, torch.float32, "cpu") is None  # not its first gradient
        acc.add(a, torch.full((3,), 2.0))  # the hook: another part of a's gradient
        acc.add(b, torch.full((2,), 5.0))
        acc.target(c, torch.float32, "cpu").fill_(10.0)  # no hook runs for c
        acc.finish_backward()
        assert [n.item() for n in acc.boundary_norms()] == [] and acc.in_place == 2  # not the boundary
        acc.end_micro_step()
        assert acc.target(a, torch.float32, "cpu") is None  # its buffer is added to now
        acc.add(a, torch.full((3,), 1.0))
        acc.add(b, torch.full((2,), 1.0))
        acc.add(c, torch.full((4,), 1.0))
        acc.finish_backward()
        acc.settle_writes()
        norms = [round(n.item() ** 2) for n in acc.boundary_norms()]
        assert norms == [3 * 4.0**2, 2 * 6.0**2, 4 * 11.0**2]
        got = {}
        opt.step(after=lambda i, m: got.setdefault(i, m.clone()))
        assert got[0].tolist() == [-4.0] * 3 + [-6.0] * 2 and got[1].tolist() == [-11.0] * 4
    finally:
        opt.close()


@pytest.mark.parametrize("record_norms", [False, True])
def test_a_buffer_written_out_between_target_and_hook_keeps_the_gradient(tmp_path, record_norms):
    # One gradient buffer: c's gradient writes a's sub-group out (with a's
    # in-place gradient) before a's hook runs; the hook then counts it
    # without the buffer (or reads it back for the norm).
    from aio.config import load_train_config
    from aio.zero.grads import GradientAccumulator
    from aio.zero.optimizer import make_optimizer
    from aio.zero.placement import SubGroupLayout

    blk = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2}
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": blk}, "aio_zero": {"gradients": "nvme"}}
    opt = make_optimizer(load_train_config(cfg), torch.optim.SGD, {"lr": 1.0}, gradients="nvme")
    a, c = _P(0, 3), _P(1, 4)
    layout = SubGroupLayout([[a], [c]])
    held = None
    try:
        for gi, n in enumerate(layout.group_numel):
            opt.register_subgroup(gi, n)
            opt.initialize(gi, torch.zeros(n))
        held = opt.acquire_buffer()  # gradients get a single buffer
        acc = GradientAccumulator(opt, layout, gas=1, record_norms=record_norms)
        acc.target(a, torch.float32, "cpu").fill_(2.0)
        acc.add(c, torch.full((4,), 3.0))  # no buffer free: a's sub-group goes out
        acc.add(a, None)  # a's hook, nothing more arrived
        acc.finish_backward()
        acc.settle_writes()
        if record_norms:
            assert [round(n.item() ** 2) for n in acc.boundary_norms()] == [12, 36]
        held.release()
        held = None
        got = {}
        opt.step(after=lambda i, m: got.setdefault(i, m.clone()))
        assert got[0].tolist() == [-2.0] * 3 and got[1].tolist() == [-3.0] * 4
    finally:
        if held is not None:
            held.release()
        opt.close()


def test_autograd_grad_calls_leave_the_gradient_buffers_alone(tmp_path):
    # torch.autograd.grad (an input-gradient penalty, a saliency map) and
    # backward(inputs=...) accumulate nothing into the weights: their weight
    # gradients must not land in the buffers the next backward fills.
    def train(extra, path):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
        losses, saliency = [], []
        with aio.zero.initialize(model, cfg_for(path, gas=1)) as engine:
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(4, 16, generator=g, requires_grad=True)
                y = torch.randn(4, 8, generator=g)
                loss = torch.nn.functional.mse_loss(engine(x), y)
                if extra:
                    saliency.append(torch.autograd.grad(loss, x, retain_graph=True)[0])
                    first = engine.module[0].weight
                    (gw,) = torch.autograd.grad(loss, first, retain_graph=True)
                    saliency.append(gw.clone())
                    loss.backward(inputs=[x], retain_graph=True)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        return losses, saliency

    plain, _ = train(False, tmp_path / "a")
    got, saliency = train(True, tmp_path / "b")
    assert got == plain
    assert all(s.abs().sum() > 0 for s in saliency)  # the gradients came back


def test_a_users_gradient_hook_on_a_weight_still_sees_its_gradient(tmp_path):
    # A hook registered on a weight (param.register_hook: gradient logging,
    # a custom clip) gets the gradient as autograd made it: that weight's
    # gradient is not computed into its buffer.
    from .common import L, train_in_memory

    with aio.zero.initialize(gpt(), cfg_for(tmp_path, gas=1)) as engine:
        weight = engine.module.blocks[0].fc.weight
        seen = []
        handle = weight.register_hook(lambda g: seen.append(g.norm().item()))
        got = train_engine(engine, 3, gas=1)
        handle.remove()
        in_place = engine.stats()["grads"]["in_place"]
    assert got == train_in_memory(3, gas=1)
    assert len(seen) == 3 and all(n > 0 for n in seen)
    assert in_place == 3 * (4 * L + 1 - 1)  # every Linear weight but the hooked one


class _Shared(torch.nn.Module):
    """A Linear applied `uses` times in one forward (shared layers, an unrolled RNN)."""

    def __init__(self, uses):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 8)
        self.uses = uses

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(self.uses):
            h = torch.tanh(self.mid(h))
        return self.out(h)


class _TiedThrice(torch.nn.Module):
    """T5's sharing: one embedding called twice (encoder, decoder) and its
    weight also the head's, through F.linear: three parts in its gradient."""

    def __init__(self, embeds=2):
        super().__init__()
        torch.manual_seed(0)
        self.shared = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.shared.weight
        self.embeds = embeds

    def forward(self, x):
        ids = (x.abs() * 10).long().clamp(0, 60)  # (4, 5, 16)
        h = sum(torch.tanh(self.shared(ids + k)).mean(2) for k in range(self.embeds))
        return self.head(h)[..., :8]


def _shared_losses(model, tmp_path, backward_autocast=False):
    """3 steps (gas 1, clip 0.5, AdamW as cfg_for) in memory (tmp_path None) or
    through aio.zero: the losses, then the trained parameters."""
    from aio.optim import CPUAdamW

    def train(m, backward, step_fn):
        out = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 5, 16, generator=g), torch.randn(4, 5, 8, generator=g)
            loss = torch.nn.functional.mse_loss(m(x), y)
            with torch.autocast("cpu", torch.bfloat16, enabled=backward_autocast):
                backward(loss)
            step_fn()
            out.append(loss.item())
        return out + [v.detach().clone() for v in m.state_dict().values()]

    if tmp_path is None:
        opt = CPUAdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

        def step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return train(model, lambda loss: loss.backward(), step)
    with aio.zero.initialize(model, cfg_for(tmp_path, gas=1)) as engine:
        return train(engine, engine.backward, engine.step)


@pytest.mark.parametrize("uses", [2, 3])
def test_a_weight_applied_several_times_sums_as_in_memory(tmp_path, uses):
    # Autograd adds a weight's parts from its other uses before the hook: with
    # one part computed in the buffer, three parts would be added in another
    # order. Such a weight's gradient comes the usual way.
    got, want = _shared_losses(_Shared(uses), tmp_path), _shared_losses(_Shared(uses), None)
    assert got[:3] == want[:3] and all(torch.equal(a, b) for a, b in zip(got[3:], want[3:], strict=True))


@pytest.mark.parametrize("embeds", [1, 2])
def test_a_tied_weight_with_more_uses_than_one_linear_and_one_other_sums_as_in_memory(tmp_path, embeds):
    # The head's part would be computed in the buffer and the embeddings' parts
    # added to it: h + (e2 + e1), where autograd sums in arrival order. One
    # other use adds commutatively (exact, and stays in place); two do not.
    # SGD with lr 1: the step shows the gradient's every bit.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, 16, generator=g)
    ref = _TiedThrice(embeds)
    ref(x).square().mean().backward()
    with torch.no_grad():
        want = ref.shared.weight - ref.shared.weight.grad
    cfg = cfg_for(tmp_path, gas=1, clip=0)
    del cfg["optimizer"]  # SGD's, given below
    model = _TiedThrice(embeds)
    with aio.zero.initialize(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=1.0)) as engine:
        engine.backward(engine(x).square().mean())
        engine.step()
        assert engine.grads.stats()["in_place"] == (1 if embeds == 1 else 0)
        with engine.gathered():
            assert torch.equal(engine.module.shared.weight.detach(), want)


def test_backward_under_autocast_computes_weight_gradients_as_autograd_does(tmp_path):
    # Autocast active around backward (not forward): autograd's mm runs in
    # bf16 in memory, so the weight gradient is not computed in the buffer.
    got = _shared_losses(_Shared(1), tmp_path, backward_autocast=True)
    want = _shared_losses(_Shared(1), None, backward_autocast=True)
    assert got[:3] == want[:3] and all(torch.equal(a, b) for a, b in zip(got[3:], want[3:], strict=True))


def test_a_users_post_accumulate_hook_still_sees_the_gradient(tmp_path):
    model, seen = _Shared(1), []
    model.mid.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    _shared_losses(model, tmp_path)
    ref, want = _Shared(1), []
    ref.mid.weight.register_post_accumulate_grad_hook(lambda p: want.append(p.grad.clone()))
    _shared_losses(ref, None)
    assert len(seen) == 3 and torch.equal(seen[0], want[0])
