"""aio's buffer rules inside DeepSpeed's ZeRO-3 NVMe swappers (issue 43).

Every case trains a few steps under DeepSpeed 0.19 on CPU (DS_ACCELERATOR=cpu,
gloo) with HF Transformers' documented ZeRO-3 NVMe block (parameter
buffer_count 5, optimizer buffer_count 4, stage3_max_reuse_distance and
max_live_parameters 1e9, the Trainer's ``auto`` values), in configs where
DeepSpeed's own swappers assert. The oracle is DeepSpeed's CPU-offload run
of the same model and batches: the losses must be equal bit for bit on every
rank (a swapper that moves the wrong bytes at the wrong time shows up there,
and nowhere else: the naive eviction below trains without an error).

Several cases share one process group (ds_swapper_train.py runs them one
after the other), so a module costs one start of DeepSpeed per rank.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install .[deepspeed])")

from aio.integrations import ds_swappers  # noqa: E402

from .ds_swapper_run import run_ranks  # noqa: E402

pytestmark = [pytest.mark.deepspeed, pytest.mark.xdist_group("deepspeed-swappers")]

HF = {}  # the defaults of ds_swapper_train.CASE_DEFAULTS are HF's block
MLP6 = {"layers": 6}  # 6 swappable weights, 5 buffers: DeepSpeed's smallest failing config
PIPE = {"layers": 8, "pipeline": True, "sub_group_size": 300_000}
PREFETCH = {"model": "gpt", "layers": 2, "prefetch": 5e7, "param_buffers": 32}  # tied embedding

ONE_RANK = [
    {"name": "mlp6-cpu", "offload": "cpu", **MLP6},
    {"name": "mlp6", **MLP6},
    {"name": "mlp6-naive", "swappers": "naive", **MLP6},
    {"name": "mlp8-cpu", "offload": "cpu", "layers": 8, "sub_group_size": 300_000},
    {"name": "pipe", **PIPE},
    {"name": "ckpt-plain", "layers": 8, "sub_group_size": 300_000, "checkpointing": "plain"},
    {"name": "ckpt-reentrant", **PIPE, "checkpointing": "reentrant", "prefetch": 5e7},
    {"name": "prefetch-cpu", "offload": "cpu", **PREFETCH},
    {"name": "prefetch", **PREFETCH},
    # A held cap below one partition: one rank's gathered parameters are their
    # buffers, so at step 2 the gather raises rather than wait.
    {"name": "mlp6-capped", **MLP6, "host_budget": 100_000},
    # Negative controls last: DeepSpeed's own classes, same configs.
    {"name": "mlp6-ds", "swappers": "ds", **MLP6},
    {"name": "pipe-ds", "swappers": "ds", **PIPE},
    {"name": "prefetch-ds", "swappers": "ds", **PREFETCH},
]

# Two ranks: h=768 so that half an h x h weight is still swappable (1 MiB).
MLP2 = {"width": 768, "layers": 6}
GPT2 = {"model": "gpt", "layers": 2}
PIPE2 = {"width": 768, "layers": 6, "pipeline": True, "sub_group_size": 300_000}
RESUME = {**PIPE2, "steps": 5, "persistence": "auto"}
CAP2 = 1_500_000  # aio_zero.host_memory_budget in bytes


def two_rank_cases(ckpt: str) -> list[dict]:
    return [
        {"name": "mlp-cpu", "offload": "cpu", **MLP2},
        {"name": "mlp", **MLP2},
        {"name": "gpt-cpu", "offload": "cpu", **GPT2},
        {"name": "gpt", **GPT2},
        # Held cap 1.5 MB: one gathered partition (1 MiB) kept, the others released.
        {"name": "gpt-capped", **GPT2, "host_budget": CAP2},
        {"name": "pipe-cpu", "offload": "cpu", **RESUME},
        {"name": "pipe-full", **RESUME, "save_at": [1, 3], "ckpt": ckpt},
        {"name": "pipe-resumed", **RESUME, "load": True, "ckpt": ckpt},
        # From step 1, saved with the first-step state released (empty tensors).
        {"name": "pipe-resumed-1", **RESUME, "load": True, "load_tag": "global_step1", "ckpt": ckpt},
        {"name": "mlp-ds", "swappers": "ds", **MLP2},
        {"name": "gpt-ds", "swappers": "ds", **GPT2},
        {"name": "pipe-ds", "swappers": "ds", **PIPE2},
    ]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("one-rank"), ONE_RANK, world=1)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    work = tmp_path_factory.mktemp("two-ranks")
    return run_ranks(work, two_rank_cases(str(work / "ckpt")), world=2)


def trained(results, name: str, steps: int = 3) -> list[list[float]]:
    """Each rank's losses of case `name`, which must have trained every step."""
    for r in results:
        rec = r[name]
        assert rec["error"] is None, f"{name}: {rec['error']}\n{rec.get('traceback', '')}"
        assert len(rec["losses"]) == steps, rec["losses"]
    return [r[name]["losses"] for r in results]


