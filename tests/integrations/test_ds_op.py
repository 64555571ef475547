"""ds_op.prepare(), which gets DeepSpeed's own op ready for the tests that
compare with it, never lets a test wait on the op's build without a bound:
it builds in a subprocess within its own budget, kills it (compilers too) at
the budget and removes the lock it left, and skips, saying why, on a lock
it finds. Fake builds stand in for DeepSpeed's (minutes long); no DeepSpeed
needed."""

import fcntl
import os
import time

import pytest

from . import ds_op

# A stand-in build: torch's lock, a "compiler" child, then the library.
# argv-free: it reads TORCH_EXTENSIONS_DIR as DeepSpeed's build does.
FAKE_BUILD = """
import os, subprocess, sys, time
op = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "async_io")
os.makedirs(op, exist_ok=True)
open(os.path.join(op, "lock"), "w").close()
child = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
open(os.path.join(op, "compiler.pid"), "w").write(str(child.pid))
time.sleep({seconds})
open(os.path.join(op, "async_io.so"), "w").close()
os.unlink(os.path.join(op, "lock"))
child.kill()
with open(os.path.join(op, "runs"), "a") as f:
    f.write("run\\n")
"""


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("AIO_TEST_DS_OP_DIR", str(tmp_path))
    return tmp_path / "cpu"


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _prepare(budget, program):
    """ds_op.prepare(), where skipping would hide a failure."""
    try:
        return ds_op.prepare("cpu", budget, program)
    except pytest.skip.Exception as e:
        pytest.fail(f"skipped: {e}")


def test_build_within_budget_then_load(folder):
    where, seconds, built = _prepare(30, FAKE_BUILD.format(seconds=0))
    assert where == str(folder) and built and seconds < 30
    assert (folder / "async_io" / "async_io.so").exists() and ds_op.torch_locks(where) == []
    # Built: a later session loads it (a no-op here) with no budget.
    where, _, built = _prepare(0, "pass")
    assert where == str(folder) and not built


def test_not_built_and_no_budget_skips_without_building(folder):
    with pytest.raises(pytest.skip.Exception, match="not built in .*AIO_TEST_DS_OP_BUILD_S"):
        ds_op.prepare("cpu", 0, FAKE_BUILD.format(seconds=0))
    assert not (folder / "async_io").exists()


def test_build_past_its_budget_is_killed_with_its_children_and_its_lock_removed(folder):
    start = time.monotonic()
    with pytest.raises(pytest.skip.Exception, match="not built within 2 s"):
        ds_op.prepare("cpu", 2, FAKE_BUILD.format(seconds=60))
    assert time.monotonic() - start < 20
    assert ds_op.torch_locks(str(folder)) == []  # a later load does not wait on it
    compiler = int((folder / "async_io" / "compiler.pid").read_text())
    assert _gone(compiler)


def test_a_lock_left_by_someone_else_skips_instead_of_waiting(folder):
    (folder / "async_io").mkdir(parents=True)
    (folder / "async_io" / "lock").touch()
    start = time.monotonic()
    with pytest.raises(pytest.skip.Exception, match="lock exists: a DeepSpeed op build"):
        ds_op.prepare("cpu", 30, FAKE_BUILD.format(seconds=0))
    assert time.monotonic() - start < 5
    assert not (folder / "async_io" / "runs").exists()  # nothing ran
    with pytest.raises(pytest.skip.Exception, match="lock exists"):
        ds_op.skip_if_locked(str(folder))


def test_another_sessions_build_is_waited_for_within_the_budget(folder):
    folder.mkdir(parents=True)
    fd = os.open(folder / ds_op.CLAIM, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(pytest.skip.Exception, match="another test session is building"):
            ds_op.prepare("cpu", 1, FAKE_BUILD.format(seconds=0))
        assert time.monotonic() - start < 5
    finally:
        os.close(fd)


def test_a_failed_build_skips_with_its_output(folder):
    with pytest.raises(pytest.skip.Exception, match=r"exit status 1\): .*no compiler here"):
        ds_op.prepare("cpu", 30, "import sys; sys.exit('no compiler here')")
