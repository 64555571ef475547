"""The compiled core on its own (aio._C, no Python-layer checks) under fork,
out-of-range arguments, failures part-way through a request, bad paths,
filesystems without direct I/O, Ctrl-C and overlapping requests in flight.
Crash- and hang-prone cases run in a subprocess with a timeout."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import ENGINES, QUEUED_ENGINES, MiB, aligned_empty

from aio import _C

READ, WRITE = 0, 1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _handle(engine="auto", block_size=MiB, queue_depth=4, thread_count=1):
    return _C.Handle(block_size, queue_depth, False, True, thread_count, engine)


def _run(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _submit_and_wait(h, op, buf, path, offset=0):
    req = h.submit(op, buf.ctypes.data, buf.nbytes, path, -1, offset)
    assert req.wait(60.0)
    return req


# F12: fork --------------------------------------------------------------------

FORK_SCRIPT = """
import gc, os, sys
import numpy as np
from aio import _C
from aio._errors import HandleStateError

path, mode = sys.argv[1], sys.argv[2]
data = (np.arange(1 << 20) % 251).astype(np.uint8)
data.tofile(path)
h = _C.Handle(1 << 18, 4, False, True, 2, "auto")
buf = np.zeros(1 << 20, np.uint8)
req = h.submit(0, buf.ctypes.data, buf.nbytes, path, -1, 0)
pid = os.fork()
if pid == 0:
    code = 0
    if mode == "parent-request":
        for name, call in (("wait", lambda: req.wait(5.0)), ("result", req.result)):
            try:
                call()
                print("child", name, "returned", flush=True)
                code = 3
            except HandleStateError as e:
                print("child", name, "error:", e, flush=True)
            except Exception as e:
                print("child", name, "wrong error:", repr(e), flush=True)
                code = 3
        h.drain()  # nothing of the child's is in flight on the inherited handle
    else:
        h2 = _C.Handle(1 << 18, 4, False, True, 2, "auto")
        out = np.zeros(1 << 20, np.uint8)
        r2 = h2.submit(0, out.ctypes.data, out.nbytes, path, -1, 0)
        r2.wait()
        r2.result()
        if not np.array_equal(out, data):
            code = 4
        del r2, h2
    del req, h
    gc.collect()
    print("child done", flush=True)
    sys.exit(code)