def counters(results, name: str) -> dict[str, int]:
    rec = results[0][name]
    return {**rec["param_counters"], **rec["optimizer_counters"]}


def test_held_partitions_past_buffer_count_equal_cpu_offload(one_rank):
    # DeepSpeed: "Not enough buffers 0 for swapping 1" at step 2 (below).
    assert trained(one_rank, "mlp6") == trained(one_rank, "mlp6-cpu")
    c = counters(one_rank, "mlp6")
    assert c["evicted"] > 0 and c["held_peak"] > 0 and c["held_peak_bytes"] > 0


def test_naive_eviction_fails_the_comparison(one_rank):
    """Mutation: dropping a gathered parameter's partition (DeepSpeed's plain
    release) instead of keeping it trains without an error, to wrong losses."""
    rec = one_rank[0]["mlp6-naive"]
    assert rec["param_counters"]["evicted"] > 0
    assert rec["error"] is not None or rec["losses"] != one_rank[0]["mlp6-cpu"]["losses"]


def test_pipelined_optimizer_backpressure_equals_cpu_offload(one_rank):
    # DeepSpeed: pipelined_optimizer_swapper.py:219 at step 1 (below).
    assert trained(one_rank, "pipe") == trained(one_rank, "mlp8-cpu")
    c = counters(one_rank, "pipe")
    assert c["writes_completed_early"] > 0
    assert c["read_ahead_skipped"] + c["read_ahead_dropped"] > 0
    assert c["evicted"] > 0


def released_after_step_1(rec: dict) -> None:
    """The first-step state of every NVMe-swapped sub-group is out of
    ordinary memory after step 1 and counted: Adam's two fp32 moments,
    8 bytes per element, no more, no less."""
    state, c = rec["first_step_state"], rec["optimizer_counters"]
    assert state["numels"] and not any(state["numels"]), state  # DeepSpeed's class: each sub-group's size
    assert c["state_released"] == len(state["numels"]), c
    assert c["state_released_bytes"] == 8 * state["elements"] > 0, (c, state)


def test_pipelined_swapper_releases_the_first_step_state_once_written(one_rank):
    """DeepSpeed's pipelined optimizer swapper keeps the Adam state the first
    step creates in ordinary memory until step 2 (8 bytes per parameter;
    deepspeed.md, Upstream 6); aio's releases it once its write completed.
    Mutation: without the release, the numels are the sub-groups' sizes and
    the counters 0. Losses stay CPU offload's (above)."""
    released_after_step_1(one_rank[0]["pipe"])
    # Pipelining off: DeepSpeed's plain swapper releases it itself.
    assert not any(one_rank[0]["mlp6"]["first_step_state"]["numels"])


@pytest.mark.parametrize("case", ["ckpt-plain", "ckpt-reentrant"])
def test_activation_checkpointing_equals_cpu_offload(one_rank, case):
    assert trained(one_rank, case) == trained(one_rank, "mlp8-cpu")
    assert counters(one_rank, case)["evicted"] > 0


def test_prefetch_lists_a_recurring_parameter_once(one_rank):
    # DeepSpeed: "param N already assigned swap buffer id M" (below).
    assert trained(one_rank, "prefetch") == trained(one_rank, "prefetch-cpu")
    assert counters(one_rank, "prefetch")["deduplicated"] > 0


NEGATIVE = {
    "mlp6-ds": ("partitioned_param_swapper.py:310", "Not enough buffers 0 for swapping 1"),
    "pipe-ds": ("pipelined_optimizer_swapper.py:219", ""),
    "prefetch-ds": ("partitioned_param_swapper.py:185", "already assigned swap buffer id"),
    "mlp-ds": ("partitioned_param_swapper.py:310", "Not enough buffers 0 for swapping 1"),
    "gpt-ds": ("partitioned_param_swapper.py:310", "Not enough buffers 0 for swapping 1"),
}


@pytest.mark.parametrize("case", ["mlp6-ds", "pipe-ds", "prefetch-ds"])
def test_deepspeeds_own_swappers_still_assert(one_rank, case):
    """Negative control: if DeepSpeed fixes an assert, this says so (and
    aio's classes may go for that DeepSpeed)."""
    where, text = NEGATIVE[case]
    for r in one_rank:
        rec = r[case]
        assert rec["error"] is not None and rec["error"].startswith("AssertionError"), rec["error"]
        assert rec["where"] == where and text in rec["error"]


