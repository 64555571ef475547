"""aio.zero.init_guard: what construction code does to stored parameters
inside ``Init`` happens to their real values, and views handed out stay
valid until the outermost module is built."""

import pytest
import torch

import aio.zero
from aio.swap import PoolExhaustedError


def _cfg(drive, buffers=4):
    return {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(drive),
                "buffer_count": buffers,
                "buffer_size": 4096,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "cpu"},
        }
    }


def _stored(init, p):
    return init.store.read(p).view(p.aio_shape)


def test_data_aliases_stay_valid_while_others_are_fetched(tmp_path):
    with aio.zero.Init(_cfg(tmp_path)) as init:
        ls = [torch.nn.Linear(8, 8, bias=False) for _ in range(3)]
        aliases = [m.weight.data for m in ls]  # three of four buffers held
        torch.nn.init.ones_(torch.nn.Linear(8, 8, bias=False).weight)  # the fourth comes and goes
        aliases[0].fill_(7.0)
    assert torch.equal(_stored(init, ls[0].weight), torch.full((8, 8), 7.0))
    assert not torch.equal(_stored(init, ls[1].weight), torch.full((8, 8), 7.0))


def test_view_taken_in_a_parent_survives_a_child_being_built(tmp_path):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            w = self.a.weight.data  # a view of a stored parameter
            self.b = torch.nn.Linear(8, 8)  # a module finishing its build in between
            w.fill_(5.0)

    with aio.zero.Init(_cfg(tmp_path)) as init:
        net = Net()
    assert torch.equal(_stored(init, net.a.weight), torch.full((8, 8), 5.0))


def test_assigning_data_stores_the_values(tmp_path):
    with aio.zero.Init(_cfg(tmp_path)) as init:
        m = torch.nn.Linear(4, 4)
        m.weight.data = torch.full((4, 4), 3.0)
        assert m.weight.shape == (4, 4) and bool((m.weight == 3.0).all())
    assert torch.equal(_stored(init, m.weight), torch.full((4, 4), 3.0))


def test_running_out_of_buffers_is_loud_and_leaves_nothing_fetched(tmp_path):
    with aio.zero.Init(_cfg(tmp_path)) as init:
        ls = [torch.nn.Linear(8, 8, bias=False) for _ in range(5)]
        with pytest.raises(PoolExhaustedError, match="buffer_count"):
            torch.stack([m.weight for m in ls])
        assert init.store.refs == {}  # nothing left counted as in use
        torch.nn.init.ones_(ls[4].weight)
    assert torch.equal(_stored(init, ls[4].weight), torch.ones(8, 8))


def _torch_as_it_was():
    """Module.apply, register_parameter and Linear.__init__ are torch's own."""
    return (
        not getattr(torch.nn.Linear.__init__, "_aio_wrapped", False)
        and torch.nn.Module.apply.__module__.startswith("torch")
        and torch.nn.Module.register_parameter.__module__.startswith("torch")
    )


def test_entering_one_init_twice_is_refused_and_torch_is_restored(tmp_path):
    """A second entry of the same Init saved its own patches as torch's
    originals: torch stayed patched after the block. It is refused now."""
    init = aio.zero.Init(_cfg(tmp_path))
    with init:
        with pytest.raises(RuntimeError, match="already active"):
            init.__enter__()
        torch.nn.Linear(4, 4)
    assert _torch_as_it_was()
    built_after = torch.nn.Linear(4, 4)
    assert not hasattr(built_after.weight, "aio_id")  # not adopted
    init.store.close()


def test_an_init_inside_another_does_nothing_so_one_store_holds_the_model(tmp_path):
    """As DeepSpeed's zero.Init: an Init entered inside another (a library
    wrapping its own build in one) is a no-op, with a warning when its config
    differs. Before, modules built in it went to the outer store while
    parameters assigned in it (register_parameter) went to the inner one:
    one model in two stores, which initialize() then refused."""
    import warnings

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    outer = aio.zero.Init(_cfg(tmp_path / "a"))
    other = _cfg(tmp_path / "b")
    other["zero_optimization"]["stage3_param_persistence_threshold"] = 7
    inner, same = aio.zero.Init(other), aio.zero.Init(_cfg(tmp_path / "a"))
    with outer:
        with pytest.warns(UserWarning, match="does nothing"):
            inner.__enter__()
        a = torch.nn.Linear(4, 4)
        a.weight = torch.nn.Parameter(torch.ones(4, 4))  # register_parameter's path
        inner.__exit__(None, None, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same config: no warning
            with same:
                b = torch.nn.Linear(4, 4)
        c = torch.nn.Linear(4, 4)  # the outer Init still builds
    assert inner.store is None and same.store is None
    assert all(p._aio_store is outer.store for m in (a, b, c) for p in m.parameters())
    assert torch.equal(_stored(outer, a.weight), torch.ones(4, 4))
    assert _torch_as_it_was()
    with inner:  # on its own, later, it builds into its own store
        d = torch.nn.Linear(4, 4)
    assert d.weight._aio_store is inner.store is not None
    assert _torch_as_it_was()
    outer.store.close()
    inner.store.close()


def test_a_failure_closing_the_build_still_restores_torch(tmp_path, monkeypatch):
    """Whatever ending the build raises (a write that failed, say), torch's
    Module is restored: a Linear built afterwards is a plain one, not a
    placeholder adopted into the store."""
    from aio.zero.init_guard import PlaceholderGuard

    def fails(self, build_only=False):
        raise OSError(5, "write failed")

    init = aio.zero.Init(_cfg(tmp_path))
    with pytest.raises(OSError, match="write failed"):
        with init:
            torch.nn.Linear(4, 4)
            monkeypatch.setattr(PlaceholderGuard, "close_opened", fails)
    monkeypatch.undo()
    assert _torch_as_it_was()
    assert torch.nn.Linear(4, 4).weight.numel() == 16
    init.store.close()
