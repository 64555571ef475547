"""aio.zero.scaler: fp16 loss scaling and clipping."""

import pytest

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


def _trajectory(consecutive, hysteresis, overflows, window=2):
    from aio.config.train import Fp16Config
    from aio.zero.scaler import LossScaler

    s = LossScaler(
        Fp16Config(
            enabled=True, loss_scale_window=window, hysteresis=hysteresis, consecutive_hysteresis=consecutive
        )
    )
    out = []
    for of in overflows:
        s.update(of)
        out.append((s.scale, s.hysteresis_left))
    return out


def test_dynamic_loss_scale_steps_as_deepspeeds():
    """DeepSpeed's DynamicLossScaler, step for step (window 2, initial 2**16):
    once the hysteresis is used up every overflow halves until the scale
    doubles again, which takes `window` clean steps before the doubling one;
    consecutive_hysteresis restores the hysteresis at every clean step."""
    o, c = True, False
    seq = [c, c, c, o, o, o, c, c, c, o, c, o]
    got = _trajectory(False, 2, seq)
    h = 2**16
    assert got == [
        (h, 2),
        (h, 2),
        (2 * h, 2),  # doubles at the third clean step (two before it)
        (2 * h, 1),
        (h, 1),
        (h / 2, 1),  # hysteresis used up: every overflow halves
        (h / 2, 1),
        (h / 2, 1),
        (h, 2),  # the doubling restores it
        (h, 1),
        (h, 1),
        (h / 2, 1),
    ]
    got = _trajectory(True, 2, seq)
    assert got[9:] == [(h, 1), (h, 2), (h, 1)]  # a clean step between overflows restores it


def test_dynamic_loss_scale_matches_deepspeed_on_random_overflows():
    pytest.importorskip("deepspeed")
    import random
    from unittest import mock

    import deepspeed.comm as dist
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    with mock.patch.object(dist, "get_rank", lambda: 1):  # its log lines need a process group
        for consecutive in (False, True):
            for hysteresis in (1, 2, 3):
                rng = random.Random(hysteresis)
                ds = DynamicLossScaler(2**16, 5, 1, hysteresis, consecutive, raise_error_at_min_scale=False)
                seq = [rng.random() < 0.25 for _ in range(400)]
                want = []
                for of in seq:
                    ds.update_scale(of)
                    want.append((ds.cur_scale, ds.cur_hysteresis))
                assert _trajectory(consecutive, hysteresis, seq, window=5) == want, (consecutive, hysteresis)
