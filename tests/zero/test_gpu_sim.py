"""aio.zero's GPU path under the strict CUDA simulator (tests/zero/cuda_sim.py),
in every scheduler mode: training equal to the same training in memory,
module buffers on the device, bounded device memory, no pageable copies."""

import pytest
import torch

import aio.zero
from aio.train import batch

from .common import B, S, V, cfg_for, gpt, train_engine, train_in_memory
from .cuda_sim import CudaSim

MODES = [("lazy", 0), ("eager", 0), ("random", 1), ("random", 2)]
STRICT = [("lazy", 0), ("random", 1)]  # the strictest schedules, for the slower cases (CI time)


@pytest.fixture(params=MODES, ids=[f"{m}-{s}" for m, s in MODES])
def sim(request):
    mode, seed = request.param
    with CudaSim(scheduler=mode, seed=seed) as s:
        yield s


def device_loss(engine, step, micro):
    x, y = batch(step, micro, B, S, V)
    out = engine(x.to("cuda"))
    return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), y.to("cuda").flatten())


def train_on_device(engine, steps, gas=2):
    return train_engine(engine, steps, gas, loss_fn=device_loss)


# Everything on the drive in every schedule; the other offloads in the lazy
# one, the strictest (CI time).
TRAINING = [(m, s, "nvme", "nvme") for m, s in MODES] + [
    ("lazy", 0, param, opt) for param, opt in (("cpu", "cpu"), ("nvme", "cpu"))
]


@pytest.mark.parametrize("mode,seed,param,opt", TRAINING, ids=[f"{m}-{s}-{p}-{o}" for m, s, p, o in TRAINING])
def test_training_on_simulated_gpu_equals_memory(tmp_path, mode, seed, param, opt):
    want = train_in_memory(3)
    with CudaSim(scheduler=mode, seed=seed) as sim:
        with aio.zero.initialize(gpt(), cfg_for(tmp_path, param=param, opt=opt), device="cuda") as engine:
            got = train_on_device(engine, 3)
        assert sim.stats()["pageable_h2d"] == 0
    assert got == want


@pytest.mark.parametrize("mode,seed", STRICT, ids=[f"{m}-{s}" for m, s in STRICT])
def test_clipping_with_norms_taken_on_the_device_equals_memory(tmp_path, mode, seed):
    """One micro-step per window: the gradient norms are taken on the device
    (as clip_grad_norm_ takes them in GPU memory); clipped training still
    equals in-memory training bit for bit."""
    want = train_in_memory(3, gas=1, clip=0.05)
    with CudaSim(scheduler=mode, seed=seed):
        with aio.zero.initialize(gpt(), cfg_for(tmp_path, gas=1, clip=0.05), device="cuda") as engine:
            got = train_on_device(engine, 3, gas=1)
            assert engine.stats()["grads"]["norms_on_device"] == 3 * len(list(engine.module.parameters()))
            assert engine.last_grad_norm > 0.05  # the clip was active
    assert got == want


class WithBuffers(torch.nn.Module):
    """A GPT with the buffers real models carry: position ids (BERT), a
    frequency table (Llama's rotary inv_freq) and BatchNorm statistics."""

    def __init__(self):
        super().__init__()
        self.gpt = gpt()
        self.register_buffer("position_ids", torch.arange(S).unsqueeze(0), persistent=False)
        self.register_buffer("inv_freq", 1.0 / (100.0 ** (torch.arange(0, V, 2).float() / V)))
        self.norm = torch.nn.BatchNorm1d(V)

    def forward(self, x):
        h = self.gpt(x)
        pos = self.position_ids[:, : x.shape[1]].unsqueeze(-1).float()
        h = h + torch.cos(pos * self.inv_freq.repeat(2)) * 0.01
        return self.norm(h.transpose(1, 2)).transpose(1, 2)


def with_buffers():
    torch.manual_seed(0)
    return WithBuffers()


