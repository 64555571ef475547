"""The io_uring engine beyond the tests parametrized over every engine: random
round trips with many requests in flight, the same typed errors as kernel_aio,
buffered I/O through the ring, and a clear error where io_uring is missing."""

import errno
import os

import numpy as np
import pytest
from conftest import MiB, engine_unavailable, handle

import aio

MISSING = engine_unavailable("io_uring")
needs_uring = pytest.mark.skipif(MISSING is not None, reason=f"io_uring unavailable: {MISSING}")


def _unaligned(rng, n):
    """n bytes at a random misalignment from a page boundary."""
    raw = np.empty(n + 8192, np.uint8)
    start = (-raw.ctypes.data) % 4096 + int(rng.integers(0, 4096))
    return raw[start : start + n]


@needs_uring
@pytest.mark.parametrize("threads", [1, 3])
def test_random_roundtrips_16_in_flight_exact(threads, tmp_path):
    rng = np.random.default_rng(27 + threads)
    h = handle(engine="io_uring", thread_count=threads, queue_depth=16, block_size=MiB)
    path = str(tmp_path / "r.bin")
    sizes = [1, 4095, 4097, 8 * MiB] + [int(x) for x in rng.integers(1, 8 * MiB + 1, 44)]
    # Disjoint, unaligned regions, so that all 16 requests of a wave may run at once.
    offsets, pos = [], 0
    for n in sizes:
        pos += int(rng.integers(1, 4096))
        offsets.append(pos)
        pos += n
    datas = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    for wave in range(0, len(sizes), 16):
        idx = range(wave, min(wave + 16, len(sizes)))
        srcs = {i: _unaligned(rng, sizes[i]) for i in idx}
        for i in idx:
            srcs[i][:] = datas[i]
        futs = [h.async_pwrite(srcs[i], path, offsets[i]) for i in idx]
        assert [f.result() for f in futs] == [sizes[i] for i in idx]
    for wave in range(0, len(sizes), 16):
        idx = range(wave, min(wave + 16, len(sizes)))
        outs = {i: _unaligned(rng, sizes[i]) for i in idx}
        futs = [h.async_pread(outs[i], path, offsets[i]) for i in idx]
        assert [f.result() for f in futs] == [sizes[i] for i in idx]
        for i in idx:
            assert np.array_equal(outs[i], datas[i]), (i, sizes[i], offsets[i])
    st = h.stats()
    assert st["engine"] == "io_uring" and st["failed_requests"] == 0
    assert st["max_inflight"] <= 16


@needs_uring
def test_read_past_eof_same_typed_error_as_kernel_aio(fpath):
    with open(fpath, "wb") as f:
        f.write(b"x" * 10000)
    errors = {}
    for engine in ("kernel_aio", "io_uring"):
        h = handle(engine=engine)
        with pytest.raises(OSError) as ei:
            h.sync_pread(np.empty(8192, np.uint8), fpath, 4096)
        errors[engine] = ei.value
    a, b = errors["kernel_aio"], errors["io_uring"]
    assert type(a) is type(b) and isinstance(b, aio.ReadPastEOFError)
    assert (a.errno, a.filename, a.offset, a.length) == (b.errno, b.filename, b.offset, b.length)


@needs_uring
def test_buffered_fallback_goes_through_the_ring(pattern, fpath):
    """Where O_DIRECT is refused, io_uring still queues the buffered I/O
    (kernel AIO would block in io_submit): counted as ring submissions."""
    data = pattern[: 4 * MiB + 3]
    h = handle(engine="io_uring", block_size=256 * 1024, queue_depth=8)
    h._c.inject_fault("open_direct", errno.EINVAL, "any", 1, 1)
    with pytest.warns(RuntimeWarning, match="O_DIRECT is not available"):
        h.sync_pwrite(data, fpath, 5)
    out = np.zeros_like(data)
    h.sync_pread(out, fpath, 5)
    assert np.array_equal(out, data)
    st = h.stats()
    assert st["buffered_fallback"] and st["buffered_bytes"] >= 2 * data.size
    assert st["submit_calls"] >= 2 and st["max_inflight"] == 8


@needs_uring
def test_huge_queue_depth_is_clamped_to_the_ring_limit(pattern, fpath):
    h = handle(engine="io_uring", queue_depth=65536, block_size=4096)
    h.sync_pwrite(pattern[: 2 * MiB], fpath)
    out = np.empty(2 * MiB, np.uint8)
    h.sync_pread(out, fpath)
    assert np.array_equal(out, pattern[: 2 * MiB])


def test_io_uring_is_listed_and_unavailability_is_clear():
    assert "io_uring" in aio._C.engines()
    if MISSING is None:
        assert aio.AsyncIOHandle(engine="io_uring").engine == "io_uring"
        return
    with pytest.raises(OSError, match="io_uring"):
        aio.AsyncIOHandle(engine="io_uring")