req.wait()
req.result()
_, status = os.waitpid(pid, 0)
print("parent saw child status", status, flush=True)
sys.exit(0 if status == 0 and np.array_equal(buf, data) else 1)
"""


def test_forked_child_makes_its_own_handle_and_exits_cleanly(tmp_path):
    r = _run(FORK_SCRIPT, str(tmp_path / "f.bin"), "own-handle")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "child done" in out and "parent saw child status 0" in out, out


def test_forked_child_waiting_on_parent_request_gets_an_error(tmp_path):
    r = _run(FORK_SCRIPT, str(tmp_path / "f.bin"), "parent-request")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "child wait error:" in out and "child result error:" in out, out
    assert "before fork" in out and "parent saw child status 0" in out, out


# F14 / F7 / F23: ranges --------------------------------------------------------


def test_pool_size_product_overflow_is_refused():
    with pytest.raises(OverflowError, match="slot_bytes"):
        _C.PinnedPool(3, 4096 * ((2**52 + 2) // 3), False)


def test_write_whose_end_overflows_int64_is_refused(fpath):
    h = _handle()
    buf = aligned_empty(8192)
    with pytest.raises(OverflowError, match="offset"):
        h.submit(WRITE, buf.ctypes.data, buf.nbytes, fpath, -1, 2**63 - 4096)
    assert not os.path.exists(fpath)
    assert h.stats()["outstanding"] == 0


def _bad_calls(fpath):
    h = _handle()
    pool = _C.PinnedPool(2, 4096, False)
    buf = aligned_empty(4096)
    p = buf.ctypes.data
    return [
        ("nbytes", lambda: h.submit(WRITE, p, 2**64, fpath, -1, 0)),
        ("nbytes", lambda: h.submit(WRITE, p, -1, fpath, -1, 0)),
        ("offset", lambda: h.submit(WRITE, p, 4096, fpath, -1, -1)),
        ("offset", lambda: h.submit(WRITE, p, 4096, fpath, -1, 2**64)),
        ("ptr", lambda: h.submit(WRITE, 2**64, 4096, fpath, -1, 0)),
        ("fd", lambda: h.submit(WRITE, p, 4096, "", 2**40, 0)),
        ("op", lambda: h.submit(2**70, p, 4096, fpath, -1, 0)),
        ("nbytes", lambda: _C.PinnedBuffer(2**64, False)),
        ("nbytes", lambda: _C.PinnedBuffer(-1, False)),
        ("count", lambda: _C.PinnedPool(2**64, 4096, False)),
        ("slot_bytes", lambda: _C.PinnedPool(1, -1, False)),
        ("index", lambda: pool.slot_ptr(2**64)),
        ("index", lambda: pool.slot_ptr(-1)),
        ("index", lambda: pool.slot_ptr(2)),
        ("index", lambda: pool.release(2**64)),
        ("timeout_ms", lambda: pool.acquire(2**64)),
        ("nth", lambda: h.inject_fault("error", 5, "any", 2**64, 1)),
        ("count", lambda: h.inject_fault("error", 5, "any", 1, -1)),
        ("errno", lambda: h.inject_fault("error", 2**40, "any", 1, 1)),
        ("block_size", lambda: _C.Handle(2**64, 4, False, True, 1, "auto")),
        ("queue_depth", lambda: _C.Handle(MiB, -1, False, True, 1, "auto")),
        ("thread_count", lambda: _C.Handle(MiB, 4, False, True, 2**33, "auto")),
    ]


@pytest.mark.parametrize("case", range(22))
def test_out_of_range_integers_name_the_argument(case, fpath):
    name, call = _bad_calls(fpath)[case]
    with pytest.raises((ValueError, OverflowError), match=name):
        call()


def test_infinite_timeouts_mean_no_timeout(fpath):
    pool = _C.PinnedPool(1, 4096, False)
    assert pool.acquire(float("inf")) == 0
    pool.release(0)
    h = _handle()
    req = h.submit(WRITE, aligned_empty(4096).ctypes.data, 4096, fpath, -1, 0)
    assert req.wait(float("inf")) is True
    with pytest.raises(ValueError, match="NaN"):
        req.wait(float("nan"))


# F18: a failed request's error covers every byte not transferred -------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("op", [READ, WRITE])
def test_error_covers_every_byte_not_transferred(engine, threads, op, pattern, fpath):
    data = pattern[: 8 * MiB]
    if op == READ:
        data.tofile(fpath)
    h = _handle(engine, block_size=MiB, queue_depth=2, thread_count=threads)
    buf = aligned_empty(data.size)
    buf[:] = data if op == WRITE else 0
    h.inject_fault("error", errno.EIO, "read" if op == READ else "write", 3, 1)
    req = _submit_and_wait(h, op, buf, fpath)
    with pytest.raises(OSError) as ei:
        req.result()
    e = ei.value
    assert e.errno == errno.EIO and e.offset % MiB == 0 and e.offset < data.size
    assert e.offset + e.length == data.size, (e.offset, e.length)
    assert f"{e.offset} of {data.size} bytes" in str(e)
    # Everything before the reported offset really was transferred.
    if op == WRITE:
        got = np.fromfile(fpath, np.uint8)[: e.offset]
    else:
        got = buf[: e.offset]
    assert np.array_equal(got, data[: e.offset])


# F19: NUL in a path ---------------------------------------------------------------


def test_path_with_nul_byte_is_refused(tmp_path):
    h = _handle()
    buf = aligned_empty(4096)
    victim = str(tmp_path / "a")
    with pytest.raises(ValueError, match="NUL"):
        h.submit(WRITE, buf.ctypes.data, 4096, victim + "\0.bin", -1, 0)
    assert not os.path.exists(victim)


# F6: statx says the file has no direct I/O (ext4 data=journal) ------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_statx_without_direct_io_falls_back_to_buffered(engine, pattern, fpath):
    data = pattern[: 3 * MiB + 123]
    h = _handle(engine, thread_count=2)
    h.inject_fault("no_direct_statx", 0, "any", 1, 1)
    src = aligned_empty(data.size)
    src[:] = data
    _submit_and_wait(h, WRITE, src, fpath).result()
    out = aligned_empty(data.size)
    _submit_and_wait(h, READ, out, fpath).result()
    assert np.array_equal(out, data)
    st = h.stats()
    assert st["buffered_fallback"] and st["failed_requests"] == 0
    assert st["buffered_bytes"] >= 2 * data.size
    assert any("statx" in n for n in h.take_notices())


# F15: Ctrl-C during a blocking open() ------------------------------------------

FIFO_SCRIPT = """
import signal
import sys
import numpy as np
from aio import _C

