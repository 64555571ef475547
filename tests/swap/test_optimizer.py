"""OptimizerSwapper: state discovery, bit-exact steps vs in-memory (pipelined
or not), configuration errors up front, faults mid-step, checkpoints."""

import errno
import functools
import gc
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from aio.swap import OptimizerSwapper, SwapStateError, discover_state_spec  # noqa: E402
from aio.swap.drives import SwapSpace  # noqa: E402

SIZES = [1000, 4097, 20000, 333, 65536]
PIPES = [(False, False), (True, False), (False, True), (True, True)]
OPTS = [
    (torch.optim.Adam, {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.01}),
    (torch.optim.AdamW, {"lr": 3e-3}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adagrad, {"lr": 0.05}),
]


def test_state_discovery():
    assert [n for n, _ in discover_state_spec(torch.optim.Adam, lr=1e-3)] == [
        "exp_avg",
        "exp_avg_sq",
    ]
    assert [n for n, _ in discover_state_spec(torch.optim.SGD, lr=0.1, momentum=0.9)] == ["momentum_buffer"]
    assert [n for n, _ in discover_state_spec(torch.optim.Adagrad, lr=0.1)] == ["sum"]
    assert discover_state_spec(torch.optim.SGD, lr=0.1) == []  # plain SGD keeps no state


def _grads(step, sizes):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(n, generator=g) for n in sizes]


def _reference(opt_cls, hyper, init, steps):
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = opt_cls(params, **hyper)
    for s in range(steps):
        for p, g in zip(params, _grads(s, [t.numel() for t in init]), strict=True):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params]


def _min_count(opt_cls, hyper):
    """Buffers one sub-group's step takes: gradient, master weights, each state."""
    return 2 + len(discover_state_spec(opt_cls, **hyper))


def _full_count(opt_cls, hyper):
    """Buffers for full overlap: the sub-group stepped, the next one read ahead,
    the previous one's write-back (all but its gradient)."""
    return 3 * _min_count(opt_cls, hyper) - 1


def _swapped(tmp_path, opt_cls, hyper, init, steps, pipe, buffer_count=None, held=False):
    """Step a swapper `steps` times; gradients written to the drive, or with
    `held` given in memory (hold_gradient) once and refilled in place."""
    if buffer_count is None:
        buffer_count = _full_count(opt_cls, hyper)
    sw = OptimizerSwapper(
        str(tmp_path),
        opt_cls,
        hyper,
        buffer_count=buffer_count,
        pipeline_read=pipe[0],
        pipeline_write=pipe[1],
    )
    for i, t in enumerate(init):
        sw.register_subgroup(i, t.numel())
        sw.initialize(i, t)
    mem = [torch.empty(t.numel()) for t in init]
    if held:
        for i, m in enumerate(mem):
            sw.hold_gradient(i, m)
    _steps(sw, range(steps), mem if held else None)
    out = [sw.read_master(i) for i in range(len(init))]
    return sw, out


def _steps(sw, steps, mem=None):
    """Step `sw` once per step number, with that step's gradients written (or
    copied into the held tensors `mem`)."""
    for s in steps:
        for i, g in enumerate(_grads(s, [sw.groups[i].numel for i in sorted(sw.groups)])):
            if mem is None:
                sw.write_gradient(i, g)
            else:
                mem[i].copy_(g)
        sw.step()


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
@pytest.mark.parametrize("held", [False, True], ids=["grad-on-drive", "grad-held"])
@pytest.mark.parametrize("count", ["min", "full"])
@pytest.mark.parametrize("pipe", PIPES, ids=lambda p: f"read{int(p[0])}write{int(p[1])}")
@pytest.mark.parametrize("opt_cls,hyper", OPTS, ids=lambda o: getattr(o, "__name__", ""))
def test_step_is_bit_exact_with_in_memory(tmp_path, opt_cls, hyper, pipe, count, held):
    # "min": only one sub-group's buffers, so pipelining degrades to none.
    g = torch.Generator().manual_seed(7)
    init = [torch.randn(n, generator=g) for n in SIZES]
    want = _reference(opt_cls, hyper, init, steps=4)
    n = _min_count(opt_cls, hyper) if count == "min" else _full_count(opt_cls, hyper)
    sw, got = _swapped(tmp_path, opt_cls, hyper, init, steps=4, pipe=pipe, buffer_count=n, held=held)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    st = sw.stats()
    assert st["steps"] == 4 and st["subgroup_steps"] == 4 * len(SIZES)
    sw.close()


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
@pytest.mark.parametrize("held", [False, True], ids=["grad-on-drive", "grad-held"])
@pytest.mark.parametrize("pipe", [(True, True), (False, False)], ids=["pipelined", "plain"])
def test_a_read_ahead_with_too_few_buffers_reads_part_of_the_next(tmp_path, monkeypatch, held, pipe):
    # One buffer past a sub-group's own (4 for AdamW with its gradient held):
    # the read ahead starts on the next sub-group's first tensors instead of
    # waiting for all of them; the steps are the same bits either way. With
    # the gradients held that is so whatever pipeline_read says (the buffers
    # are free anyway: measured 1.5 s/step faster at 2B with 4 buffers).
    # Writes land before write() returns: when a buffer comes free must not
    # hang on the drive's timing (a write landing late defers a read ahead).
    real_write = SwapSpace.write

    def write(space, buf, offset):
        fut = real_write(space, buf, offset)
        fut.wait()
        return fut

    monkeypatch.setattr(SwapSpace, "write", write)
    opt_cls, hyper = torch.optim.AdamW, {"lr": 3e-3}
    init = [torch.randn(n, generator=torch.Generator().manual_seed(3)) for n in SIZES]
    want = _reference(opt_cls, hyper, init, steps=4)
    n = _min_count(opt_cls, hyper) + (0 if held else 1)
    sw, got = _swapped(tmp_path, opt_cls, hyper, init, steps=4, pipe=pipe, buffer_count=n, held=held)
    try:
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        # Only with the gradients in memory (on the drive it measured slower).
        partial = sw.stats()["partial_reads"]
        assert partial >= 4 * (len(SIZES) - 2) if held else partial == 0, sw.stats()
    finally:
        sw.close()