def test_summary_line_once_per_run(one_rank):
    lines = [x for x in one_rank[0]["_stderr"].splitlines() if "aio's buffer rules" in x]
    assert len(lines) == 1, lines
    held = r"held [1-9]\d* gathered partitions past buffer_count=[\d/]+ in ordinary memory"
    assert re.search(held, lines[0])
    assert re.search(r"took [1-9]\d* repeated prefetch entries once", lines[0])
    assert re.search(r"[1-9]\d* writes completed early", lines[0])
    assert re.search(r"released [1-9]\d* first-step state tensors once written \([\d.]+ [KMG]iB\)", lines[0])
    # The held bytes against their cap (the smallest of the engines': mlp6-capped's).
    assert re.search(
        r"at most [1-9]\d* at once, [\d.]+ [KMG]iB; cap 97\.7 KiB, aio_zero\.host_memory_budget", lines[0]
    )


def test_past_the_held_cap_one_rank_raises_instead_of_waiting(one_rank):
    """One rank on the CPU: a gathered parameter is a view of its buffer, so
    past the cap no buffer can come back; the gather raises, naming both
    settings, instead of waiting for a release that would never come."""
    rec = one_rank[0]["mlp6-capped"]
    error = rec["error"] or ""
    assert error.startswith("ValueError: zero_optimization.offload_param.buffer_count=5 "), error
    assert "cap of 97.7 KiB (aio_zero.host_memory_budget 100000 bytes" in error
    assert rec["losses"] == one_rank[0]["mlp6-cpu"]["losses"][:1]  # step 1 keeps nothing gathered
    assert rec["param_counters"]["held_peak_bytes"] <= 100_000


@pytest.mark.parametrize("case", ["mlp", "gpt"])
def test_two_ranks_equal_cpu_offload_on_every_rank(two_ranks, case):
    theirs = trained(two_ranks, f"{case}-cpu")
    assert trained(two_ranks, case) == theirs
    assert theirs[0] != theirs[1]  # each rank's own batch: both ranks compared
    assert all(r[case]["param_counters"]["evicted"] > 0 for r in two_ranks)


def test_past_the_held_cap_partitions_are_released_and_losses_stay_exact(two_ranks):
    """Two ranks: a gathered parameter holds its own copy (the all-gather's
    output), so past the cap its partition is released instead of kept (the
    drive has it); training stays bit-identical to CPU offload."""
    assert trained(two_ranks, "gpt-capped") == trained(two_ranks, "gpt-cpu")
    for r in two_ranks:
        c = r["gpt-capped"]["param_counters"]
        assert c["evicted"] > 0 and c["released"] > 0, c
        assert 0 < c["held_peak_bytes"] <= CAP2
    line = next(x for x in two_ranks[0]["_stderr"].splitlines() if "aio's buffer rules" in x)
    assert re.search(r"released [1-9]\d* past the cap", line)


def test_held_cap_comes_from_aios_host_memory_budget(monkeypatch):
    from aio.integrations.ds_swappers import held_cap

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    cap = held_cap({}, available=8 << 30)  # the default: half the available memory
    assert cap.nbytes == 4 << 30 and cap.source == "aio_zero.host_memory_budget 0.5 of 8.0 GiB available"
    monkeypatch.setenv("LOCAL_SIZE", "4")  # DeepSpeed's launcher: the node's ranks share it
    assert held_cap({"aio_zero": {"host_memory_budget": 0.25}}, available=8 << 30).nbytes == 512 << 20
    assert held_cap({"aio_zero": {"host_memory_budget": 4e9}}).nbytes == 1_000_000_000
    for bad in (0, -1, 1.5e9 + 0.5, True, "1e9"):
        with pytest.raises(ValueError, match="aio_zero.host_memory_budget"):
            held_cap({"aio_zero": {"host_memory_budget": bad}})


@pytest.fixture
def aio_enabled():
    """enable() for the test (DeepSpeed's swappers on aio's handle); disable() after unless it was on."""
    import aio.integrations.deepspeed as aio_ds

    before = aio_ds.is_enabled()
    aio_ds.enable()
    yield
    if not before:
        aio_ds.disable()


def capped_swapper(tmp_path, monkeypatch, buffer_count: int, budget: float):
    """aio's parameter swapper (no engine) with ``aio_zero.host_memory_budget``
    `budget`, as test_ds_swappers_unit.py makes one."""
    import deepspeed
    import torch

    from .test_ds_swappers_unit import NUMEL

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    offload = SimpleNamespace(nvme_path=str(tmp_path), buffer_size=NUMEL, buffer_count=buffer_count)
    aio_config = {
        "use_gds": False,
        "block_size": 1 << 20,
        "queue_depth": 8,
        "single_submit": False,
        "overlap_events": True,
        "intra_op_parallelism": 1,
    }
    cfg = SimpleNamespace(
        zero_config=SimpleNamespace(offload_param=offload),
        aio_config=aio_config,
        _param_dict={"aio_zero": {"host_memory_budget": budget}},
    )
    return ds_swappers.param_swapper_class()(cfg, torch.float32)


