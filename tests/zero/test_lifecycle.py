"""aio.zero under failures and at exit: I/O errors surface as OSError with
errno, nothing reads as valid that is not, a checkpoint restores a usable
state, and a process that exits mid-training leaves no swap files."""

import errno
import os
import subprocess
import sys

import pytest

import aio.zero
from aio.swap import SwapStateError

from .common import cfg_for, gpt, loss_of, train_engine

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _micro(engine, step, micro):

    engine.backward(loss_of(engine, step, micro))
    engine.step()


def test_gradient_write_error_drops_the_step_and_loses_nothing(tmp_path, reference):  # noqa: F811
    # Gradients written to the drive (aio_zero.gradients: nvme); held in memory, none are written.
    with aio.zero.initialize(gpt(), cfg_for(tmp_path, aio_zero={"gradients": "nvme"})) as engine:
        first = train_engine(engine, 5)
        engine.opt.space.drives[0].writer._c.inject_fault("error", errno.EIO, "write", 1, 1)
        with pytest.raises(OSError) as ei:
            _micro(engine, 5, 0)
            _micro(engine, 5, 1)
        assert ei.value.errno == errno.EIO and "optimizer.swp" in str(ei.value.filename)
        engine.opt.space.drives[0].writer._c.clear_fault()
        st = engine.stats()
        assert st["abandoned_windows"] == 1 and st["global_steps"] == 5 and st["micro_steps"] == 10
        assert engine.opt.pool.available() == engine.opt.pool.count  # no buffer leaked
        # The optimizer never saw the lost gradients: redoing step 5 continues exactly.
        rest = train_engine(engine, 15, start=5)
    assert first + rest == reference


def test_optimizer_write_error_poisons_until_checkpoint_restore(tmp_path, reference):  # noqa: F811
    ckpt = str(tmp_path / "ck")
    # 4 buffers: one sub-group's, so every step writes back what it steps.
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "d", pipeline=False)) as engine:
        first = train_engine(engine, 5)
        engine.save_checkpoint(ckpt)
        engine.backward(loss_of_step(engine, 5, 0))
        engine.step()
        engine.backward(loss_of_step(engine, 5, 1))
        engine._settle_writes()  # gradient writes done; the next write is the step's
        engine.opt.space.drives[0].writer._c.inject_fault("error", errno.ENOSPC, "write", 1, 1)
        with pytest.raises(OSError) as ei:
            engine.step()
        assert ei.value.errno == errno.ENOSPC
        engine.opt.space.drives[0].writer._c.clear_fault()
        # The optimizer state is partly stepped, and so are the master weights the
        # parameters are read from: both refuse rather than continue wrongly.
        assert engine.mirrored == 0 and engine.store.stats()["by_state"]["invalid"] > 0
        with pytest.raises(SwapStateError, match="partly updated|invalid"):
            train_engine(engine, 1, start=5)
        engine.load_checkpoint(ckpt)
        assert engine.mirrored > 0
        rest = train_engine(engine, 15, start=5)
    assert first + rest == reference


def test_kept_state_write_back_error_poisons_until_checkpoint_restore(tmp_path, reference):  # noqa: F811
    """With every sub-group's state kept in buffers across steps (enough of
    them), nothing is written in a step; a failed write when the state is
    written back (here: saving a checkpoint) fails loudly and refuses further
    steps until a checkpoint is loaded."""
    ckpt = str(tmp_path / "ck")
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "d")) as engine:
        first = train_engine(engine, 5)
        engine.save_checkpoint(ckpt)
        assert train_engine(engine, 1, start=5) == reference[5:6]
        assert engine.stats()["optimizer"]["cached_subgroups"] > 0
        engine.opt.space.drives[0].writer._c.inject_fault("error", errno.ENOSPC, "write", 1, 1)
        with pytest.raises(OSError) as ei:
            engine.save_checkpoint(str(tmp_path / "ck2"))
        assert ei.value.errno == errno.ENOSPC
        engine.opt.space.drives[0].writer._c.clear_fault()
        assert not any((tmp_path / "ck2").iterdir())  # no partial checkpoint left
        with pytest.raises(SwapStateError, match="incomplete"):
            train_engine(engine, 1, start=6)
        engine.load_checkpoint(ckpt)
        rest = train_engine(engine, 15, start=5)
    assert first + rest == reference