class EagerStateAdagrad(torch.optim.Adagrad):
    """Adagrad as torch < 2.13 has it: state made in __init__ only, and a step
    on a parameter without state fails (KeyError) instead of creating it."""

    def _init_group(self, group, *args, **kwargs):
        for p in group["params"]:
            if p.grad is not None and len(self.state[p]) == 0:
                raise KeyError("sum")
        return super()._init_group(group, *args, **kwargs)


@pytest.mark.parametrize("pipe", [(False, False), (True, True)], ids=["plain", "pipelined"])
def test_optimizer_with_eager_state_is_bit_exact(tmp_path, pipe):
    # The first step of a sub-group must start from the state the optimizer
    # creates in its constructor (initial_accumulator_value here), not from none.
    hyper = {"lr": 0.05, "initial_accumulator_value": 0.25}
    g = torch.Generator().manual_seed(11)
    init = [torch.randn(n, generator=g) for n in SIZES[:3]]
    want = _reference(EagerStateAdagrad, hyper, init, steps=3)
    sw, got = _swapped(tmp_path, EagerStateAdagrad, hyper, init, steps=3, pipe=pipe)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    sw.close()


def test_after_callback_sees_updated_weights(tmp_path):
    init = [torch.ones(100), torch.ones(200)]
    seen = {}
    sw = OptimizerSwapper(str(tmp_path), torch.optim.SGD, {"lr": 0.5})
    for i, t in enumerate(init):
        sw.register_subgroup(i, t.numel())
        sw.initialize(i, t)
        sw.write_gradient(i, torch.ones(t.numel()), async_op=False)
    sw.step(after=lambda i, w: seen.__setitem__(i, w.clone()))
    assert all(torch.equal(seen[i], torch.full((n,), 0.5)) for i, n in ((0, 100), (1, 200)))
    sw.close()


@pytest.mark.parametrize(
    "opt_cls,hyper,count,need",
    [
        (torch.optim.Adam, {"lr": 1e-3}, 3, 4),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 2, 3),
        (torch.optim.SGD, {"lr": 0.1}, 1, 2),
    ],
)
@pytest.mark.parametrize("pipe", [(True, True), (False, False)], ids=["pipelined", "plain"])
def test_pool_too_small_for_one_subgroup_refused_up_front(tmp_path, opt_cls, hyper, count, need, pipe):
    with pytest.raises(ValueError, match=rf"offload_optimizer\.buffer_count.*at least {need}\b"):
        OptimizerSwapper(
            str(tmp_path), opt_cls, hyper, buffer_count=count, pipeline_read=pipe[0], pipeline_write=pipe[1]
        )
    with OptimizerSwapper(str(tmp_path), opt_cls, hyper, buffer_count=need):
        pass  # the minimum itself is accepted


@pytest.mark.parametrize("pipe,count", [((True, True), 10), ((True, False), 7), ((False, True), 6)])
def test_pool_too_small_for_pipeline_warns_once_and_steps(tmp_path, pipe, count):
    # Adam: 4 buffers per sub-group; full overlap needs 4 (+4 read ahead) (+3 writing).
    with pytest.warns(UserWarning, match=r"offload_optimizer\.buffer_count=\d+ is too small for full"):
        sw = OptimizerSwapper(
            str(tmp_path),
            torch.optim.Adam,
            {"lr": 1e-3},
            buffer_count=count,
            pipeline_read=pipe[0],
            pipeline_write=pipe[1],
        )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stepping does not warn again
        for i in range(3):
            sw.register_subgroup(i, 3000)
            sw.initialize(i, torch.ones(3000))
        for _ in range(2):
            for i in range(3):
                sw.write_gradient(i, torch.ones(3000))
            sw.step()
    sw.drop_cached()  # a step may leave sub-groups in buffers for the next one
    assert sw.pool.available() == count
    sw.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OptimizerSwapper(
            str(tmp_path),
            torch.optim.Adam,
            {"lr": 1e-3},
            buffer_count=count + 1,
            pipeline_read=pipe[0],
            pipeline_write=pipe[1],
        ).close()


def test_buffers_hold_one_tensor_of_the_largest_subgroup(tmp_path):
    """DeepSpeed's meaning of buffer_count: that many buffers of one fp32 tensor
    of the largest sub-group each, page-locked at first use and counted exactly."""
    from aio import pinned
    from aio.swap.storage import align_up

    with OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-3}, buffer_count=5) as sw:
        for i, n in enumerate(SIZES):
            sw.register_subgroup(i, n)
        assert sw.pinned_bytes() == 0  # nothing allocated yet
        assert sw.planned_pinned_bytes() == 5 * align_up(max(SIZES) * 4)
        gc.collect()  # an earlier test's buffers are freed now, not during this one
        before = pinned.locked_bytes()
        for i, n in enumerate(SIZES):
            sw.initialize(i, torch.ones(n))
        assert pinned.locked_bytes() - before == sw.pinned_bytes() == 5 * align_up(max(SIZES) * 4)
        assert sw.pool.slot_bytes == align_up(max(SIZES) * 4)
        assert sw.stats()["pinned_buffer_bytes"] == sw.pinned_bytes()
    with OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-3}, pin_memory=False) as sw:
        sw.register_subgroup(0, 1000)
        sw.initialize(0, torch.ones(1000))
        assert sw.pinned_bytes() == 0 and sw.planned_pinned_bytes() > 0


