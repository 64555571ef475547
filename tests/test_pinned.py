"""Pinned memory: locked tensors, pools with leases, mlock failure reporting."""

import errno
import os

import numpy as np
import pytest
from conftest import ENGINES

import aio
from aio import _C

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64])
def test_new_cpu_locked_tensor(dtype):
    h = aio.AsyncIOHandle()
    before = aio.locked_bytes()
    ex = torch.empty(0, dtype=dtype)
    t = h.new_cpu_locked_tensor(1000, ex)
    assert t.dtype == dtype and t.numel() == 1000 and t.device.type == "cpu"
    kind = aio.pinned.pinned_kind(t)
    # mlock (no CUDA) or our mapping registered with CUDA: page-aligned; only
    # torch's pinned allocator (the CUDA fallback) may hand out other addresses.
    assert kind == ("mlock" if not torch.cuda.is_available() else kind)
    if kind != "cuda_pin_memory":
        assert t.data_ptr() % 4096 == 0
    assert h.is_pinned(t)
    assert not h.is_pinned(torch.empty(10))
    assert aio.locked_bytes() >= before + 1000 * t.element_size()
    t.fill_(1)
    assert h.free_cpu_locked_tensor(t)
    assert t.numel() == 0 and not h.is_pinned(t)
    assert not h.free_cpu_locked_tensor(torch.empty(3))


def test_locked_memory_returns_when_last_view_goes():
    # Holds on both paths: mlock'ed and CUDA-pinned bytes are both counted.
    import gc

    gc.collect()
    base = aio.locked_bytes()
    t = aio.new_locked_tensor(1 << 20, torch.uint8)
    view = t[10:20]
    assert aio.locked_bytes() >= base + (1 << 20)
    assert aio.free_locked_tensor(t)
    assert aio.locked_bytes() >= base + (1 << 20)  # a view still uses it
    view.fill_(3)  # and stays valid
    del view
    gc.collect()
    assert aio.locked_bytes() == base


def test_locked_tensor_roundtrip(tmp_path):
    h = aio.AsyncIOHandle()
    src = h.new_cpu_locked_tensor(3 << 20, torch.empty(0, dtype=torch.float32))
    src.copy_(torch.randn(3 << 20))
    p = str(tmp_path / "t.bin")
    assert h.sync_pwrite(src, p) == src.numel() * 4
    dst = h.new_cpu_locked_tensor(3 << 20, src)
    h.sync_pread(dst, p)
    assert torch.equal(src, dst)
    if aio.pinned.pinned_kind(dst) != "cuda_pin_memory":
        assert h.stats()["bounce_bytes"] == 0  # aligned memory: zero-copy direct path


def test_mlock_failure_names_limit_and_size():
    _C.set_lock_fault(errno.ENOMEM)
    try:
        with pytest.raises(OSError) as ei:
            aio.new_locked_tensor(123456, torch.uint8)
        msg = str(ei.value)
        assert "RLIMIT_MEMLOCK" in msg and "123456" in msg
        assert ei.value.errno == errno.ENOMEM
        with pytest.raises(OSError, match="RLIMIT_MEMLOCK"):
            aio.PinnedPool(2, 4096)
    finally:
        _C.set_lock_fault(0)


