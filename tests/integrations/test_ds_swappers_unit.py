"""aio's DeepSpeed parameter swapper, call by call (no engine, no process
group): which buffer goes back when, what is kept, what is waited for.
The engine-level checks, bit-exact against CPU offload, are in
test_ds_swappers.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install .[deepspeed])")

import torch  # noqa: E402
from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (  # noqa: E402
    AsyncPartitionedParameterSwapper,
    PartitionedParamStatus,
)
from deepspeed.runtime.zero import partition_parameters as pp  # noqa: E402
from deepspeed.runtime.zero import stage3  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402

import aio.integrations.deepspeed as aio_ds  # noqa: E402
from aio.integrations import ds_swappers  # noqa: E402

NUMEL = 1024  # a multiple of DeepSpeed's I/O alignment (256 fp32 elements)


@pytest.fixture
def enabled():
    """enable() for the test; disable() after unless it was on before."""
    before = aio_ds.is_enabled()
    aio_ds.enable()
    yield
    if not before:
        aio_ds.disable()


@pytest.fixture
def make_swapper(tmp_path, monkeypatch, enabled):
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)

    def make(buffer_count: int):
        offload = SimpleNamespace(nvme_path=str(tmp_path), buffer_size=NUMEL, buffer_count=buffer_count)
        aio_config = {
            "use_gds": False,
            "block_size": 1 << 20,
            "queue_depth": 8,
            "single_submit": False,
            "overlap_events": True,
            "intra_op_parallelism": 1,
        }
        cfg = SimpleNamespace(zero_config=SimpleNamespace(offload_param=offload), aio_config=aio_config)
        return ds_swappers.param_swapper_class()(cfg, torch.float32)

    return make


class Param:
    """What the swapper reads of a ZeRO-3 parameter."""

    def __init__(self, ds_id: int) -> None:
        self.ds_id = ds_id
        self.ds_numel = NUMEL
        self.ds_status = ZeroParamStatus.NOT_AVAILABLE
        self.data = torch.empty(0)
        self.ds_tensor = None


def on_drive(sw, ds_id: int) -> Param:
    """A parameter whose partition (values ds_id + 0, 1, 2, ...) is on the
    drive, made as zero.Init makes one."""
    p = Param(ds_id)
    buf = sw.get_buffer(p, NUMEL)
    part = torch.empty(0)
    part.data = buf.data
    part.ds_numel, part.status, part.final_location = NUMEL, PartitionedParamStatus.AVAILABLE, "nvme"
    p.ds_tensor = part
    part.copy_(torch.arange(NUMEL, dtype=torch.float32) + ds_id)
    sw.swap_out_and_release([p])
    assert part.status == PartitionedParamStatus.NOT_AVAILABLE
    return p


def gather(sw, *params: Param) -> None:
    """What a one-rank gather does: partitions available, then the
    parameters made views of them (pp NoGatherHandle on the CPU)."""
    with sw.gathering(params):
        sw.swap_in([p for p in params if p.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE], False)
    for p in params:
        p.data = p.ds_tensor.data.view(-1)
        p.ds_status = ZeroParamStatus.AVAILABLE


def values(p: Param) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) + p.ds_id


def shares_buffers(sw, t: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == sw.buffers.untyped_storage().data_ptr()


def test_gathered_partition_moves_to_memory_and_gives_its_buffer_back(make_swapper):
    sw = make_swapper(2)
    a, b, c = (on_drive(sw, i) for i in range(3))
    gather(sw, a)
    gather(sw, b)
    gather(sw, c)  # DeepSpeed: "Not enough buffers 0 for swapping 1"
    assert sw.counters["evicted"] == 1 and sw.counters["held_peak"] == 1
    # The oldest gathered partition stays AVAILABLE (the NVMe prefetch must not
    # read it again), with its values, in ordinary memory; so does the parameter.
    assert a.ds_tensor.status == PartitionedParamStatus.AVAILABLE
    assert not shares_buffers(sw, a.ds_tensor) and not shares_buffers(sw, a.data)
    assert torch.equal(a.data, values(a)) and torch.equal(a.ds_tensor, values(a))
    assert torch.equal(c.data, values(c)) and torch.equal(b.data, values(b))
    sw.remove_partition_and_release_buffers([a, b, c])  # partition() at release
    assert sw._private_bytes == 0 and len(sw.available_buffer_ids) == 2
    assert a.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE


def test_prefetched_partition_nobody_gathers_is_dropped_for_a_needed_read(make_swapper):
    sw = make_swapper(2)
    a, b, c = (on_drive(sw, i) for i in range(3))
    sw.swap_in([a, b], async_op=True)  # the coordinator's NVMe prefetch
    sw.synchronize_reads()
    gather(sw, c)
    assert sw.counters["dropped_prefetch"] == 1 and sw.counters["waited"] == 0
    # The latest prefetched (needed last) goes; it is read again when needed.
    assert b.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE
    assert a.ds_tensor.status == PartitionedParamStatus.AVAILABLE
    gather(sw, b)
    assert torch.equal(b.data, values(b)) and torch.equal(c.data, values(c))


def test_needed_read_waits_for_reads_in_flight(make_swapper):
    sw = make_swapper(2)
    a, b, c = (on_drive(sw, i) for i in range(3))
    sw.swap_in([a, b], async_op=True)  # in flight: their buffers cannot be taken yet
    gather(sw, c)
    assert sw.counters["waited"] == 1 and sw.counters["dropped_prefetch"] == 1
    gather(sw, a)
    assert torch.equal(a.data, values(a)) and torch.equal(c.data, values(c))


def test_partitions_of_the_gather_in_progress_are_never_dropped(make_swapper):
    sw = make_swapper(2)
    a, b, c = (on_drive(sw, i) for i in range(3))
    sw.swap_in([a, b], async_op=True)
    with pytest.raises(ValueError, match=r"offload_param\.buffer_count=2 is too small.*at least 3"):
        gather(sw, a, b, c)
    assert a.ds_tensor.status != PartitionedParamStatus.NOT_AVAILABLE
    assert b.ds_tensor.status != PartitionedParamStatus.NOT_AVAILABLE


def test_prefetch_takes_a_parameter_once_and_only_free_or_evictable_buffers(make_swapper):
    sw = make_swapper(2)
    a, b, c = (on_drive(sw, i) for i in range(3))
    sw.swap_in([a, a], async_op=True)  # DeepSpeed: "param 0 already assigned swap buffer id 1"
    assert sw.counters["deduplicated"] == 1
    sw.swap_in([b, c], async_op=True)  # one free buffer; a is prefetched, not gathered: kept
    assert sw.counters["trimmed_prefetch"] == 1 and sw.counters["dropped_prefetch"] == 0
    sw.synchronize_reads()
    assert c.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE
    assert torch.equal(a.ds_tensor, values(a)) and torch.equal(b.ds_tensor, values(b))


def test_prefetch_may_evict_gathered_partitions(make_swapper):
    sw = make_swapper(2)
    a, b, c = (on_drive(sw, i) for i in range(3))
    gather(sw, a)
    gather(sw, b)
    assert sw.available_swap_in_buffers() == 2  # what the coordinator bounds its prefetch by
    sw.swap_in([c], async_op=True)
    sw.synchronize_reads()
    assert sw.counters["evicted"] == 1 and torch.equal(c.ds_tensor, values(c))


def test_partition_updated_in_its_memory_copy_is_written_from_a_buffer(make_swapper):
    """GatheredParameters(modifier_rank=...) repartitions a gathered
    parameter: the swapper writes it, also after it was evicted."""
    sw = make_swapper(1)
    a, b = on_drive(sw, 0), on_drive(sw, 1)
    gather(sw, a)
    gather(sw, b)  # a is evicted
    a.ds_tensor.data.add_(100)
    sw.swap_out_and_release([a])
    assert sw.counters["rebuffered"] == 1
    assert a.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE
    sw.remove_partition_and_release_buffers([b])
    gather(sw, a)
    assert torch.equal(a.data, values(a) + 100)


class FakeEvent:
    """Stands in for a CUDA event (no device here): records the calls."""

    log: list[str] = []

    def record(self, stream=None) -> None:
        FakeEvent.log.append("record")

    def synchronize(self) -> None:
        FakeEvent.log.append("synchronize")


def test_buffer_read_by_a_device_copy_is_reused_only_after_its_event(make_swapper, monkeypatch):
    """On a device, the gathered parameter was copied out of the pinned
    buffer by an asynchronous host-to-device copy: the buffer is reused only
    after an event recorded behind that copy has completed (never a
    device-wide synchronize)."""
    from aio.integrations import _ds_param_swapper

    FakeEvent.log = []
    monkeypatch.setattr(_ds_param_swapper, "get_accelerator", lambda: SimpleNamespace(Event=FakeEvent))
    sw = make_swapper(1)
    a, b = on_drive(sw, 0), on_drive(sw, 1)
    with sw.gathering([a]):
        sw.swap_in([a], async_op=False)
    a.data = torch.empty(NUMEL, device="meta")  # "on the device": not a view of the buffer
    a.ds_status = ZeroParamStatus.AVAILABLE
    reads = []
    handle = sw.aio_read_handle
    orig = handle.async_pread

    def async_pread(*args, **kwargs):
        reads.append(list(FakeEvent.log))
        return orig(*args, **kwargs)

    monkeypatch.setattr(handle, "async_pread", async_pread)
    gather(sw, b)
    assert reads == [["record", "synchronize"]]  # the read into a's buffer started after the event
    assert sw.counters["device_waits"] == 1 and torch.equal(b.data, values(b))
    assert torch.equal(a.ds_tensor, values(a))


def test_enable_installs_and_disable_restores(enabled):
    assert pp.AsyncPartitionedParameterSwapper is ds_swappers.param_swapper_class()
    assert stage3.PipelinedOptimizerSwapper is ds_swappers.optimizer_swapper_class()
    assert getattr(pp.Init._ensure_availability_of_partitioned_params, "_aio_wrapped", False)
    assert issubclass(pp.AsyncPartitionedParameterSwapper, AsyncPartitionedParameterSwapper)
    aio_ds.disable()
    assert pp.AsyncPartitionedParameterSwapper is AsyncPartitionedParameterSwapper
    assert stage3.PipelinedOptimizerSwapper.__module__.startswith("deepspeed")
    assert not getattr(pp.Init._ensure_availability_of_partitioned_params, "_aio_wrapped", False)
    aio_ds.enable()
    assert ds_swappers.installed()


def test_switch_off_leaves_deepspeeds_classes(monkeypatch):
    before = aio_ds.is_enabled()
    aio_ds.disable()
    monkeypatch.setenv("AIO_DEEPSPEED_SWAPPERS", "0")
    aio_ds.enable()
    try:
        assert aio_ds.is_enabled() and not ds_swappers.installed()
        assert pp.AsyncPartitionedParameterSwapper is AsyncPartitionedParameterSwapper
        # DeepSpeed's pipelined optimizer swapper too: its first-step state stays (below).
        assert stage3.PipelinedOptimizerSwapper.__module__.startswith("deepspeed")
    finally:
        aio_ds.disable()
        if before:
            monkeypatch.delenv("AIO_DEEPSPEED_SWAPPERS")
            aio_ds.enable()


def test_other_deepspeed_versions_are_left_untouched(monkeypatch, caplog):
    was = ds_swappers.installed()
    ds_swappers.uninstall()
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    try:
        with caplog.at_level(logging.WARNING, logger="aio"):
            assert ds_swappers.install() is False
        assert pp.AsyncPartitionedParameterSwapper is AsyncPartitionedParameterSwapper
        assert any(
            "left as they are" in r.getMessage() and "0.20.1" in r.getMessage() for r in caplog.records
        )
    finally:
        monkeypatch.undo()
        if was:
            ds_swappers.install()


def test_the_switch_off_also_undoes_an_earlier_install(monkeypatch):
    from deepspeed.runtime.zero import partition_parameters as pp

    from aio.integrations import ds_swappers

    ds_swappers.uninstall()
    own = pp.AsyncPartitionedParameterSwapper
    try:
        assert ds_swappers.install()
        assert pp.AsyncPartitionedParameterSwapper is not own
        monkeypatch.setenv(ds_swappers.ENV_SWITCH, "0")
        assert not ds_swappers.install()
        assert pp.AsyncPartitionedParameterSwapper is own and not ds_swappers.installed()
    finally:
        ds_swappers.uninstall()


def test_a_model_built_before_enable_is_told(caplog):
    import torch
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

    from aio.integrations import ds_swappers

    model = torch.nn.Linear(2, 2)
    model.weight.nvme_swapper = object.__new__(AsyncPartitionedParameterSwapper)  # DeepSpeed's own class
    ds_swappers.uninstall()
    assert not ds_swappers.warn_if_built_before(model)  # not installed: nothing to say
    try:
        assert ds_swappers.install()
        assert ds_swappers.warn_if_built_before(model)
        assert "before aio.integrations.deepspeed.enable()" in caplog.text
        model.weight.nvme_swapper = object.__new__(ds_swappers.param_swapper_class())
        assert not ds_swappers.warn_if_built_before(model)
    finally:
        ds_swappers.uninstall()


# -- the pipelined optimizer swapper ---------------------------------------------------------
OPT_NUMEL = 1 << 18  # 1 MiB of fp32: DeepSpeed swaps optimizer tensors of 1 MiB (MIN_AIO_BYTES) and up


def optimizer_swapper(tmp_path, monkeypatch, cls):
    """An optimizer swapper of class `cls` (no engine), as stage3 makes the
    pipelined one: HF's 4 buffers, pipelining on, an optimizer whose state
    the test fills in."""
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    aio_config = {
        "use_gds": False,
        "block_size": 1 << 20,
        "queue_depth": 8,
        "single_submit": False,
        "overlap_events": True,
        "intra_op_parallelism": 1,
    }
    swap = SimpleNamespace(buffer_count=4, pipeline_read=True, pipeline_write=True)
    opt = SimpleNamespace(state={})
    return cls(swap, aio_config, str(tmp_path), opt, OPT_NUMEL, "cpu", torch.float32, None)


def sub_groups(sw, *names: str) -> list[torch.Tensor]:
    """Sub-groups' flat fp32 weights written at set-up, as stage3 does
    before the first step (weights 0, 1, 2, ...)."""
    groups = []
    for name in names:
        fp32 = torch.empty(0)
        fp32.ds_id = name  # stage3 names its flat fp32 sub-groups by their parameters' ids
        groups.append(fp32)
    src = [torch.arange(OPT_NUMEL, dtype=torch.float32) for _ in names]
    sw.initialize_parameters(parameters=groups, src_tensors=src)
    return groups


def first_step(sw, fp32: torch.Tensor, async_swap: bool) -> dict[str, torch.Tensor]:
    """One sub-group's first optimizer step as stage3 makes it: read in,
    Adam's state created in ordinary memory, swapped out. Returns that
    state (the optimizer's own tensors)."""
    sw.swap_in_optimizer_state(parameter=fp32, async_parameter=None)
    state = {
        "exp_avg": torch.full((OPT_NUMEL,), 1.5),
        "exp_avg_sq": torch.full((OPT_NUMEL,), 2.5),
        "step": torch.tensor(1.0),
    }
    sw.optimizer.state[fp32] = state
    sw.swap_out_optimizer_state(parameter=fp32, async_swap=async_swap)
    return state


def moments(state: dict[str, torch.Tensor]) -> list[int]:
    return [state[k].numel() for k in ("exp_avg", "exp_avg_sq")]


def test_first_step_state_is_released_once_its_write_has_completed(tmp_path, monkeypatch, enabled):
    """DeepSpeed's pipelined swapper copies the state Adam created into swap
    buffers and keeps the originals until the next swap-in (8 bytes per
    parameter after step 1). aio's releases them, but never while the write
    is in flight: a pending write (pipeline_write) keeps them until it is
    completed, here by the next sub-group's swap-out."""
    sw = optimizer_swapper(tmp_path, monkeypatch, ds_swappers.optimizer_swapper_class())
    fp32_a, fp32_b = sub_groups(sw, "a", "b")
    a = first_step(sw, fp32_a, async_swap=True)
    assert sw.swap_ops["async_swap_out"] is not None  # a's write is pending
    assert moments(a) == [OPT_NUMEL] * 2 and sw.counters["state_released"] == 0
    b = first_step(sw, fp32_b, async_swap=False)  # completes a's write first, then b's
    assert moments(a) == [0, 0] and moments(b) == [0, 0]
    assert sw.counters["state_released"] == 4
    assert sw.counters["state_released_bytes"] == 4 * OPT_NUMEL * 4
    assert a["step"].item() == 1.0  # not swapped: left as it is
    # The same tensor objects get the written values back at the next swap-in.
    sw.swap_in_optimizer_state(parameter=fp32_a, async_parameter=None)
    assert torch.equal(a["exp_avg"], torch.full((OPT_NUMEL,), 1.5))
    assert torch.equal(a["exp_avg_sq"], torch.full((OPT_NUMEL,), 2.5))
    assert torch.equal(fp32_a, torch.arange(OPT_NUMEL, dtype=torch.float32))


def test_deepspeeds_pipelined_swapper_keeps_the_first_step_state(tmp_path, monkeypatch, enabled):
    """Negative control (and what AIO_DEEPSPEED_SWAPPERS=0 keeps): DeepSpeed's
    own class leaves the state in ordinary memory after its write. If this
    fails, DeepSpeed releases it itself and aio's release can go."""
    from deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper import PipelinedOptimizerSwapper

    sw = optimizer_swapper(tmp_path, monkeypatch, PipelinedOptimizerSwapper)
    fp32_a, fp32_b = sub_groups(sw, "a", "b")
    a = first_step(sw, fp32_a, async_swap=True)
    b = first_step(sw, fp32_b, async_swap=False)
    assert all(op is None for op in sw.swap_ops.values())  # every write completed
    assert moments(a) == [OPT_NUMEL] * 2 and moments(b) == [OPT_NUMEL] * 2


def test_its_files_go_with_it_engine_or_not(make_swapper):
    # zero.Init makes the swapper and writes its files before deepspeed.initialize;
    # an initialize that then failed left them (the clean-up was the engine's).
    import gc
    import os

    swapper = make_swapper(2)
    path = os.path.join(swapper.swap_folder, "5_param.tensor.swp")
    open(path, "wb").close()
    swapper.id_to_path[5] = path
    other = os.path.join(swapper.swap_folder, "notes.txt")  # not its own: stays
    open(other, "w").close()
    del swapper
    gc.collect()
    assert not os.path.exists(path) and os.path.exists(other)


def test_no_optimizer_buffers_is_refused_naming_the_key(tmp_path, monkeypatch, enabled):
    # DeepSpeed's pool raised IndexError ("list index out of range") for buffer_count 0.
    cls = ds_swappers.optimizer_swapper_class()
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    swap = SimpleNamespace(buffer_count=0, pipeline_read=True, pipeline_write=True)
    aio_config = {"use_gds": False, "block_size": 1 << 20, "queue_depth": 8, "single_submit": False,
                  "overlap_events": True, "intra_op_parallelism": 1}  # fmt: skip
    with pytest.raises(ValueError, match=r"offload_optimizer\.buffer_count=0 is too small"):
        cls(swap, aio_config, str(tmp_path), SimpleNamespace(state={}), OPT_NUMEL, "cpu", torch.float32, None)