def test_subgroup_larger_than_sub_group_size(tmp_path):
    with OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-3}, sub_group_size=10000) as sw:
        with pytest.raises(ValueError, match="sub_group_size to at least 10001"):
            sw.register_subgroup(0, 10001)
        sw.register_subgroup(0, 500)
        sw.initialize(0, torch.zeros(500))
        sw.write_gradient(0, torch.zeros(500))
        sw.step()
        with pytest.raises(ValueError, match="register every sub-group before"):
            sw.register_subgroup(1, 8000)


@pytest.mark.parametrize("numel", [2**60, 2**64])
def test_absurd_subgroup_size_is_refused_and_the_swapper_still_works(tmp_path, numel):
    """A sub-group too large for a file offset is a ValueError naming numel; the
    swap file keeps its size, so the next registration works (it used to leave
    an OverflowError behind for every later call)."""
    with OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-3}) as sw:
        with pytest.raises(ValueError, match="numel"):
            sw.register_subgroup(0, numel)
        sw.register_subgroup(0, 1000)
        sw.initialize(0, torch.ones(1000))
        sw.write_gradient(0, torch.ones(1000))
        sw.step()


def test_swap_file_refuses_an_extent_past_the_largest_offset(tmp_path):
    from aio.swap.storage import MAX_FILE_BYTES, SwapFile

    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    f = SwapFile(dir_fd, "f.swap", str(tmp_path / "f.swap"))
    try:
        with pytest.raises(ValueError, match="largest file size"):
            f.allocate(MAX_FILE_BYTES)
        assert f.size == 0
        assert f.allocate(4096) == 0
    finally:
        f.close()
        os.close(dir_fd)


def test_bad_gradient_and_uninitialized(tmp_path):
    with OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-3}) as sw:
        sw.register_subgroup(0, 10)
        with pytest.raises(SwapStateError, match="initialize"):
            sw.step()
        with pytest.raises(ValueError, match="fp32"):
            sw.write_gradient(0, torch.zeros(10, dtype=torch.float16))


@pytest.mark.parametrize("where", ["read", "write"])
@pytest.mark.parametrize("pipe", [(True, True), (False, False)], ids=["pipelined", "plain"])
def test_fault_mid_step_surfaces_and_poisons(tmp_path, where, pipe):
    init = [torch.randn(n) for n in SIZES]
    (tmp_path / "s").mkdir()
    sw = OptimizerSwapper(
        str(tmp_path / "s"),
        torch.optim.Adam,
        {"lr": 1e-2},
        buffer_count=11,
        pipeline_read=pipe[0],
        pipeline_write=pipe[1],
    )
    for i, t in enumerate(init):
        sw.register_subgroup(i, t.numel())
        sw.initialize(i, t)
        sw.write_gradient(i, torch.ones(t.numel()), async_op=False)
    sw.step()
    ck = str(tmp_path / "ck")
    sw.export_checkpoint(ck)
    for i, t in enumerate(init):
        sw.write_gradient(i, torch.ones(t.numel()), async_op=False)
    handle = sw.space.drives[0].reader if where == "read" else sw.space.drives[0].writer
    handle._c.inject_fault("error", errno.EIO, where, 3, 1)
    with pytest.raises(OSError) as ei:
        sw.step()
    assert ei.value.errno == errno.EIO
    assert sw.broken and "import_checkpoint" in sw.broken
    if where == "write":
        assert not all(g.valid for g in sw.groups.values())  # the failed write reads as invalid
    with pytest.raises(SwapStateError, match="partly updated"):
        sw.step()
    handle._c.clear_fault()
    assert sw.pool.available() == 11  # no buffer leaked by the failure
    sw.import_checkpoint(ck)
    assert sw.broken is None
    for i, t in enumerate(init):
        sw.write_gradient(i, torch.ones(t.numel()), async_op=False)
    sw.step()  # consistent again
    sw.close()


def test_held_gradients_carry_subgroups_across_steps(tmp_path):
    """Gradients held in memory + pipelined writes: each step leaves its last
    sub-groups in their buffers, and the next step (in reverse order) starts
    from them without reading; with pipeline_read it also reads the next ones
    ahead. Everything stays exact, through a checkpoint taken between steps,
    and every buffer comes back."""
    g = torch.Generator().manual_seed(5)
    init = [torch.randn(n, generator=g) for n in SIZES]
    hyper = {"lr": 1e-2}
    want = _reference(torch.optim.Adam, hyper, init, steps=6)
    sw, _ = _swapped(tmp_path, torch.optim.Adam, hyper, init, steps=0, pipe=(True, True), held=True)
    mem = [sw.groups[i].grad_mem for i in sorted(sw.groups)]
    all_states = 3 * sum(g.part_io("param")[1] for g in sw.groups.values())
    _steps(sw, range(4), mem)
    count = sw.pool.count
    assert sw.counters["cached_subgroups"] >= 3  # steps 2-4 each start from kept buffers
    assert sw.counters["bytes_read"] < 4 * all_states
    assert sw.counters["bytes_written"] < 4 * all_states + all_states  # + initialize()
    assert sw.pool.available() < count  # kept for step 5 (and read ahead)
    read = sw.counters["bytes_read"]
    ck = str(tmp_path / "ck")
    sw.export_checkpoint(ck)  # writes back what is kept and gives the buffers back first
    assert sw.pool.available() == count
    _steps(sw, [4, 5], mem)
    # Step 5 (4 read everything afresh after the export) starts from kept buffers.
    assert all_states <= sw.counters["bytes_read"] - read < 2 * all_states
    for i, w in enumerate(want):
        assert torch.equal(sw.read_master(i), w)
    sw.import_checkpoint(ck)  # the drive copy changes: nothing carried may survive
    _steps(sw, [4, 5], mem)
    for i, w in enumerate(want):
        assert torch.equal(sw.read_master(i), w)
    sw.close()
    assert sw.pool.available() == count