def test_real_mlock_failure_under_small_rlimit():
    """An unprivileged child with RLIMIT_MEMLOCK=64 KiB asks for 1 MiB."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to an unprivileged user")
    import resource

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        msg = "no error"
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
            os.setgid(65534)
            os.setuid(65534)
            _C.PinnedBuffer(1 << 20, True)
        except OSError as e:
            msg = f"{e.errno}|{e}"
        except BaseException as e:  # noqa: BLE001
            msg = f"other {e!r}"
        os.write(wfd, msg.encode())
        os._exit(0)
    os.close(wfd)
    got = os.read(rfd, 8192).decode()
    os.close(rfd)
    os.waitpid(pid, 0)
    err, _, text = got.partition("|")
    assert err in (str(errno.ENOMEM), str(errno.EPERM), str(errno.EAGAIN)), got
    assert "65536 bytes" in text and "1048576" in text, text


def test_pool_leases():
    pool = aio.PinnedPool(3, 10000)
    assert pool.slot_bytes % 4096 == 0 and pool.slot_bytes >= 10000
    assert pool.total_bytes == 3 * pool.slot_bytes
    leases = [pool.acquire() for _ in range(3)]
    assert pool.available() == 0
    assert len({lease.ptr for lease in leases}) == 3
    assert all(lease.ptr % 4096 == 0 for lease in leases)
    with pytest.raises(TimeoutError, match="buffer count"):
        pool.acquire(timeout=0.05)
    t = leases[0].tensor(torch.float32, 100)
    t.fill_(2.5)
    assert leases[0].tensor(torch.float32)[:100].sum().item() == 250.0
    with pytest.raises(ValueError, match="does not fit"):
        leases[1].tensor(torch.float32, 10**6)
    for lease in leases:
        lease.release()
    leases[0].release()  # double release is a no-op on the lease
    assert pool.available() == 3
    with pool.acquire() as lease:
        mv = lease.buffer()
        mv[:3] = b"abc"
        assert pool.available() == 2
    assert pool.available() == 3


def test_large_allocations_lock_whole_huge_pages_where_that_is_cheap():
    # io_uring moves I/O on a registered buffer in large pieces only when all
    # of it is huge pages: a 4 MB read from a 15.3 MiB pool (a 4 KiB-page
    # tail) went to the disk as 6 requests instead of 1.
    import gc

    page, huge, ls = _C.page_size(), 2 << 20, aio.pinned.locked_size
    assert ls(0) == 0 and ls(1) == page and ls(huge - page + 1) == huge
    assert ls(4 * 4_000_000) == 16 << 20  # +4.8 %: whole huge pages
    assert ls(17 << 20) == 18 << 20
    assert ls(huge + page) == huge + page  # doubling it: whole pages only
    assert ls(3 * huge - page) == 3 * huge  # a page more is fine
    gc.collect()
    base = aio.locked_bytes()
    pool = aio.PinnedPool(4, 4_000_000)  # what locked_bytes() counts is what was locked
    assert pool.total_bytes == 4 * 4_001_792 and pool.locked_bytes == 16 << 20
    assert aio.locked_bytes() == base + (16 << 20)
    if not torch.cuda.is_available():  # mlock'ed (CUDA-pinned memory counts its own size)
        t = aio.new_locked_tensor(4_000_000, torch.float32)
        assert aio.pinned.locked_nbytes(t) == 16 << 20
        assert aio.locked_bytes() == base + (32 << 20)
        assert aio.free_locked_tensor(t)
    del pool
    gc.collect()
    assert aio.locked_bytes() == base


def test_pool_slot_roundtrip(tmp_path):
    pool = aio.PinnedPool(2, 1 << 20)
    h = aio.AsyncIOHandle()
    with pool.acquire() as a, pool.acquire() as b:
        np.frombuffer(a.buffer(), np.uint8)[:] = 7
        h.sync_pwrite(a.buffer(), str(tmp_path / "p.bin"))
        h.sync_pread(b.buffer(), str(tmp_path / "p.bin"))
        assert (np.frombuffer(b.buffer(), np.uint8) == 7).all()


@pytest.mark.parametrize("bad", [0, -1])
def test_pool_bad_sizes(bad):
    with pytest.raises(ValueError, match="count"):
        aio.PinnedPool(bad, 4096)
    with pytest.raises(ValueError, match="slot_bytes"):
        aio.PinnedPool(1, bad)


@pytest.mark.cuda
def test_cuda_tensor_roundtrip_through_bounce(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here; run on a GPU machine")
    h = aio.AsyncIOHandle()
    src = torch.randn(5 << 20, device="cuda")
    p = str(tmp_path / "gpu.bin")
    assert h.sync_pwrite(src, p, 4096) == src.numel() * 4
    dst = torch.empty_like(src)
    fut = h.async_pread(dst, p, 4096)
    assert fut.result() == src.numel() * 4
    assert torch.equal(src, dst)
    loc = h.new_cpu_locked_tensor(10, src)
    assert loc.is_pinned() and h.is_pinned(loc)


def test_pool_release_waits_for_io_in_flight_on_the_slot(tmp_path):
    # A read into a leased slot that is still queued when the lease is
    # released must land before the slot can go to the next owner.
    import torch

    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(128 << 20)
    h = aio.AsyncIOHandle(engine="posix", thread_count=1, block_size=1 << 16, queue_depth=1)
    ahead = h.async_pread(np.empty(128 << 20, np.uint8), str(big))  # keeps the one worker busy
    pool = aio.PinnedPool(1, 1 << 20, lock=False)
    with pool.acquire() as lease:
        fut = h.async_pread(lease.tensor(torch.uint8), str(path))
    assert fut.done(), "release returned with a read into the slot still in flight"
    nxt = pool.acquire(timeout=5)
    t = nxt.tensor(torch.uint8)
    t.fill_(7)
    fut.result()
    ahead.result()
    assert bool((t == 7).all())
    nxt.release()
    h.close()


def test_a_freed_tensors_collection_does_not_forget_a_new_tensor_at_its_address():
    """free_locked_tensor(t) then ``t = new_locked_tensor(...)``: the new
    memory can get the old address, and the old tensor's finalizer (run as
    the name is rebound) dropped the new tensor's record, so freeing it no
    longer waited for its I/O (it returned False at once)."""
    t = aio.new_locked_tensor(1 << 20, torch.uint8)
    first = t.data_ptr()
    assert aio.free_locked_tensor(t)
    reused = 0
    for _ in range(8):
        t = aio.new_locked_tensor(1 << 20, torch.uint8)
        reused += t.data_ptr() == first
        assert aio.pinned.pinned_kind(t) is not None
        assert aio.pinned.locked_nbytes(t) == 1 << 20
        assert aio.free_locked_tensor(t), "a tensor of ours was not recognised as pinned"
    if not reused:
        pytest.skip("the allocator never handed the same address out again")


class _FakeCudart:
    def __init__(self):
        self.calls = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append("register")
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append("unregister")
        return 0

    def cudaGetLastError(self):
        self.calls.append("get_last_error")
        return 0


def test_pinning_does_not_start_cuda_in_a_process_that_never_used_it(monkeypatch):
    """A CPU-offload job on a GPU machine: CUDA is available but never
    initialised; pinning must not create a context (it mlocks instead)."""
    from aio import pinned

    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    t = pinned.new_locked_tensor(1024, torch.uint8)
    assert pinned.pinned_kind(t) == "mlock" and fake.calls == []


def test_registration_is_undone_only_by_the_process_that_made_it(monkeypatch):
    """A forked child (another pid) that drops a registered tensor calls no
    CUDA function (it cannot); the parent unregisters."""
    import os

    from aio import pinned

    fake = _FakeCudart()
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    undo = pinned.cuda_register(4096, 4096)
    assert undo is not None and fake.calls == ["register"]
    real = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: real + 1)
    undo()
    assert fake.calls == ["register"]
    monkeypatch.setattr(os, "getpid", lambda: real)
    undo2 = pinned.cuda_register(8192, 4096)
    undo2()
    assert fake.calls == ["register", "register", "unregister"]


def test_a_refused_registration_clears_cudas_error(monkeypatch):
    from aio import pinned

    fake = _FakeCudart()
    fake.cudaHostRegister = lambda ptr, n, f: (fake.calls.append("register"), 1)[1]
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    assert pinned.cuda_register(4096, 4096) is None
    assert fake.calls == ["register", "get_last_error"]


def test_registered_tensor_is_page_aligned_exact_and_unregistered_when_freed():
    from aio import pinned

    calls = []

    def register(ptr, nbytes):
        calls.append(("register", ptr % 4096, nbytes))
        return lambda: calls.append(("unregister",))

    t, registered = pinned.registered_tensor(5000, torch.float32, register)
    assert t.numel() == 5000 and t.data_ptr() % 4096 == 0
    assert registered == 20480 and calls == [("register", 0, 20480)]  # whole pages, no power of two
    del t
    import gc

    gc.collect()
    assert calls[-1] == ("unregister",)


# -- fork: the child gets none of the pinned memory ------------------------------

# Run in a subprocess per engine (fork with threads and rings). A 64 MiB locked
# pool is read from the file (every page touched, registered on io_uring);
# then a forked child reports its private dirty memory at once, and again
# after making its own handle of the same engine and reading 1 MiB with it
# into the pool, plus whether the pool reads as zeros there.
_FORK_SMAPS = """
import ctypes, os, sys, time
import numpy as np
from aio import _C

