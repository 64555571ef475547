"""The op DeepSpeed loads after enable(): every call form DeepSpeed 0.19's own
async_io op accepts (its pybind11 signatures, keyword names and return codes),
and the cases of DeepSpeed's handle unit tests, written afresh.

Each test runs against aio's handle as DeepSpeed gets it
(``AsyncIOBuilder().load().aio_handle(...)`` after ``enable()``). With
``AIO_TEST_DS_OP=1`` the same tests also run against DeepSpeed's own op
(built by ds_op.py, with its own time budget, into a folder of the tests'
own), the reference these call forms were taken from.
"""

from __future__ import annotations

import filecmp
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install .[deepspeed])")

import aio.integrations.deepspeed as aio_ds  # noqa: E402

from . import ds_op  # noqa: E402

BLOCK, DEPTH, THREADS = 1024, 2, 2
SIZE = 4 * BLOCK * 4  # several blocks per worker slice
CUDA = torch.cuda.is_available()


def _deepspeeds_op(request):
    """DeepSpeed's own op, loaded in this process from the tests' build of it."""
    if os.environ.get("AIO_TEST_DS_OP") != "1":
        pytest.skip("set AIO_TEST_DS_OP=1 to compare with DeepSpeed's own op")
    aio_ds.disable()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import AsyncIOBuilder

    folder = request.getfixturevalue("ds_op_dir")(get_accelerator().device_name())
    ds_op.skip_if_locked(folder)  # the load would wait on it
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", folder)
        return AsyncIOBuilder().load(verbose=False)


# The first test on DeepSpeed's op may pay for its build (ds_op.py's budget).
DEEPSPEED = pytest.param("deepspeed", marks=pytest.mark.timeout(ds_op.timeout_s()))


@pytest.fixture(params=["aio", DEEPSPEED], scope="module")
def op(request):
    """The async_io op module DeepSpeed would use."""
    if request.param == "deepspeed":
        yield _deepspeeds_op(request)
        return
    aio_ds.enable()
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        yield AsyncIOBuilder().load(verbose=False)
    finally:
        aio_ds.disable()


def is_aio(op) -> bool:
    return op.aio_handle is aio_ds.DeepSpeedAioHandle


def new_handle(op, single_submit=False, overlap_events=True):
    # Positional, in the order of DeepSpeed's constructor.
    return op.aio_handle(BLOCK, DEPTH, single_submit, overlap_events, THREADS)


def ref_file(tmp_path, name="ref.bin", size=SIZE) -> tuple[str, bytes]:
    data = os.urandom(size)
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(data)
    return path, data


def make_buffer(h, kind: str, size=SIZE, fill: bytes | None = None):
    if kind == "locked":
        t = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    elif kind == "plain":
        t = torch.empty(size, dtype=torch.uint8)
    elif kind == "cuda_pinned":
        t = torch.empty(size, dtype=torch.uint8).pin_memory()
    else:
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
    if fill is not None:
        t.copy_(torch.frombuffer(bytearray(fill), dtype=torch.uint8))
    return t


def as_bytes(t) -> bytes:
    return bytes(t.cpu().numpy().tobytes())


