"""aio.fsdp's checks, one process: the torch version gate and bad arguments
fail with clear typed errors before anything is written."""

from __future__ import annotations

import pytest
import torch

import aio.fsdp
from aio.fsdp import SUPPORTED, TierError, UnsupportedTorchError, offload_params


def test_an_untested_torch_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(torch, "__version__", "2.12.1+cpu")
    with pytest.raises(UnsupportedTorchError, match=r"2\.13, 2\.14"):
        offload_params(torch.nn.Linear(2, 2), str(tmp_path))
    assert not list(tmp_path.iterdir())


def test_an_untested_torch_runs_when_the_user_opts_in(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog
) -> None:
    from aio.fsdp import _internals

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(_internals, "_warned", set())
    monkeypatch.setenv("AIO_FSDP_UNTESTED_TORCH", "1")
    with caplog.at_level("WARNING", logger="aio"):
        _internals.check_torch()
        _internals.check_torch()
    said = [r.getMessage() for r in caplog.records if "AIO_FSDP_UNTESTED_TORCH=1" in r.getMessage()]
    assert len(said) == 1 and "2.11.0+cu130" in said[0]  # once per process
    # Past the gate, the model's own checks still run (not fully_shard-ed here).
    with pytest.raises(TierError, match="apply fully_shard first"):
        offload_params(torch.nn.Linear(2, 2), str(tmp_path))
    monkeypatch.setenv("AIO_FSDP_UNTESTED_TORCH", "yes")
    with pytest.raises(ValueError, match="AIO_FSDP_UNTESTED_TORCH='yes'"):
        _internals.check_torch()
    monkeypatch.setenv("AIO_FSDP_UNTESTED_TORCH", "0")
    with pytest.raises(UnsupportedTorchError, match="AIO_FSDP_UNTESTED_TORCH=1"):
        _internals.check_torch()


def test_supported_versions_are_the_tested_ones() -> None:
    assert SUPPORTED == ((2, 13), (2, 14))


def test_a_model_without_fully_shard_is_refused(tmp_path) -> None:
    try:
        aio.fsdp.tier.check_torch()
    except UnsupportedTorchError:
        pytest.skip("torch version not supported by the tier")
    with pytest.raises(TierError, match="apply fully_shard first"):
        offload_params(torch.nn.Linear(2, 2), str(tmp_path))


@pytest.mark.parametrize("window", [0, -1, 1.5, True])
def test_bad_window(window, tmp_path) -> None:
    with pytest.raises(ValueError, match="window"):
        offload_params(torch.nn.Linear(2, 2), str(tmp_path), window=window)


@pytest.mark.parametrize(
    "kw",
    [
        {"nvme_path": 5},
        {"optimizer": []},
        {"aio": "fast"},
        {"pin_memory": "yes"},
        {"params_from_master": "no"},
        {"empty_shards": 1},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_a_bad_argument_type_is_a_type_error_naming_it(kw, tmp_path) -> None:
    # Before: pybind's or list()'s own errors, not naming the argument, some after changes.
    name = next(iter(kw))
    args = {"nvme_path": str(tmp_path), **kw}
    with pytest.raises(TypeError, match=f"offload_params: {name} must be"):
        offload_params(torch.nn.Linear(2, 2), **args)
    assert not list(tmp_path.iterdir())


@pytest.fixture
def one_rank(gloo_world_one):
    """One gloo rank in this process (tests/conftest.py)."""


def _one_rank_model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3))
    fully_shard(model[0])
    return fully_shard(model)


def _train_one_rank(model, opt, steps=3, sched=None) -> list[torch.Tensor]:
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.detach())
    return losses


def test_one_rank_bit_identical_and_one_tier_per_model(one_rank, tmp_path) -> None:
    # One rank: FSDP copies the shard in wait_for_unshard, not in an all-gather.
    ref = _one_rank_model()
    want = _train_one_rank(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False))
    model = _one_rank_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    tier = offload_params(model, str(tmp_path), opt)
    try:
        got = _train_one_rank(model, opt)
        assert tier.resident_bytes() == 0 and tier.stats()["sync_fetches"] == 0
        with pytest.raises(TierError, match="already has a parameter tier"):
            offload_params(model, str(tmp_path), opt)
    finally:
        tier.close()
    assert all(map(torch.equal, want, got))
    pairs = zip(ref.parameters(), model.parameters(), strict=True)
    assert all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in pairs)


def test_a_failed_offload_params_leaves_the_model_as_it_was(one_rank, tmp_path, monkeypatch) -> None:
    """offload_params failing part-way through its hooks (here: the
    optimizer's step wrapper) takes off what it put on: the model trains as
    without it, takes a tier again, and resident() after close() is a
    TierError. Before: a half-tiered model, unusable until rebuilt."""
    from aio.fsdp.tier import ParamTier

    ref = _one_rank_model()
    want = _train_one_rank(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False))
    model = _one_rank_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

    def refuse(self, _opt):
        raise RuntimeError("injected: the step wrapper")

    with monkeypatch.context() as m:
        m.setattr(ParamTier, "_wrap_step", refuse)
        with pytest.raises(RuntimeError, match="injected"):
            offload_params(model, str(tmp_path), opt)
    assert not list(tmp_path.glob("aio-swap-*/*"))
    got = _train_one_rank(model, opt)
    assert all(map(torch.equal, want, got))
    tier = offload_params(model, str(tmp_path), opt)
    tier.close()
    with pytest.raises(TierError, match="after close"):
        with tier.resident():
            pass


def test_ops_on_stand_ins_leave_no_reference_cycles(one_rank, tmp_path) -> None:
    """An op between steps served through a shard's stand-in must free its
    arguments when it returns: a reference cycle kept each one's (at the
    3.2B set-up, a whole layer) until the next full collection."""
    import gc

    model = _one_rank_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    tier = offload_params(model, str(tmp_path), opt)
    try:
        _train_one_rank(model, opt, steps=1)
        w = model[0].weight.to_local()  # a stand-in between steps
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage
        try:
            for _ in range(5):
                w.view(-1).mul(2.0)  # a view (a stand-in replaying it), then a read through it
            gc.collect()
            cyclic = [o for o in gc.garbage if isinstance(o, torch.Tensor) or type(o).__name__ == "function"]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert cyclic == []
    finally:
        tier.close()


def test_an_lr_scheduler_built_after_offload_params(one_rank, tmp_path) -> None:
    """offload_params wraps opt.step; a torch LR scheduler built afterwards
    wraps it again through ``opt.step.__func__``, which a plain function
    lacks (AttributeError): the tier's wrapper is a bound method, and the
    scheduled training is torch's, bit for bit."""

    def scheduled(model, opt) -> list[torch.Tensor]:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
        return _train_one_rank(model, opt, sched=sched)

    ref = _one_rank_model()
    want = scheduled(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False))
    model = _one_rank_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    tier = offload_params(model, str(tmp_path), opt)
    try:
        got = scheduled(model, opt)
    finally:
        tier.close()
    assert all(map(torch.equal, want, got))