def train_buffers_in_memory(steps):
    from aio.optim import CPUAdamW

    m = with_buffers()
    opt = CPUAdamW(m.parameters(), lr=3e-3, weight_decay=0.01)
    out = []
    for step in range(steps):
        x, y = batch(step, 0, B, S, V)
        loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out, m.norm.running_mean.clone()


def test_module_buffers_follow_the_device(sim, tmp_path):
    """BatchNorm statistics, position ids and frequency tables are on the
    device after initialize(): the first forward does not mix devices, and
    training (BatchNorm's running statistics too) equals memory."""
    want, want_mean = train_buffers_in_memory(3)
    cfg = cfg_for(tmp_path, gas=1, clip=0)
    with aio.zero.initialize(with_buffers(), cfg, device="cuda") as engine:
        got = []
        for step in range(3):
            x, y = batch(step, 0, B, S, V)
            out = engine(x.to("cuda"))
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), y.to("cuda").flatten())
            engine.backward(loss)
            engine.step()
            got.append(loss.item())
        assert all(b.device.type == "cuda" for b in engine.module.buffers())
        assert torch.equal(engine.state_dict()["norm.running_mean"], want_mean)
    assert got == want


def test_a_buffer_left_on_the_host_is_a_device_mismatch(tmp_path, monkeypatch):
    """What the simulator does when buffers stay behind (the bug fixed above):
    CUDA's error on the first forward."""
    import aio.zero.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "move_buffers", lambda model, device: None)
    with CudaSim(), aio.zero.initialize(with_buffers(), cfg_for(tmp_path), device="cuda") as engine:
        x, _ = batch(0, 0, B, S, V)
        with pytest.raises(RuntimeError, match="same device"):
            engine(x.to("cuda"))


def module_bytes(model):
    return max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())


@pytest.mark.parametrize("ahead", [1, 2])
def test_device_memory_is_bounded_when_the_host_runs_ahead(tmp_path, ahead):
    """Lazy GPU (it never runs unless the host waits): freed parameter blocks
    are reused only once the GPU has passed them, so the host must wait; peak
    device memory stays at a few modules, not the model. Every host wait is
    one of: a module fetch's pacing, a gradient copy, an item()."""
    model = gpt()
    total = sum(p.numel() * 4 for p in model.parameters())
    largest = module_bytes(model)
    cfg = cfg_for(tmp_path, aio_zero={"modules_ahead": ahead})
    with CudaSim(scheduler="lazy") as sim:
        with aio.zero.initialize(model, cfg, device="cuda") as engine:
            train_on_device(engine, 2)
            stats = engine.stats()
        peak = sim.stats()["peak_device_bytes"]
        waits = sim.stats()["blocking_waits"]
    fetches = stats["fetcher"]["fetches"]
    assert peak <= (ahead + 2) * largest + 16 * 1024 < total
    assert stats["params"]["pace_waits"] <= fetches
    assert waits <= fetches + 4 * 2 * 2  # per micro-step: loss.item(), end of backward, step


def test_eager_gpu_needs_almost_no_host_waits(tmp_path):
    """When the GPU keeps up, nothing blocks: no pacing waits, a handful per run."""
    with CudaSim(scheduler="eager") as sim:
        with aio.zero.initialize(gpt(), cfg_for(tmp_path), device="cuda") as engine:
            train_on_device(engine, 2)
            assert engine.stats()["params"]["pace_waits"] == 0
        assert sim.stats()["blocking_waits"] <= 4


