"""aio.zero.params: parameters live in the store, placeholders between uses."""

import pytest
import torch

import aio.zero

from .common import V, W, cfg_for, gpt, loss_of, train_engine


def test_parameters_are_placeholders_between_uses(tmp_path):
    cfg = cfg_for(tmp_path)
    with aio.zero.initialize(gpt(), cfg) as engine:
        train_engine(engine, 2)
        for p in engine.module.parameters():
            assert p.numel() == 0 and p.aio_numel > 0
        sw = engine.store.swapper
        held = [part_id for part_id, n in engine.store.refs.items() if n > 0]
        assert held == []
        # Only prefetched (speculative) partitions may hold a buffer now.
        buffered = {part_id for part_id, part in sw.parts.items() if part.lease is not None}
        assert buffered <= set(engine.store.speculative)
        # The full model is readable on demand.
        sd = engine.state_dict()
        assert (
            sd["wte.weight"].shape == (V, W) and sd["head.weight"].data_ptr() != sd["wte.weight"].data_ptr()
        )
        assert torch.equal(sd["head.weight"], sd["wte.weight"])


def test_too_few_parameter_buffers_is_a_clear_error(tmp_path):
    cfg = cfg_for(tmp_path, gas=1)
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = 1  # qkv needs weight and bias at once
    with aio.zero.initialize(gpt(), cfg) as engine:
        with pytest.raises(aio.swap.PoolExhaustedError, match="buffer_count"):
            loss_of(engine, 0, 0)


def _fake_device_store(tmp_path, monkeypatch, param_device, sizes):
    """A ParamStore whose compute device is a fake CUDA device (aio.zero.streams
    with fake streams): uploads run only when the fake runs them."""
    from aio.config import load_train_config
    from aio.zero.params import ParamStore
    from aio.zero.streams import DeviceCopies

    from .fake_streams import FakeBackend

    cfg = load_train_config(cfg_for(tmp_path, param=param_device, opt="cpu"))
    store = ParamStore(cfg, "cpu")
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for i, p in enumerate(ps):
        store.adopt(p, f"p{i}")
    store.device = torch.device("cuda")
    backend = FakeBackend(first="compute")
    store.copies = store.uploads.copies = DeviceCopies(backend, small_bytes=1024)  # 20_000 fp32: large
    return store, ps, backend


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
def test_fetch_to_a_device_waits_on_no_host_sync(tmp_path, monkeypatch, param_device):
    """A large parameter goes up alone, the small ones in one copy; the host
    never synchronizes; the device tensors hold the stored values."""
    store, ps, b = _fake_device_store(tmp_path, monkeypatch, param_device, [20_000, 30, 7, 5])
    try:
        store.acquire(ps)
        assert b.synchronizes() == 0 and store.copies.counters["h2d_copies"] == 2
        b.run_all()
        for p in ps:
            assert p.shape == (p.aio_numel,) and torch.equal(p.data, store.read(p))
        store.drop(ps)
    finally:
        store.close()


def test_swap_buffer_goes_back_only_after_its_upload(tmp_path, monkeypatch):
    """Dropped while its upload is still queued, a partition keeps its buffer;
    the buffer returns once the upload is done, and a fetch that needs it waits
    for that upload (and no other wait happens)."""
    store, ps, b = _fake_device_store(tmp_path, monkeypatch, "nvme", [20_000] * 7)  # 6 buffers
    pool = store.swapper.pool
    try:
        store.acquire(ps[:3])
        store.drop(ps[:3])
        assert (
            set(store.uploads.deferred) == {p.aio_id for p in ps[:3]} and pool.available() == pool.count - 3
        )
        store.acquire(ps[3:6])  # 3 free buffers: nothing waited
        assert b.synchronizes() == 0
        store.drop(ps[3:6])
        store.acquire(ps[:1])  # still buffered: reused without a wait
        assert b.synchronizes() == 0 and ps[0].aio_id not in store.uploads.deferred
        b.run_all()
        store.acquire(ps[1:2])  # done uploads give their buffers back without a wait
        assert b.synchronizes() == 0 and not store.uploads.deferred
        b.run_all()
        for p in ps[:2]:
            assert torch.equal(p.data, store.read(p))
        store.drop(ps[:2])
        store.acquire(ps[2:])
        store.drop(ps[2:])
        assert len(store.uploads.deferred) == 5 and pool.available() == 1
        store.acquire(ps[:2])  # one buffer short: waits for the oldest upload, once
        assert b.synchronizes() == 1
        b.run_all()
        for p in ps[:2]:
            assert torch.equal(p.data, store.read(p))
        store.drop(ps[:2])
    finally:
        store.close()


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
def test_write_waits_for_the_upload_reading_the_old_values(tmp_path, monkeypatch, param_device):
    store, ps, b = _fake_device_store(tmp_path, monkeypatch, param_device, [20_000, 7])
    try:
        old = [store.read(p) for p in ps]
        store.acquire(ps)
        live = [p.data for p in ps]
        for p in ps:
            store.write(p, torch.full((p.aio_numel,), 3.0), async_op=True)
        b.run_all()
        for p, o, t in zip(ps, old, live, strict=True):
            assert torch.equal(t, o)  # the upload queued before the write saw the old values
            assert torch.equal(store.read(p), torch.full((p.aio_numel,), 3.0))
            assert torch.equal(p.data, torch.full((p.aio_numel,), 3.0))  # in use: refreshed
        store.drop(ps)
    finally:
        store.close()


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_an_optimizer_step_copies_each_parameter_once(tmp_path, param_device, dtype):
    """Each step copies every parameter once; bf16 parameters in CPU memory
    are not copied at all: the Adam kernel writes each packed sub-group's
    bf16 copy in its update pass."""
    extra = {"bf16": {"enabled": True}} if dtype else {}
    cfg = cfg_for(tmp_path, param=param_device, opt="cpu", gas=1, **extra)
    model = gpt().to(torch.bfloat16) if dtype else gpt()
    with aio.zero.initialize(model, cfg) as engine:
        store = engine.store
        train_engine(engine, 1, gas=1)
        before, writes = store.stats()["write_copy_bytes"], store.stats()["writes"]
        train_engine(engine, 1, gas=1, start=1)
        param_bytes = sum(p().aio_numel * p().element_size() for p in store.params.values())
        fused = param_device == "cpu" and dtype == "bf16"
        assert bool(store.packed) == fused
        assert store.stats()["write_copy_bytes"] - before == (0 if fused else param_bytes)
        assert store.stats()["writes"] - writes == len(store.params)


