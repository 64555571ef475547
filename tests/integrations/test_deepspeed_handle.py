"""DeepSpeedAioHandle: every way DeepSpeed's swappers call the handle, with
the return codes they assert on. Needs no DeepSpeed install."""

import errno
import functools
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from aio.integrations.deepspeed import AioAsyncIOBuilder, DeepSpeedAioHandle  # noqa: E402


def test_constructor_matches_deepspeed_signature_and_defaults():
    h = DeepSpeedAioHandle()
    assert (
        h.get_block_size(),
        h.get_queue_depth(),
        h.get_single_submit(),
        h.get_overlap_events(),
        h.get_intra_op_parallelism(),
    ) == (1 << 20, 128, False, False, 1)
    h = DeepSpeedAioHandle(262144, 32, True, True, 4)  # positional, as DeepSpeed's tests do
    assert h.get_thread_count() == 4 and h.get_block_size() == 262144
    h = DeepSpeedAioHandle(
        block_size=4096,
        queue_depth=2,
        single_submit=False,
        overlap_events=True,
        intra_op_parallelism=2,
    )
    assert h.get_intra_op_parallelism() == 2
    assert DeepSpeedAioHandle(num_threads=3).get_thread_count() == 3
    with pytest.raises(TypeError):
        DeepSpeedAioHandle(bogus=1)
    assert h.get_alignment() % 4096 == 0


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"single_submit": "false"}, "single_submit"),  # bool("false") is True: flipped in silence before
        ({"overlap_events": "no"}, "overlap_events"),
        ({"block_size": 4096.9}, "block_size"),  # truncated to 4096 before
        ({"queue_depth": "8"}, "queue_depth"),
        ({"intra_op_parallelism": True}, "intra_op_parallelism"),
    ],
)
def test_a_setting_of_the_wrong_type_is_refused_naming_its_aio_key(kw, key):
    with pytest.raises(TypeError, match=rf"^aio\.{key} must be "):
        DeepSpeedAioHandle(**kw)
    assert DeepSpeedAioHandle(single_submit=1, overlap_events=0).get_single_submit() is True


def test_the_aio_block_is_checked_as_aio_config_checks_it():
    from aio.config import ConfigError
    from aio.integrations.deepspeed import check_aio_block

    check_aio_block(None)
    check_aio_block({"block_size": 262144, "queue_depth": 32, "thread_count": 2, "single_submit": False})
    for block, key, what in (
        ({"blok_size": 4096}, "aio.blok_size", "did you mean 'block_size'"),  # DeepSpeed ignored it
        ({"block_size": 1000}, "aio.block_size", "multiple of 4096"),
        ({"overlap_events": "false"}, "aio.overlap_events", "bool"),
        ([1], "aio", "block of settings"),
    ):
        with pytest.raises(ConfigError) as ei:
            check_aio_block(block)
        assert ei.value.problems[0][0] == key and what in str(ei.value), str(ei.value)


def test_an_engine_checks_its_aio_block_before_it_is_built():
    deepspeed = pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    import aio.integrations.deepspeed as aio_ds
    from aio.config import ConfigError

    before = aio_ds.is_enabled()
    aio_ds.enable()
    try:
        engine = object.__new__(deepspeed.DeepSpeedEngine)  # nothing built: the check comes first
        cfg = SimpleNamespace(_param_dict={"aio": {"blok_size": 4096}})
        with pytest.raises(ConfigError, match="aio.blok_size"):
            deepspeed.DeepSpeedEngine.__init__(engine, config_class=cfg)
    finally:
        if not before:
            aio_ds.disable()