@pytest.mark.parametrize("mode,seed", STRICT, ids=[f"{m}-{s}" for m, s in STRICT])
def test_init_on_a_gpu_builds_the_values_of_memory(tmp_path, mode, seed):
    """Init(device='cuda'): weight initialisation runs on host tensors with the
    host RNG (the simulated device has its own generator), so values and the
    host RNG stream equal the same build in memory."""
    from aio.train import build_gpt

    from .common import H, L, W

    torch.manual_seed(0)
    ref = build_gpt(V, W, L, H, S)
    after_ref = torch.get_rng_state()
    cfg = cfg_for(tmp_path)
    torch.manual_seed(0)
    with CudaSim(scheduler=mode, seed=seed):
        with aio.zero.Init(cfg, device="cuda"):
            model = build_gpt(V, W, L, H, S)
        assert torch.equal(torch.get_rng_state(), after_ref)
        with aio.zero.initialize(model, cfg, device="cuda") as engine:
            got = engine.state_dict()
    for name, t in ref.state_dict().items():
        assert torch.equal(got[name], t), name


def test_training_under_a_users_stream(tmp_path):
    """Inside the user's own stream (``with torch.cuda.stream(s)``), aio's
    copies order against that stream, not the default one."""
    want = train_in_memory(2)
    with CudaSim(scheduler="lazy") as sim:
        with sim.stream(sim.new_stream("user")):
            with aio.zero.initialize(gpt(), cfg_for(tmp_path), device="cuda") as engine:
                assert train_on_device(engine, 2) == want


@pytest.mark.parametrize("mode,seed", STRICT, ids=[f"{m}-{s}" for m, s in STRICT])
def test_checkpoint_resume_on_the_gpu_matches_uninterrupted(tmp_path, mode, seed):
    """Save after 2 steps on the (simulated) GPU, load into a fresh model,
    train on: the losses equal 4 uninterrupted steps in memory."""
    with CudaSim(scheduler=mode, seed=seed):
        _checkpoint_resume(tmp_path)


def _checkpoint_resume(tmp_path):
    want = train_in_memory(4)
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a"), device="cuda") as engine:
        first = train_on_device(engine, 2)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    torch.manual_seed(123)
    from aio.train import build_gpt

    from .common import H, L, W

    with aio.zero.initialize(build_gpt(V, W, L, H, S), cfg_for(tmp_path / "b"), device="cuda") as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        second = [_device_step(engine, step) for step in range(2, 4)]
    assert first + second == want


def _device_step(engine, step, gas=2):
    for micro in range(gas):
        loss = device_loss(engine, step, micro)
        engine.backward(loss)
        engine.step()
    return loss.item()


def test_gpu_job_pins_through_the_device_not_mlock(tmp_path, no_garbage):
    """Swap pools (parameters and optimizer) and resident partitions of a GPU
    job are registered with the device, exact and page-aligned: nothing is
    mlock-ed (docker's 64 KiB RLIMIT_MEMLOCK cannot break it) and every
    upload is a DMA copy."""
    from aio import _C

    before = _C.locked_bytes()
    cfg = cfg_for(tmp_path)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100  # small ones resident
    with CudaSim(scheduler="random", seed=5) as sim:
        with aio.zero.initialize(gpt(), cfg, device="cuda") as engine:
            train_on_device(engine, 1)
            assert _C.locked_bytes() == before
            assert engine.pinned_bytes() > 0
        assert sim.stats()["pageable_h2d"] == 0 and sim.stats()["pageable_d2h"] == 0


# -- found by a review of the GPU data path (each failed before its fix) --------------------


def _two_losses_per_micro_step(model_or_engine, step, micro, device="cpu"):
    out = []
    for k in (micro, micro + 10):
        x, y = batch(step, k, B, S, V)
        o = model_or_engine(x.to(device))
        out.append(torch.nn.functional.cross_entropy(o.flatten(0, 1).float(), y.to(device).flatten()))
    return out


def _memory_two_backwards(steps, gas, clip):
    from aio.optim import CPUAdamW

    m = gpt()
    opt = CPUAdamW(m.parameters(), lr=3e-3, weight_decay=0.01)
    for step in range(steps):
        for micro in range(gas):
            for loss in _two_losses_per_micro_step(m, step, micro):  # each forward, then its backward
                (loss / gas if gas > 1 else loss).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.clone() for k, v in m.state_dict().items()}