h = _C.Handle(1 << 20, 4, False, True, 2, "auto")
buf = np.zeros(4096, np.uint8)
try:
    print("about to open", flush=True)
    h.submit(0, buf.ctypes.data, 4096, sys.argv[1], -1, 0)
    print("open returned", flush=True)
except KeyboardInterrupt:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the test repeats it
    print("interrupted", flush=True)
    sys.exit(0)
sys.exit(1)
"""


def test_ctrl_c_interrupts_open_of_fifo_without_writer(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(FIFO_SCRIPT), fifo],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout.readline().strip() == "about to open"
        # Repeat the signal: one sent before open() starts is handled by the
        # interpreter alone; the point is that one arriving during it works.
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(0.2)
            except subprocess.TimeoutExpired:
                pass
        out, err = proc.communicate(timeout=1) if proc.poll() is not None else ("", "")
        # A repeated SIGINT may still land while the child exits after
        # printing; what matters is that the KeyboardInterrupt reached Python.
        assert "interrupted" in out, (proc.returncode, out, err)
        assert proc.returncode in (0, -signal.SIGINT), (proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# F17: overlapping requests keep their order ---------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_read_after_overlapping_write_sees_the_write(engine, fpath):
    page = 4096
    h = _handle(engine, block_size=page, thread_count=4)
    np.zeros(4 * page, np.uint8).tofile(fpath)
    src = aligned_empty(4 * page)
    out = aligned_empty(page)
    for i in range(200):
        src[:] = i % 251 + 1
        # The write is split over the 4 workers (one page each); the read of
        # its last page runs on worker 0, right behind the write's first page.
        w = h.submit(WRITE, src.ctypes.data, src.nbytes, fpath, -1, 0)
        r = h.submit(READ, out.ctypes.data, page, fpath, -1, 3 * page)
        assert r.wait(60.0) and w.wait(60.0)
        r.result()
        w.result()
        assert (out == i % 251 + 1).all(), f"iteration {i}: read missed the write"


def test_overlapping_requests_on_one_worker_do_not_deadlock(fpath):
    h = _handle("posix", block_size=4096, thread_count=3)
    bufs = [aligned_empty(5 * 4096) for _ in range(30)]
    reqs = []
    for i, b in enumerate(bufs):
        b[:] = i
        reqs.append(h.submit(WRITE, b.ctypes.data, b.nbytes, fpath, -1, (i % 3) * 4096))
    for r in reqs:
        assert r.wait(60.0)
        r.result()
    assert h.stats()["outstanding"] == 0
    # The last write (i = 29, at offset 2 pages) is what the file holds there.
    got = np.fromfile(fpath, np.uint8)
    assert (got[2 * 4096 : 7 * 4096] == 29).all()


# The file a request opened is the file it finishes ---------------------------------
# A request's unaligned tail goes through a buffered descriptor opened after its
# aligned middle (block_size 4096, queue_depth 1: thousands of I/Os before it),
# so a name or descriptor number changed right after submit() is changed while
# the request runs.

RUNNING = 16 * MiB  # at 4 KiB a time, far longer than the changes below take


def _running_write(engine, src, path="", fd=-1):
    h = _handle(engine, block_size=4096, queue_depth=1)
    return h, h.submit(WRITE, src.ctypes.data, src.nbytes, path, fd, 0)


def _finish(req, nbytes):
    assert not req.done(), "the request ended before the change: make RUNNING bigger"
    assert req.wait(60.0)
    assert req.result() == nbytes


@pytest.mark.parametrize("change", ["replace", "unlink"])
@pytest.mark.parametrize("engine", ENGINES)
def test_write_edges_reach_the_opened_file_when_its_name_changes(engine, change, tmp_path):
    path = str(tmp_path / "f")
    src = aligned_empty(RUNNING + 100)
    src[:] = 0x5A
    h, req = _running_write(engine, src, path=path)
    keep = os.open(path, os.O_RDONLY)  # the file the request opened, whatever its name
    try:
        if change == "replace":  # an atomic replace by another tool
            os.rename(path, str(tmp_path / "moved"))
            with open(path, "wb") as f:
                f.write(b"NEWFILE")
        else:
            os.unlink(path)
        _finish(req, src.nbytes)
        got = np.frombuffer(os.pread(keep, src.nbytes + 1, 0), np.uint8)
    finally:
        os.close(keep)
    assert got.size == src.nbytes and (got == 0x5A).all()
    if change == "replace":
        with open(path, "rb") as f:
            assert f.read() == b"NEWFILE"


@pytest.mark.parametrize("engine", ENGINES)
def test_read_edges_come_from_the_opened_file_when_its_name_changes(engine, tmp_path):
    path = str(tmp_path / "f")
    np.full(RUNNING + 100, 0x5A, np.uint8).tofile(path)
    out = aligned_empty(RUNNING + 100)
    h = _handle(engine, block_size=4096, queue_depth=1)
    req = h.submit(READ, out.ctypes.data, out.nbytes, path, -1, 0)
    os.rename(path, str(tmp_path / "moved"))
    np.full(RUNNING + 100, 0xA5, np.uint8).tofile(path)
    _finish(req, out.nbytes)
    assert (out == 0x5A).all()


@pytest.mark.parametrize("engine", ENGINES)
def test_caller_may_close_its_descriptor_while_the_request_runs(engine, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    src = aligned_empty(RUNNING + 100)  # the tail reopens the descriptor, late
    src[:] = 0x41
    fd = os.open(a, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    h, req = _running_write(engine, src, fd=fd)
    os.close(fd)  # e.g. leaving a `with open(...)` block before waiting
    other = os.open(b, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        assert other == fd, "the number was not reused: the test proves nothing"
        _finish(req, src.nbytes)
    finally:
        os.close(other)
    assert os.path.getsize(b) == 0
    got = np.fromfile(a, np.uint8)
    assert got.size == src.nbytes and (got == 0x41).all()


DUP_FAILS_SCRIPT = """
import errno, os, resource, sys
import numpy as np
from aio import _C

resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
h = _C.Handle(1 << 20, 4, False, True, 1, "posix")
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
buf = np.zeros(4096, np.uint8)
h.submit(1, buf.ctypes.data, buf.nbytes, "", fd, 0).wait()  # the engine's own descriptors
filler = []
try:
    while True:
        filler.append(os.dup(fd))
except OSError as e:
    assert e.errno == errno.EMFILE, e
try:
    h.submit(1, buf.ctypes.data, buf.nbytes, "", fd, 0)
    print("submitted")
except OSError as e:
    print(type(e).__name__, e.errno == errno.EMFILE, "fd %d" % fd in str(e))
"""


def test_descriptor_that_cannot_be_duplicated_is_an_oserror(tmp_path):
    r = _run(DUP_FAILS_SCRIPT, str(tmp_path / "f"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["OSError", "True", "True"], r.stdout


@pytest.mark.parametrize("engine", ENGINES)
def test_read_of_what_an_unfinished_write_appends_waits_for_it(engine, fpath):
    """A read of bytes a write still in flight is adding to a new file waits
    for that write (overlapping requests keep their order) instead of being
    refused as past the end of the file; once nothing in flight can extend
    the file, a read past its end is refused at once."""
    size = 32 << 20
    h = _handle(engine, thread_count=2)
    src = aligned_empty(size)
    out = aligned_empty(4096)
    for i in range(5):
        if os.path.exists(fpath):
            os.unlink(fpath)
        src[:] = i + 1
        w = h.submit(WRITE, src.ctypes.data, src.nbytes, fpath, -1, 0)
        r = h.submit(READ, out.ctypes.data, out.nbytes, fpath, -1, size - 4096)
        assert r.wait(60.0) and w.wait(60.0)
        w.result()
        r.result()
        assert (out == i + 1).all(), f"round {i}: the read missed the write"
    with pytest.raises(OSError, match="past end of file"):
        h.submit(READ, out.ctypes.data, out.nbytes, fpath, -1, size)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_small_unaligned_transfer_at_a_huge_block_size_stages_only_its_size(engine, fpath):
    """Memory not aligned for O_DIRECT goes through staging of chunk x
    queue_depth bytes; the chunk was block_size whatever the transfer, so an
    8 KiB read at block_size 1 GiB and queue_depth 256 asked for 256 GiB
    (ENOMEM on the queued engines). The chunk is now at most the slice."""
    data = np.arange(8192, dtype=np.uint8)
    data.tofile(fpath)
    h = _C.Handle(1 << 30, 256, False, True, 1, engine)
    raw = np.zeros(8192 + 1, np.uint8)
    out = raw[1:]  # one byte off: staged
    r = h.submit(READ, out.ctypes.data, out.nbytes, fpath, -1, 0)
    assert r.wait(60.0)
    r.result()
    assert (out == data).all()
    back = np.full(8192 + 1, 7, np.uint8)[1:]
    w = h.submit(WRITE, back.ctypes.data, back.nbytes, fpath, -1, 0)
    assert w.wait(60.0)
    w.result()
    assert (np.fromfile(fpath, np.uint8) == 7).all()


@pytest.mark.parametrize("engine", QUEUED_ENGINES)
def test_a_block_size_transfer_into_unaligned_memory_stages_what_can_be_in_flight(engine, tmp_path):
    """Staging was chunk x queue_depth: one 8 MiB transfer at block_size 8 MiB
    and queue_depth 32768 into unaligned memory asked for 256 GiB (ENOMEM).
    It is now made as chunks are staged: no more than the slice's chunks,
    queue_depth, or 64 MiB (one chunk if larger)."""
    path = str(tmp_path / "f.bin")
    n = 8 * MiB
    data = (np.arange(3 * n) % 251).astype(np.uint8)
    data.tofile(path)
    h = _handle(engine, block_size=n, queue_depth=32768)
    for size in (n, 3 * n):  # one chunk; three (a larger staging)
        out = np.zeros(size + 1, np.uint8)[1:]  # one byte off: staged
        _submit_and_wait(h, READ, out, path).result()
        assert (out == data[:size]).all()
        back = np.full(size + 1, 7, np.uint8)[1:]
        _submit_and_wait(h, WRITE, back, path).result()
        assert (np.fromfile(path, np.uint8)[:size] == 7).all()
        data[:size] = 7
    assert h.stats()["bounce_bytes"] == 2 * (n + 3 * n)


@pytest.mark.parametrize("engine", QUEUED_ENGINES)
def test_many_small_staged_requests_are_still_in_flight_together(engine, tmp_path):
    """Staging made as chunks need it grows for every slice in flight: 64
    unaligned 4 KiB reads at queue_depth 64 are not queued one at a time."""
    path = str(tmp_path / "f.bin")
    data = (np.arange(64 * 4096) % 241).astype(np.uint8)
    data.tofile(path)
    h = _handle(engine, block_size=MiB, queue_depth=64)
    outs = [np.zeros(4096 + 1, np.uint8)[1:] for _ in range(64)]
    reqs = [h.submit(READ, o.ctypes.data, 4096, path, -1, i * 4096) for i, o in enumerate(outs)]
    for r in reqs:
        assert r.wait(60.0)
        r.result()
    for i, o in enumerate(outs):
        assert (o == data[i * 4096 : (i + 1) * 4096]).all(), i
    assert h.stats()["max_inflight"] > 8


@pytest.mark.parametrize("engine", ENGINES)
def test_core_refuses_a_write_through_an_append_descriptor(engine, tmp_path):
    """File::adopt on an O_APPEND descriptor: every write would be appended
    whatever its offset (the core alone, without the Python check)."""
    path = str(tmp_path / "a.bin")
    old = (np.arange(16384) % 199).astype(np.uint8)
    old.tofile(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        h = _handle(engine)
        src = aligned_empty(4096)
        src[:] = 1
        with pytest.raises(OSError, match="O_APPEND") as ei:
            h.submit(WRITE, src.ctypes.data, src.nbytes, "", fd, 0).wait(60.0)
        assert ei.value.errno == errno.EINVAL and ei.value.filename == f"fd {fd}"
        offs = np.array([4096], np.int64)
        with pytest.raises(OSError, match="O_APPEND"):
            h.submit_pieces(WRITE, src.ctypes.data, 4096, offs.ctypes.data, 1, "", fd).wait(60.0)
    finally:
        os.close(fd)
    assert (np.fromfile(path, np.uint8) == old).all()