engine, path = sys.argv[1], sys.argv[2]
MiB = 1 << 20
def private_dirty_mib():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("Private_Dirty:")) / 1024
pool = _C.PinnedPool(64, MiB, True)
base = pool.slot_ptr(0)
(np.arange(64 * MiB) % 251).astype(np.uint8).tofile(path)
h = _C.Handle(MiB, 8, False, True, 1, engine)
r = h.submit(0, base, 64 * MiB, path, -1, 0)
r.wait()
r.result()
rfd, wfd = os.pipe()
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    at_fork = private_dirty_mib()
    zero = bytes(ctypes.string_at(base, 4096)) == bytes(4096)
    mine = _C.Handle(MiB, 8, False, True, 1, engine)
    r2 = mine.submit(0, base, MiB, path, -1, 0)
    r2.wait()
    r2.result()
    got = np.ctypeslib.as_array((ctypes.c_uint8 * MiB).from_address(base))
    ok = bool((got == np.arange(MiB) % 251).all())
    os.write(wfd, f"{at_fork:.1f} {private_dirty_mib():.1f} {zero} {ok}".encode())
    os._exit(0)
fork_ms = (time.perf_counter() - t0) * 1000
child = os.read(rfd, 200).decode()
os.waitpid(pid, 0)
print(child, f"{fork_ms:.1f}")
"""


def _run_script(script, *args):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize("engine", ENGINES)
def test_forked_child_gets_pinned_memory_zero_filled_not_copied(engine, tmp_path):
    """Pages registered with io_uring are long-term pinned, and fork() copies
    pinned pages into the child at once: each forked process (a DataLoader
    worker) paid the whole pool again (33 MiB of private dirty memory for a
    32 MiB pool). Pinned memory is now wiped in a child (MADV_WIPEONFORK),
    on every engine: the child starts with none of it, reads zeros there,
    and its own handle neither registers nor allocates the parent's pool."""
    out = _run_script(_FORK_SMAPS, engine, str(tmp_path / "f.bin")).split()
    at_fork, after_own_io, zero, ok = float(out[0]), float(out[1]), out[2], out[3]
    assert at_fork < 16, f"child has {at_fork} MiB private dirty after fork (pool 64 MiB)"
    assert after_own_io < 16, f"child has {after_own_io} MiB private dirty after its own I/O"
    assert zero == "True", "the child sees the parent's pinned bytes"
    assert ok == "True", "the child's own read into the pool came back wrong"


