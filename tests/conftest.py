import os

import numpy as np
import pytest

import aio

MiB = 1 << 20


def engine_unavailable(name: str) -> str | None:
    """Why the engine cannot run here (its probe's error), or None if it can."""
    try:
        aio.AsyncIOHandle(engine=name).close()
    except OSError as e:
        return str(e)
    return None


_URING_MISSING = engine_unavailable("io_uring")
# io_uring is probed at runtime: kernel.io_uring_disabled, seccomp (Docker's
# default profile) or an old kernel turn it off, and its tests skip saying why.
IO_URING = pytest.param(
    "io_uring",
    marks=pytest.mark.skipif(_URING_MISSING is not None, reason=f"io_uring unavailable: {_URING_MISSING}"),
)
ENGINES = ["kernel_aio", "posix", IO_URING]
# The engines that queue I/O in the kernel (queue_depth, single_submit and
# overlap_events apply to them).
QUEUED_ENGINES = ["kernel_aio", IO_URING]


@pytest.fixture(scope="session")
def pattern() -> np.ndarray:
    """64 MiB + a few bytes of random data, sliced by the tests."""
    rng = np.random.default_rng(1234)
    return rng.integers(0, 256, size=64 * MiB + 8192, dtype=np.uint8)


@pytest.fixture
def no_garbage() -> None:
    """Collect until nothing is left: for tests that count process-wide bytes
    (aio.locked_bytes()), so that an earlier test's engine waiting in a
    reference cycle is not freed mid-count. One gc.collect() is not always
    enough: torch frees a tensor's Python object only when its C++ side
    goes, a pass later."""
    import gc

    for _ in range(10):
        if not gc.collect():
            break


@pytest.fixture
def fpath(tmp_path):
    return str(tmp_path / "data.bin")


def aligned_empty(n: int, misalign: int = 0) -> np.ndarray:
    """A uint8 array of n bytes whose address is page-aligned plus `misalign`."""
    raw = np.empty(n + 8192, dtype=np.uint8)
    base = (-raw.ctypes.data) % 4096
    return raw[base + misalign : base + misalign + n]


def make_file(path: str, data: bytes | np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(bytes(memoryview(data)))


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


def handle(**kw) -> aio.AsyncIOHandle:
    return aio.AsyncIOHandle(**kw)


def pytest_configure(config):
    """AIO_EXPECT_TORCH=2.14.1 (scripts/second_torch.sh) refuses to run the
    suite on any other torch: a second-torch CI run that silently imported
    the default torch would prove nothing."""
    want = os.environ.get("AIO_EXPECT_TORCH")
    if want:
        import torch

        if torch.__version__.split("+")[0] != want:
            raise pytest.UsageError(f"AIO_EXPECT_TORCH={want} but torch {torch.__version__} is imported")


def pytest_report_header(config):
    import torch

    h = aio.AsyncIOHandle()
    return [
        f"aio engine auto -> {h.engine}: {h.stats()['engine_reason']}",
        f"torch {torch.__version__} ({os.path.dirname(torch.__file__)})",
        f"pid {os.getpid()}",
    ]


@pytest.fixture
def gloo_world_one(tmp_path):
    """An in-process gloo process group of world 1 (rank 0), torn down after
    the test; skipped when one is up already. Costs well under a second (no
    spawn): for the one-rank cases of FSDP2, DTensor and DDP."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
