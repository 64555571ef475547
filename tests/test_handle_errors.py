"""Every error path of AsyncIOHandle: real OS errors and API misuse."""

import errno
import os

import numpy as np
import pytest
from conftest import ENGINES, MiB, aligned_empty, engine_unavailable, handle

import aio


@pytest.mark.parametrize("engine", ENGINES)
def test_missing_file_is_file_not_found(engine, tmp_path):
    h = handle(engine=engine)
    p = str(tmp_path / "nope.bin")
    with pytest.raises(FileNotFoundError) as ei:
        h.sync_pread(np.empty(10, np.uint8), p, 5)
    e = ei.value
    assert e.errno == errno.ENOENT and e.filename == p
    assert e.operation.startswith("open") and e.offset == 0
    with pytest.raises(FileNotFoundError):
        h.async_pread(np.empty(10, np.uint8), p)
    assert h.wait() == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_read_past_eof_raises_and_never_returns_stale_bytes(engine, fpath):
    h = handle(engine=engine)
    with open(fpath, "wb") as f:
        f.write(b"x" * 10000)
    out = np.full(8192, 0xAB, np.uint8)
    with pytest.raises(aio.ReadPastEOFError) as ei:
        h.sync_pread(out, fpath, 4096)
    e = ei.value
    assert isinstance(e, OSError) and isinstance(e, EOFError)
    assert e.errno == errno.ENODATA and e.filename == fpath
    assert e.offset == 4096 and e.length == 8192
    assert "10000 bytes" in str(e)
    # An empty file and an offset beyond the end too.
    open(fpath, "wb").close()
    with pytest.raises(EOFError):
        h.sync_pread(bytearray(1), fpath, 0)


def test_write_to_directory_is_is_a_directory(tmp_path):
    h = handle()
    with pytest.raises(IsADirectoryError) as ei:
        h.sync_pwrite(b"abc", str(tmp_path))
    assert ei.value.filename == str(tmp_path)


def test_real_enospc_surfaces_as_oserror():
    """/dev/full rejects O_DIRECT (buffered fallback) and fails writes with ENOSPC."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    h = handle()
    with pytest.warns(RuntimeWarning, match="O_DIRECT"):
        with pytest.raises(OSError) as ei:
            h.sync_pwrite(np.ones(4096, np.uint8), "/dev/full", 0)
    assert ei.value.errno == errno.ENOSPC
    assert ei.value.filename == "/dev/full" and ei.value.length > 0
    assert h.stats()["failed_requests"] == 1


def test_permission_denied_as_unprivileged_user(tmp_path):
    """Root bypasses file modes, so the check runs in a forked child that
    drops to 'nobody' (modules are already imported, so no path access is needed)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 100)
    os.chmod(secret, 0o600)
    os.chmod(tmp_path, 0o755)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        msg = b"no error"
        try:
            os.setgid(65534)
            os.setuid(65534)
            h = aio.AsyncIOHandle()
            h.sync_pread(np.empty(10, np.uint8), str(secret))
        except PermissionError as e:
            msg = f"PermissionError {e.errno} {e.filename}".encode()
        except BaseException as e:  # noqa: BLE001
            msg = f"other {type(e).__name__} {e}".encode()
        os.write(wfd, msg)
        os._exit(0)
    os.close(wfd)
    got = os.read(rfd, 4096).decode()
    os.close(rfd)
    os.waitpid(pid, 0)
    assert got == f"PermissionError 13 {secret}", got


# -- misuse: ValueError / TypeError naming the argument ------------------------


def test_negative_offset(fpath):
    h = handle()
    with pytest.raises(ValueError, match="file_offset"):
        h.sync_pwrite(b"abc", fpath, -1)
    with pytest.raises(TypeError, match="file_offset"):
        h.sync_pwrite(b"abc", fpath, 1.5)


