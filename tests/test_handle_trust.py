"""Trust under misuse, Ctrl-C, threads and fork (issue 12): every in-flight
buffer stays owned, waits wake up for signals, each caller sees its outcome,
and bad input is refused before it reaches the core.

Tests that would crash or hang the old code run in a subprocess. In-flight I/O
is made to last by queueing the request under test behind ~1 GiB of reads on
one posix worker; a signal is sent only once the main thread is seen inside
the wait (by its stack), and an attempt counts only if the I/O was provably
still in flight when the interrupt arrived.
"""

import errno
import math
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import ENGINES, IO_URING, MiB

import aio
from aio import pinned

torch = pytest.importorskip("torch")

# Shared by the subprocess scripts: a handle whose single worker is kept busy
# by `blockers()` (32 x 32 MiB reads), and a SIGINT sender that fires only
# once the main thread is inside a function of aio (handle.py / future.py / pinned.py).
PRELUDE = textwrap.dedent(
    """
    import gc, os, signal, sys, threading, time, weakref
    import numpy as np
    import aio

    DIR = sys.argv[1]
    BIG = 32 << 20
    SRC = os.path.join(DIR, "src.bin")
    if not os.path.exists(SRC):
        np.random.default_rng(5).integers(0, 256, BIG, dtype=np.uint8).tofile(SRC)
    EXPECT = np.fromfile(SRC, dtype=np.uint8)
    ENGINE = sys.argv[2] if len(sys.argv) > 2 else "posix"
    h = aio.AsyncIOHandle(engine=ENGINE, thread_count=1, block_size=1 << 20)
    sink = np.empty(BIG, np.uint8)

    def blockers(n=32):
        return [h.async_pread(sink, SRC)._req for _ in range(n)]

    AIO_FILES = ("handle.py", "future.py", "pinned.py")

    def in_aio(frame):
        while frame is not None:
            f = frame.f_code.co_filename
            if f.endswith(tuple(os.path.join("aio", m) for m in AIO_FILES)):
                return True
            frame = frame.f_back
        return False

    def interrupt_when_waiting():
        main = threading.main_thread().ident
        stop = threading.Event()

        def run():
            while not stop.is_set():
                if in_aio(sys._current_frames().get(main)):
                    os.kill(os.getpid(), signal.SIGINT)
                    return
                time.sleep(0.001)

        threading.Thread(target=run, daemon=True).start()
        return stop
    """
)