# The parent's I/O into a pinned pool while a child forks and scribbles over
# its (wiped) view of the pool: every round's bytes must be the parent's, and
# fixed-buffer I/O must still be used after the fork.
_FORK_INFLIGHT = """
import ctypes, os, sys
import numpy as np
from aio import _C

engine, path = sys.argv[1], sys.argv[2]
MiB = 1 << 20
n = 32 * MiB
pool = _C.PinnedPool(2, n, True)
src, dst = (np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(pool.slot_ptr(i))) for i in (0, 1))
h = _C.Handle(MiB, 8, False, True, 2, engine)
in_flight = 0
for rnd in range(4):
    src[:] = (np.arange(n) + rnd) % 253
    w = h.submit(1, src.ctypes.data, n, path, -1, 0)
    pid = os.fork()
    if pid == 0:
        ctypes.memset(src.ctypes.data, 0xFF, n)  # the child's own pages
        os._exit(0)
    in_flight += not w.done()
    w.wait()
    w.result()
    r = h.submit(0, dst.ctypes.data, n, path, -1, 0)
    pid2 = os.fork()
    if pid2 == 0:
        ctypes.memset(dst.ctypes.data, 0xEE, n)
        os._exit(0)
    in_flight += not r.done()
    r.wait()
    r.result()
    for p in (pid, pid2):
        os.waitpid(p, 0)
    assert (dst == src).all(), f"round {rnd}: the parent's read is wrong"
    assert (np.fromfile(path, np.uint8) == src).all(), f"round {rnd}: the file is wrong"
st = h.stats()
print(in_flight, st["fixed_ios"], st["ios"])
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_io_in_flight_across_fork_lands_in_the_parent(engine, tmp_path):
    """Reads and writes in flight while the process forks complete with the
    parent's bytes (the child's writes to its wiped view of the pool go to
    its own pages), and fixed-buffer I/O goes on after the fork."""
    in_flight, fixed, ios = map(int, _run_script(_FORK_INFLIGHT, engine, str(tmp_path / "f.bin")).split())
    if engine == "io_uring":
        assert fixed == ios > 0, (fixed, ios)
    print(f"{in_flight} of 8 I/Os were in flight at fork")
