"""What aio.optim's optimizers cannot step on DTensor parameters
(aio/optim/dtensor.py's check_pair, issue 44): a plain gradient on a DTensor
parameter (or the other way round), a gradient laid out otherwise (Partial:
still to be reduced), one on another device mesh, and a Partial parameter
are each a TypeError naming the parameter and what differs, before
anything changes; the optimizer then steps a corrected gradient as torch's
AdamW does (it is not left refusing). One process: a gloo group of world 1,
started in this process (no spawn)."""

from __future__ import annotations

import pytest
import torch

from aio.optim import CPUAdamW, NVMeAdamW, is_bit_exact

dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

KW = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-7, "weight_decay": 0.05}


@pytest.fixture
def mesh(gloo_world_one):
    """A one-rank CPU device mesh over an in-process gloo group (tests/conftest.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def _values(seed: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))


def _sharded(t: torch.Tensor, mesh) -> torch.Tensor:
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(t, mesh, [Shard(0)])


def _partial(t: torch.Tensor, mesh) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Partial

    return DTensor.from_local(t, mesh, [Partial()], shape=t.shape, stride=t.stride())


def _other_mesh(t: torch.Tensor, mesh) -> torch.Tensor:
    from torch.distributed.device_mesh import init_device_mesh

    # The same rank, but a mesh of its own (named): not the parameter's.
    return _sharded(t, init_device_mesh("cpu", (1,), mesh_dim_names=("other",)))


# name: (the second parameter from its values, its refused gradient, the
# gradient that fixes it or None (a Partial parameter: none does), what the
# message says after the parameter's name).
CASES = {
    "plain_grad": (_sharded, lambda g, m: g, _sharded, " is a DTensor but its gradient is a plain tensor"),
    "dtensor_grad": (
        lambda t, m: t, _sharded, lambda g, m: g, " is a plain tensor but its gradient is a DTensor",
    ),
    "partial_grad": (
        _sharded, _partial, _sharded,
        r"'s gradient has placements \(Partial\(sum\),\), the parameter \(Shard\(dim=0\),\); redistribute",
    ),
    "other_mesh_grad": (_sharded, _other_mesh, _sharded, "'s gradient is on another device mesh"),
    "partial_param": (_partial, _partial, None, r" has a Partial placement \(\(Partial\(sum\),\)\)"),
}  # fmt: skip
# How each optimizer names the second of two parameters.
NAMES = {CPUAdamW: "parameter 1 of param group 0", NVMeAdamW: r"parameter 1 \(in param_groups order\)"}


def _optimizer(cls, params, tmp_path):
    if cls is NVMeAdamW:
        drive = tmp_path / "drive"
        drive.mkdir(exist_ok=True)
        return NVMeAdamW(params, nvme_path=str(drive), match_torch=True, **KW)
    return CPUAdamW(params, match_torch=True, **KW)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _params(make, mesh) -> list[torch.nn.Parameter]:
    """A well-formed sharded parameter first, then the one of the case."""
    return [torch.nn.Parameter(_sharded(_values(0), mesh)), torch.nn.Parameter(make(_values(1), mesh))]


@pytest.mark.parametrize("cls", [CPUAdamW, NVMeAdamW], ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", list(CASES))
def test_what_cannot_be_stepped_is_a_type_error_that_changes_nothing(mesh, tmp_path, cls, case) -> None:
    make_param, bad_grad, good_grad, says = CASES[case]
    params = _params(make_param, mesh)
    opt = _optimizer(cls, params, tmp_path)
    params[0].grad = _sharded(torch.full((6, 4), 0.5), mesh)
    params[1].grad = bad_grad(torch.full((6, 4), -0.25), mesh)
    before = [_local(p).detach().clone() for p in params]
    for _ in range(2):  # refused again, in the same words: not another error once refused
        with pytest.raises(TypeError, match=f"^{NAMES[cls]}{says}"):
            opt.step()
        for b, p in zip(before, params, strict=True):
            assert torch.equal(b, _local(p))  # the good parameter too: nothing half-stepped
    if good_grad is None:
        return
    # The gradient fixed: the next step is torch's first, bit for bit.
    params[1].grad = good_grad(torch.full((6, 4), -0.25), mesh)
    opt.step()
    ref = _params(make_param, mesh)
    for r, p in zip(ref, params, strict=True):
        r.grad = p.grad
    ref_opt = torch.optim.AdamW(ref, foreach=False, **KW)
    ref_opt.step()
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert [float(got[k]["step"]) for k in (0, 1)] == [1.0, 1.0]
    if is_bit_exact():  # aio's kernel reproduces torch's sqrt here
        for k, (r, p) in enumerate(zip(ref, params, strict=True)):
            assert torch.equal(_local(r), _local(p)), k
            for n in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(_local(want[k][n]), _local(got[k][n])), (k, n)
    if hasattr(opt, "close"):
        opt.close()