def test_gradient_held_after_a_drive_gradient_step_is_the_one_used(tmp_path):
    """Reads started ahead at the end of a step that took gradients from the
    drive must not feed the next step a stale drive gradient once the caller
    holds gradients in memory."""
    g = torch.Generator().manual_seed(9)
    init = [torch.randn(n, generator=g) for n in SIZES]
    want = _reference(torch.optim.Adam, {"lr": 1e-2}, init, steps=3)
    hyper = {"lr": 1e-2}
    sw, _ = _swapped(tmp_path, torch.optim.Adam, hyper, init, steps=1, pipe=(True, True), buffer_count=20)
    mem = [torch.empty(n) for n in SIZES]
    for i, m in enumerate(mem):
        sw.hold_gradient(i, m)
    _steps(sw, [1, 2], mem)
    for i, w in enumerate(want):
        assert torch.equal(sw.read_master(i), w)
    sw.close()


def test_prefetched_read_error_surfaces_at_the_next_step(tmp_path):
    init = [torch.randn(n) for n in SIZES]
    sw, _ = _swapped(tmp_path, torch.optim.Adam, {"lr": 1e-2}, init, steps=0, pipe=(True, True), held=True)
    # Step 1 reads the master weights of each sub-group (its states are zeros,
    # not read); the next read is one started ahead for step 2.
    sw.space.drives[0].reader._c.inject_fault("error", errno.EIO, "read", len(SIZES) + 1, 1)
    for i in range(len(SIZES)):
        sw.groups[i].grad_mem.fill_(1.0)
    sw.step()  # the failing read is in flight or done, its error not yet taken
    assert not sw.broken
    with pytest.raises(OSError) as ei:
        sw.step()
    assert sw.space.drives[0].reader._c.fault_hits() == 1
    assert ei.value.errno == errno.EIO and sw.broken
    sw.space.drives[0].reader._c.clear_fault()
    assert sw.pool.available() == sw.pool.count
    sw.close()


def test_checkpoint_resume_is_exact(tmp_path):
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(n, generator=g) for n in SIZES]
    hyper = {"lr": 1e-2}
    want = _reference(torch.optim.Adam, hyper, init, steps=5)
    (tmp_path / "a").mkdir()
    a, _ = _swapped(tmp_path / "a", torch.optim.Adam, hyper, init, steps=3, pipe=(True, True))
    ck = str(tmp_path / "ckpt")
    a.export_checkpoint(ck)
    a.close()
    assert sorted(os.listdir(ck))[:3] == ["complete", "manifest.json", "scalars.pt"]
    (tmp_path / "b").mkdir()
    b = OptimizerSwapper(
        str(tmp_path / "b"),
        torch.optim.Adam,
        hyper,
        buffer_count=11,
        pipeline_read=True,
        pipeline_write=True,
    )
    for i, t in enumerate(init):
        b.register_subgroup(i, t.numel())
    b.import_checkpoint(ck)
    for s in (3, 4):
        for i, gr in enumerate(_grads(s, SIZES)):
            b.write_gradient(i, gr)
        b.step()
    for i, w in enumerate(want):
        assert torch.equal(b.read_master(i), w)
    b.close()