def test_non_contiguous_buffers(fpath):
    torch = pytest.importorskip("torch")
    h = handle()
    with pytest.raises(ValueError, match="contiguous"):
        h.sync_pwrite(np.arange(20, dtype=np.uint8)[::2], fpath)
    with pytest.raises(ValueError, match="contiguous"):
        h.sync_pwrite(torch.arange(20).reshape(4, 5).t(), fpath)
    with pytest.raises(ValueError, match="contiguous"):
        h.sync_pwrite(memoryview(bytearray(20))[::2], fpath)


def test_read_into_read_only_buffers(fpath):
    h = handle()
    with open(fpath, "wb") as f:
        f.write(b"z" * 100)
    with pytest.raises(ValueError, match="read-only"):
        h.sync_pread(b"\0" * 10, fpath)
    ro = np.zeros(10, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        h.sync_pread(ro, fpath)


def test_unsupported_buffer_and_path_types(fpath):
    h = handle()
    with pytest.raises(TypeError, match="buffer"):
        h.sync_pwrite("text", fpath)
    with pytest.raises(TypeError, match="buffer"):
        h.sync_pwrite(object(), fpath)
    with pytest.raises(TypeError, match="path"):
        h.sync_pwrite(b"a", 3.5)
    with pytest.raises(ValueError, match="path"):
        h.sync_pwrite(b"a", "")
    with pytest.raises(ValueError, match="descriptor"):
        h.sync_pwrite(b"a", -3)


def test_bad_descriptor_is_oserror():
    h = handle()
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError) as ei:
        h.sync_pwrite(b"a", w)
    assert ei.value.errno == errno.EBADF


@pytest.mark.parametrize(
    "kw,exc,name",
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": -4096}, ValueError, "block_size"),
        ({"queue_depth": 0}, ValueError, "queue_depth"),
        ({"queue_depth": "8"}, TypeError, "queue_depth"),
        ({"thread_count": 0}, ValueError, "thread_count"),
        ({"thread_count": 2.0}, TypeError, "thread_count"),
        ({"single_submit": 1}, TypeError, "single_submit"),
        ({"overlap_events": None}, TypeError, "overlap_events"),
        ({"engine": "libaio"}, ValueError, "engine"),
        ({"engine": 3}, TypeError, "engine"),
        ({"block_size": True}, TypeError, "block_size"),
    ],
)
def test_bad_settings(kw, exc, name):
    with pytest.raises(exc, match=name):
        aio.AsyncIOHandle(**kw)


def test_closed_handle(fpath):
    h = handle()
    h.sync_pwrite(b"abc", fpath)
    h.close()
    h.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        h.sync_pwrite(b"abc", fpath)
    with pytest.raises(ValueError, match="closed"):
        h.wait()
    with aio.AsyncIOHandle() as h2:
        h2.sync_pwrite(b"abc", fpath)
    with pytest.raises(ValueError, match="closed"):
        h2.async_pread(bytearray(3), fpath)


@pytest.mark.parametrize("how", ["close", "with"])
def test_close_raises_an_async_error_nobody_saw(fpath, how):
    """An async write that failed and was never waited for: close() (or the
    with block's end) raises it once the handle is closed, as a file's
    close() raises a failed flush; one already seen is not raised again."""
    buf = np.ones(1 << 20, np.uint8)
    with pytest.raises(OSError, match="write failed") as err:
        if how == "with":
            with aio.AsyncIOHandle() as h:
                h._c.inject_fault("error", errno.EIO, "write", 1, 1)
                h.async_pwrite(buf, fpath)
        else:
            h = aio.AsyncIOHandle()
            h._c.inject_fault("error", errno.EIO, "write", 1, 1)
            h.async_pwrite(buf, fpath)
            h.close()
    assert err.value.errno == errno.EIO
    with pytest.raises(ValueError, match="closed"):
        h.wait()
    h2 = aio.AsyncIOHandle()
    h2._c.inject_fault("error", errno.EIO, "write", 1, 1)
    fut = h2.async_pwrite(buf, fpath)
    assert isinstance(fut.exception(), OSError)
    h2.close()  # seen through the future: not raised again