def test_packed_sub_groups_are_the_parameters_storage(tmp_path):
    """In CPU memory in bf16, each sub-group's parameters are consecutive
    views of one tensor, which the optimizer's kernel writes: after a step,
    that tensor is the master weights rounded to bf16, and the model's
    parameters show it."""
    cfg = cfg_for(tmp_path, param="cpu", opt="cpu", gas=1, bf16={"enabled": True})
    with aio.zero.initialize(gpt().to(torch.bfloat16), cfg) as engine:
        store = engine.store
        train_engine(engine, 2, gas=1)
        assert set(store.packed) == set(range(len(engine.layout.groups)))
        for gi, (flat, part_ids) in store.packed.items():
            assert [s.param.aio_id for s in engine.layout.groups[gi]] == part_ids
            for s in engine.layout.groups[gi]:
                assert s.param.data.data_ptr() == flat[s.offset :].data_ptr()
            assert torch.equal(flat, engine.optimizer.master[gi].to(torch.bfloat16))


@pytest.mark.parametrize("param_device", ["nvme", "cpu"])
def test_malloc_bound_while_building_relaxed_for_training(tmp_path, monkeypatch, param_device):
    """Parameters on the drive are built under a 1 MiB mmap threshold; every
    training pass (CPU offload too, where no parameter is fetched) recycles
    its temporaries in the heap: 8 MiB mmap, 64 MiB trim thresholds."""
    from aio.zero import malloc as params_mod

    monkeypatch.setattr(params_mod, "_mmap_threshold", None)
    monkeypatch.setattr(params_mod, "_trim_threshold", None)
    with aio.zero.initialize(gpt(), cfg_for(tmp_path, param=param_device)) as engine:
        building = (params_mod.BUILD_MMAP_THRESHOLD, None) if param_device == "nvme" else (None, None)
        assert (params_mod._mmap_threshold, params_mod._trim_threshold) == building
        train_engine(engine, 1)
        assert params_mod._mmap_threshold == params_mod.TRAIN_MMAP_THRESHOLD
        assert params_mod._trim_threshold == params_mod.TRAIN_TRIM_THRESHOLD


def _stored(store, model):
    return {n: store.read(p).clone() for n, p in model.named_parameters()}


def test_adoption_writes_overlap_the_build_within_a_bound(tmp_path, monkeypatch):
    """Under Init each parameter's initial values are written without waiting,
    at most ADOPT_WRITE_BYTES in flight (the oldest waited for past it), and
    what lands equals the model built in memory."""
    from aio.zero import params as params_mod

    monkeypatch.setattr(params_mod, "ADOPT_WRITE_BYTES", 16 << 10)
    seen = []
    settle = params_mod.ParamStore._settle_adoption

    def spy(self):
        seen.append(self._adopting_bytes)
        settle(self)

    monkeypatch.setattr(params_mod.ParamStore, "_settle_adoption", spy)
    mem = gpt()
    with aio.zero.Init(cfg_for(tmp_path)) as init:
        model = gpt()
        assert init.store._adopting_bytes <= (16 << 10) + max(p.aio_numel * 4 for p in model.parameters())
    assert init.store._adopting_bytes == 0 and not init.store._adopting  # Init's exit waited for all
    assert seen and max(seen) > 0
    got = _stored(init.store, model)
    for name, p in mem.named_parameters():
        assert torch.equal(got[name], p.detach().reshape(-1)), name
    init.store.close()


def test_a_failed_adoption_write_is_raised_by_init_with_its_place(tmp_path):
    import errno

    with pytest.raises(aio.swap.SwapStateError, match="writing partition") as ei:
        with aio.zero.Init(cfg_for(tmp_path)) as init:
            init.store.swapper.space.drives[0].writer._c.inject_fault("error", errno.EIO, "write", 2, 1)
            gpt()
    cause = ei.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.EIO and "param" in str(cause.filename)
    init.store.close()


def test_gathering_more_parameters_than_buffers_says_what_to_do(tmp_path):
    """gathered() of the whole model (its default) needs a buffer per drive
    partition at once: past the buffers it is a ValueError pointing at
    gathering fewer or state_dict(), before anything is read."""
    from .common import cfg_for, gpt

    with aio.zero.initialize(gpt(), cfg_for(tmp_path)) as engine:  # 6 parameter buffers
        with pytest.raises(ValueError, match="gather fewer"):
            with engine.gathered():
                pass
        assert engine.store.swapper.pool.available() == engine.store.swapper_buffer_count()
        params = list(engine.module.parameters())[:3]
        with engine.gathered(params):
            assert all(p.numel() > 0 for p in params)
        assert len(engine.state_dict()) > len(params)