def test_states_set_up_never_wrote_are_zeros_in_steps_and_checkpoints(tmp_path):
    """initialize() writes the master weights alone. Re-initialized over a
    drive copy that still holds two steps' states, the sub-groups step from
    zero states, and a checkpoint taken before that step holds zeros: both
    resume exactly as a fresh start."""
    g = torch.Generator().manual_seed(5)
    init = [torch.randn(n, generator=g) for n in SIZES]
    hyper = {"lr": 1e-2}
    want = _reference(torch.optim.Adam, hyper, init, steps=2)
    (tmp_path / "a").mkdir()
    a, _ = _swapped(tmp_path / "a", torch.optim.Adam, hyper, init, steps=2, pipe=(True, True))
    written = dict(a.bytes_by_part["written"])
    for i, t in enumerate(init):
        a.initialize(i, t)
    grew = {k: v - written.get(k, 0) for k, v in a.bytes_by_part["written"].items()}
    assert {k for k, v in grew.items() if v} == {"param"}, grew  # the master weights, nothing else
    assert 4 * sum(SIZES) <= grew["param"] < 4 * sum(SIZES) + 4096 * len(SIZES)  # each padded to a page
    ck = str(tmp_path / "ckpt")
    a.export_checkpoint(ck)
    for i, n in enumerate(SIZES):  # each file: the master weights (page-padded), then the states
        saved = (Path(ck) / f"subgroup_{i}.bin").read_bytes()
        master = -(-4 * n // 4096) * 4096
        assert len(saved) > master and saved[master:].count(0) == len(saved) - master, i
    _steps(a, range(2))
    (tmp_path / "b").mkdir()
    b = OptimizerSwapper(str(tmp_path / "b"), torch.optim.Adam, hyper, buffer_count=11)
    for i, t in enumerate(init):
        b.register_subgroup(i, t.numel())
    b.import_checkpoint(ck)
    _steps(b, range(2))
    for i, w in enumerate(want):
        assert torch.equal(a.read_master(i), w) and torch.equal(b.read_master(i), w), i
    a.close()
    b.close()


def test_checkpoint_corruption_and_mismatch_detected(tmp_path):
    (tmp_path / "a").mkdir()
    sw, _ = _swapped(tmp_path / "a", torch.optim.Adam, {"lr": 1e-3}, [torch.ones(5000)], 1, (False, False), 4)
    ck = tmp_path / "ck"
    sw.export_checkpoint(str(ck))
    with pytest.raises(FileExistsError):
        sw.export_checkpoint(str(ck))
    data = bytearray((ck / "subgroup_0.bin").read_bytes())
    data[100] ^= 0xFF
    (ck / "subgroup_0.bin").write_bytes(bytes(data))
    with pytest.raises(OSError, match="checksum"):
        sw.import_checkpoint(str(ck))
    sw.close()
    (tmp_path / "b").mkdir()
    other = OptimizerSwapper(str(tmp_path / "b"), torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    other.register_subgroup(0, 5000)
    with pytest.raises(ValueError, match="does not match"):
        other.import_checkpoint(str(ck))
    other.close()


def _remark(ck):
    """Rewrite a checkpoint's complete marker to match its files now (as
    whoever tampered with them could): only the content checks remain."""
    import json
    import zlib

    files = {p.name: p.stat().st_size for p in ck.iterdir() if p.name != "complete"}
    crcs = {n: zlib.crc32((ck / n).read_bytes()) for n in files if not n.endswith(".bin")}
    (ck / "complete").write_text(json.dumps({"files": files, "crc32": crcs}))


@pytest.mark.parametrize(
    "tamper",
    [
        "manifest not an object",
        "manifest without spec",
        "steps not a number",
        "lr a string",
        "params in a group",
        "scalars of junk",
        "a state's name among the scalars",
    ],
)
def test_a_malformed_checkpoint_is_a_value_error_that_changes_nothing(tmp_path, tamper):
    """A manifest or scalar state that parses but is malformed (missing keys,
    values of the wrong kind) is a ValueError naming the folder, raised
    before anything changes: the swapper steps on as before (it was a
    KeyError, or imported and broke the next step)."""
    import json

    (tmp_path / "a").mkdir()
    init = [torch.ones(5000)]
    sw, _ = _swapped(tmp_path / "a", torch.optim.Adam, {"lr": 1e-3}, init, 1, (False, False), 4)
    ck = tmp_path / "ck"
    sw.export_checkpoint(str(ck))
    manifest = json.loads((ck / "manifest.json").read_text())
    extra = torch.load(ck / "scalars.pt", weights_only=True)
    if tamper == "manifest not an object":
        manifest = [manifest]
    elif tamper == "manifest without spec":
        del manifest["spec"]
    elif tamper == "steps not a number":
        manifest["steps"] = "1"
    elif tamper == "lr a string":
        extra["param_groups"][0]["lr"] = "oops"
    elif tamper == "params in a group":
        extra["param_groups"][0]["params"] = []
    elif tamper == "scalars of junk":
        extra["scalars"][0] = "junk"
    else:
        extra["scalars"][0] = {"exp_avg": torch.zeros(5000)}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    torch.save(extra, ck / "scalars.pt")
    _remark(ck)
    before = [sw.read_master(0).clone(), sw.steps]
    with pytest.raises(ValueError, match="not a checkpoint of this optimizer") as ei:
        sw.import_checkpoint(str(ck))
    assert str(ck) in str(ei.value)
    assert sw.broken is None and sw.steps == before[1] and torch.equal(sw.read_master(0), before[0])
    _steps(sw, range(1, 2))  # steps on as before
    sw.close()


def test_two_optimizer_swappers_one_path_and_cleanup(tmp_path):
    a = OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-3})
    b = OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-3})
    assert a.space.dirs[0] != b.space.dirs[0]
    for sw, v in ((a, 1.0), (b, 2.0)):
        sw.register_subgroup(0, 100)
        sw.initialize(0, torch.full((100,), v))
    assert (a.read_master(0) == 1).all() and (b.read_master(0) == 2).all()
    a.close()
    b.close()
    assert os.listdir(tmp_path) == []


def test_from_config(tmp_path):
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1e6,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(tmp_path),
                "buffer_count": 11,
                "pipeline_read": True,
                "pipeline_write": True,
            },
        }
    }
    with OptimizerSwapper.from_config(cfg, torch.optim.Adam, {"lr": 1e-3}) as sw:
        assert sw.pipeline_read and sw.pipeline_write and sw.sub_group_size == 10**6


