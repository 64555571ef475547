"""DeepSpeed's own async_io op, for the tests that compare aio with it.

DeepSpeed JIT-builds the op (C++, libaio-dev) the first time it is loaded:
12 minutes on this 2-core VM (DeepSpeed 0.19.8, torch 2.13), about one on 16
cores. Loaded inside a test, that build ran past pytest's 300 s limit; and a
build killed part-way leaves torch's ``lock`` file in its extensions folder,
on which every later load of any DeepSpeed op waits, forever. So the tests
get the op from here:

- built into a folder of the tests' own, ``AIO_TEST_DS_OP_DIR`` (default
  ``~/.cache/aio-tests/torch_extensions``), one subfolder per DeepSpeed
  accelerator (the CPU and CUDA builders build different ops), never the
  ``~/.cache/torch_extensions`` or ``TORCH_EXTENSIONS_DIR`` other DeepSpeed
  jobs use;
- by a subprocess, with its own time budget in seconds,
  ``AIO_TEST_DS_OP_BUILD_S``: 0 unless ``AIO_TEST_DS_OP=1`` (then 900),
  so a plain test run never builds (CI's time), and uses the op only once
  built; killed at the budget, along with its compilers, and the lock it
  left removed (ninja keeps what it compiled: the next build goes on from
  there);
- one build at a time per folder (``flock``), waited for within that budget;
  a ``lock`` found there (a build killed by something else) makes the tests
  skip, saying so, instead of waiting on it.

``python3 tests/integrations/ds_op.py [cpu|cuda]`` builds it beforehand and
prints the time.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

# What the build subprocess runs: the op's load (a build first if needed),
# then the op DeepSpeed's torch backend loads at init_distributed (the shared
# memory collectives on CPU), which a training run on DeepSpeed's op would
# otherwise build into the same folder inside a test (2 minutes here).
LOAD = (
    "from deepspeed.ops.op_builder import AsyncIOBuilder as B; B().load(verbose=False); "
    "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
)
# The subprocess's limit when the op is built, whatever the budget: the op
# loads in 3 s here (ninja finds nothing to do), the CPU collectives op, when
# missing, builds in 0.5 to 2 minutes; longer means a rebuild (sources or
# flags changed).
LOAD_S = 240.0
SO = os.path.join("async_io", "async_io.so")
CLAIM = ".aio-tests-build.lock"
# pytest's limit for a test that loads the op, beyond the build budget.
TEST_S = 300.0


def ext_dir(accelerator: str) -> str:
    """The TORCH_EXTENSIONS_DIR of the tests' op for DeepSpeed's `accelerator`."""
    root = os.environ.get("AIO_TEST_DS_OP_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "aio-tests", "torch_extensions")
    return os.path.join(root, accelerator)


def build_budget_s() -> float:
    """Seconds a test session may spend building the op (0: never build)."""
    value = os.environ.get("AIO_TEST_DS_OP_BUILD_S")
    if value is None:
        return 900.0 if os.environ.get("AIO_TEST_DS_OP") == "1" else 0.0
    return float(value)


def timeout_s() -> float:
    """pytest's timeout for a test that may pay for the build (or the load)."""
    return max(build_budget_s(), LOAD_S) + TEST_S


def unbuildable_reason() -> str | None:
    """Why DeepSpeed's op cannot be built here, or None (it can)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        import aio.integrations.deepspeed as aio_ds
    except ImportError as e:
        return f"DeepSpeed's op builders cannot be imported: {e}"
    # With aio enabled in this process the export is aio's stand-in.
    builder = aio_ds._ds_builder if AsyncIOBuilder is aio_ds.AioAsyncIOBuilder else AsyncIOBuilder
    if builder is None or not builder().is_compatible(False):
        return "DeepSpeed's async_io op cannot be built here (needs libaio-dev)"
    return None


def torch_locks(folder: str) -> list[str]:
    """torch's build locks in `folder` (one per op being built, or killed mid-build)."""
    return sorted(glob.glob(os.path.join(folder, "*", "lock")))


