"""One job per DeepSpeed swap folder (aio/integrations/ds_folder_lock.py):
a second process is refused before DeepSpeed deletes or rewrites anything."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install .[deepspeed])")

import torch  # noqa: E402

import aio.integrations.deepspeed as aio_ds  # noqa: E402
from aio.integrations import ds_folder_lock  # noqa: E402

_HOLDER = """
import sys
from aio.integrations.ds_folder_lock import hold
try:
    hold(sys.argv[1])
except OSError as e:
    print("refused", e.errno, e, flush=True)
    sys.exit(3)
print("held", flush=True)
sys.stdin.read()  # until the test closes it
"""


class Holder:
    """Another process holding (or refused) the lock of `folder`."""

    def __init__(self, folder: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, folder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.p.stdout is not None
        self.line = self.p.stdout.readline().strip()

    def close(self) -> int:
        assert self.p.stdin is not None
        self.p.stdin.close()
        return self.p.wait(timeout=30)


def test_held_once_per_process_refused_to_another_until_let_go(tmp_path) -> None:
    folder = str(tmp_path / "zero_stage_3" / "float32params" / "rank0")
    first, second = ds_folder_lock.hold(folder), ds_folder_lock.hold(folder)  # two swappers, one process
    other = Holder(folder)
    assert other.close() == 3 and other.line.startswith(f"refused {errno.EBUSY}"), other.line
    assert f"pid {os.getpid()}" in other.line and folder in other.line and "own nvme_path" in other.line
    first()
    first()  # idempotent: the other swapper still holds it
    other = Holder(folder)
    assert other.close() == 3, other.line
    second()
    assert not os.path.exists(ds_folder_lock.lock_path(folder))  # nothing left behind
    other = Holder(folder)
    assert other.line == "held"
    with pytest.raises(OSError) as ei:
        ds_folder_lock.hold(folder)
    assert ei.value.errno == errno.EBUSY and ei.value.filename == folder
    assert other.close() == 0
    ds_folder_lock.hold(folder)()  # free once its holder is gone (the kernel's lock)


def test_a_planted_symlink_is_not_followed(tmp_path) -> None:
    folder = str(tmp_path / "rank0")
    target = tmp_path / "victim"
    target.write_text("keep")
    os.symlink(target, ds_folder_lock.lock_path(folder))
    with pytest.raises(OSError) as ei:
        ds_folder_lock.hold(folder)
    assert ei.value.errno == errno.ELOOP
    assert target.read_text() == "keep"


@pytest.fixture
def enabled(monkeypatch):
    before = aio_ds.is_enabled()
    aio_ds.enable()
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    yield
    if not before:
        aio_ds.disable()


def test_deepspeeds_swappers_are_refused_before_they_touch_another_jobs_folder(tmp_path, enabled) -> None:
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    params = tmp_path / "zero_stage_3" / "float32params" / "rank0"
    optim = tmp_path / "zero_stage_3" / "optimizer" / "rank0"
    for folder in (params, optim):
        folder.mkdir(parents=True)
        (folder / "0_param.tensor.swp").write_text("the other job's")
    offload = SimpleNamespace(nvme_path=str(tmp_path), buffer_size=1024, buffer_count=2)
    aio_config = {"use_gds": False, "block_size": 1 << 20, "queue_depth": 8, "single_submit": False,
                  "overlap_events": True, "intra_op_parallelism": 1}  # fmt: skip
    cfg = SimpleNamespace(zero_config=SimpleNamespace(offload_param=offload), aio_config=aio_config)
    holders = [Holder(str(params)), Holder(str(optim))]
    try:
        assert [h.line for h in holders] == ["held", "held"]
        with pytest.raises(OSError, match="in use by another process") as ei:
            AsyncPartitionedParameterSwapper(cfg, torch.float32)  # DeepSpeed would rmtree the folder
        assert ei.value.errno == errno.EBUSY and ei.value.filename == str(params)
        with pytest.raises(OSError, match="in use by another process") as ei:
            DeepSpeedZeroOptimizer_Stage3._configure_tensor_swapping(SimpleNamespace(), offload, aio_config)
        assert ei.value.filename == str(optim)
        for folder in (params, optim):
            assert (folder / "0_param.tensor.swp").read_text() == "the other job's"
    finally:
        assert [h.close() for h in holders] == [0, 0]
    swapper = AsyncPartitionedParameterSwapper(cfg, torch.float32)  # its holder gone: taken
    assert swapper.swap_folder == str(params) and os.path.exists(ds_folder_lock.lock_path(str(params)))