def test_return_codes(tmp_path):
    h = DeepSpeedAioHandle(intra_op_parallelism=2)
    p = str(tmp_path / "swap.bin")
    bufs = [h.new_cpu_locked_tensor(100_000, torch.empty(0, dtype=torch.float16)) for _ in range(3)]
    for i, b in enumerate(bufs):
        b.fill_(i)
        assert h.async_pwrite(b, p, i * 200_000) == 0
    assert h.wait() == 3
    assert h.wait() == 0
    outs = [torch.empty(100_000, dtype=torch.float16) for _ in range(3)]
    for i, o in enumerate(outs):
        assert h.async_pread(o, p, i * 200_000) == 0
    assert h.wait() == 3
    assert all((o == i).all() for i, o in enumerate(outs))
    assert h.sync_pwrite(bufs[0], p, 0) == 1
    assert h.sync_pread(outs[1], p, 0) == 1 and (outs[1] == 0).all()
    # A synchronous call also completes (and counts) pending async work.
    h.async_pread(outs[2], p, 200_000)
    assert h.sync_pread(outs[0], p, 0) == 2
    assert h.wait() == 0
    assert h.pread(outs[0], p, False, True, 0) == 0 and h.wait() == 1
    assert h.pwrite(bufs[1], p, True, False, 0) == 1  # validated write
    assert h.read(outs[0], p, True) == 0 and h.write(bufs[1], p, False) == 0


def test_async_pwrite_with_caller_descriptor(tmp_path):
    """DeepSpeed's fast checkpoint writer passes (buffer, fd, offset)."""
    h = DeepSpeedAioHandle()
    p = str(tmp_path / "fd.bin")
    t = h.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
    t.fill_(7)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        assert h.async_pwrite(t, fd, 4096) == 0
        assert h.wait() == 1
    finally:
        os.close(fd)
    data = np.fromfile(p, np.uint8)
    assert data.size == 4096 + (1 << 20) and (data[4096:] == 7).all()


def test_pinned_tensor_calls_cover_views():
    h = DeepSpeedAioHandle()
    t = h.new_cpu_locked_tensor(10_000, torch.empty(0, dtype=torch.bfloat16))
    assert t.dtype == torch.bfloat16 and t.numel() == 10_000
    assert h.is_pinned(t) and h.is_pinned(t.narrow(0, 5000, 100))  # DeepSpeed asserts on slices
    assert not h.is_pinned(torch.empty(10))
    assert h.free_cpu_locked_tensor(t) and not h.is_pinned(t)


def test_errors_raise_instead_of_returning_minus_one(tmp_path):
    h = DeepSpeedAioHandle()
    with pytest.raises(FileNotFoundError):
        h.async_pread(torch.empty(10), str(tmp_path / "missing"), 0)
    p = str(tmp_path / "short.bin")
    h.sync_pwrite(torch.zeros(10), p, 0)
    with pytest.raises(EOFError):
        h.sync_pread(torch.empty(100), p, 0)
    h.handle._c.inject_fault("error", errno.EIO, "write", 1, 1)
    h.async_pwrite(torch.zeros(1000), p, 0)
    with pytest.raises(OSError) as ei:
        h.wait()
    assert ei.value.errno == errno.EIO
    with pytest.raises(NotImplementedError, match="use_gds"):
        h.pin_device_tensor(torch.empty(1))


def test_builder_stand_in():
    b = AioAsyncIOBuilder()
    assert b.is_compatible() and b.NAME == "async_io"
    op = b.load(verbose=False)
    assert op.aio_handle is DeepSpeedAioHandle


