"""async_pread_pieces / async_pwrite_pieces: many requests in one call, one
future; exact data on every engine, the first failed piece's error, misuse
refused before anything is queued."""

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import ENGINES, MiB, aligned_empty, handle, make_file

import aio


@pytest.fixture
def src(tmp_path, pattern):
    p = str(tmp_path / "src.bin")
    make_file(p, pattern[: 8 * MiB])
    return p


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("piece,misalign", [(4096, 0), (4096, 1), (777, 3), (64 * 1024 + 5, 0)])
def test_random_pieces_round_trip_exactly(engine, piece, misalign, src, pattern, tmp_path):
    """Random (often unaligned) offsets, unaligned memory and sizes: every
    piece lands where it belongs, reading and writing."""
    h = handle(engine=engine, queue_depth=16, block_size=64 * 1024)
    rng = np.random.default_rng(piece + misalign)
    offs = rng.integers(0, 8 * MiB - piece, 48)
    out = aligned_empty(48 * piece, misalign)
    fut = h.async_pread_pieces(out, src, offs)
    assert fut.result(timeout=60) == out.nbytes and fut.offset == offs[0]
    for i, o in enumerate(offs):
        assert np.array_equal(out[i * piece : (i + 1) * piece], pattern[o : o + piece]), i
    # Writes: disjoint pieces of a fresh file, read back whole.
    dst = str(tmp_path / "dst.bin")
    make_file(dst, np.zeros(48 * 2 * piece, np.uint8))
    slots = rng.permutation(96)[:48] * piece
    assert h.async_pwrite_pieces(out, dst, slots).result(timeout=60) == out.nbytes
    back = np.fromfile(dst, np.uint8)
    for i, o in enumerate(slots):
        assert np.array_equal(back[o : o + piece], out[i * piece : (i + 1) * piece]), i


def test_pieces_are_in_flight_together(src):
    h = handle(engine="kernel_aio", queue_depth=32)
    offs = np.arange(64) * 4096 * 7
    out = aligned_empty(64 * 4096)
    h.async_pread_pieces(out, src, offs).result(timeout=60)
    st = h.stats()
    assert st["read_requests"] == 64 and st["max_inflight"] > 1


def test_a_failed_piece_fails_the_future_with_its_own_error(src):
    h = handle(engine="kernel_aio", queue_depth=8)
    h._c.inject_fault("error", errno.EIO, "read", 3, 1)  # the third I/O submitted
    offs = np.arange(8) * 65536
    fut = h.async_pread_pieces(aligned_empty(8 * 4096), src, offs)
    with pytest.raises(OSError) as ei:
        fut.result(timeout=60)
    e = ei.value
    assert e.errno == errno.EIO and e.filename == src and e.offset in set(offs.tolist())
    assert h.stats()["failed_requests"] == 1 and h.pending() == 0


def test_a_piece_past_the_end_refuses_the_call_and_queues_nothing(src):
    h = handle()
    with pytest.raises(OSError) as ei:
        h.async_pread_pieces(np.empty(2 * 4096, np.uint8), src, [0, 8 * MiB - 100])
    assert ei.value.errno == errno.ENODATA and "past end of file" in str(ei.value)
    assert h.stats()["read_requests"] == 0 and h.stats()["outstanding"] == 0


@pytest.mark.parametrize(
    "offsets,exc,text",
    [
        ([], ValueError, "non-empty"),
        ([[0, 1]], ValueError, "1-D"),
        ([0.0, 4096.0], TypeError, "integers"),
        ([True, False], TypeError, "integers"),
        ([0, -4096], ValueError, ">= 0"),
        ([0, 4096, 8192], ValueError, "equal pieces"),
        ([0, 2**63 - 2], OverflowError, r"2\*\*63-1"),
    ],
)
def test_misuse_is_refused_before_anything_is_queued(src, offsets, exc, text):
    h = handle()
    with pytest.raises(exc, match=text):
        h.async_pread_pieces(np.empty(2 * 4096, np.uint8), src, offsets)
    assert h.stats()["read_requests"] == 0 and h.pending() == 0


def test_the_future_owns_the_buffer_until_done(src, pattern):
    """The caller may drop its buffer right after the call."""
    import weakref

    h = handle(engine="posix")
    out = np.empty(16 * 4096, np.uint8)
    ref = weakref.ref(out)
    fut = h.async_pread_pieces(out, src, np.arange(16) * 4096)
    del out
    assert fut.result(timeout=60) == 16 * 4096
    assert ref() is None or np.array_equal(ref(), pattern[: 16 * 4096])
    assert isinstance(fut, aio.AioFuture) and os.path.exists(src)


# Runs in a child: the address-space limit makes the core run out of memory
# while it queues the pieces (it allocates per piece), after some are queued.
OUT_OF_MEMORY_SCRIPT = textwrap.dedent(
    """
    import os, resource, sys
    import numpy as np
    import aio
    from aio.pinned import PinnedPool

    engine, path = sys.argv[1], sys.argv[2]
    h = aio.AsyncIOHandle(engine=engine, queue_depth=32)
    h.sync_pwrite(np.zeros(1 << 20, np.uint8), path, 0)
    n, piece = 1_000_000, 8
    pool = PinnedPool(1, n * piece, lock=False)
    lease = pool.acquire()
    buf = np.frombuffer(lease.buffer(), np.uint8)[: n * piece]
    offs = np.arange(n, dtype=np.int64) * piece % (1 << 20)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    # Room for the offsets the core copies (8 MB), not for a million pieces.
    resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), hard))
    try:
        h.async_pread_pieces(buf, path, offs)
        sys.exit("no MemoryError: the test did not run out of memory")
    except MemoryError:
        pass
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    lease.release()  # waits until the handle is idle
    st = h.stats()
    assert st["outstanding"] == 0, st
    assert st["read_requests"] > 0, "the memory ran out before any piece was queued"
    h.close()
    print("ok", st["read_requests"])
    """
)


@pytest.mark.parametrize("engine", ENGINES)
def test_out_of_memory_part_way_leaves_nothing_outstanding(engine, tmp_path):
    """std::bad_alloc while the core queued a piece (RLIMIT_AS, 125,772
    pieces in) left the handle's outstanding count at 1 for good: the
    Lease.release() after the MemoryError, close() and the exit-time drain
    all waited forever (the process hung at exit). The pieces queued before
    it complete and count; the one that failed counts nothing."""
    r = subprocess.run(
        [sys.executable, "-c", OUT_OF_MEMORY_SCRIPT, engine, str(tmp_path / "f.bin")],
        capture_output=True,
        text=True,
        timeout=60,  # a hang (the count left behind) ends in TimeoutExpired
    )
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