def test_bf16_states_fused_in_the_kernel_equal_widened_steps(tmp_path):
    """bf16 moments: aio's Adam kernel steps them directly (widening and
    rounding per block); torch's AdamW gets them widened in the buffer and
    rounded back after. Same bits: masters, and the checkpointed states
    (the kernel with torch's square root, where it can reproduce it)."""
    from aio.optim import CPUAdamW, is_bit_exact

    if not is_bit_exact():
        pytest.skip("the kernel does not reproduce torch's square root here")

    sizes = [70_001, 300_000]
    gen = torch.Generator().manual_seed(7)
    grads = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(3)]
    crcs, masters = [], []
    for cls, kw in ((CPUAdamW, {"match_torch": True}), (torch.optim.AdamW, {"foreach": False})):
        d = tmp_path / cls.__name__
        d.mkdir()
        sw = OptimizerSwapper(str(d), cls, {"lr": 1e-2, **kw}, buffer_count=4, state_dtype="bf16")
        for i, n in enumerate(sizes):
            sw.register_subgroup(i, n)
            sw.initialize(i, torch.linspace(-1, 1, n))
        for step in grads:
            for i, g in enumerate(step):
                sw.write_gradient(i, g, async_op=False)
            sw.step()
        masters.append([sw.read_master(i) for i in range(len(sizes))])
        sw.export_checkpoint(str(d / "ck"))
        manifest = json.loads((d / "ck" / "manifest.json").read_text())
        crcs.append({i: g["crc32"] for i, g in manifest["groups"].items()})
        sw.close()
    assert all(torch.equal(a, b) for a, b in zip(*masters, strict=True))
    assert crcs[0] == crcs[1]


def test_initialize_many_fills_buffers_and_a_failed_write_stays_invalid(tmp_path):
    init = [torch.randn(n) for n in SIZES]
    with OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-2}, buffer_count=4) as sw:
        for i, t in enumerate(init):
            sw.register_subgroup(i, t.numel())
        filled = []

        def fill(i, out):
            filled.append((i, out.dtype, out.numel()))
            out.copy_(init[i])

        fills = [(i, functools.partial(fill, i)) for i in range(len(init))]
        sw.initialize_many(iter(fills))
        assert filled == [(i, torch.float32, n) for i, n in enumerate(SIZES)]
        assert all(torch.equal(sw.read_master(i), t) for i, t in enumerate(init))
        # The second write I/O to complete fails: which sub-group's depends on
        # completion order (several are in flight), so the test finds it.
        sw.space.drives[0].writer._c.inject_fault("error", errno.EIO, "write", 2, 1)
        with pytest.raises(OSError) as ei:
            sw.initialize_many(iter(fills))
        sw.space.drives[0].writer._c.clear_fault()
        assert ei.value.errno == errno.EIO and sw.pool.available() == 4  # every write ended, buffers back
        bad = [i for i in range(len(SIZES)) if not sw.groups[i].valid]
        assert len(bad) == 1  # that one only, the others valid
        with pytest.raises(SwapStateError, match="initialize"):
            sw.step()
        sw.initialize(bad[0], init[bad[0]])
        for i, t in enumerate(init):
            sw.write_gradient(i, torch.ones(t.numel()), async_op=False)
        sw.step()


def test_flush_writes_kept_masters_only_and_a_failure_poisons(tmp_path):
    """Held gradients: a step keeps sub-groups in buffers unwritten; flush()
    makes each one's master weights on the drive current (what master_extent()
    names) without writing its states, and they stay kept for the next step."""
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(n, generator=g) for n in SIZES]
    hyper = {"lr": 1e-2}
    want = _reference(torch.optim.Adam, hyper, init, steps=2)
    sw, _ = _swapped(tmp_path, torch.optim.Adam, hyper, init, steps=0, pipe=(True, True), held=True)
    mem = [sw.groups[i].grad_mem for i in sorted(sw.groups)]
    _steps(sw, [0, 1], mem)
    written = dict(sw.bytes_by_part["written"])
    sw.flush()
    added = {k: v - written.get(k, 0) for k, v in sw.bytes_by_part["written"].items()}
    assert added.get("param", 0) > 0 and added.get("exp_avg", 0) == added.get("exp_avg_sq", 0) == 0
    for i, w in enumerate(want):
        space, off = sw.master_extent(i)
        got = torch.empty(SIZES[i])
        space.sync_read(got, off)
        assert torch.equal(got, w)
    assert sw.pool.available() < sw.pool.count  # still kept for the next step
    _steps(sw, [2], mem)
    sw.space.drives[0].writer._c.inject_fault("error", errno.EIO, "write", 1, 1)
    with pytest.raises(OSError):
        sw.flush()
    sw.space.drives[0].writer._c.clear_fault()
    assert sw.broken and "import_checkpoint" in sw.broken and sw.pool.available() == sw.pool.count
    with pytest.raises(SwapStateError, match="master weights failed"):
        sw.step()
    sw.close()


@pytest.mark.parametrize("where", ["step", "flush"])
def test_a_write_batch_failing_to_start_part_way_settles_the_started_ones(tmp_path, where):
    """Ctrl-C (or a submit error) between a sub-group's part writes: the
    writes already started are waited for before their buffers go back (they
    were in no list, so the buffers went back with a write still in them,
    and that write could land over a checkpoint imported afterwards)."""
    # Room to keep both sub-groups' three tensors in buffers after the step.
    sw = OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-2}, buffer_count=8)
    try:
        for i in range(2):
            sw.register_subgroup(i, 1024)
            sw.initialize(i, torch.randn(1024))
            if where == "flush":
                sw.hold_gradient(i, torch.ones(1024))  # write-back: the step keeps both dirty
            else:
                sw.write_gradient(i, torch.ones(1024), async_op=False)
        if where == "flush":
            sw.step()
        real, started = sw.space.write, []

        class Slow:
            """A started write the drive has not done yet."""

            def __init__(self, fut):
                self.fut, self.settled = fut, False

            def done(self):
                return self.settled

            def exception(self, timeout=None):
                self.settled = True
                return self.fut.exception()

        def write(buf, off):
            if started:
                raise KeyboardInterrupt
            started.append(Slow(real(buf, off)))
            return started[0]

        sw.space.write = write
        with pytest.raises(KeyboardInterrupt):
            sw.step() if where == "step" else sw.flush()
        assert started and started[0].settled
    finally:
        sw.space.write = real
        sw.close()


