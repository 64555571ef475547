"""Fault injection through the engines' test hook: EIO, ENOSPC, short I/O,
EINTR/EAGAIN and O_DIRECT refused at open. Each must surface as the right
exception, or be recovered with the data intact -- never silently lost."""

import errno
import warnings

import numpy as np
import pytest
from conftest import ENGINES, MiB, handle

OPS = ["read", "write"]


def _prep(h, path, data):
    h.sync_pwrite(data, path, 0)


def _do(h, op, path, data, mode):
    if op == "write":
        buf = data
        call = h.sync_pwrite if mode == "sync" else h.async_pwrite
    else:
        buf = np.zeros_like(data)
        call = h.sync_pread if mode == "sync" else h.async_pread
    r = call(buf, path, 0)
    if mode == "async":
        r = r.result()
    return r, buf


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
@pytest.mark.parametrize("nth", [1, 3])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_error_on_nth_io_raises(engine, op, err, nth, mode, pattern, fpath):
    data = pattern[: 4 * MiB]
    h = handle(engine=engine, block_size=256 * 1024, queue_depth=4)
    _prep(h, fpath, data)
    h._c.inject_fault("error", err, op, nth, 1)
    with pytest.raises(OSError) as ei:
        _do(h, op, fpath, data, mode)
    e = ei.value
    assert e.errno == err and e.filename == fpath
    assert e.operation == op and e.length > 0 and e.offset % (256 * 1024) == 0
    assert h._c.fault_hits() == 1
    assert h.stats()["failed_requests"] == 1
    # An error already raised by the future is not raised again by wait().
    assert h.wait() == (0 if mode == "sync" else 1)
    # The handle stays usable and the next I/O is intact.
    h._c.clear_fault()
    r, buf = _do(h, op, fpath, data, "sync")
    assert r == data.size
    if op == "read":
        assert np.array_equal(buf, data)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("nth", [1, 2, 5])
def test_short_transfer_is_resumed(engine, op, nth, pattern, fpath):
    data = pattern[: 3 * MiB + 5]
    h = handle(engine=engine, block_size=512 * 1024, thread_count=2)
    if op == "read":
        _prep(h, fpath, data)
    h._c.inject_fault("short", 0, op, nth, 2)
    r, buf = _do(h, op, fpath, data, "sync")
    assert r == data.size
    assert h._c.fault_hits() >= 1
    assert h.stats()["short_resumed"] >= 1
    h._c.clear_fault()
    out = np.zeros_like(data)
    h.sync_pread(out, fpath, 0)
    assert np.array_equal(out, data)
    if op == "read":
        assert np.array_equal(buf, data)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("err", [errno.EINTR, errno.EAGAIN])
def test_transient_errors_are_retried(engine, op, err, pattern, fpath):
    data = pattern[: 2 * MiB + 100]
    h = handle(engine=engine, block_size=256 * 1024)
    _prep(h, fpath, data)
    h._c.inject_fault("error", err, op, 2, 3)
    r, buf = _do(h, op, fpath, data, "async")
    assert r == data.size
    assert h.stats()["retries"] >= 3
    h._c.clear_fault()
    out = np.zeros_like(data)
    h.sync_pread(out, fpath, 0)
    assert np.array_equal(out, data)


@pytest.mark.parametrize("engine", ENGINES)
def test_open_direct_refused_falls_back_to_buffered(engine, pattern, fpath):
    data = pattern[: 2 * MiB + 7]
    h = handle(engine=engine)
    h._c.inject_fault("open_direct", errno.EINVAL, "any", 1, 1)
    with pytest.warns(RuntimeWarning, match="O_DIRECT is not available"):
        h.sync_pwrite(data, fpath, 11)
    out = np.zeros_like(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is given once per handle
        h.sync_pread(out, fpath, 11)
    assert np.array_equal(out, data)
    st = h.stats()
    assert st["buffered_fallback"] is True
    assert st["buffered_bytes"] >= data.size


def test_open_direct_other_errno_is_raised(fpath):
    """Only EINVAL means 'no O_DIRECT here'; other open errors are real."""
    h = handle()
    h._c.inject_fault("open_direct", errno.EACCES, "write", 1, 1)
    with pytest.raises(PermissionError):
        h.sync_pwrite(b"abc", fpath)


@pytest.mark.parametrize("engine", ENGINES)
def test_error_in_one_slice_of_multithreaded_request(engine, pattern, fpath):
    """With 4 workers, one failing slice fails the whole request, after every
    other slice finished (no I/O left aimed at the buffer)."""
    data = pattern[: 8 * MiB]
    h = handle(engine=engine, thread_count=4, block_size=MiB)
    _prep(h, fpath, data)
    h._c.inject_fault("error", errno.EIO, "read", 5, 1)
    out = np.zeros_like(data)
    fut = h.async_pread(out, fpath)
    with pytest.raises(OSError) as ei:
        h.wait()
    assert ei.value.errno == errno.EIO
    assert fut.done() and h.stats()["outstanding"] == 0


def test_wait_raises_first_error_but_collects_all(pattern, tmp_path):
    h = handle(block_size=MiB)
    data = pattern[: 2 * MiB]
    paths = [str(tmp_path / f"f{i}") for i in range(4)]
    h._c.inject_fault("error", errno.EIO, "write", 3, 1)
    futs = [h.async_pwrite(data, p) for p in paths]
    with pytest.raises(OSError):
        h.wait()
    assert all(f.done() for f in futs)
    assert sum(f.exception() is not None for f in futs) == 1
    assert h.wait() == 0
