"""Round trips through AsyncIOHandle over engines, sizes, offsets and settings.

The posix engine is the oracle: every result is also compared with plain
buffered file I/O of the same bytes.
"""

import os

import numpy as np
import pytest
from conftest import ENGINES, MiB, aligned_empty, handle

SIZES = [1, 4095, 4097, MiB + 3, 64 * MiB]
OFFSETS = [0, 4096, 513]


def _roundtrip(h, path, data, off, mode, misalign=0):
    src = aligned_empty(len(data), misalign)
    src[:] = data
    if mode == "sync":
        assert h.sync_pwrite(src, path, off) == len(data)
    else:
        fut = h.async_pwrite(src, path, off)
        assert fut.result() == len(data)
        assert h.wait() == 1
    with open(path, "rb") as f:  # oracle: buffered read of the same bytes
        f.seek(off)
        assert f.read(len(data)) == data.tobytes()
    dst = aligned_empty(len(data), misalign)
    dst[:] = 0
    if mode == "sync":
        assert h.sync_pread(dst, path, off) == len(data)
    else:
        fut = h.async_pread(dst, path, off)
        assert h.wait() == 1
        assert fut.done() and fut.result() == len(data)
    assert np.array_equal(dst, data)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"n{s}")
@pytest.mark.parametrize("off", OFFSETS, ids=lambda o: f"off{o}")
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_roundtrip_engine_size_offset_threads(engine, size, off, threads, pattern, fpath):
    mode = "async" if (size + off + threads) % 2 else "sync"
    h = handle(engine=engine, thread_count=threads)
    _roundtrip(h, fpath, pattern[:size], off, mode)


@pytest.mark.parametrize("qd", [1, 4, 32])
@pytest.mark.parametrize("single_submit", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_roundtrip_kernel_settings(qd, single_submit, overlap, threads, mode, pattern, fpath):
    h = handle(
        engine="kernel_aio",
        queue_depth=qd,
        single_submit=single_submit,
        overlap_events=overlap,
        thread_count=threads,
        block_size=256 * 1024,
    )
    _roundtrip(h, fpath, pattern[: 5 * MiB + 4099], 4096 * 3 + 7, mode)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("misalign", [1, 8, 100])
def test_unaligned_memory_goes_through_bounce(engine, misalign, pattern, fpath):
    h = handle(engine=engine, block_size=128 * 1024)
    _roundtrip(h, fpath, pattern[: 3 * MiB], 0, "sync", misalign=misalign)
    assert h.stats()["bounce_bytes"] >= 2 * 3 * MiB


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("block_size", [4096, 12345, 3 * MiB])
def test_odd_block_sizes(engine, block_size, pattern, fpath):
    h = handle(engine=engine, block_size=block_size)
    _roundtrip(h, fpath, pattern[: 2 * MiB + 17], 4099, "sync")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("off,n", [(0, 1), (1, 1), (4095, 2), (100, 8000), (4096, 4096), (5000, MiB)])
def test_overwrite_in_middle_keeps_surroundings(engine, off, n, pattern, fpath):
    base = pattern[: 2 * MiB + 100].copy()
    with open(fpath, "wb") as f:
        f.write(base.tobytes())
    h = handle(engine=engine, thread_count=2)
    new = (pattern[7 : 7 + n] ^ 0xFF).astype(np.uint8)
    h.sync_pwrite(new, fpath, off)
    expect = base.copy()
    expect[off : off + n] = new
    with open(fpath, "rb") as f:
        got = np.frombuffer(f.read(), dtype=np.uint8)
    assert got.size == base.size, "file size must not change"
    assert np.array_equal(got, expect)


def test_engines_agree_with_each_other(pattern, tmp_path):
    """Write with one engine, read with the other, both directions."""
    a, b = handle(engine="kernel_aio", thread_count=2), handle(engine="posix", thread_count=3)
    data = pattern[: 7 * MiB + 11]
    for w, r in ((a, b), (b, a)):
        p = str(tmp_path / f"x_{w.engine}.bin")
        w.sync_pwrite(data, p, 123)
        out = np.empty_like(data)
        r.sync_pread(out, p, 123)
        assert np.array_equal(out, data)


def test_write_never_truncates(pattern, fpath):
    h = handle()
    h.sync_pwrite(pattern[: 2 * MiB], fpath, 0)
    h.sync_pwrite(pattern[:10], fpath, 0)
    assert os.path.getsize(fpath) == 2 * MiB


def test_sparse_extend_reads_zeros_in_gap(fpath):
    h = handle()
    h.sync_pwrite(np.full(10, 7, np.uint8), fpath, 1 * MiB + 5)
    out = np.ones(MiB + 15, np.uint8)
    h.sync_pread(out, fpath, 0)
    assert not out[: MiB + 5].any() and (out[MiB + 5 :] == 7).all()


def test_zero_length_requests(fpath):
    h = handle()
    open(fpath, "wb").close()
    assert h.sync_pwrite(np.empty(0, np.uint8), fpath, 0) == 0
    assert h.sync_pread(bytearray(0), fpath, 0) == 0
    assert h.async_pread(bytearray(0), fpath).result() == 0


def test_dev_shm_roundtrip(pattern):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    path = f"/dev/shm/aio-test-{os.getpid()}.bin"
    try:
        h = handle()
        _roundtrip(h, path, pattern[: 3 * MiB + 5], 4097, "sync")
    finally:
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.parametrize("engine", ENGINES)
def test_caller_owned_descriptor(engine, pattern, fpath):
    """DeepSpeed passes its own (O_DIRECT) descriptor; it must not be closed."""
    data = pattern[: 2 * MiB + 3]
    h = handle(engine=engine)
    fd = os.open(fpath, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        assert h.async_pwrite(data, fd, 4096).result() == data.size
        out = np.empty_like(data)
        assert h.sync_pread(out, fd, 4096) == data.size
        assert np.array_equal(out, data)
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
    fd = os.open(fpath, os.O_RDONLY)  # buffered descriptor works too
    try:
        out = np.empty_like(data)
        h.sync_pread(out, fd, 4096)
        assert np.array_equal(out, data)
    finally:
        os.close(fd)


@pytest.mark.cuda
def test_a_done_read_into_a_cuda_tensor_holds_the_data(tmp_path):
    """done() is True only once the bytes are in device memory (the read
    lands in host memory first; done() copies it up)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import aio

    data = torch.arange(1 << 16, dtype=torch.uint8) % 251
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    dev = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    with aio.AsyncIOHandle() as h:
        fut = h.async_pread(dev, path, 0)
        while not fut.done():
            pass
        assert torch.equal(dev.cpu(), data)
        assert fut.result() == 1 << 16