class _FileSource:
    """Master weights kept in a file of their own (as aio.zero keeps float32
    parameters), read through an aio handle: initialize_from()'s source."""

    def __init__(self, path, init):
        import aio

        self.handle = aio.AsyncIOHandle()
        self.path = str(path)
        self.offsets = []
        pos = 0
        for t in init:
            self.offsets.append(pos)
            pos += -(-t.numel() * 4 // 4096) * 4096
        with open(self.path, "wb") as f:
            for off, t in zip(self.offsets, init, strict=True):
                f.seek(off)
                f.write(t.numpy().tobytes())
        self.calls = []

    def __call__(self, i, out):
        self.calls.append(i)
        return [self.handle.async_pread(out, self.path, self.offsets[i])]


def _sourced(tmp_path, init, **kw):
    """A swapper (Adam) whose sub-groups start from a _FileSource of `init`."""
    source = _FileSource(tmp_path / "params.bin", init)
    (tmp_path / "swap").mkdir()
    kw = {"buffer_count": 4, **kw}
    sw = OptimizerSwapper(str(tmp_path / "swap"), torch.optim.Adam, {"lr": 1e-2}, **kw)
    for i, t in enumerate(init):
        sw.register_subgroup(i, t.numel())
        assert sw.initialize_from(i, functools.partial(source, i))
    return sw, source


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
@pytest.mark.parametrize("count", [4, 5, 11])
@pytest.mark.parametrize("held", [False, True], ids=["grad-on-drive", "grad-held"])
@pytest.mark.parametrize("pipe", [(True, True), (False, False)], ids=["pipelined", "plain"])
def test_initialize_from_reads_the_source_once_and_steps_bit_exact(tmp_path, held, pipe, count):
    """Set-up writes nothing: the first step reads each sub-group's master
    weights from its source (a step later, from the swap file it wrote),
    with any number of buffers (partial reads ahead, write-back)."""
    g = torch.Generator().manual_seed(5)
    init = [torch.randn(n, generator=g) for n in SIZES]
    want = _reference(torch.optim.Adam, {"lr": 1e-2}, init, steps=3)
    sw, source = _sourced(tmp_path, init, buffer_count=count, pipeline_read=pipe[0], pipeline_write=pipe[1])
    with sw:
        assert all(sw.master_extent(i) is None for i in range(len(SIZES)))  # nothing to read there yet
        assert sw.counters["bytes_written"] == sw.counters["bytes_read"] == 0
        mem = [torch.zeros(t.numel()) for t in init]
        for i, m in enumerate(mem if held else []):
            sw.hold_gradient(i, m)
        _steps(sw, range(3), mem if held else None)
        assert sorted(source.calls) == list(range(len(SIZES)))  # once each, in step 1
        assert all(sw.master_extent(i) is not None for i in range(len(SIZES)))
        for i, w in enumerate(want):
            assert torch.equal(sw.read_master(i), w)


def test_a_first_step_with_nothing_to_read_is_no_cache_hit(tmp_path):
    """cached_subgroups counts sub-groups a step found in the buffers the step
    before kept, not every sub-group that needed no read: before its first
    step a sub-group whose source copies its master weights at once (no
    future), whose states are zeroed and whose gradient is held in memory
    reads nothing, and is no cache hit."""
    init = [torch.randn(n, generator=torch.Generator().manual_seed(7)) for n in SIZES]
    (tmp_path / "swap").mkdir()
    sw = OptimizerSwapper(str(tmp_path / "swap"), torch.optim.Adam, {"lr": 1e-2}, buffer_count=4)

    def copy_now(i, out):
        out.copy_(init[i])
        return []

    with sw:
        mem = [torch.ones(t.numel()) for t in init]
        for i, t in enumerate(init):
            sw.register_subgroup(i, t.numel())
            assert sw.initialize_from(i, functools.partial(copy_now, i))
            sw.hold_gradient(i, mem[i])
        sw.step()  # (its end reads the next step's first sub-groups ahead)
        assert sw.counters["cached_subgroups"] == 0
        sw.step()  # the sub-groups stepped last come first, from their buffers
        assert sw.counters["cached_subgroups"] >= 1


def test_initialize_from_before_the_first_step_reads_edits_and_checkpoints_the_source(tmp_path):
    """read_master(), update_master() and a checkpoint before the first step
    see the source's values; one edited or saved is written, and read from
    the swap file after; a checkpoint loaded replaces every source."""
    init = [torch.randn(n, generator=torch.Generator().manual_seed(6)) for n in SIZES]
    sw, source = _sourced(tmp_path, init)
    with sw:
        assert torch.equal(sw.read_master(1), init[1])
        sw.update_master(2, lambda m: m.mul_(2))
        assert sw.master_extent(2) is not None and torch.equal(sw.read_master(2), init[2] * 2)
        source.calls.clear()
        sw.export_checkpoint(str(tmp_path / "ck"))
        assert sorted(source.calls) == [i for i in range(len(SIZES)) if i != 2]
        assert all(sw.master_extent(i) is not None for i in range(len(SIZES)))
    (tmp_path / "eager").mkdir()
    want = [t * 2 if i == 2 else t for i, t in enumerate(init)]
    with OptimizerSwapper(str(tmp_path / "eager"), torch.optim.Adam, {"lr": 1e-2}, buffer_count=4) as sw:
        for i, t in enumerate(want):
            sw.register_subgroup(i, t.numel())
            sw.initialize_from(i, functools.partial(source, i))  # replaced by the checkpoint
        source.calls.clear()
        sw.import_checkpoint(str(tmp_path / "ck"))
        assert all(torch.equal(sw.read_master(i), t) for i, t in enumerate(want)) and not source.calls


def test_a_source_read_failing_in_the_first_step_poisons_until_a_checkpoint(tmp_path):
    init = [torch.randn(n) for n in SIZES]
    source = _FileSource(tmp_path / "params.bin", init)
    (tmp_path / "swap").mkdir()
    with OptimizerSwapper(str(tmp_path / "swap"), torch.optim.Adam, {"lr": 1e-2}, buffer_count=4) as sw:
        for i, t in enumerate(init):
            sw.register_subgroup(i, t.numel())
            sw.initialize(i, t)
        sw.export_checkpoint(str(tmp_path / "ck"))
        for i in range(len(SIZES)):
            sw.initialize_from(i, functools.partial(source, i))
        source.handle._c.inject_fault("error", errno.EIO, "read", 2, 1)
        with pytest.raises(OSError) as ei:
            _steps(sw, [0])
        source.handle._c.clear_fault()
        assert ei.value.errno == errno.EIO and sw.broken and sw.pool.available() == 4
        sw.import_checkpoint(str(tmp_path / "ck"))
        _steps(sw, [0])


@pytest.mark.parametrize("how", ["read_master", "update_master"])
def test_a_source_failing_before_the_first_step_changes_nothing(tmp_path, how):
    """A source read failing in read_master()/update_master() raises; the
    sub-group keeps its source, every buffer comes back, and the next try
    works."""
    init = [torch.randn(n) for n in SIZES]
    sw, source = _sourced(tmp_path, init)
    with sw:
        call = {
            "read_master": lambda: sw.read_master(1),
            "update_master": lambda: sw.update_master(1, torch.neg_),
        }
        source.handle._c.inject_fault("error", errno.EIO, "read", 1, 1)
        with pytest.raises(OSError) as ei:
            call[how]()
        source.handle._c.clear_fault()
        assert ei.value.errno == errno.EIO and not sw.broken
        assert sw.pool is None or sw.pool.available() == 4  # read_master() takes no buffer
        assert sw.groups[1].valid and sw.master_extent(1) is None  # still read from the source
        call[how]()
        want = init[1] if how == "read_master" else -init[1]
        assert torch.equal(sw.read_master(1), want)


def test_aio_adam_first_step_uses_the_zeroed_buffers_as_its_state(tmp_path, monkeypatch):
    """aio's Adam starts each sub-group's moments in the buffers it is
    stepped in (zeroed there), not in fresh tensors copied over afterwards
    (16 GB of new memory in the first step at 2B); the same bits as in memory."""
    from aio.optim import CPUAdamW

    hyper = {"lr": 1e-2, "weight_decay": 0.01}
    init = [torch.randn(n, generator=torch.Generator().manual_seed(8)) for n in SIZES]
    want = _reference(CPUAdamW, hyper, init, steps=2)
    zeros_like = torch.zeros_like
    made = []

    def counting(*args, **kw):
        made.append(args[0].numel())
        return zeros_like(*args, **kw)

    monkeypatch.setattr(torch, "zeros_like", counting)
    sw, got = _swapped(tmp_path, CPUAdamW, hyper, init, steps=2, pipe=(True, True))
    sw.close()
    assert not [n for n in made if n in SIZES]  # no state tensor of a sub-group's size was made
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


class _NoMasterSlot(OptimizerSwapper):
    """Master weights kept elsewhere (as NVMeAdamW's master="params")."""

    def master_slot(self):
        return False


def test_a_swapper_without_a_master_slot_refuses_what_would_lose_the_master(tmp_path):
    sw = _NoMasterSlot(str(tmp_path), torch.optim.Adam, {"lr": 1e-1})
    for i in range(2):
        sw.register_subgroup(i, 1024)
    assert sw.state_names() == ["exp_avg", "exp_avg_sq"]  # "param" is not on the drive
    with pytest.raises(SwapStateError, match="sub-group 0 has no master weights: initialize_from"):
        sw.read_master(0)  # never initialised: not a KeyError
    masters = [torch.randn(1024) for _ in range(2)]
    for i, m in enumerate(masters):
        sw.initialize_from(i, lambda out, m=m: [out.copy_(m)][:0])
        sw.hold_gradient(i, torch.ones(1024))
    before = [m.clone() for m in masters]
    with pytest.raises(ValueError, match=r"step\(after=None\).*thrown away"):
        sw.step()  # the update would go nowhere
    assert sw.steps == 0 and not sw.broken and all(g.scalars is None for g in sw.groups.values())
    assert all(map(torch.equal, masters, before))
    calls = []

    def after(i, new):
        calls.append(i)
        if len(calls) == 2:
            raise RuntimeError("stored nowhere")
        masters[i].copy_(new)

    with pytest.raises(RuntimeError, match="stored nowhere"):
        sw.step(after=after)
    # Broken: the remedy it names must exist (import_checkpoint is refused here).
    assert "load_state_dict" in sw.broken and "Restore it with import_checkpoint" not in sw.broken
    with pytest.raises(SwapStateError, match="writing every sub-group's state again"):
        sw.step(after=after)
    with pytest.raises(ValueError, match="master_slot"):
        sw.import_checkpoint(str(tmp_path / "none"))
    sw.close()
