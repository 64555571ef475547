"""aio.zero.optimizer: one optimizer interface. Both backends implement every
member of the ZeroOptimizer protocol, and the trainer never asks which one it
has."""

import inspect

import pytest
import torch

import aio.zero.trainer
from aio import pinned
from aio.config import load_train_config
from aio.zero.memory_optimizer import MemoryOptimizer
from aio.zero.optimizer import ZeroOptimizer, make_optimizer
from aio.zero.swapped_optimizer import SwappedOptimizer

MEMBERS = sorted(n for n in vars(ZeroOptimizer) if not n.startswith("_")) + ["hyper"]


def _cfg(tmp_path, device):
    opt = {"device": device}
    if device == "nvme":
        opt.update(nvme_path=str(tmp_path), buffer_count=2)
    return load_train_config({"zero_optimization": {"stage": 3, "offload_optimizer": opt}})


@pytest.mark.parametrize("device,cls", [("cpu", MemoryOptimizer), ("nvme", SwappedOptimizer)])
def test_backend_implements_the_protocol(tmp_path, device, cls):
    opt = make_optimizer(_cfg(tmp_path, device), torch.optim.SGD, {"lr": 0.1})
    try:
        assert type(opt) is cls
        missing = [m for m in MEMBERS if not hasattr(opt, m)]
        assert not missing
        for m in MEMBERS:
            if m != "hyper":
                proto = inspect.signature(getattr(ZeroOptimizer, m))
                mine = inspect.signature(getattr(cls, m))
                assert list(proto.parameters) == list(mine.parameters)[: len(proto.parameters)], m
    finally:
        opt.close()


def test_trainer_never_asks_which_optimizer():
    src = inspect.getsource(aio.zero.trainer)
    assert "MemoryOptimizer" not in src and "OptimizerSwapper" not in src


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_gradient_accumulates_across_close_and_resume(tmp_path, device):
    opt = make_optimizer(_cfg(tmp_path, device), torch.optim.SGD, {"lr": 1.0})
    try:
        opt.register_subgroup(0, 4)
        opt.initialize(0, torch.zeros(4))
        buf = opt.open_gradient(0, 4, resume=False)
        assert torch.equal(buf.tensor, torch.zeros(4))
        buf.tensor.add_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        pending = opt.close_gradient(0, buf)
        if pending is not None:
            pending.wait()
        buf = opt.try_open_gradient(0, 4, resume=True)
        assert buf is not None and torch.equal(buf.tensor, torch.tensor([1.0, 2.0, 3.0, 4.0]))
        buf.tensor.add_(1.0)
        pending = opt.close_gradient(0, buf)
        if pending is not None:
            pending.wait()
        got = {}
        opt.step(after=lambda i, master: got.setdefault(i, master.clone()))
        assert torch.equal(got[0], -torch.tensor([2.0, 3.0, 4.0, 5.0]))  # SGD lr 1 from zeros
        opt.set_lr(0.5)
        assert opt.hyper["lr"] == 0.5
        assert (opt.io_bytes() > 0) == (device == "nvme")
    finally:
        opt.close()


def _nvme_opt_config(tmp_path, gradients):
    return load_train_config(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4},
            },
            "aio_zero": {"gradients": gradients},
        }
    )


def test_swapped_gradients_in_memory_cost_no_io_and_no_buffer(tmp_path):
    """aio_zero.gradients cpu (the default): every sub-group's gradient is open at
    once in memory, nothing is written for it, and the step reads only master
    weights (each fp32 sub-group tensor is whole blocks on the drive; before the
    first step the states are zeros, not read) and writes master and states;
    as it ends, the one buffer its last sub-group left free reads ahead the
    first tensor of the next step's second (sub-group 3: the order reverses)."""
    opt = make_optimizer(_nvme_opt_config(tmp_path, "cpu"), torch.optim.Adam, {"lr": 0.1})
    try:
        sizes = [3000 + i for i in range(5)]
        for i, n in enumerate(sizes):
            opt.register_subgroup(i, n)
            opt.initialize(i, torch.zeros(n))
        before = dict(opt.counters)
        bufs = [opt.try_open_gradient(i, n, resume=False) for i, n in enumerate(sizes)]
        for i, b in enumerate(bufs):
            assert b is not None and b.lease is None
            b.tensor.fill_(1.0)
            assert opt.close_gradient(i, b) is None
        assert opt.counters == before  # no gradient I/O
        opt.step()
        opt.drop_cached()  # write back what the step kept in its buffers
        per_tensor = [pinned.page_round(n * 4) for n in sizes]
        assert opt.counters["bytes_read"] - before["bytes_read"] == sum(per_tensor) + per_tensor[3]
        assert opt.counters["bytes_written"] - before["bytes_written"] == 3 * sum(per_tensor)
        b = opt.open_gradient(0, sizes[0], resume=True)
        assert torch.equal(b.tensor, torch.ones(sizes[0]))  # accumulation resumes in place
        opt.read_master(0)
    finally:
        opt.close()