TWO_BW = [("cpu", 1, "nvme"), ("cpu", 2, "nvme"), ("cpu", 2, "cpu"), ("cuda", 1, "nvme"), ("cuda", 2, "cpu")]


@pytest.mark.parametrize("device,gas,gradients", TWO_BW, ids=[f"{d}-gas{g}-{w}" for d, g, w in TWO_BW])
def test_two_backwards_before_a_step_sum_their_gradients(tmp_path, device, gas, gradients):
    """backward(), another forward and backward(), then step(): the gradients
    are summed, as torch sums them into .grad (the second used to overwrite
    the first); clipped by the norm of the sum (on the GPU, not the norms
    taken on the device for the first backward alone)."""
    want = _memory_two_backwards(2, gas, clip=0.05)
    cfg = cfg_for(tmp_path, gas=gas, clip=0.05, aio_zero={"gradients": gradients})
    with CudaSim(scheduler="lazy") if device == "cuda" else _nothing():
        with aio.zero.initialize(gpt(), cfg, device=device) as engine:
            for step in range(2):
                for micro in range(gas):
                    for _ in range(2):
                        loss = _two_losses_per_micro_step(engine, step, micro, device)[_]
                        engine.backward(loss)
                    engine.step()
            got = engine.state_dict()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def loss_of_device(model_or_engine, step, device):
    x, y = batch(step, 0, B, S, V)
    o = model_or_engine(x.to(device))
    return torch.nn.functional.cross_entropy(o.flatten(0, 1).float(), y.to(device).flatten())


def _memory_losses(model, steps):
    """Losses of `steps` plain in-memory steps (aio's AdamW, no clipping) of
    `model`'s trainable parameters, one micro-step each."""
    from aio.optim import CPUAdamW

    opt = CPUAdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.01)
    out = []
    for step in range(steps):
        loss = loss_of_device(model, step, "cpu")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def _engine_losses(model, cfg, device, steps, on_engine=None):
    """Losses of the same steps through aio.zero on `device` (the simulator's
    for "cuda"); `on_engine(engine)` first."""
    with CudaSim(scheduler="lazy") if device == "cuda" else _nothing():
        with aio.zero.initialize(model, cfg, device=device) as engine:
            if on_engine is not None:
                on_engine(engine)
            return [_step(engine, step, device) for step in range(steps)]


def _step(engine, step, device):
    loss = loss_of_device(engine, step, device)
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_frozen_layer_in_the_middle_trains_as_in_memory(tmp_path, device):
    """LoRA-style partial fine-tuning: a frozen Linear that the gradient
    passes through (it used to reach backward with its weight never fetched
    again), its parameters released when its backward is done, not held to
    the end of backward."""

    def frozen(m):
        for p in m.blocks[1].fc.parameters():
            p.requires_grad_(False)
        return m

    held_at_end = []

    def record(engine):
        end = engine.fetcher.end_backward

        def recording_end():
            held_at_end.append([p for p in engine.fetcher.bw_held.values() if not p.requires_grad])
            end()

        engine.fetcher.end_backward = recording_end

    want = _memory_losses(frozen(gpt()), 3)
    got = _engine_losses(frozen(gpt()), cfg_for(tmp_path, gas=1, clip=0), device, 3, record)
    assert got == want
    assert held_at_end and all(h == [] for h in held_at_end)


def test_out_of_device_memory_mid_upload_lets_a_retry_train(tmp_path, monkeypatch):
    """An out-of-memory error while parameters go up (HF's
    find_executable_batch_size then retries smaller) used to leave them
    counted as in use with placeholder data: every later forward failed."""
    want = train_in_memory(2, gas=1, clip=0)
    with CudaSim(scheduler="lazy"):
        with aio.zero.initialize(gpt(), cfg_for(tmp_path, gas=1, clip=0), device="cuda") as engine:
            uploads = engine.store.uploads
            real, calls = uploads.upload, []

            def failing(params, hosts):
                calls.append(len(params))
                if len(calls) == 3:
                    raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
                return real(params, hosts)

            monkeypatch.setattr(uploads, "upload", failing)
            with pytest.raises(torch.OutOfMemoryError):
                device_loss(engine, 0, 0)
            monkeypatch.setattr(uploads, "upload", real)
            got = train_on_device(engine, 2, gas=1)  # the retry: a forward again, nothing else
    assert got == want