def skip_if_locked(folder: str) -> None:
    """Skip the test rather than let torch wait on a lock in `folder` forever."""
    locks = torch_locks(folder)
    if locks:
        pytest.skip(
            f"{locks[0]} exists: a DeepSpeed op build into {folder} is running or was killed "
            "part-way, and every load of the op would wait on it; remove it if no build is running"
        )


@contextlib.contextmanager
def _claimed(folder: str, deadline: float) -> Iterator[None]:
    """Hold `folder`'s build claim (an flock, gone with its holder); skip
    when another session holds it past `deadline` (time.monotonic())."""
    fd = os.open(os.path.join(folder, CLAIM), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    pytest.skip(f"another test session is building DeepSpeed's async_io op into {folder}")
                time.sleep(0.5)
        yield
    finally:
        os.close(fd)  # releases the flock


def _run(program: str, folder: str, accelerator: str, timeout: float) -> tuple[int | None, str]:
    """Run `program` with TORCH_EXTENSIONS_DIR=`folder`; (exit status, output),
    status None when it ran past `timeout` and was killed with its children."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=folder, DS_ACCELERATOR=accelerator)
    p = subprocess.Popen(
        [sys.executable, "-c", program],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group: ninja and the compilers are killed with it
    )
    try:
        out, _ = p.communicate(timeout=max(timeout, 0.0))
    except BaseException as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            return None, out
        raise
    return p.returncode, out


def _libraries(folder: str) -> dict[str, float]:
    """The ops built in `folder`: each one's library and its mtime."""
    found = {}
    for path in glob.glob(os.path.join(folder, "*", "*.so")):
        with contextlib.suppress(FileNotFoundError):
            found[path] = os.stat(path).st_mtime
    return found


def prepare(accelerator: str, budget: float, program: str = LOAD) -> tuple[str, float, bool]:
    """Build (if needed, within `budget` seconds) and load DeepSpeed's op for
    `accelerator` in a subprocess; (its TORCH_EXTENSIONS_DIR, seconds taken,
    whether it was built). Skips the calling test when it is not ready."""
    start = time.monotonic()
    folder = ext_dir(accelerator)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    before = _libraries(folder)
    built = os.path.join(folder, SO) in before
    if not built and budget <= 0:
        pytest.skip(
            f"DeepSpeed's async_io op is not built in {folder} (its build takes minutes: 12 on "
            "2 cores); set AIO_TEST_DS_OP_BUILD_S=900 (or AIO_TEST_DS_OP=1) to build it, once per "
            "machine, or run python3 tests/integrations/ds_op.py"
        )
    limit = max(budget, LOAD_S) if built else budget
    with _claimed(folder, start + limit):
        skip_if_locked(folder)
        rc, out = _run(program, folder, accelerator, start + limit - time.monotonic())
        if rc is None:
            # Killed with its children: no build into this folder is running
            # (we hold its claim), so the locks there are the killed build's.
            for lock in torch_locks(folder):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
            pytest.skip(
                f"DeepSpeed's async_io op was not built within {limit:.0f} s (AIO_TEST_DS_OP_BUILD_S); "
                f"what was compiled is kept in {folder}, and the next build goes on from there"
            )
        if rc != 0:
            pytest.skip(f"DeepSpeed's async_io op did not build or load (exit status {rc}): {out[-1500:]}")
    return folder, time.monotonic() - start, _libraries(folder) != before


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    os.environ.setdefault("AIO_TEST_DS_OP_BUILD_S", "3600")
    try:
        where, seconds, built = prepare(which, build_budget_s())
    except pytest.skip.Exception as e:
        sys.exit(str(e))
    state = "built" if built else "already built"
    print(f"DeepSpeed's async_io op ({which}) {state} in {where}: {seconds:.0f} s")