def gather_copy(sw, *params) -> None:
    """What a gather on several ranks (or onto a device) does: partitions
    available, then each parameter gets data of its own (not a view)."""
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    with sw.gathering(params):
        sw.swap_in([p for p in params if p.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE], False)
    for p in params:
        p.data = p.ds_tensor.data.clone()
        p.ds_status = ZeroParamStatus.AVAILABLE


def test_released_partition_is_not_read_ahead_and_gets_a_buffer_for_an_update(
    tmp_path, monkeypatch, aio_enabled
):
    """Past the cap (2 bytes: nothing is kept) a gathered partition is
    released; the NVMe prefetch does not read it again while its parameter is
    gathered; GatheredParameters(modifier_rank=...) gets it a buffer back
    (Init._partition_param, wrapped) and the update reaches the drive."""
    import torch
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from .test_ds_swappers_unit import on_drive, values

    sw = capped_swapper(tmp_path, monkeypatch, buffer_count=2, budget=2)
    a, b, c = (on_drive(sw, i) for i in range(3))
    gather_copy(sw, a)
    gather_copy(sw, b)
    gather_copy(sw, c)  # a's buffer goes back, nothing copied
    assert sw.counters["released"] == 1 and sw.counters["evicted"] == 0 and sw._private_bytes == 0
    assert a.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE and torch.equal(a.data, values(a))
    sw.swap_in([a], async_op=True)  # the coordinator's NVMe prefetch: a is still gathered
    assert a.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE and not sw.inflight_params
    update = ds_swappers._wrap_partition_param(lambda self, p, **kw: p.ds_tensor.copy_(p.data))
    a.nvme_swapper = sw  # as zero.Init sets it
    a.data = a.data + 100  # modified by the modifier rank
    update(None, a, has_been_updated=True)  # b's buffer goes back (released) for it
    assert sw.counters["released"] == 2 and torch.equal(a.ds_tensor, values(a) + 100)
    sw.swap_out_and_release([a])
    a.ds_status = ZeroParamStatus.NOT_AVAILABLE
    sw.remove_partition_and_release_buffers([b, c])
    gather_copy(sw, a)
    assert torch.equal(a.data, values(a) + 100)


def test_two_ranks_pipelined_and_resumed_exactly(two_ranks):
    """HF's block with pipelining and its auto persistence threshold: trains
    as CPU offload does, releasing the first-step state on each rank, and a
    step-3 checkpoint in DeepSpeed's format resumes in a fresh engine to the
    same losses, on both ranks; so does the step-1 one, saved after the
    release (its swapped state tensors empty: the files hold them)."""
    full = trained(two_ranks, "pipe-full", steps=5)
    assert full == trained(two_ranks, "pipe-cpu", steps=5)
    assert trained(two_ranks, "pipe-resumed", steps=2) == [f[3:] for f in full]
    assert trained(two_ranks, "pipe-resumed-1", steps=4) == [f[1:] for f in full]
    assert counters(two_ranks, "pipe-full")["writes_completed_early"] > 0
    for r in two_ranks:
        released_after_step_1(r["pipe-full"])


@pytest.mark.parametrize("case", ["mlp-ds", "gpt-ds", "pipe-ds"])
def test_two_ranks_deepspeeds_own_swappers_still_assert(two_ranks, case):
    where, text = NEGATIVE.get(case, ("pipelined_optimizer_swapper.py:219", ""))
    for r in two_ranks:
        rec = r[case]
        assert rec["error"] is not None and rec["error"].startswith("AssertionError"), rec["error"]
        assert rec["where"] == where and text in rec["error"]


@pytest.mark.slow
def test_three_ranks_pipelined_equal_cpu_offload(tmp_path):
    cfg = {"width": 1024, "layers": 6, "pipeline": True, "sub_group_size": 400_000}
    results = run_ranks(
        tmp_path,
        [
            {"name": "cpu", "offload": "cpu", **cfg},
            {"name": "aio", **cfg},
            {"name": "ds", "swappers": "ds", **cfg},
        ],
        world=3,
    )
    assert trained(results, "aio") == trained(results, "cpu")
    assert all(r["ds"]["where"] == "pipelined_optimizer_swapper.py:219" for r in results)
