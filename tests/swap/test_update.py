"""aio.swap.update: SubGroupUpdater steps one sub-group in its buffers with
the same bits as the torch optimizer in memory -- states kept as bfloat16
widened and rounded back, master weights given as pieces stepped where
they are (their owner told first) -- without an OptimizerSwapper."""

import pytest

torch = pytest.importorskip("torch")

from aio.swap.param_groups import TorchGroups  # noqa: E402
from aio.swap.pieces import check_pieces  # noqa: E402
from aio.swap.pool import BufferPool  # noqa: E402
from aio.swap.subgroup import SubGroup, layout, part_bytes  # noqa: E402
from aio.swap.update import SubGroupUpdater  # noqa: E402

N = 1000  # elements of the sub-group: not a whole block, so its bfloat16 states have padding
SPEC = [("exp_avg", torch.float32), ("exp_avg_sq", torch.float32)]
HYPER = {"lr": 1e-2, "weight_decay": 0.01}


def _setup(narrowed):
    """An updater for torch's AdamW and one sub-group with a buffer per tensor."""
    dtypes = [("grad", torch.float32), ("param", torch.float32)]
    dtypes += [(n, torch.bfloat16 if n in narrowed else dt) for n, dt in SPEC]
    parts, nbytes = layout(N, dtypes)
    g = SubGroup(0, N, 0, parts, nbytes, proxy=torch.nn.Parameter(torch.empty(0)))
    pool = BufferPool(len(parts), part_bytes(N, torch.float32), False, "count", "size")
    leases = {name: pool.acquire() for name in parts}
    up = SubGroupUpdater(torch.optim.AdamW, dict(HYPER), SPEC, list(narrowed), TorchGroups(None))
    up.ensure_optimizer({0: g})
    return up, g, pool, leases


def _grad(step):
    return torch.randn(N, generator=torch.Generator().manual_seed(100 + step))


def _reference(seed):
    """Initial master weights, and torch's AdamW over a copy of them in memory."""
    init = torch.randn(N, generator=torch.Generator().manual_seed(seed))
    ref = torch.nn.Parameter(init.clone())
    return init, ref, torch.optim.AdamW([ref], **HYPER)


def _release(pool, leases):
    for lease in leases.values():
        lease.release()
    pool.close()


def test_steps_in_buffers_give_the_bits_of_torch_in_memory_and_scale_the_gradient():
    init, ref, ref_opt = _reference(1)
    up, g, pool, leases = _setup(narrowed=[])
    leases["param"].tensor(torch.float32, N).copy_(init)
    for step in range(3):
        ref.grad = _grad(step) * 0.5
        ref_opt.step()
        leases["grad"].tensor(torch.float32, N).copy_(_grad(step))
        master = up.step(g, leases, None, 0.5)
        assert master.data_ptr() == leases["param"].tensor(torch.float32, N).data_ptr()
        assert torch.equal(master, ref.detach())
        for name, _ in SPEC:
            assert torch.equal(leases[name].tensor(torch.float32, N), ref_opt.state[ref][name])
        assert float(g.scalars["step"]) == step + 1 and set(g.scalars) == {"step"}
        assert g.proxy.grad is None and g.proxy.numel() == 0  # pointed at nothing between updates
    _release(pool, leases)


def test_bf16_states_are_widened_for_the_update_and_rounded_back_as_the_drive_holds_them():
    init, ref, ref_opt = _reference(2)
    up, g, pool, leases = _setup(narrowed=["exp_avg", "exp_avg_sq"])
    leases["param"].tensor(torch.float32, N).copy_(init)
    for step in range(2):
        ref.grad = _grad(step)
        ref_opt.step()
        for name, _ in SPEC:  # what the drive holds between steps
            st = ref_opt.state[ref][name]
            st.copy_(st.to(torch.bfloat16))
        leases["grad"].tensor(torch.float32, N).copy_(_grad(step))
        up.step(g, leases, None, None)
        assert torch.equal(leases["param"].tensor(torch.float32, N), ref.detach())
        for name, _ in SPEC:
            raw = leases[name].tensor(torch.uint8)
            assert torch.equal(raw[: 2 * N].view(torch.bfloat16), ref_opt.state[ref][name].to(torch.bfloat16))
            assert not raw[2 * N : part_bytes(N, torch.bfloat16)].any()  # padding: no float32 leftovers
    _release(pool, leases)


def test_master_pieces_are_stepped_where_they_are_their_owner_told_before():
    init, ref, ref_opt = _reference(3)
    ref.grad = _grad(0)
    ref_opt.step()
    up, g, pool, leases = _setup(narrowed=[])
    leases["param"].release()
    del leases["param"]  # stepped in place: no buffer for them
    owned = [init[:300].clone(), init[300:].clone()]
    leases["grad"].tensor(torch.float32, N).copy_(_grad(0))
    told = []

    def after(index, master):
        told.append((index, master, torch.equal(torch.cat(owned), init)))

    assert up.step(g, leases, after, None, in_place=check_pieces(owned, N, "master")) is None
    assert told == [(0, None, True)]  # before the update changed them
    assert torch.equal(torch.cat(owned), ref.detach())
    for name, _ in SPEC:
        assert torch.equal(leases[name].tensor(torch.float32, N), ref_opt.state[ref][name])
    _release(pool, leases)
