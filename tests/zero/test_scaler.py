"""aio.zero.scaler: fp16 loss scaling and clipping."""

import aio.zero

from .common import cfg_for, gpt, train_engine, train_in_memory


def test_fp16_static_loss_scale_tracks_fp32(tmp_path, reference):
    # fp16 has 11 significand bits (finer than bf16) but a narrow range: a
    # static scale of 128 keeps these gradients in range. Same 1% bound.
    cfg = cfg_for(tmp_path, fp16={"enabled": True, "loss_scale": 128})
    with aio.zero.initialize(gpt(), cfg) as engine:
        got = train_engine(engine, 20)
        assert engine.stats()["skipped_steps"] == 0
    for a, b in zip(got, reference, strict=True):
        assert abs(a - b) <= 0.01 * abs(b), (got, reference)


def test_fp16_dynamic_loss_scale_skips_overflowing_steps(tmp_path):
    # 2**24 overflows fp16 gradients here: those steps change nothing and
    # halve the scale (hysteresis 1) until steps go through.
    cfg = cfg_for(tmp_path, gas=1, fp16={"enabled": True, "initial_scale_power": 24, "hysteresis": 1})
    with aio.zero.initialize(gpt(), cfg) as engine:
        losses = train_engine(engine, 16, gas=1)
        st = engine.stats()
    assert 0 < st["skipped_steps"] < 16 and st["global_steps"] == 16  # skipped ones count, as in DeepSpeed
    assert st["loss_scale"] == 2 ** (24 - st["skipped_steps"])
    # Skipped steps leave the weights alone: the same batch gives the same loss.
    untouched = train_in_memory(1, gas=1, clip=0)
    assert abs(losses[0] - untouched[0]) < 1e-2