def loss_of_step(engine, step, micro):

    return loss_of(engine, step, micro)


@pytest.mark.parametrize("from_master", [False, True])
def test_parameter_read_error_names_the_file(tmp_path, from_master):
    # float32 parameters are read from the optimizer's master weights by default.
    cfg = cfg_for(tmp_path, gas=1, aio_zero={"params_from_master": from_master})
    with aio.zero.initialize(gpt(), cfg) as engine:
        train_engine(engine, 1, gas=1)
        space = engine.opt.space if from_master else engine.store.swapper.space
        assert engine.store.stats()["aliased"] == engine.mirrored and (engine.mirrored > 0) == from_master
        space.drives[0].reader._c.inject_fault("error", errno.EIO, "read", 1, 1)
        with pytest.raises(OSError) as ei:
            for _ in range(3):  # prefetched buffers may serve the first modules
                train_engine(engine, 1, gas=1)
        file = "optimizer.swp" if from_master else "params.swp"
        assert ei.value.errno == errno.EIO and file in str(ei.value.filename)
        space.drives[0].reader._c.clear_fault()


def test_exit_mid_training_leaves_no_swap_files(tmp_path):
    drive = tmp_path / "drive"
    drive.mkdir()
    code = f"""
import torch, aio.zero
from aio.train import build_gpt, batch
cfg = {cfg_for(drive)!r}
torch.manual_seed(0)
with aio.zero.Init(cfg):
    model = build_gpt(64, 64, 2, 2, 8)
engine = aio.zero.initialize(model, cfg)
x, y = batch(0, 0, 2, 8, 64)
loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), y.flatten())
engine.backward(loss)   # gradient writes in flight, never stepped, never closed
print("swap", sorted(os.listdir({str(drive)!r} + f"/aio-swap-{{os.geteuid()}}")))
"""
    r = subprocess.run(
        [sys.executable, "-c", "import os\n" + code], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "param" in r.stdout and "optimizer" in r.stdout
    left = [os.path.join(d, f) for d, _, fs in os.walk(drive) for f in fs]
    assert left == [], left


def _host_region_bytes(sim):
    """Bytes the simulator counts page-locked, less its own pinned
    allocations (the staging rings), which it keeps to the end."""
    kept = sum(t.numel() for t in sim.keep_pinned)
    return sum(hi - lo for lo, hi in sim.host_regions) - kept


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_close_frees_the_pinned_buffers_without_the_collector(tmp_path, device, no_garbage):
    """close() gives the page-locked swap buffers back at once. A process
    that builds engines one after another (a hyper-parameter search, a
    notebook) held each closed engine's pinned memory until Python's
    collector broke the engine's reference cycles, so the next engine could
    meet RLIMIT_MEMLOCK or run out of memory; a GPU job kept its buffers
    registered with the device."""
    import contextlib
    import gc

    from .cuda_sim import CudaSim
    from .test_gpu_sim import train_on_device

    gc.disable()  # the collector must not be what frees them
    try:
        with CudaSim(scheduler="lazy") if device == "cuda" else contextlib.nullcontext() as sim:
            before = aio.locked_bytes() if sim is None else _host_region_bytes(sim)
            engine = aio.zero.initialize(gpt(), cfg_for(tmp_path), device=device)
            if sim is None:
                train_engine(engine, 2)
            else:
                train_on_device(engine, 2)
            assert engine.pinned_bytes() > 0
            engine.close()
            assert engine.pinned_bytes() == 0
            assert (aio.locked_bytes() if sim is None else _host_region_bytes(sim)) == before
    finally:
        gc.enable()


def test_an_interrupted_close_frees_no_buffer_a_device_copy_still_reads(tmp_path, monkeypatch):
    """A second Ctrl-C while close() waits for the uploads: the device copies
    still queued from the parameter swap buffers run before those buffers
    are let go (freed and unregistered at once since close() frees them)."""
    import weakref

    from aio.zero.uploads import Uploads

    from .cuda_sim import CudaSim

    queued_when_freed = []
    with CudaSim(scheduler="lazy") as sim:
        engine = aio.zero.initialize(gpt(), cfg_for(tmp_path), device="cuda")
        drive_ids = set(engine.store.on_drive_part_ids(engine.module.parameters()))
        on_drive = [p for p in engine.module.parameters() if p.aio_id in drive_ids][:3]
        engine.store.acquire(on_drive)  # uploads queued on the side stream, not run (lazy)
        assert sum(len(s.queue) for s in sim.streams) > 0
        pool = engine.store.swapper.pool._pool
        weakref.finalize(pool, lambda: queued_when_freed.append(sum(len(s.queue) for s in sim.streams)))
        del pool

        def interrupted(self):
            raise KeyboardInterrupt("a second Ctrl-C")

        monkeypatch.setattr(Uploads, "close", interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.close()
        assert queued_when_freed == [0]


@pytest.mark.parametrize(
    "opt,groups",
    [("nvme", "one"), ("cpu", "one"), ("cpu", "several")],
    ids=["swapped", "memory", "memory-mid"],
)
def test_a_parameter_write_failing_after_the_update_counts_the_step_once(tmp_path, reference, opt, groups):  # noqa: F811
    """The optimizer has stepped when a sub-group's parameter writes fail (or
    a Ctrl-C ends the wait for them): after the last sub-group's, or (the
    optimizer in memory, which updates every sub-group first) after the
    first of several. The step counts, its gradients are spent (step() again
    without a backward() is refused: the same gradients never apply twice),
    the parameter that was not stored refuses to be read, and a checkpoint
    restores exact training."""
    ckpt = str(tmp_path / "ck")
    not_mirrored = {"params_from_master": False}  # parameters written back by every step
    cfg = cfg_for(tmp_path / "d", opt=opt, aio_zero=not_mirrored)
    if groups == "one":
        cfg["zero_optimization"]["sub_group_size"] = 10**9  # its writes end the step
    with aio.zero.initialize(gpt(), cfg) as engine:
        assert (len(engine.layout.groups) > 1) == (groups == "several")
        first = train_engine(engine, 5)
        engine.save_checkpoint(ckpt)
        engine.backward(loss_of(engine, 5, 0))
        engine.step()
        engine.backward(loss_of(engine, 5, 1))
        engine._settle_writes()
        writer = engine.store.swapper.space.drives[0].writer._c
        writer.inject_fault("error", errno.EIO, "write", 1, 1)
        with pytest.raises(SwapStateError, match="writing partition") as ei:
            engine.step()
        writer.clear_fault()
        cause = ei.value.__cause__
        assert isinstance(cause, OSError) and cause.errno == errno.EIO and "params.swp" in str(cause.filename)
        assert engine.stats()["global_steps"] == 6 == engine.opt.steps
        for _ in range(engine.gas - 1):
            engine.step()  # a window's micro-steps with no backward
        with pytest.raises(RuntimeError, match="without a backward"):
            engine.step()
        assert engine.opt.steps == 6  # not stepped again on the same gradients
        with pytest.raises(SwapStateError, match="invalid"):
            loss_of(engine, 6, 0)
        engine.load_checkpoint(ckpt)
        rest = train_engine(engine, 15, start=5)
    assert first + rest == reference


def test_close_closes_the_parameter_store_when_the_optimizer_close_fails(tmp_path, monkeypatch):
    """close() runs once: an error closing the optimizer (its swap folder
    not removable, say) is raised after the parameter store is closed too,
    its buffers freed and its folder removed, not left to the collector."""
    engine = aio.zero.initialize(gpt(), cfg_for(tmp_path))
    train_engine(engine, 1)
    param_dir = engine.store.swapper.space.dirs[0]

    def fails():
        raise PermissionError(errno.EACCES, "cannot remove the swap folder")

    monkeypatch.setattr(engine.opt.space, "close", fails)
    with pytest.raises(PermissionError):
        engine.close()
    assert engine.store.closed and engine.store.swapper.pool.closed
    assert not os.path.exists(param_dir)
    engine.close()  # idempotent
    monkeypatch.undo()
    engine.opt.space.close()  # what the failed close left
