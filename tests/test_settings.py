"""Each setting measurably does what it says, read off the engine's counters."""

import numpy as np
import pytest
from conftest import ENGINES, QUEUED_ENGINES, MiB, aligned_empty, handle


@pytest.fixture
def bigfile(tmp_path, pattern):
    p = str(tmp_path / "s.bin")
    with open(p, "wb") as f:
        f.write(pattern[: 16 * MiB].tobytes())
    return p


def _read(h, path, n=16 * MiB):
    buf = np.empty(n + 4096, np.uint8)
    start = (-buf.ctypes.data) % 4096  # aligned memory: no bounce
    h.sync_pread(buf[start : start + n], path)
    return h.stats()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("bs", [64 * 1024, 1 * MiB, 4 * MiB])
def test_block_size_sets_io_size(engine, bs, bigfile):
    st = _read(handle(engine=engine, block_size=bs), bigfile)
    assert st["ios"] == 16 * MiB // bs


@pytest.mark.parametrize("engine", QUEUED_ENGINES)
@pytest.mark.parametrize("qd", [1, 2, 8, 32])
def test_queue_depth_bounds_inflight(engine, qd, bigfile):
    st = _read(handle(engine=engine, queue_depth=qd, block_size=64 * 1024), bigfile)
    assert st["max_inflight"] == qd