def test_auto_prefers_io_uring_and_says_why_kernel_aio_serves_where_refused(recwarn):
    """Where io_uring is refused (seccomp, kernel.io_uring_disabled), auto
    takes kernel AIO without a warning and engine_reason says why; asking for
    io_uring by name raises the same reason."""
    if MISSING is None:
        assert aio.AsyncIOHandle().engine == "io_uring"
    aio._C.set_uring_setup_fault(errno.EPERM)
    try:
        h = aio.AsyncIOHandle()
        with pytest.raises(PermissionError, match="io_uring"):
            aio.AsyncIOHandle(engine="io_uring")
    finally:
        aio._C.set_uring_setup_fault(0)
    assert h.engine == "kernel_aio"
    reason = h.stats()["engine_reason"]
    assert reason.startswith("auto: io_uring unavailable") and reason.endswith("kernel_aio is available here")
    assert "io_uring" in reason and ("disabled" in reason or "blocked" in reason or "restricted" in reason)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def _locked(n: int) -> np.ndarray:
    """n bytes of locked memory (aio.new_locked_tensor), as a numpy array."""
    import torch

    return aio.new_locked_tensor(n, torch.uint8).numpy()


@needs_uring
def test_locked_memory_goes_out_as_fixed_buffers(pattern, fpath):
    """Chunks in pinned buffers use the ring's registered (fixed) buffers;
    other memory still works, as plain reads and writes."""
    h = handle(engine="io_uring", block_size=MiB, queue_depth=8)
    src = _locked(4 * MiB)
    src[:] = pattern[: 4 * MiB]
    h.sync_pwrite(src, fpath)
    out = _locked(4 * MiB)
    h.sync_pread(out, fpath)
    assert np.array_equal(out, src)
    st = h.stats()
    assert st["fixed_ios"] == st["ios"] == 8
    plain = np.empty(4 * MiB, np.uint8)  # numpy's memory: not registered
    h.sync_pread(plain, fpath)
    assert np.array_equal(plain, src)
    assert h.stats()["fixed_ios"] == 8 and h.stats()["ios"] > 8


@needs_uring
def test_refused_registration_falls_back_to_plain_io(pattern, fpath):
    h = handle(engine="io_uring", block_size=MiB)
    aio._C.set_fixed_fault(errno.ENOMEM)  # as RLIMIT_MEMLOCK refuses an unprivileged user
    try:
        buf = _locked(3 * MiB)
    finally:
        aio._C.set_fixed_fault(0)
    buf[:] = pattern[: 3 * MiB]
    h.sync_pwrite(buf, fpath)
    buf[:] = 0
    h.sync_pread(buf, fpath)
    assert np.array_equal(buf, pattern[: 3 * MiB])
    assert h.stats()["fixed_ios"] == 0


@needs_uring
def test_freed_buffer_address_reused_reads_into_the_new_buffer(pattern, tmp_path):
    """A buffer freed and another mapped at the same address: the ring must
    use the new buffer's pages, never the old registration."""
    h = handle(engine="io_uring", block_size=MiB)
    paths = [str(tmp_path / f"{i}.bin") for i in range(4)]
    for i, p in enumerate(paths):
        with open(p, "wb") as f:
            f.write(np.roll(pattern[: 4 * MiB], i).tobytes())
    seen = set()
    for i, p in enumerate(paths):
        buf = _locked(4 * MiB)
        seen.add(buf.ctypes.data)
        h.sync_pread(buf, p)
        assert np.array_equal(buf, np.roll(pattern[: 4 * MiB], i)), i
        del buf
    st = h.stats()
    assert st["fixed_ios"] == st["ios"] == 16
    assert aio._C.fixed_bytes() < 4 * MiB * len(paths)  # freed ones left the table


@needs_uring
def test_forked_child_registrations_never_reach_the_parents_ring(pattern, tmp_path):
    """A child inherits the parent's ring descriptors: buffers it makes must
    not be registered there (the kernel would pin the child's pages into the
    parent's table, and the parent's next fixed read would land in them)."""
    h = handle(engine="io_uring", block_size=MiB)
    path = str(tmp_path / "p.bin")
    with open(path, "wb") as f:
        f.write(pattern[: 2 * MiB].tobytes())
    h.sync_pread(_locked(2 * MiB), path)  # the worker's ring exists
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: wait until the parent's buffer is registered, then add one
        try:
            os.read(go_r, 1)
            child_buf = _locked(2 * MiB)
            child_buf[:] = 0
            os.write(done_w, b"x")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    parent_buf = _locked(2 * MiB)
    parent_buf[:] = 0
    os.write(go_w, b"x")
    assert os.read(done_r, 1) == b"x"
    h.sync_pread(parent_buf, path)
    os.write(go_w, b"x")
    os.waitpid(pid, 0)
    assert np.array_equal(parent_buf, pattern[: 2 * MiB])
    assert h.stats()["fixed_ios"] == h.stats()["ios"]