def test_validations_survive_an_interrupted_wait(tmp_path, monkeypatch):
    """Ctrl-C during wait() collects nothing: the validate=True checks of the
    pending requests are done by the wait() that does collect them."""
    h = DeepSpeedAioHandle()
    p = str(tmp_path / "v.bin")
    checked = []
    monkeypatch.setattr(h.handle, "verify", lambda buf, f, off, what: checked.append((f, off, what)))
    assert h.pwrite(torch.ones(1000), p, True, True, 0) == 0  # async, validated at wait()
    real_wait = h.handle.wait

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(h.handle, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        h.wait()
    monkeypatch.setattr(h.handle, "wait", real_wait)
    assert h.wait() == 1 and checked == [(p, 0, "write")]


def test_failed_wait_drops_the_failed_batchs_validations(tmp_path):
    h = DeepSpeedAioHandle()
    p = str(tmp_path / "f.bin")
    h.handle._c.inject_fault("error", errno.EIO, "write", 1, 1)
    h.pwrite(torch.zeros(1000), p, True, True, 0)
    with pytest.raises(OSError):
        h.wait()
    assert h.wait() == 0  # the failed write is not checked again


def _settled(h: DeepSpeedAioHandle) -> None:
    """Until every request of `h` has finished (10 s at most), without collecting them."""
    deadline = time.monotonic() + 10
    while h.handle.pending():
        if time.monotonic() > deadline:
            raise TimeoutError("requests still pending after 10 s")
        time.sleep(0.001)


def test_failed_request_keeps_the_batchs_other_validations(tmp_path):
    """One request of a batch fails: the validate=True checks of the others
    still run, and a failed check is noted on the error wait() raises."""
    h = DeepSpeedAioHandle()
    src, ok = str(tmp_path / "src.bin"), str(tmp_path / "ok.bin")
    h.sync_pwrite(torch.zeros(1000), src, 0)
    h.handle._c.inject_fault("error", errno.EIO, "read", 1, 1)
    assert h.pread(torch.empty(1000), src, False, True, 0) == 0  # fails
    assert h.pwrite(torch.ones(1000), ok, True, True, 0) == 0  # succeeds, validated at wait()
    _settled(h)
    with open(ok, "r+b") as f:  # the bytes on the drive are not the buffer's
        f.write(b"\xff")
    with pytest.raises(OSError) as ei:
        h.wait()
    assert ei.value.operation == "read" and ei.value.filename == src  # the I/O error comes first
    notes = getattr(ei.value, "__notes__", [])
    assert len(notes) == 1 and "validation after write failed" in notes[0] and ok in notes[0], notes
    assert h.wait() == 0


def test_every_validation_runs_and_the_first_failure_is_raised(tmp_path):
    h = DeepSpeedAioHandle()
    paths = [str(tmp_path / f"{i}.bin") for i in range(3)]
    for p in paths:
        assert h.pwrite(torch.ones(1000), p, True, True, 0) == 0
    _settled(h)
    for p in (paths[0], paths[2]):
        with open(p, "r+b") as f:
            f.write(b"\xff")
    with pytest.raises(OSError, match="validation after write failed") as ei:
        h.wait()
    assert ei.value.filename == paths[0]
    notes = getattr(ei.value, "__notes__", [])
    assert len(notes) == 1 and "validation after write failed" in notes[0] and paths[2] in notes[0], notes
    assert h.wait() == 0


def test_remove_swap_files_takes_only_this_engines_files(tmp_path):
    from aio.integrations.deepspeed import _optimizer_swap_file, remove_swap_files

    folder = tmp_path / "rank0"
    folder.mkdir()
    ours = ["7_10.tensor.swp", "exp_avg-7_10.tensor.swp", "7_10_gradient_0_262144.tensor.swp"]
    theirs = ["17_10.tensor.swp", "exp_avg-7_100.tensor.swp", "notes.txt", "7_10.tensor.swp.bak"]
    for name in ours + theirs:
        (folder / name).write_bytes(b"x")
    outside = tmp_path / "outside.tensor.swp"
    outside.write_bytes(b"keep")
    (folder / "3_4.tensor.swp").symlink_to(outside)  # a link named like ours: not followed, not removed

    owned = functools.partial(_optimizer_swap_file, frozenset({"7_10", "3_4"}))
    assert remove_swap_files(str(folder), owned) == 3
    assert sorted(os.listdir(folder)) == sorted([*theirs, "3_4.tensor.swp"])
    assert outside.read_bytes() == b"keep"
    for name in theirs + ["3_4.tensor.swp"]:
        (folder / name).unlink()
    assert remove_swap_files(str(folder), owned) == 0 and not folder.exists()  # empty: removed
    link = tmp_path / "linked"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "7_10.tensor.swp").write_bytes(b"x")
    assert remove_swap_files(str(link), owned) == 0  # a folder that is a link is left alone
    assert (tmp_path / "elsewhere" / "7_10.tensor.swp").exists()
