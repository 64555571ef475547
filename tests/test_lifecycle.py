"""Lifecycle: exit with I/O pending, dropped futures and buffers, fork, the
GIL during long reads, many handles and threads at once."""

import gc
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import ENGINES, MiB, handle

import aio


@pytest.mark.parametrize("engine", ENGINES)
def test_exit_with_io_pending_completes_writes(tmp_path, engine):
    out = tmp_path / "pending.bin"
    code = textwrap.dedent(
        f"""
        import numpy as np, aio
        h = aio.AsyncIOHandle(block_size=1 << 20, queue_depth=4, engine={engine!r})
        for i in range(8):
            h.async_pwrite(np.full(16 << 20, i, np.uint8), {str(out)!r}, i * (16 << 20))
        # no wait(): the interpreter exits with writes in flight
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "terminate called" not in r.stderr
    data = np.fromfile(out, dtype=np.uint8)
    assert data.size == 8 * 16 * MiB
    assert all((data[i * 16 * MiB : (i + 1) * 16 * MiB] == i).all() for i in range(8))


@pytest.mark.parametrize("engine", ENGINES)
def test_exit_with_handle_dropped_mid_io(tmp_path, engine):
    code = textwrap.dedent(
        f"""
        import numpy as np, aio
        h = aio.AsyncIOHandle(thread_count=2, engine={engine!r})
        h.async_pwrite(np.ones(32 << 20, np.uint8), {str(tmp_path / "x.bin")!r})
        del h
        import gc; gc.collect()
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_dropped_future_and_buffer_are_safe(fpath, pattern):
    h = handle(block_size=256 * 1024, queue_depth=2)
    h.sync_pwrite(pattern[: 32 * MiB], fpath)
    for _ in range(4):
        buf = np.empty(32 * MiB, np.uint8)
        h.async_pread(buf, fpath)  # future dropped at once
        del buf  # only the handle's pending list keeps it alive now
        gc.collect()
    assert h.wait() == 4
    assert h.stats()["outstanding"] == 0


def test_future_keeps_buffer_alive():
    import weakref

    torch = pytest.importorskip("torch")
    h = handle()
    t = torch.zeros(1 << 20, dtype=torch.uint8)
    ref = weakref.ref(t)
    import tempfile

    with tempfile.NamedTemporaryFile() as f:
        fut = h.async_pwrite(t, f.name)
        del t
        gc.collect()
        assert ref() is not None or fut.done()
        assert fut.result() == 1 << 20
    h.wait()


@pytest.mark.parametrize("engine", ENGINES)
def test_fork_child_gets_clear_error_and_can_make_a_new_handle(fpath, engine):
    h = handle(engine=engine)
    h.sync_pwrite(b"parent", fpath)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = []
        try:
            h.sync_pread(bytearray(6), fpath)
            out.append("inherited-handle-worked")
        except ValueError as e:
            out.append("refused" if "fork" in str(e) else f"wrong:{e}")
        try:
            h2 = aio.AsyncIOHandle(engine=engine)
            b = bytearray(6)
            h2.sync_pread(b, fpath)
            out.append(bytes(b).decode())
        except BaseException as e:  # noqa: BLE001
            out.append(f"new-failed:{e}")
        os.write(wfd, ",".join(out).encode())
        os._exit(0)
    os.close(wfd)
    got = os.read(rfd, 4096).decode()
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert got == "refused,parent"
    # The parent's handle is unaffected.
    b = bytearray(6)
    h.sync_pread(b, fpath)
    assert bytes(b) == b"parent"


@pytest.mark.parametrize("engine", ENGINES)
def test_gil_released_during_long_read(engine, tmp_path):
    path = str(tmp_path / "big.bin")
    n = 256 * MiB
    h = handle(engine=engine, block_size=MiB)
    h.sync_pwrite(np.ones(n, np.uint8), path)
    ticks = [0]
    stop = threading.Event()
    started = threading.Event()

    def spin():
        started.set()
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=spin)
    buf = np.empty(n, np.uint8)
    t.start()
    started.wait()
    before = ticks[0]
    for _ in range(3):
        h.sync_pread(buf, path)
    during = ticks[0] - before
    stop.set()
    t.join()
    # A held GIL would freeze the spinning thread for the whole read.
    assert during > 1000, during


def test_many_handles_and_threads(tmp_path, pattern):
    shared = handle(thread_count=2, queue_depth=4)
    errors = []

    def worker(i):
        try:
            own = handle(engine="kernel_aio" if i % 2 else "posix", thread_count=1 + i % 3)
            for j, h in enumerate((own, shared)):
                p = str(tmp_path / f"t{i}_{j}.bin")
                data = pattern[i * 1000 : i * 1000 + MiB + i * 17]
                futs = [h.async_pwrite(data, p, k * (2 * MiB)) for k in range(3)]
                for f in futs:
                    f.result()
                for k in range(3):
                    out = np.empty_like(data)
                    h.sync_pread(out, p, k * (2 * MiB))
                    assert np.array_equal(out, data)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    shared.wait()


def test_futures_only_use_does_not_grow_pending(fpath):
    h = handle()
    buf = np.ones(4096, np.uint8)
    for _ in range(500):
        assert h.async_pwrite(buf, fpath).result() == 4096
    assert len(h._pending) <= 64
    assert h.wait() == 500  # still counted
    assert h.wait() == 0