def test_wait_with_nothing_pending_is_zero():
    assert handle().wait() == 0


def test_future_timeout_and_repr(fpath):
    h = handle()
    f = h.async_pwrite(np.ones(4 * MiB, np.uint8), fpath)
    assert "AioFuture write" in repr(f)
    assert f.result(timeout=60) == 4 * MiB
    assert f.exception() is None
    assert h.wait() == 1


def test_validate_detects_mismatch(fpath, monkeypatch):
    h = handle()
    data = np.arange(8192, dtype=np.uint8)
    assert h.pwrite(data, fpath, validate=True) == 8192
    out = np.empty_like(data)
    assert h.pread(out, fpath, validate=True) == 8192
    with pytest.raises(ValueError, match="validate"):
        h.pread(out, fpath, validate=True, async_op=True)
    # A buffer that differs from the file must fail validation with EIO.
    out[5] ^= 0xFF
    with pytest.raises(OSError) as ei:
        h.verify(out, fpath, 0, "read")
    assert ei.value.errno == errno.EIO and "validation" in str(ei.value)


@pytest.mark.parametrize("by", ["path", "fd"])
def test_validate_reads_back_past_one_short_read(fpath, monkeypatch, by):
    """One pread returns at most 2 GiB on Linux (less on a pipe-like file):
    validation by descriptor took one call's bytes for the whole file and
    failed a correct read of a buffer past that. Here every call is capped."""
    data = np.arange(1 << 16, dtype=np.uint8)
    with open(fpath, "wb") as f:
        f.write(data.tobytes())
    real_pread, real_preadv = os.pread, os.preadv
    monkeypatch.setattr(os, "pread", lambda fd, n, off: real_pread(fd, min(n, 1000), off))
    monkeypatch.setattr(
        os, "preadv", lambda fd, bufs, off: real_preadv(fd, [memoryview(bufs[0])[:1000]], off)
    )
    h = handle()
    out = np.empty_like(data)
    fd = os.open(fpath, os.O_RDONLY)
    try:
        assert h.pread(out, fd if by == "fd" else fpath, validate=True) == data.size
        out[-1] ^= 0xFF  # a difference in the last short read is still found
        with pytest.raises(OSError, match="validation"):
            h.verify(out, fd if by == "fd" else fpath)
    finally:
        os.close(fd)


@pytest.fixture
def aio_limit_exhausted():
    """io_setup fails with EAGAIN, as when fs.aio-max-nr is used up. Through
    the engine's hook: exhausting the real, system-wide limit made every
    other process's io_setup fail meanwhile (CI: a test beside it did)."""
    aio._C.set_kaio_setup_fault(errno.EAGAIN)
    try:
        yield
    finally:
        aio._C.set_kaio_setup_fault(0)


def test_io_setup_failure_is_explained_and_auto_falls_back(aio_limit_exhausted):
    with pytest.raises(OSError) as ei:
        aio.AsyncIOHandle(engine="kernel_aio", queue_depth=65536, thread_count=2)
    assert ei.value.errno == errno.EAGAIN
    assert "io_setup" in str(ei.value) and "aio-max-nr" in str(ei.value)
    if engine_unavailable("io_uring") is None:
        # auto takes io_uring, which kernel AIO's limit does not bind.
        h = aio.AsyncIOHandle(engine="auto", queue_depth=65536, thread_count=2)
        assert h.engine == "io_uring" and h.stats()["engine_reason"] == "auto: io_uring is available here"
        # With io_uring refused too, auto comes down to posix threads, with a warning.
        aio._C.set_uring_setup_fault(errno.EPERM)
        try:
            with pytest.warns(
                RuntimeWarning, match="io_uring unavailable.*kernel_aio unavailable.*aio-max-nr"
            ):
                h = aio.AsyncIOHandle(engine="auto", queue_depth=65536, thread_count=2)
        finally:
            aio._C.set_uring_setup_fault(0)
        assert h.engine == "posix"
        return
    with pytest.warns(RuntimeWarning, match="posix"):
        h = aio.AsyncIOHandle(engine="auto", queue_depth=65536, thread_count=2)
    assert h.engine == "posix" and "aio-max-nr" in h.stats()["engine_reason"]


