"""enable()/disable(), the version guard, and the no-code-change paths."""

import os
import subprocess
import sys
import textwrap

import pytest

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install .[deepspeed])")

import aio.integrations.deepspeed as aio_ds  # noqa: E402

ENV = dict(os.environ, DS_ACCELERATOR="cpu")


def test_enable_routes_every_swapper_to_aio():
    from deepspeed.runtime.swap_tensor import (
        partitioned_optimizer_swapper,
        partitioned_param_swapper,
        pipelined_optimizer_swapper,
    )

    aio_ds.enable()
    aio_ds.enable()  # idempotent
    try:
        for mod in (
            partitioned_param_swapper,
            partitioned_optimizer_swapper,
            pipelined_optimizer_swapper,
        ):
            assert mod.AsyncIOBuilder is aio_ds.AioAsyncIOBuilder, mod.__name__
        from deepspeed.ops.op_builder import AsyncIOBuilder

        h = (
            AsyncIOBuilder()
            .load(verbose=False)
            .aio_handle(
                block_size=262144,
                queue_depth=8,
                single_submit=False,
                overlap_events=True,
                intra_op_parallelism=2,
            )
        )
        assert isinstance(h, aio_ds.DeepSpeedAioHandle) and h.get_thread_count() == 2
        from deepspeed.accelerator import get_accelerator

        assert get_accelerator().get_op_builder("AsyncIOBuilder") is aio_ds.AioAsyncIOBuilder
        assert aio_ds.is_enabled()
        from deepspeed.runtime.engine import DeepSpeedEngine

        assert getattr(DeepSpeedEngine.load_checkpoint, "_aio_wrapped", False)  # checkpoint repair
    finally:
        aio_ds.disable()
    assert not aio_ds.is_enabled()
    assert not getattr(DeepSpeedEngine.load_checkpoint, "_aio_wrapped", False)
    assert partitioned_param_swapper.AsyncIOBuilder is not aio_ds.AioAsyncIOBuilder


def test_unsupported_version_is_refused(monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", "0.18.4")
    with pytest.raises(RuntimeError, match=r"deepspeed>=0.19,<0.20; found deepspeed 0.18.4"):
        aio_ds.enable()
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with pytest.raises(RuntimeError, match="supports"):
        aio_ds.enable()
    assert not aio_ds.is_enabled()


CHECK = textwrap.dedent(
    """
    from deepspeed.runtime.swap_tensor import partitioned_param_swapper as p
    import aio.integrations.deepspeed as d
    print("ENABLED" if p.AsyncIOBuilder is d.AioAsyncIOBuilder else "NOT-ENABLED")
    """
)


def test_env_var_at_import(tmp_path):
    code = "import aio\n" + CHECK
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(ENV, AIO_DEEPSPEED="1"),
    )
    assert "ENABLED" in r.stdout and "NOT-ENABLED" not in r.stdout, r.stderr[-2000:]


def test_run_module_wrapper_enables_for_a_plain_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys\n" + CHECK + "print('ARGS', sys.argv[1:])\n")
    r = subprocess.run(
        [sys.executable, "-m", "aio.run", str(script), "--lr", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ENABLED" in r.stdout and "ARGS ['--lr', '3']" in r.stdout


def test_enable_and_first_io_each_log_one_info_line(caplog, tmp_path):
    import logging

    import torch

    from aio import _log

    _log._reset_for_tests()
    caplog.set_level(logging.INFO, logger="aio")
    aio_ds.disable()
    try:
        aio_ds.enable()
        aio_ds.enable()  # already enabled: no second line
        (rec,) = [r for r in caplog.records if r.name == "aio.deepspeed"]
        assert rec.levelno == logging.INFO
        assert "async_io op served by aio (engine " in rec.getMessage()
        assert deepspeed.__version__ in rec.getMessage()
        from deepspeed.ops.op_builder import AsyncIOBuilder

        h = AsyncIOBuilder().load(verbose=False).aio_handle(block_size=8192, queue_depth=3)
        folder = tmp_path / "swap"
        folder.mkdir()
        buf = h.new_cpu_locked_tensor(4096, torch.empty(0))
        assert h.async_pwrite(buf, str(folder / "a.swp"), 0) == 0 and h.wait() == 1
        assert h.sync_pread(buf, str(folder / "a.swp"), 0) == 1
        (swap,) = [r for r in caplog.records if r.name == "aio.swap"]
        msg = swap.getMessage()
        assert "block_size 8192" in msg and "queue_depth 3" in msg and str(folder) in msg
    finally:
        aio_ds.disable()
        _log._reset_for_tests()


def test_disable_also_restores_modules_imported_while_enabled():
    """A DeepSpeed module imported after enable() binds aio's builder from the
    patched op_builder; disable() gives it DeepSpeed's class back."""
    code = textwrap.dedent(
        """
        import sys
        import aio.integrations.deepspeed as d
        d.enable()
        assert "deepspeed.nvme.torch_fastio_engine" not in sys.modules
        import deepspeed.nvme.torch_fastio_engine as fe
        print("WHILE", fe.AsyncIOBuilder is d.AioAsyncIOBuilder)
        d.disable()
        from deepspeed.ops.op_builder import AsyncIOBuilder
        print("AFTER", fe.AsyncIOBuilder is AsyncIOBuilder, d.is_enabled())
        d.enable()
        print("AGAIN", fe.AsyncIOBuilder is d.AioAsyncIOBuilder)
        d.disable()
        print("UNDONE", fe.AsyncIOBuilder is AsyncIOBuilder)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [x for x in r.stdout.splitlines() if x.split(" ")[0] in ("WHILE", "AFTER", "AGAIN", "UNDONE")]
    assert lines == ["WHILE True", "AFTER True False", "AGAIN True", "UNDONE True"]