@pytest.mark.parametrize("engine", QUEUED_ENGINES)
def test_queue_depth_spans_requests(engine, bigfile, pattern, tmp_path):
    """queue_depth is I/Os in flight per worker, whatever the requests: 64
    separate 4 KiB reads on one worker are 64 I/Os in flight (fio's iodepth),
    not one request at a time. A buffered read of 256 MiB from the page
    cache, one I/O (block_size), keeps the worker busy while the 64 are
    queued (tens of times longer than queueing them takes), so they are all
    waiting when it ends; one request at a time would show 1 in flight."""
    import os
    import random

    hold = tmp_path / "hold.bin"
    hold.write_bytes(bytes(256 * MiB))  # buffered: it stays in the page cache
    h = handle(engine=engine, queue_depth=64, thread_count=1, block_size=256 * MiB)
    fd = os.open(hold, os.O_RDONLY)  # no O_DIRECT: the handle honours buffered I/O
    try:
        held = h.async_pread(np.empty(256 * MiB, np.uint8), fd)
        offs = random.Random(7).sample(range(16 * MiB // 4096), 64)
        bufs = [aligned_empty(4096) for _ in offs]
        futs = [h.async_pread(b, bigfile, o * 4096) for b, o in zip(bufs, offs, strict=True)]
        assert not held.done(), "the held read ended before the 64 were queued"
        assert held.result(timeout=60) == 256 * MiB
        assert [f.result(timeout=60) for f in futs] == [4096] * 64
    finally:
        os.close(fd)
    for b, o in zip(bufs, offs, strict=True):
        assert np.array_equal(b, pattern[o * 4096 : o * 4096 + 4096])
    st = h.stats()
    assert st["tasks"] == 65 and st["failed_requests"] == 0
    assert st["max_inflight"] == 64


@pytest.mark.parametrize("engine", QUEUED_ENGINES)
def test_single_submit_makes_one_syscall_per_io(engine, bigfile):
    # Without overlap_events the queue drains before each refill, so the
    # batches are 8 whatever the drive does (with it, how many completions
    # one refill gathers is timing: a CI run saw 35 submits for 64 I/Os).
    def stats(single_submit):
        h = handle(
            engine=engine,
            single_submit=single_submit,
            overlap_events=False,
            queue_depth=8,
            block_size=256 * 1024,
        )
        return _read(h, bigfile)

    single, batch = stats(True), stats(False)
    assert single["submit_calls"] == single["ios"] == 64
    assert batch["submit_calls"] == batch["ios"] // 8


def _trickled(overlap, path):
    # The "trickle" fault makes each wait hand back no more completions than
    # it asked for, as a slow drive does; on a fast one (or tmpfs, where
    # kernel AIO completes inside io_submit) every wait finds the whole batch
    # done and the two modes cannot differ.
    h = handle(engine="kernel_aio", queue_depth=8, block_size=256 * 1024, overlap_events=overlap)
    h._c.inject_fault("trickle", 0, "any", 1, 1)  # the core handle's test hook
    return _read(h, path)


def test_overlap_events_refills_vs_batches(bigfile, pattern):
    # Without overlap the queue drains before each batch of 8: 64/8 batches,
    # one io_submit each, whatever the drive does.
    no = _trickled(False, bigfile)
    assert no["submit_calls"] == 8 and no["getevents_calls"] == 8
    # With overlap every completion is refilled at once: the first batch of 8,
    # then one io_submit per completion until the 64 chunks are handed out.
    yes = _trickled(True, bigfile)
    assert yes["submit_calls"] == 1 + (64 - 8) and yes["getevents_calls"] == 64
    assert yes["max_inflight"] == no["max_inflight"] == 8
    # On the real drive, untouched, the same read is right in both modes.
    for overlap in (False, True):
        h = handle(engine="kernel_aio", queue_depth=8, block_size=256 * 1024, overlap_events=overlap)
        buf = np.empty(16 * MiB, np.uint8)
        h.sync_pread(buf, bigfile)
        assert np.array_equal(buf, pattern[: 16 * MiB])
        assert h.stats()["max_inflight"] == 8


@pytest.mark.parametrize("engine", QUEUED_ENGINES[1:])
def test_overlap_events_refills_vs_batches_io_uring(engine, bigfile, pattern):
    # io_uring submits a batch and waits for it in one io_uring_enter, and
    # takes completions already in the ring without a system call: the
    # submissions count as for kernel AIO, the waits are at most one each.
    def trickled(overlap):
        h = handle(engine=engine, queue_depth=8, block_size=256 * 1024, overlap_events=overlap)
        h._c.inject_fault("trickle", 0, "any", 1, 1)
        return _read(h, bigfile)

    no = trickled(False)
    assert no["submit_calls"] == 8 and no["getevents_calls"] <= 8
    yes = trickled(True)
    assert yes["submit_calls"] == 1 + (64 - 8) and yes["getevents_calls"] <= 64
    assert yes["max_inflight"] == no["max_inflight"] == 8
    for overlap in (False, True):
        h = handle(engine=engine, queue_depth=8, block_size=256 * 1024, overlap_events=overlap)
        buf = np.empty(16 * MiB, np.uint8)
        h.sync_pread(buf, bigfile)
        assert np.array_equal(buf, pattern[: 16 * MiB])
        assert h.stats()["max_inflight"] == 8


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7])
def test_thread_count_splits_request_into_slices(engine, threads, bigfile):
    st = _read(handle(engine=engine, thread_count=threads), bigfile)
    assert st["tasks"] == threads


def test_small_request_uses_fewer_slices_than_threads(bigfile):
    st = _read(handle(thread_count=8), bigfile, n=3 * 4096)
    assert st["tasks"] == 3


def test_getters_and_aliases():
    h = handle(
        block_size=123 * 4096,
        queue_depth=5,
        single_submit=True,
        overlap_events=False,
        thread_count=3,
    )
    assert h.get_block_size() == 123 * 4096 and h.get_queue_depth() == 5
    assert h.get_single_submit() is True and h.get_overlap_events() is False
    assert h.get_thread_count() == h.get_intra_op_parallelism() == 3
    assert h.get_alignment() >= 4096 and h.get_alignment() % 4096 == 0
    import aio

    assert aio.AsyncIOHandle(intra_op_parallelism=4).get_thread_count() == 4
    st = h.stats()
    for key in (
        "engine",
        "engine_reason",
        "bytes_read",
        "bytes_written",
        "retries",
        "short_resumed",
        "buffered_fallback",
        "bounce_bytes",
        "submit_calls",
        "max_inflight",
        "pending",
    ):
        assert key in st