def run_script(
    tmp_path, body: str, timeout: float = 120, engine: str = "posix"
) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), engine],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert "corrupted" not in r.stderr and r.returncode >= 0, (r.returncode, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


# -- F1: an interrupted wait() keeps every in-flight buffer alive ----------------
@pytest.mark.parametrize("engine", ["posix"])  # the handle's wait, whatever the engine (CI time)
def test_interrupted_handle_wait_keeps_inflight_buffers(tmp_path, engine):
    r = run_script(
        tmp_path,
        engine=engine,
        body="""
        valid = 0
        for attempt in range(5):
            blk = blockers()
            refs, reqs = [], []
            for i in range(4):
                buf = np.empty(1 << 20, np.uint8)
                f = h.async_pread(buf, SRC, i << 20)
                refs.append(weakref.ref(buf)); reqs.append(f._req)
                del buf, f  # only the handle owns them now
            stop = interrupt_when_waiting()
            try:
                h.wait()
                raise SystemExit("wait() was not interrupted")
            except KeyboardInterrupt:
                pass
            stop.set()
            gc.collect()
            for ref, req in zip(refs, reqs):
                assert req.done() or ref() is not None, "buffer freed with its read in flight"
            if not blk[-1].done():
                valid += 1
                assert h.pending() > 0
            h.wait()
            if valid:
                break  # one attempt that provably raced in-flight I/O is the proof
        assert valid > 0, "the interrupt never arrived while I/O was in flight"
        print("ok", valid)
        """,
    )
    assert r.stdout.startswith("ok")


# -- F15/F20: waits wake up for Ctrl-C; the future stays pending -----------------
# The waits are the handle's, whatever the engine: every way of waiting on one
# engine, and one way on io_uring (each case runs up to 15 s; CI time).
CTRL_C = [("posix", how) for how in ("result", "future_wait", "handle_wait", "exception")]
CTRL_C += [pytest.param("io_uring", "handle_wait", marks=IO_URING.marks)]


@pytest.mark.parametrize("engine,how", CTRL_C)
def test_ctrl_c_interrupts_waits_and_future_stays_pending(tmp_path, how, engine):
    r = run_script(
        tmp_path,
        engine=engine,
        body=f"""
        how = {how!r}
        valid = 0
        for attempt in range(5):
            blk = blockers()
            out = np.zeros(1 << 20, np.uint8)
            fut = h.async_pread(out, SRC)
            stop = interrupt_when_waiting()
            try:
                if how == "result": fut.result()
                elif how == "exception": fut.exception()
                elif how == "future_wait": fut.wait()
                else: h.wait()
                raise SystemExit("not interrupted")
            except KeyboardInterrupt:
                pass
            stop.set()
            if not blk[-1].done():
                valid += 1
                assert not fut.done() and h.pending() > 0
            assert fut.result() == 1 << 20  # still a live future, buffer intact
            assert (out == EXPECT[: 1 << 20]).all()
            h.wait()
            if valid:
                break  # one attempt that provably raced in-flight I/O is the proof
        assert valid > 0, "the interrupt never arrived while I/O was in flight"
        print("ok")
        """,
    )
    assert r.stdout.startswith("ok")


@pytest.mark.parametrize("op", ["sync_pread", "sync_pwrite"])
def test_ctrl_c_in_a_sync_call_keeps_the_buffer_until_its_io_is_done(tmp_path, op):
    """sync_pread/sync_pwrite interrupted: its future (never handed out) goes
    with the exception, and the caller drops the buffer; the memory stays
    owned until the worker is done with it (it was freed at once, and a
    read then wrote into whatever took the memory: a segfault or worse)."""
    run_script(
        tmp_path,
        body=f"""
        valid = 0
        for attempt in range(5):
            blk = blockers()
            buf = np.empty(1 << 20, np.uint8)
            ref = weakref.ref(buf)
            stop = interrupt_when_waiting()
            try:
                h.{op}(buf, SRC if {op!r} == "sync_pread" else os.path.join(DIR, "out.bin"))
                raise SystemExit("not interrupted")
            except KeyboardInterrupt:
                pass
            stop.set()
            del buf
            gc.collect()
            if not blk[-1].done():
                valid += 1
                assert ref() is not None, "buffer freed with its I/O in flight"
            h.wait()
            if valid:
                break
        assert valid > 0, "the interrupt never arrived while I/O was in flight"
        print("ok")
        """,
    )


def test_ctrl_c_interrupts_pool_acquire(tmp_path):
    run_script(
        tmp_path,
        """
        pool = aio.PinnedPool(1, 4096)
        held = pool.acquire()
        stop = interrupt_when_waiting()
        try:
            pool.acquire()  # no slot will ever free up
            raise SystemExit("acquired a slot that is leased")
        except KeyboardInterrupt:
            pass
        stop.set()
        held.release()
        assert pool.acquire(timeout=float("inf")).index == 0
        """,
        timeout=60,
    )


def test_infinite_and_invalid_timeouts(fpath):
    h = aio.AsyncIOHandle()
    fut = h.async_pwrite(np.ones(MiB, np.uint8), fpath)
    assert fut.result(timeout=math.inf) == MiB
    assert fut.wait(math.inf) and fut.exception(timeout=float("inf")) is None
    for bad in (math.nan, -1, -0.5):
        with pytest.raises(ValueError, match="timeout"):
            fut.result(timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            fut.wait(bad)
    with pytest.raises(TypeError, match="timeout"):
        fut.wait("1")
    pool = aio.PinnedPool(1, 4096)
    lease = pool.acquire(timeout=math.inf)
    with pytest.raises(ValueError, match="timeout"):
        pool.acquire(timeout=math.nan)
    with pytest.raises(ValueError, match="timeout"):
        pool.acquire(timeout=-1)
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.01)
    lease.release()
    h.wait()


# -- F2: futures own the storage; freeing memory with a read in flight is safe --
@pytest.mark.parametrize("how", ["free_locked_tensor", "set_"])
def test_free_or_set_during_read_is_safe(tmp_path, how):
    run_script(
        tmp_path,
        f"""
        import torch
        how = {how!r}
        valid = 0
        for attempt in range(3):
            blk = blockers(8)
            if how == "free_locked_tensor":
                t = h.new_cpu_locked_tensor(BIG, torch.empty(0, dtype=torch.uint8))
            else:
                t = torch.empty(BIG, dtype=torch.uint8)
            fut = h.async_pread(t, SRC)
            if not fut.done():
                valid += 1
            if how == "free_locked_tensor":
                assert h.free_cpu_locked_tensor(t)
            else:
                t.set_()
            del t
            gc.collect()
            junk = [np.full(BIG, 7, np.uint8) for _ in range(2)]  # reuse freed memory
            assert fut.result() == BIG
            assert all((j == 7).all() for j in junk), "a read landed in someone else's memory"
            h.wait()
        assert valid > 0
        print("ok")
        """,
    )


def test_free_locked_tensor_waits_for_inflight_io(fpath):
    h = aio.AsyncIOHandle(engine="posix", thread_count=1)
    h.sync_pwrite(np.full(8 * MiB, 3, np.uint8), fpath)
    t = h.new_cpu_locked_tensor(8 * MiB, torch.empty(0, dtype=torch.uint8))
    futs = [h.async_pread(t, fpath) for _ in range(4)]
    assert h.free_cpu_locked_tensor(t)
    assert all(f.done() for f in futs)  # waited, not refused
    assert [f.result() for f in futs] == [8 * MiB] * 4
    h.wait()


# -- F8/F9: each caller sees the true outcome ---------------------------------
class _SlowResult:
    """Wraps a core request so its result() lingers until a second thread has
    had its chance to read the outcome (the F8 race made deterministic)."""

    def __init__(self, req, entered, other_done):
        self._r, self._entered, self._other_done = req, entered, other_done

    def __getattr__(self, name):
        return getattr(self._r, name)

    def result(self):
        self._entered.set()
        self._other_done.wait(2.0)  # the fix holds the other thread out meanwhile
        return self._r.result()


def test_two_threads_result_on_failed_future_both_raise(fpath):
    h = aio.AsyncIOHandle(engine="posix")
    h._c.inject_fault("error", errno.EIO, "write", 1, 1)
    fut = h.async_pwrite(np.ones(4096, np.uint8), fpath)
    assert fut.wait(60)
    entered, other_done = threading.Event(), threading.Event()
    fut._req = _SlowResult(fut._req, entered, other_done)
    outcomes = {}

    def call(name):
        try:
            outcomes[name] = fut.result()
        except OSError as e:
            outcomes[name] = e.errno
        if name == "second":
            other_done.set()

    t1 = threading.Thread(target=call, args=("first",))
    t1.start()
    assert entered.wait(30)
    t2 = threading.Thread(target=call, args=("second",))
    t2.start()
    t1.join(30)
    t2.join(30)
    assert outcomes == {"first": errno.EIO, "second": errno.EIO}
    assert fut.exception().errno == errno.EIO


def test_wait_on_shared_handle_tells_each_submitter(tmp_path):
    h = aio.AsyncIOHandle(engine="posix")
    h._c.inject_fault("error", errno.EIO, "write", 1, 1)
    step_b = threading.Event()
    seen = {}

    def thread_b():
        fut_b = h.async_pwrite(np.ones(4096, np.uint8), str(tmp_path / "b.bin"))
        seen["submitted"] = True
        step_b.wait(60)  # thread A's wait() runs (and raises) in between
        try:
            seen["b_wait"] = h.wait()
        except OSError as e:
            seen["b_wait"] = e.errno
        seen["b_result"] = fut_b.exception(timeout=60).errno

    tb = threading.Thread(target=thread_b)
    tb.start()
    while "submitted" not in seen:
        tb.join(0.01)
    fut_a = h.async_pwrite(np.ones(4096, np.uint8), str(tmp_path / "a.bin"))
    with pytest.raises(OSError) as ei:  # A learns the shared handle had a failure
        h.wait()
    assert ei.value.errno == errno.EIO and fut_a.result() == 4096
    step_b.set()
    tb.join(60)
    # B is told its own write failed: by wait() and by its future.
    assert seen["b_wait"] == errno.EIO and seen["b_result"] == errno.EIO
    assert h.wait() == 0


# -- F16: buffers whose bytes are not their values are refused ----------------
def test_object_arrays_are_refused(fpath):
    h = aio.AsyncIOHandle()
    h.sync_pwrite(np.zeros(4096, np.uint8), fpath)
    objs = np.array([object()] * 512, dtype=object)
    with pytest.raises(TypeError, match="object"):
        h.sync_pwrite(objs, fpath)
    with pytest.raises(TypeError, match="object"):
        h.sync_pwrite(memoryview(objs), fpath)
    rec = np.zeros(256, dtype=[("a", "i8"), ("b", "O")])
    with pytest.raises(TypeError, match="object"):
        h.sync_pwrite(rec, fpath)


def test_read_into_object_array_is_refused_without_crash(tmp_path):
    run_script(
        tmp_path,
        """
        objs = np.array([object()] * (4 << 20), dtype=object)
        for buf in (objs, memoryview(objs)):
            try:
                h.sync_pread(buf, SRC)
                raise SystemExit("read into object pointers")
            except TypeError:
                pass
        gc.collect()
        print("ok")
        """,
        timeout=60,
    )


def test_lazy_conj_neg_and_odd_tensors_are_refused(fpath):
    h = aio.AsyncIOHandle()
    z = torch.randn(1024, dtype=torch.complex64)
    h.sync_pwrite(torch.zeros(1024, dtype=torch.complex64), fpath)
    for op in (h.sync_pwrite, h.sync_pread):
        with pytest.raises(ValueError, match="resolve_conj"):
            op(z.conj(), fpath)
        with pytest.raises(ValueError, match="resolve_neg"):
            op(torch._neg_view(torch.randn(1024)), fpath)
    assert h.sync_pwrite(z.conj().resolve_conj(), fpath) == z.numel() * 8
    back = torch.empty_like(z)
    h.sync_pread(back, fpath)
    assert torch.equal(back, z.conj().resolve_conj())
    q = torch.quantize_per_tensor(torch.randn(4096), 0.1, 0, torch.qint8)
    with pytest.raises(ValueError, match="quantized"):
        h.sync_pwrite(q, fpath)
    with pytest.raises(ValueError, match="meta"):
        h.sync_pwrite(torch.empty(16, device="meta"), fpath)
    with pytest.raises(ValueError, match="sparse|layout"):
        h.sync_pwrite(torch.eye(4).to_sparse_csr(), fpath)
    with pytest.raises(ValueError, match="contiguous"):
        h.sync_pread(torch.zeros(1, 4096).expand(4, 4096), fpath)


# -- F19/F23/F14/F7: paths and sizes are checked before the core --------------
def test_path_with_nul_is_refused(tmp_path):
    h = aio.AsyncIOHandle()
    target = tmp_path / "a.bin"
    with pytest.raises(ValueError, match="NUL"):
        h.sync_pwrite(b"x" * 4096, str(target) + "\0.evil")
    with pytest.raises(ValueError, match="NUL"):
        h.sync_pwrite(b"x" * 4096, os.fsencode(target) + b"\0")
    assert not target.exists()


def test_bytes_paths_work(tmp_path):
    h = aio.AsyncIOHandle()
    p = os.fsencode(tmp_path / "b.bin")
    assert h.sync_pwrite(b"y" * 5000, p) == 5000
    out = bytearray(5000)
    assert h.sync_pread(out, p) == 5000 and out == b"y" * 5000


@pytest.mark.parametrize("offset", [2**63, 2**64, 2**63 - 4096])
def test_offsets_past_int64_are_refused(fpath, offset):
    h = aio.AsyncIOHandle()
    with pytest.raises(OverflowError, match="file_offset"):
        h.sync_pwrite(np.ones(8192, np.uint8), fpath, offset)
    with pytest.raises(OverflowError, match="file_offset"):
        h.async_pread(np.ones(8192, np.uint8), fpath, offset)
    assert h.wait() == 0


def test_huge_settings_and_descriptors_are_refused(fpath):
    with pytest.raises(OverflowError, match="block_size"):
        aio.AsyncIOHandle(block_size=2**64)
    h = aio.AsyncIOHandle()
    with pytest.raises(OverflowError, match="descriptor"):
        h.sync_pwrite(b"x", 2**40)
    with pytest.raises(OverflowError, match="2\\*\\*63"):
        aio.new_locked_tensor(2**62, torch.float32)


def test_pinned_pool_size_overflow_is_refused(tmp_path):
    # On the old code the product wrapped to 8 KiB and the slots overlapped
    # unmapped memory (SIGSEGV), hence the subprocess.
    code = textwrap.dedent(
        """
        import aio
        for count, slot in ((3, 4096 * ((2**52 + 2) // 3)), (2, 2**63 - 1), (2**62, 4096)):
            try:
                aio.PinnedPool(count, slot)
                raise SystemExit(f"PinnedPool({count}, {slot}) was accepted")
            except OverflowError as e:
                assert "slot_bytes" in str(e), e
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr)


# -- F12: fork ------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_forked_child_waiting_on_parent_future_gets_error(tmp_path, engine):
    run_script(
        tmp_path,
        engine=engine,
        body="""
        blk = blockers(8)
        out = np.zeros(1 << 20, np.uint8)
        fut = h.async_pread(out, SRC)
        assert not fut.done()
        pid = os.fork()
        if pid == 0:
            bad = []
            for name, call in (("result", fut.result), ("wait", fut.wait),
                               ("exception", fut.exception), ("h.wait", h.wait)):
                try:
                    call()
                    bad.append(name + " returned")
                except aio.HandleStateError:
                    pass
                except BaseException as e:
                    bad.append(f"{name}: {e!r}")
            os.write(2, repr(bad).encode())
            os._exit(0 if not bad else 3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert fut.result() == 1 << 20 and (out == EXPECT[: 1 << 20]).all()
        h.wait()
        print("ok")
        """,
        timeout=120,
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_forked_child_recipe_exits_cleanly(tmp_path, engine):
    """Needs the core fix of ~Handle in a forked child as well (csrc)."""
    run_script(
        tmp_path,
        engine=engine,
        body="""
        blk = blockers(4)
        pid = os.fork()
        if pid == 0:
            # The child drops the parent's handle and uses its own, then exits
            # through the normal interpreter shutdown (destructors, atexit).
            del h
            gc.collect()
            with aio.AsyncIOHandle() as mine:
                p = os.path.join(DIR, "child.bin")
                mine.sync_pwrite(np.full(1 << 20, 9, np.uint8), p)
                back = np.empty(1 << 20, np.uint8)
                mine.sync_pread(back, p)
                code = 0 if (back == 9).all() else 4
            sys.exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        h.wait()
        print("ok")
        """,
        timeout=120,
    )


# -- GPU-related, checked on CPU ----------------------------------------------
@pytest.mark.parametrize("nbytes", [4096, MiB])
def test_odirect_on_memory_at_page_offset_2048(fpath, nbytes):
    """torch's CUDA pinned allocator hands out memory at data_ptr % 4096 == 2048."""
    h = aio.AsyncIOHandle()
    base = aio.new_locked_tensor(nbytes + 8192, torch.uint8)
    off = (2048 - base.data_ptr()) % 4096
    t = base[off : off + nbytes]
    assert t.data_ptr() % 4096 == 2048
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    t.copy_(src)
    assert h.sync_pwrite(t, fpath, 4096) == nbytes
    t.zero_()
    assert h.sync_pread(t, fpath, 4096) == nbytes
    assert torch.equal(t, src)
    fd = os.open(fpath, os.O_RDONLY)
    try:
        mem_align = aio._C.probe_alignment(fd)["memory"]
    finally:
        os.close(fd)
    if mem_align > 2048:  # the filesystem wants more: staged through the bounce buffer
        assert h.stats()["bounce_bytes"] > 0
    with open(fpath, "rb") as f:
        f.seek(4096)
        assert f.read(nbytes) == src.numpy().tobytes()


class _FakeCudart:
    def __init__(self, ok=True):
        self.ok, self.registered, self.unregistered = ok, [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's name
        self.registered.append((ptr, size, flags))
        return 0 if self.ok else 1

    def cudaHostUnregister(self, ptr):  # noqa: N802 - CUDA's name
        self.unregistered.append(ptr)
        return 0


def test_cuda_path_registers_page_aligned_memory_and_unregisters(monkeypatch, no_garbage):
    import gc

    fake = _FakeCudart()
    monkeypatch.setattr(pinned, "_cuda_available", lambda: True)
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    before = aio.locked_bytes()
    t = aio.new_locked_tensor(3000, torch.float32)
    assert t.data_ptr() % 4096 == 0 and pinned.pinned_kind(t) == pinned.CUDA_REGISTER
    assert fake.registered == [(t.data_ptr(), 12000, 0)]
    assert aio.locked_bytes() == before + 12000
    assert aio.is_locked(t)
    view = t[5:10]
    assert aio.free_locked_tensor(t)
    assert fake.unregistered == []  # a view still uses the memory
    view.fill_(1.0)
    del view, t
    gc.collect()
    assert fake.unregistered == [fake.registered[0][0]]
    assert aio.locked_bytes() == before


def test_cuda_path_falls_back_to_torch_pinned_memory(monkeypatch, no_garbage):
    import gc

    if not torch.cuda.is_available():
        # CPU-only torch cannot pin: make pin_memory=True hand out plain memory.
        real_empty = torch.empty

        def empty(*a, pin_memory=False, **kw):
            return real_empty(*a, **kw)

        monkeypatch.setattr(torch, "empty", empty)
    fake = _FakeCudart(ok=False)
    monkeypatch.setattr(pinned, "_cuda_available", lambda: True)
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    before = aio.locked_bytes()
    t = aio.new_locked_tensor(1000, torch.uint8)
    assert pinned.pinned_kind(t) == pinned.CUDA_PIN_MEMORY and len(fake.registered) == 1
    assert aio.locked_bytes() == before + 1000
    del t
    gc.collect()
    assert aio.locked_bytes() == before and fake.unregistered == []


def test_an_interrupt_right_after_the_core_submitted_keeps_the_memory(tmp_path):
    """A Ctrl-C whose handler runs just after the core's submit returned (the
    request queued, no future made yet) must not give the memory back: it
    stays owned until the process ends (a leak), since a worker may still
    read into it. A refusal by the core (nothing submitted) gives it back."""
    import gc
    import weakref

    from aio import _buffers
    from aio.handle import AsyncIOHandle

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1 << 20))
    h = aio.AsyncIOHandle()
    try:
        c = h._c
        buf = np.empty(1 << 20, np.uint8)
        ref = weakref.ref(buf)
        resolved = _buffers.resolve(buf, writable=True)
        ptr, nbytes = resolved.ptr, resolved.nbytes

        def submit_then_interrupted():
            c.submit(0, ptr, nbytes, str(src), -1, 0)
            raise KeyboardInterrupt

        before = len(_buffers._inflight)
        with pytest.raises(KeyboardInterrupt):
            AsyncIOHandle._started(c, resolved, None, submit_then_interrupted)
        del buf, resolved
        gc.collect()
        assert ref() is not None, "the memory was let go with its request in flight"
        assert len(_buffers._inflight) == before + 1
        c.drain()

        def refused():
            raise ValueError("refused by the core")

        other = _buffers.resolve(np.empty(4096, np.uint8), writable=True)
        with pytest.raises(ValueError):
            AsyncIOHandle._started(c, other, None, refused)
        assert len(_buffers._inflight) == before + 1  # given back
    finally:
        h.close()


def test_ctrl_c_interrupts_close_waiting_for_requests_nobody_holds(tmp_path):
    """close() waits for every request, also those whose futures were dropped
    (a sync call interrupted on a hung file system): interruptibly, leaving
    the handle open and intact, as its wait for held futures does."""
    import _thread
    import time

    h = aio.AsyncIOHandle()
    real = h._c

    class _Stuck:  # a core whose last request never finishes
        def drain_for(self, seconds):
            time.sleep(min(seconds, 0.05))
            return False

        def __getattr__(self, name):
            return getattr(real, name)

    h._c = _Stuck()
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            h.close()
    finally:
        timer.cancel()
    assert not h._closed  # open and intact: close() again finishes it
    h._c = real
    src = tmp_path / "x.bin"
    src.write_bytes(b"\1" * 4096)
    buf = np.zeros(4096, np.uint8)
    h.sync_pread(buf, str(src))
    assert (buf == 1).all()
    h.close()
    assert h._closed


# -- issue 42 F3: a submit cut short keeps its memory until its I/O is done ----
PIECES_SCRIPT = """
from aio import pinned

SLOT, N = 2 << 20, 65536  # 32-byte pieces: the core queues them for ~0.1-0.3 s
PIECES = os.path.join(DIR, "pieces.bin")
np.random.default_rng(6).integers(0, 256, SLOT, dtype=np.uint8).tofile(PIECES)
OFFS = np.arange(N, dtype=np.int64) * (SLOT // N)
pool = pinned.PinnedPool(1, SLOT, lock=False)  # one slot: the next lease reuses it

def interrupt(*_):
    raise KeyboardInterrupt

signal.signal(signal.SIGALRM, interrupt)

# When the timer fires matters: too soon, before the core is reached (a loaded
# box stretches the Python before it); too late, after the submit returned.
# Trials go on past their count, other delays in turn, until some were cut.
DELAYS = (0.005, 0.002, 0.01, 0.001, 0.02)

def interrupted_read(buf, trial):
    # A timer's handler raises while the core queues the pieces (the GIL is
    # released there, so it runs as the core returns): the future is lost.
    fut = None
    signal.setitimer(signal.ITIMER_REAL, DELAYS[trial % len(DELAYS)])
    try:
        fut = h.async_pread_pieces(buf, PIECES, OFFS)
        fut.wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    # Counts only if the submit itself was cut short with reads still queued.
    return fut is None and h.stats()["outstanding"] > 0

valid = 0
for trial in range(40):
    if trial >= 8 and valid:
        break
    lease = pool.acquire()
    cut = interrupted_read(lease.buffer(), trial)
    lease.release()
    if cut:
        valid += 1
        assert h.stats()["outstanding"] == 0, "release() returned with reads in flight"
    nxt = pool.acquire(timeout=5)
    mine = np.frombuffer(nxt.buffer(), np.uint8)
    mine[:] = 0xA5
    h._c.drain()
    assert (mine == 0xA5).all(), f"a late read overwrote {int((mine != 0xA5).sum())} bytes of the next lease"
    nxt.release()
tensor_valid = 0
for trial in range(40):
    if trial >= 4 and tensor_valid:
        break
    t = aio.new_locked_tensor(SLOT, torch.uint8)
    cut = interrupted_read(t, trial)
    aio.free_locked_tensor(t)
    if cut:
        tensor_valid += 1
        assert h.stats()["outstanding"] == 0, "free_locked_tensor returned with reads in flight"
    h._c.drain()
assert valid and tensor_valid, ("no submit was cut short", valid, tensor_valid)
print("ok", valid, tensor_valid)
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_a_lease_released_after_an_interrupted_submit_waits_for_its_reads(tmp_path, engine):
    """Ctrl-C landing as async_pread_pieces' core returns (no future made)
    keeps the memory owned; Lease.release() and free_locked_tensor() must then
    wait for the queued reads, not hand the slot to the next lease while they
    land in it (they overwrote up to 2 MB of it in 8 of 8 trials)."""
    body = "import torch\n" + PIECES_SCRIPT
    r = run_script(tmp_path, body, timeout=180, engine=engine)
    assert r.stdout.startswith("ok")


def test_a_submit_that_fails_part_way_keeps_the_memory_until_queued_pieces_end(tmp_path):
    """A MemoryError from the core after some pieces were queued (the core
    allocates per piece) is not a refusal: releasing the memory waits for
    the pieces already queued, then the registry lets it go."""
    from aio import _buffers
    from aio.handle import AsyncIOHandle

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(32 * MiB))
    h = aio.AsyncIOHandle(engine="posix", thread_count=1)
    pool = pinned.PinnedPool(1, 2 * MiB, lock=False)
    try:
        c = h._c
        sink = np.empty(32 * MiB, np.uint8)
        blockers = [h.async_pread(sink, str(src)) for _ in range(4)]  # the pieces queue behind these
        lease = pool.acquire()
        resolved = _buffers.resolve(lease.buffer(), writable=True)
        n = 65536
        offs = np.arange(n // 2, dtype=np.int64) * 32

        def half_queued_then_out_of_memory():
            c.submit_pieces(0, resolved.ptr, 32, offs.ctypes.data, n // 2, str(src), -1)
            raise MemoryError("std::bad_alloc")

        before = len(_buffers._inflight)
        with pytest.raises(MemoryError):
            AsyncIOHandle._started(c, resolved, None, half_queued_then_out_of_memory)
        assert not blockers[-1].done(), "the test needs the pieces still queued here"
        lease.release()
        assert c.stats()["outstanding"] == 0, "the slot was given back with pieces in flight"
        assert len(_buffers._inflight) == before, "the waited-for entry is forgotten"
        h.wait()
    finally:
        h.close()
