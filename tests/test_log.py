"""aio's logging: the logger tree, and one swap line per process."""

import logging
import os
import subprocess
import sys

import pytest

import aio
from aio import _log

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def fresh_process_state():
    _log._reset_for_tests()
    yield
    _log._reset_for_tests()


def swap_records(caplog):
    return [r for r in caplog.records if r.name == "aio.swap"]


def test_package_adds_no_handlers():
    assert logging.getLogger("aio").handlers == []


def test_swap_line_once_per_process(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="aio")
    with aio.AsyncIOHandle(block_size=65536, queue_depth=4, thread_count=2) as h:
        assert _log.swap_line_pending()
        _log.log_swap_handle(h, str(tmp_path))
        _log.log_swap_handle(h, "/elsewhere")
        assert not _log.swap_line_pending()
        engine = h.engine
    (rec,) = swap_records(caplog)
    assert rec.levelno == logging.INFO
    msg = rec.getMessage()
    for part in (f"engine {engine}", "block_size 65536", "queue_depth 4", "thread_count 2", str(tmp_path)):
        assert part in msg


def test_param_swapper_logs_its_folder(caplog, tmp_path):
    from aio.swap.param import ParamSwapper

    caplog.set_level(logging.INFO, logger="aio")
    s1 = ParamSwapper(str(tmp_path), dtype=torch.float32, buffer_count=1, buffer_size=1024)
    s2 = ParamSwapper(str(tmp_path), dtype=torch.float32, buffer_count=1, buffer_size=1024)
    try:
        (rec,) = swap_records(caplog)  # the second swapper logs nothing
        assert s1.space.dirs[0] in rec.getMessage()
    finally:
        s1.close()
        s2.close()


def test_forked_child_logs_its_own_line(tmp_path):
    code = (
        "import logging, os, sys, aio\n"
        "from aio import _log\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(process)d %(message)s')\n"
        "h = aio.AsyncIOHandle()\n"
        "_log.log_swap_handle(h, 'parent')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    _log.log_swap_handle(aio.AsyncIOHandle(), 'child')\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "_log.log_swap_handle(h, 'parent again')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(aio.__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if "swap I/O" in ln]
    assert len(lines) == 2 and lines[0].endswith("parent") and lines[1].endswith("child"), r.stdout