KINDS = [
    "locked",
    "plain",
    pytest.param("cuda_pinned", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA")),
]
SUBMIT = [(s, o) for s in (True, False) for o in (True, False)]


def test_settings_round_trip(op):
    h = op.aio_handle(block_size=4096, queue_depth=4, single_submit=True, overlap_events=False)
    assert (h.get_block_size(), h.get_queue_depth()) == (4096, 4)
    assert (h.get_single_submit(), h.get_overlap_events(), h.get_intra_op_parallelism()) == (True, False, 1)
    d = op.aio_handle()
    assert (d.get_block_size(), d.get_queue_depth(), d.get_overlap_events()) == (1 << 20, 128, False)
    h = new_handle(op)
    assert h.get_intra_op_parallelism() == THREADS
    assert isinstance(h.get_alignment(), int) and h.get_alignment() > 0


@pytest.mark.parametrize("single_submit,overlap_events", SUBMIT)
@pytest.mark.parametrize("kind", KINDS)
def test_sync_and_async_read(op, tmp_path, kind, single_submit, overlap_events):
    h = new_handle(op, single_submit, overlap_events)
    path, data = ref_file(tmp_path)
    buf = make_buffer(h, kind)
    assert h.sync_pread(buf, path) == 1
    assert as_bytes(buf) == data
    buf.zero_()
    assert h.async_pread(buf, path) == 0
    assert h.wait() == 1
    assert as_bytes(buf) == data


@pytest.mark.parametrize("single_submit,overlap_events", SUBMIT)
@pytest.mark.parametrize("kind", KINDS)
def test_sync_and_async_write(op, tmp_path, kind, single_submit, overlap_events):
    h = new_handle(op, single_submit, overlap_events)
    path, data = ref_file(tmp_path)
    buf = make_buffer(h, kind, fill=data)
    out1, out2 = str(tmp_path / "sync.bin"), str(tmp_path / "async.bin")
    assert h.sync_pwrite(buf, out1) == 1
    assert h.async_pwrite(buf, out2) == 0
    assert h.wait() == 1
    filecmp.clear_cache()
    assert filecmp.cmp(path, out1, shallow=False) and filecmp.cmp(path, out2, shallow=False)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_device_buffers(op, tmp_path):
    h = new_handle(op)
    path, data = ref_file(tmp_path)
    dev = make_buffer(h, "cuda")
    assert h.async_pread(dev, path) == 0 and h.wait() == 1
    assert as_bytes(dev) == data
    out = str(tmp_path / "out.bin")
    assert h.async_pwrite(dev, out) == 0 and h.wait() == 1
    assert filecmp.cmp(path, out, shallow=False)


@pytest.mark.parametrize("n", [2, 3])
def test_queue_of_requests(op, tmp_path, n):
    h = new_handle(op, single_submit=True, overlap_events=True)
    refs = [ref_file(tmp_path, f"ref{i}.bin") for i in range(n)]
    bufs = [make_buffer(h, "locked") for _ in range(n)]
    for buf, (path, _) in zip(bufs, refs, strict=True):
        assert h.async_pread(buf, path) == 0
    assert h.wait() == n
    assert [as_bytes(b) for b in bufs] == [d for _, d in refs]
    outs = [str(tmp_path / f"out{i}.bin") for i in range(n)]
    for buf, out in zip(bufs, outs, strict=True):
        assert h.async_pwrite(buf, out) == 0
    assert h.wait() == n
    assert all(filecmp.cmp(p, o, shallow=False) for (p, _), o in zip(refs, outs, strict=True))
    for b in bufs:
        h.free_cpu_locked_tensor(b)


def test_file_offsets(op, tmp_path):
    h = new_handle(op)
    path, data = ref_file(tmp_path, size=4 * SIZE)
    buf = make_buffer(h, "locked")
    for i in range(4):
        assert h.sync_pread(buf, path, i * SIZE) == 1 and as_bytes(buf) == data[i * SIZE : (i + 1) * SIZE]
        assert h.async_pread(buffer=buf, filename=path, file_offset=i * SIZE) == 0 and h.wait() == 1
        assert as_bytes(buf) == data[i * SIZE : (i + 1) * SIZE]
    out = str(tmp_path / "out.bin")
    for i in reversed(range(4)):
        buf.copy_(torch.frombuffer(bytearray(data[i * SIZE : (i + 1) * SIZE]), dtype=torch.uint8))
        assert h.sync_pwrite(buffer=buf, filename=out, file_offset=i * SIZE) == 1
    assert filecmp.cmp(path, out, shallow=False)


def test_pread_pwrite_flag_forms(op, tmp_path):
    h = new_handle(op)
    path, data = ref_file(tmp_path)
    buf = make_buffer(h, "locked")
    assert h.pread(buf, path, False, False) == 1 and as_bytes(buf) == data  # synchronous
    assert h.pread(buf, path, False, True, 0) == 0 and h.wait() == 1  # positional async
    kw = {"buffer": buf, "filename": path, "validate": False, "async": True, "file_offset": 0}
    assert h.pread(**kw) == 0 and h.wait() == 1  # DeepSpeed's keyword names
    out = str(tmp_path / "out.bin")
    assert h.pwrite(**dict(kw, filename=out)) == 0 and h.wait() == 1
    assert filecmp.cmp(path, out, shallow=False)


def test_validated_forms(op, tmp_path):
    if not is_aio(op):
        # Seen on an H200 (session 15, DeepSpeed 0.19.8 JIT-built): the first
        # call below kills the process with SIGSEGV inside DeepSpeed's op.
        pytest.xfail("DeepSpeed 0.19.8's own op segfaults on a validated pwrite")
    h = new_handle(op)
    path, data = ref_file(tmp_path)
    buf = make_buffer(h, "locked", fill=data)
    out = str(tmp_path / "out.bin")
    assert h.pwrite(buf, out, True, False, 0) == 1  # validated synchronous write
    assert h.pwrite(buf, out, True, True, 0) == 0 and h.wait() == 1  # validated at wait()
    assert h.pread(buf, out, True, True, 0) == 0 and h.wait() == 1
    assert filecmp.cmp(path, out, shallow=False)


def test_older_read_write(op, tmp_path):
    h = new_handle(op)
    path, data = ref_file(tmp_path)
    buf = make_buffer(h, "locked")
    assert h.read(buf, path, False) == 0 and as_bytes(buf) == data
    out = str(tmp_path / "out.bin")
    assert h.write(buffer=buf, filename=out, validate=True, file_offset=0) == 0
    assert h.read(buffer=buf, filename=out, validate=True) == 0
    assert filecmp.cmp(path, out, shallow=False)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_async_pwrite_to_descriptor(op, tmp_path, direct):
    """DeepSpeed's fast checkpoint writer: ``async_pwrite(buffer, fd, offset)``."""
    h = new_handle(op)
    path, data = ref_file(tmp_path, size=3 * SIZE)
    out = str(tmp_path / "out.bin")
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
    bufs = [make_buffer(h, "locked", fill=data[i * SIZE : (i + 1) * SIZE]) for i in range(3)]
    try:
        assert h.async_pwrite(bufs[0], fd, 0) == 0
        assert h.async_pwrite(buffer=bufs[1], fd=fd, file_offset=SIZE) == 0
        assert h.async_pwrite(bufs[2], fd=fd, file_offset=2 * SIZE) == 0
        assert h.wait() == 3
        os.fstat(fd)  # still open: the caller owns it
    finally:
        os.close(fd)
    assert filecmp.cmp(path, out, shallow=False)
    if is_aio(op):
        # O_DIRECT descriptors get direct I/O; buffered ones stay buffered.
        stats = h.handle.stats()
        assert stats["bytes_written"] == 3 * SIZE
        assert stats["buffered_bytes"] == (0 if direct else 3 * SIZE)


def test_pinned_tensor_keywords(op):
    h = new_handle(op)
    t = h.new_cpu_locked_tensor(num_elem=1024, example_tenosr=torch.empty(0, dtype=torch.float16))
    assert t.dtype == torch.float16 and t.numel() == 1024
    assert h.is_pinned(buffer=t) and not h.is_pinned(torch.empty(8))
    assert h.free_cpu_locked_tensor(tensor=t)


@pytest.mark.parametrize("kind", ["locked", "plain"])
def test_module_functions(op, tmp_path, kind):
    if not is_aio(op):
        # Seen with deepspeed 0.19.8 on this machine: with memory that is not
        # page-aligned its one-shot functions return 0 and leave wrong bytes
        # (printing "Fail: correctness"); with locked buffers they pass, but
        # the process then crashes (SIGSEGV) in a later test.
        pytest.skip("DeepSpeed's own aio_read/aio_write are unreliable here")
    h = new_handle(op)
    path, data = ref_file(tmp_path)
    src = make_buffer(h, kind, fill=data)
    out = str(tmp_path / "out.bin")
    assert op.aio_write(src, out, BLOCK, DEPTH, False, True, True) == 0
    dst = make_buffer(h, kind)
    assert op.aio_read(dst, out, BLOCK, DEPTH, True, False, True) == 0
    assert as_bytes(dst) == data
    copy = torch.zeros(SIZE, dtype=torch.uint8)
    assert op.deepspeed_memcpy(copy, dst) == 0 and torch.equal(copy, dst)


def test_aio_only_extras(op, tmp_path):
    """What aio adds over DeepSpeed's op (DeepSpeed asserts or misreads here)."""
    if not is_aio(op):
        pytest.skip("aio's behaviour only")
    h = new_handle(op)
    assert h.wait() == 0  # DeepSpeed's op asserts on an empty wait()
    path, _ = ref_file(tmp_path)
    buf = make_buffer(h, "locked")
    assert h.pread(buf, path, False, async_op=True) == 0 and h.wait() == 1
    with pytest.raises(TypeError, match="exactly one of filename or fd"):
        h.async_pwrite(buf)
    with pytest.raises(TypeError, match="exactly one of filename or fd"):
        h.async_pwrite(buf, path, fd=3)
    with pytest.raises(TypeError, match="fd must be an int"):
        h.async_pwrite(buf, fd="3")
    with pytest.raises(TypeError, match="async or async_op"):
        h.pread(buf, path, False, True, **{"async": True})
    with pytest.raises(TypeError, match="unexpected keyword"):
        h.pread(buf, path, asynchronous=True)
    with pytest.raises(TypeError, match="exactly one of example_tensor"):
        h.new_cpu_locked_tensor(8)