def test_extension_links_no_libaio():
    import aio._C as C

    with open(C.__file__, "rb") as f:
        blob = f.read()
    assert b"libaio.so" not in blob
    assert b"io_submit@" not in blob  # no libaio symbol imports; syscalls only


def test_error_names_real_path_for_proc_fd_paths(tmp_path):
    # The swappers reach their files as /proc/self/fd/N/name through a held
    # folder descriptor; errors must still name the real file.
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        h = aio.AsyncIOHandle()
        with pytest.raises(FileNotFoundError) as ei:
            h.sync_pread(bytearray(4096), f"/proc/self/fd/{fd}/missing.swp")
        assert ei.value.filename == str(tmp_path / "missing.swp")
    finally:
        os.close(fd)


@pytest.mark.parametrize("op", ["read", "write"])
def test_directory_is_refused_without_a_false_fallback(tmp_path, op):
    # open(dir, O_DIRECT) fails with EINVAL, as on a filesystem without
    # direct I/O; that must not be taken (and reported) as a fallback.
    import warnings

    h = aio.AsyncIOHandle()
    buf = np.zeros(4096, np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(IsADirectoryError):
            (h.sync_pread if op == "read" else h.sync_pwrite)(buf, str(tmp_path))
    assert h.stats()["buffered_fallback"] is False
    h.close()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direct", [False, True])
def test_write_through_an_append_descriptor_is_refused(engine, direct, tmp_path):
    """The kernel puts every write on an O_APPEND descriptor at the end of the
    file, whatever its offset: a 16 KiB file grew to 20480, then 24576 bytes,
    silently. Such a write is now refused (ValueError naming the fd); reads
    through it still work."""
    path = tmp_path / "a.bin"
    old = (np.arange(16384) % 199).astype(np.uint8)
    path.write_bytes(old.tobytes())
    h = handle(engine=engine)
    buf = aligned_empty(4096)
    buf[:] = 1
    flags = os.O_RDWR | os.O_APPEND | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    try:
        with pytest.raises(ValueError, match=f"fd {fd} is open with O_APPEND"):
            h.sync_pwrite(buf, fd, 0)
        with pytest.raises(ValueError, match="O_APPEND"):
            h.async_pwrite_pieces(buf, fd, [4096])
        with pytest.raises(ValueError, match="O_APPEND"):
            h.async_pwrite(buf, fd, 8192)
        assert h.wait() == 0
        h.sync_pread(buf, fd, 4096)
        assert np.array_equal(buf, old[4096:8192])
    finally:
        os.close(fd)
    assert path.read_bytes() == old.tobytes()


def test_an_error_in_a_removed_held_folder_names_its_path_and_says_so(tmp_path):
    # The swappers reach files through a held folder descriptor; someone
    # deleting the folder made errors name ".../<folder> (deleted)/optimizer.swp".
    from aio._errors import make_error

    folder = tmp_path / "swap"
    folder.mkdir()
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        held = f"/proc/self/fd/{fd}/optimizer.swp"
        e = make_error(errno.ENOENT, "open for write failed", held, "write", 0, 4096, False)
        assert isinstance(e, FileNotFoundError) and "while in use" not in e.strerror
        assert e.filename == str(folder / "optimizer.swp")
        os.rmdir(folder)
        e = make_error(errno.ENOENT, "open for write failed", held, "write", 0, 4096, False)
        assert isinstance(e, FileNotFoundError) and e.filename == str(folder / "optimizer.swp")
        assert "deleted while in use" in e.strerror
    finally:
        os.close(fd)
