"""aio.zero.params: parameters live in the store, placeholders between uses."""

import pytest
import torch

import aio.zero

from .common import V, W, cfg_for, gpt, loss_of, train_engine


def test_parameters_are_placeholders_between_uses(tmp_path):
    cfg = cfg_for(tmp_path)
    with aio.zero.initialize(gpt(), cfg) as engine:
        train_engine(engine, 2)
        for p in engine.module.parameters():
            assert p.numel() == 0 and p.aio_numel > 0
        sw = engine.store.swapper
        held = [part_id for part_id, n in engine.store.refs.items() if n > 0]
        assert held == []
        # Only prefetched (speculative) partitions may hold a buffer now.
        buffered = {part_id for part_id, part in sw.parts.items() if part.lease is not None}
        assert buffered <= set(engine.store.speculative)
        # The full model is readable on demand.
        sd = engine.state_dict()
        assert (
            sd["wte.weight"].shape == (V, W) and sd["head.weight"].data_ptr() != sd["wte.weight"].data_ptr()
        )
        assert torch.equal(sd["head.weight"], sd["wte.weight"])


def test_too_few_parameter_buffers_is_a_clear_error(tmp_path):
    cfg = cfg_for(tmp_path, gas=1)
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = 1  # qkv needs weight and bias at once
    with aio.zero.initialize(gpt(), cfg) as engine:
        with pytest.raises(aio.swap.PoolExhaustedError, match="buffer_count"):
            loss_of(engine, 0, 0)