def test_swapped_gradient_buffers_are_one_pool_slot_each(tmp_path):
    """aio_zero.gradients nvme: gradients are gathered in the optimizer's pool,
    one buffer (one tensor of the largest sub-group) per open sub-group; the
    step needs 2 + states of them."""
    cfg = _nvme_opt_config(tmp_path, "nvme")
    opt = make_optimizer(cfg, torch.optim.Adam, {"lr": 0.1})
    try:
        for i in range(5):
            opt.register_subgroup(i, 3000 + i)
            opt.initialize(i, torch.zeros(3000 + i))
        bufs = [opt.try_open_gradient(i, 3000 + i, resume=False) for i in range(4)]
        assert all(b is not None for b in bufs)
        assert opt.try_open_gradient(4, 3004, resume=False) is None  # all 4 in use
        for i, b in enumerate(bufs):
            b.tensor.fill_(1.0)
            opt.close_gradient(i, b).wait()
        b = opt.open_gradient(4, 3004, resume=False)
        opt.close_gradient(4, b).wait()
        opt.step()
        assert opt.pinned_bytes() == 4 * pinned.page_round(3004 * 4)
        assert opt.counters["cached_subgroups"] == 0
        assert opt.stats()["pinned_buffer_bytes"] == opt.pinned_bytes()
    finally:
        opt.close()


@pytest.mark.parametrize("gradients", ["cpu", "nvme"])
def test_gradient_slot_on_the_drive_only_with_gradients_there(tmp_path, gradients):
    """With gradients held in memory the swap file has no room for them (4 B
    per element less drive space), and writing one there is refused."""
    from aio.config import estimate_memory
    from aio.swap.storage import align_up

    cfg = load_train_config(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4},
            },
            "aio_zero": {"gradients": gradients},
        }
    )
    sizes = [1000, 5000]
    opt = make_optimizer(cfg, torch.optim.AdamW, {"lr": 1e-3}, gradients=gradients)
    try:
        for i, n in enumerate(sizes):
            opt.register_subgroup(i, n)
        slots = 1 if gradients == "nvme" else 0
        assert opt.stats()["drive_bytes"] == sum(align_up(4 * n) * (3 + slots) for n in sizes)
        if not slots:
            with pytest.raises(ValueError, match="holds gradients in memory"):
                opt.write_gradient(0, torch.zeros(1000))
    finally:
        opt.close()
    est = estimate_memory(cfg.offload, 10**6)
    full = sum(est.nvme.values())
    from aio.config.gradients import place_gradients

    est.add_gradients(place_gradients(cfg, 10**6, est.held_bytes))
    assert full - sum(est.nvme.values()) == (4 * 10**6 if gradients == "cpu" else 0)


def _slow_zeros(monkeypatch, made, gate):
    """long_lived_zeros that records each allocation and waits for `gate`."""
    import aio.zero.swapped_optimizer as so

    real = so.long_lived_zeros

    def slow(numel):
        gate.wait(timeout=30)
        made.append(numel)
        return real(numel)

    monkeypatch.setattr(so, "long_lived_zeros", slow)


def test_gradients_reserved_in_the_background_last_first_and_once(tmp_path, monkeypatch):
    """reserve_memory(background=True) allocates the gradients kept in memory
    in a thread, the last sub-groups' first; open_gradient() of one it has
    not reached allocates it itself, and none is allocated twice; step()
    waits for the thread."""
    import threading

    made, gate = [], threading.Event()
    _slow_zeros(monkeypatch, made, gate)
    opt = make_optimizer(_cfg(tmp_path, "nvme"), torch.optim.SGD, {"lr": 1.0})
    try:
        sizes = [4, 5, 6, 7]
        for i, n in enumerate(sizes):
            opt.register_subgroup(i, n)
            opt.initialize(i, torch.zeros(n))
        opt.reserve_memory(background=True)
        gate.set()
        buf = opt.open_gradient(0, 4, resume=False)  # reached last by the thread, maybe not yet
        buf.tensor.fill_(1.0)
        assert opt.close_gradient(0, buf) is None
        opt.wait_reserved()
        assert opt.pool.allocated  # the swap buffers after the gradients
        assert sorted(made) == sorted(sizes)  # each once
        assert made[0] == 7  # the last sub-group first
        for i, n in enumerate(sizes[1:], 1):
            opt.open_gradient(i, n, resume=False).tensor.fill_(2.0)
        opt.step()
        assert torch.equal(opt.read_master(0), torch.full((4,), -1.0))
        assert torch.equal(opt.read_master(3), torch.full((7,), -2.0))
    finally:
        opt.close()


def test_close_stops_the_background_reservation(tmp_path, monkeypatch):
    import threading

    made, gate = [], threading.Event()
    _slow_zeros(monkeypatch, made, gate)
    opt = make_optimizer(_cfg(tmp_path, "nvme"), torch.optim.SGD, {"lr": 1.0})
    for i in range(50):
        opt.register_subgroup(i, 1000)
    opt.reserve_memory(background=True)
    threads = [t for t in threading.enumerate() if t.name == "aio-reserve"]
    assert len(threads) == 1
    threading.Timer(0.2, gate.set).start()
    opt.close()  # stops the thread (at most the allocation under way ends), then frees the rest
    assert not threads[0].is_alive() and len(made) <= 1
