"""aio.zero.grads: gradient buffers per sub-group."""

import pytest
import torch

import aio.zero

from .common import cfg_for, gpt, train_engine


def test_gradient_buffers_smaller_than_model_flush_and_read_back(tmp_path, reference):
    # Few optimizer buffers (AdamW's minimum: 4, one tensor each) and more
    # small sub-groups than that: backward has to write partly filled
    # gradient sub-groups out and read them back. (Was buffer_count 1 when a
    # buffer held a whole sub-group.)
    cfg = cfg_for(tmp_path, pipeline=False)
    cfg["zero_optimization"]["sub_group_size"] = 20_000
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 4
    with aio.zero.initialize(gpt(), cfg) as engine:
        assert train_engine(engine, 20) == reference


class _P:
    """A stand-in for an adopted parameter."""

    def __init__(self, aio_id, aio_numel):
        self.aio_id, self.aio_numel = aio_id, aio_numel


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_accumulator_with_one_buffer_flushes_and_reads_back(tmp_path, device):
    """Two sub-groups filled alternately through a single pinned buffer: the
    open one is written out to make room and read back to add to it; over two
    micro-steps the stored gradient is the sum."""
    from aio.config import load_train_config
    from aio.zero.grads import GradientAccumulator
    from aio.zero.optimizer import make_optimizer
    from aio.zero.placement import SubGroupLayout

    opt_blk = {"device": device}
    if device == "nvme":
        # SGD's minimum (gradient + master weights); one is held below, so
        # gradients get a single buffer.
        opt_blk.update(nvme_path=str(tmp_path), buffer_count=2)
    cfg = load_train_config({"zero_optimization": {"stage": 3, "offload_optimizer": opt_blk}})
    opt = make_optimizer(cfg, torch.optim.SGD, {"lr": 1.0})
    a, b, c = _P(0, 3), _P(1, 2), _P(2, 4)
    layout = SubGroupLayout([[a, b], [c]])
    held = None
    try:
        for gi, n in enumerate(layout.group_numel):
            opt.register_subgroup(gi, n)
            opt.initialize(gi, torch.zeros(n))
        if device == "nvme":
            held = opt.acquire_buffer()
        acc = GradientAccumulator(opt, layout, gas=2, record_norms=True)
        for micro in range(2):
            acc.add(a, torch.full((3,), 1.0 + micro))
            acc.add(c, torch.full((4,), 10.0 + micro))  # no buffer free: sub-group 0 goes out
            acc.add(b, torch.full((2,), 100.0 + micro))  # sub-group 0 read back
            acc.finish_backward()
            if micro == 0:
                acc.end_micro_step()
        acc.settle_writes()
        if held is not None:
            held.release()  # the step needs it
        assert len(acc.boundary_norms()) == 3
        got = {}
        opt.step(after=lambda i, m: got.setdefault(i, m.clone()))
        assert got[0].tolist() == [-3.0] * 3 + [-201.0] * 2
        assert got[1].tolist() == [-21.0] * 4
    finally:
        opt.close()