# -- registrations: once per process, refusals visible ------------------------

# argv: mode, path. Every ring of a 4-worker io_uring handle must hold a
# 2 MiB locked pool registered, made before the handle ("before") or after
# it ("after"); printed: the process's pinned kB (VmPin: what io_uring
# charges), the handle's refused registrations, its fixed and all I/Os, the
# reason for refusals and how many log lines told of them (two handles).
# "nobody": as user nobody with RLIMIT_MEMLOCK 5 MiB, where each ring that
# registers the pool itself charges it again to the user (2 + 2 + 2 > 5);
# "nobody-noclone": so, with table clones turned off.
_REGISTER_ONCE = """
import io, logging, os, resource, sys
import aio
from aio import _C

mode, path = sys.argv[1], sys.argv[2]
MiB = 1 << 20
with open(path, "wb") as f:
    f.write(os.urandom(2 * MiB))
fd = os.open(path, os.O_RDWR)
log = io.StringIO()
logging.getLogger("aio").addHandler(logging.StreamHandler(log))
if mode.startswith("nobody"):
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (5 * MiB, 5 * MiB))
    os.setgid(65534)
    os.setuid(65534)
if mode == "nobody-noclone":
    _C.set_fixed_clone(False)
def vmpin_kb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmPin:"))
pool = _C.PinnedPool(2, MiB, True) if mode != "after" else None
h = aio.AsyncIOHandle(block_size=MiB, queue_depth=8, thread_count=4, engine="io_uring")
pool = pool or _C.PinnedPool(2, MiB, True)
for _ in range(4):  # each worker's ring gets a slice of each request
    r = h._c.submit(0, pool.slot_ptr(0), 2 * MiB, "", fd, 0)
    r.wait()
    r.result()
aio.AsyncIOHandle(thread_count=4, engine="io_uring").close()  # refused again: no second line
st = h.stats()
print(vmpin_kb(), st["fixed_refused"], st["fixed_ios"], st["ios"])
print(st["fixed_refused_reason"])
print(log.getvalue().count("RLIMIT_MEMLOCK"))
"""


def _register_once(mode, tmp_path):
    import subprocess
    import sys

    path = str(tmp_path / "f.bin")
    r = subprocess.run(
        [sys.executable, "-c", _REGISTER_ONCE, mode, path], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    first, reason, log_lines = r.stdout.splitlines()
    pinned_kb, refused, fixed, ios = map(int, first.split())
    return pinned_kb, refused, fixed, ios, reason, int(log_lines)


@needs_uring
@pytest.mark.parametrize("made", ["before", "after"])
def test_every_ring_holds_a_buffer_pinned_once(made, tmp_path):
    """Each ring used to register (pin, and for a user without CAP_IPC_LOCK
    charge to RLIMIT_MEMLOCK) every buffer again: 4 workers pinned a 2 MiB
    pool 4 times. The other rings now copy one ring's registrations (Linux
    6.13), so the process pins it once, and every ring uses it."""
    pinned_kb, refused, fixed, ios, _, _ = _register_once(made, tmp_path)
    assert fixed == ios > 0 and refused == 0
    cloning = tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) >= (6, 13)
    if cloning:
        assert pinned_kb == 2 * 1024, f"{pinned_kb} kB pinned for a 2 MiB pool"


@needs_uring
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_unprivileged_rings_share_the_memlock_charge_and_refusals_are_told(tmp_path):
    """A user without CAP_IPC_LOCK: io_uring charges every registration to
    the user's RLIMIT_MEMLOCK (8 ranks on a node add up), and registrations
    past it failed silently, the I/O going out plain. One ring now registers
    and the others copy it; where they cannot (clones off, as before Linux
    6.13), stats() counts the refusals with the reason, and the log has one
    line per process."""
    _, refused, fixed, ios, reason, lines = _register_once("nobody", tmp_path)
    if tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) >= (6, 13):
        assert refused == 0 and fixed == ios > 0 and lines == 0, (refused, fixed, ios, reason)
    _, refused, fixed, ios, reason, lines = _register_once("nobody-noclone", tmp_path)
    assert refused == 2 and 0 < fixed < ios, (refused, fixed, ios)  # rings 3 and 4: 6 MiB > 5
    assert "RLIMIT_MEMLOCK" in reason and "Cannot allocate memory" in reason, reason
    assert lines == 1