def test_init_device_and_initialize_device_must_agree(tmp_path):
    cfg = cfg_for(tmp_path, gas=1)
    with aio.zero.Init(cfg):
        model = gpt()
    with pytest.raises(ValueError, match="pass the same device"):
        aio.zero.initialize(model, cfg, device="cuda")


def _checkpointed(m, reentrant, **kwargs):
    """`m` with every block under torch.utils.checkpoint."""
    import torch.utils.checkpoint as tc

    def wrap(f):
        return lambda x: tc.checkpoint(f, x, use_reentrant=reentrant, **kwargs)

    for blk in m.blocks:
        blk.forward = wrap(blk.forward)
    return m


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_activation_checkpointing_reentrant_trains_as_in_memory(tmp_path, device):
    """torch.utils.checkpoint in its reentrant mode on every block: the
    blocks' forwards run again in backward, their parameters fetched again;
    the same bits as in memory."""
    want = _memory_losses(_checkpointed(gpt(), True), 3)
    assert _engine_losses(_checkpointed(gpt(), True), cfg_for(tmp_path, gas=1, clip=0), device, 3) == want


def _non_reentrant_cfg(tmp_path):
    cfg = cfg_for(tmp_path, gas=1, clip=0)
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = 16  # a block's 12 partitions, and room
    return cfg


def test_non_reentrant_activation_checkpointing_trains_as_in_memory_on_the_cpu(tmp_path):
    """use_reentrant=False (transformers 5's default): the recomputation in
    backward holds the block's parameters until their gradients land (it
    failed with a PoolExhaustedError or worse); the same bits as in memory.
    A block's partitions must fit the parameter buffers at once."""
    want = _memory_losses(_checkpointed(gpt(), False), 3)
    seen = []
    cfg = _non_reentrant_cfg(tmp_path)
    got = _engine_losses(_checkpointed(gpt(), False), cfg, "cpu", 3, lambda e: seen.append(e.fetcher))
    assert got == want and seen[0].counters["recompute_fetches"] > 0


@pytest.mark.parametrize("mode,seed", STRICT, ids=[f"{m}-{s}" for m, s in STRICT])
def test_non_reentrant_activation_checkpointing_on_the_simulated_gpu_equals_memory(tmp_path, mode, seed):
    """The same on a GPU model, in the strictest schedules. torch's
    recomputation check compares devices, which the simulator cannot fake
    for tensors made in backward: it is off here (determinism_check="none")
    and on in the real-GPU test below."""
    want = _memory_losses(_checkpointed(gpt(), False), 3)
    model = _checkpointed(gpt(), False, determinism_check="none")
    with CudaSim(scheduler=mode, seed=seed):
        with aio.zero.initialize(model, _non_reentrant_cfg(tmp_path), device="cuda") as engine:
            got = [_step(engine, step, "cuda") for step in range(3)]
            assert engine.fetcher.counters["recompute_fetches"] > 0
    assert got == want


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here or in CI)")
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_on_a_gpu_equals_no_checkpointing(tmp_path, reentrant):
    """On a real GPU (torch's recomputation check on): the same losses, bit
    for bit, as the same training on the GPU without checkpointing."""

    def losses(model, drive):
        with aio.zero.initialize(model, _non_reentrant_cfg(drive), device="cuda") as engine:
            return [_step(engine, step, "cuda") for step in range(4)]

    assert losses(_checkpointed(gpt(), reentrant), tmp_path / "b") == losses(gpt(), tmp_path / "a")
