"""aio.zero.placement: every check before any allocation."""

import gc

import pytest
import torch

import aio.zero
from aio.config import ConfigError

from .common import cfg_for, drive_is_empty, gpt


@pytest.mark.parametrize(
    "mutate,key",
    [
        (lambda c: c["zero_optimization"].update(sub_group_size=100), "zero_optimization.sub_group_size"),
        (
            lambda c: c["zero_optimization"]["offload_param"].update(buffer_size=1000),
            "zero_optimization.offload_param.buffer_size",
        ),
        (lambda c: c["optimizer"].update(type="Lion"), "optimizer.type"),
        (lambda c: c["optimizer"]["params"].update(betaz=(0.9, 0.99)), "optimizer.params.betaz"),
        (lambda c: c["optimizer"]["params"].update(lr=-1), "optimizer.params"),
        (lambda c: c.update(bf16={"enabled": True}, fp16={"enabled": True}), "fp16.enabled"),
        (lambda c: c.update(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
        (lambda c: c.update(gradient_clipping="big"), "gradient_clipping"),
        (
            lambda c: c["zero_optimization"]["offload_param"].pop("nvme_path"),
            "zero_optimization.offload_param.nvme_path",
        ),
        (
            lambda c: c["zero_optimization"]["offload_optimizer"].update(bufer_count=2),
            "zero_optimization.offload_optimizer.bufer_count",
        ),
        (
            lambda c: c["zero_optimization"]["offload_optimizer"].update(buffer_count=2),
            "zero_optimization.offload_optimizer.buffer_count",
        ),
        (lambda c: c["zero_optimization"].update(stage=2), "zero_optimization.stage"),
        (
            lambda c: c["zero_optimization"]["offload_optimizer"].update(nvme_path="/nonexistent/drive"),
            "zero_optimization.offload_optimizer.nvme_path",
        ),
    ],
)
def test_bad_config_fails_before_any_allocation(tmp_path, mutate, key):
    from aio import pinned

    cfg = cfg_for(tmp_path / "drive")
    mutate(cfg)
    model = gpt()
    gc.collect()  # pinned memory of earlier tests goes now, not while we count
    before = pinned.locked_bytes()
    with pytest.raises(ConfigError) as ei:
        aio.zero.initialize(model, cfg)
    assert key in str(ei.value)
    assert drive_is_empty(tmp_path / "drive")
    assert pinned.locked_bytes() <= before  # nothing allocated (and kept)
    assert all(not hasattr(p, "aio_id") and p.numel() > 0 for p in model.parameters())
    if "sub_group_size" in key or "buffer_size" in key:
        return  # depends on the model: Init meets it when that parameter is created
    with pytest.raises(ConfigError):
        aio.zero.Init(cfg)
    assert drive_is_empty(tmp_path / "drive")


class _P:
    """A stand-in for an adopted parameter: its id and element count."""

    def __init__(self, aio_id, aio_numel):
        self.aio_id, self.aio_numel = aio_id, aio_numel


def test_sub_group_layout_packs_in_model_order():
    from aio.zero.placement import SubGroupLayout, pack_subgroups

    ps = [_P(i, n) for i, n in enumerate([30, 50, 20, 60, 10])]
    sizes = {str(i): p.aio_numel for i, p in enumerate(ps)}
    packed = pack_subgroups([(str(i), p) for i, p in enumerate(ps)], sizes, 100)
    assert [[p.aio_id for p in g] for g in packed] == [[0, 1, 2], [3, 4]]
    layout = SubGroupLayout(packed)
    assert layout.group_numel == [100, 70]
    assert [(s.group, s.offset, s.order) for s in layout.ordered()] == [
        (0, 0, 0),
        (0, 30, 1),
        (0, 80, 2),
        (1, 0, 3),
        (1, 60, 4),
    ]
    master = torch.empty(layout.group_numel[1])
    layout.fill_master(1, lambda p, out: (out.fill_(float(p.aio_id)), None)[1], master)
    assert master.tolist() == [3.0] * 60 + [4.0] * 10
    # bfloat16 parameters are put in the front of the buffer and widened there
    layout.fill_master(1, lambda p, out: (out.fill_(p.aio_id + 0.5), None)[1], master, dtype=torch.bfloat16)
    assert master.tolist() == [3.5] * 60 + [4.5] * 10


class _Read:
    """A finished read: its bytes, or its error."""

    def __init__(self, nbytes, exc=None):
        self.nbytes, self._exc, self.waits = nbytes, exc, 0

    def done(self):
        return True

    def exception(self, timeout=None):
        self.waits += 1
        return self._exc


def test_widened_reads_widen_once_after_every_read_and_keep_the_first_error():
    import errno
    import threading

    from aio.zero.placement import SubGroupLayout, WidenedReads, pack_subgroups

    ps = [_P(i, n) for i, n in enumerate([30, 50, 20])]
    sizes = {str(i): p.aio_numel for i, p in enumerate(ps)}
    layout = SubGroupLayout(pack_subgroups([(str(i), p) for i, p in enumerate(ps)], sizes, 100))
    master = torch.full((100,), 7.0)
    reads = []

    def start(p, out):
        out.fill_(p.aio_id + 0.5)  # what the read brings, as bfloat16
        reads.append(_Read(out.numel() * 2))
        return reads[-1]

    (fut,) = layout.start_widened_reads(0, start, master)
    assert isinstance(fut, WidenedReads) and fut.nbytes == 200 and fut.done()
    threads = [threading.Thread(target=fut.result) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert master.tolist() == [0.5] * 30 + [1.5] * 50 + [2.5] * 20  # widened once
    assert fut.result() == 200 and [r.waits for r in reads] == [1, 1, 1]
    bad = OSError(errno.EIO, "read failed")
    futs = [_Read(8), _Read(8, bad), _Read(8, OSError(errno.EIO, "later"))]
    failed = WidenedReads(futs, torch.zeros(8))
    assert failed.exception() is bad and [r.waits for r in futs] == [1, 1, 1]  # every read waited for
    with pytest.raises(OSError, match="read failed"):
        failed.result()
