"""aio.fsdp.guard's stand-ins, one process, no FSDP: every op on one runs
on the real tensor its keeper makes resident, a write is reported, a view
is a stand-in that replays the view, a foreach op over more groups than
the window runs in pieces, and what cannot be served raises."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

from aio.fsdp import TierError
from aio.fsdp.guard import ShardStandIn


class Keeper:
    """The tier's side, recorded: which groups ops held and wrote."""

    def __init__(self, tensors: list[torch.Tensor], window: int = 2) -> None:
        self.tensors = tensors
        self.window = window
        self.held: list[int] = []
        self.wrote: set[int] = set()
        self.most = 0
        self.live: set[int] = set()

    def user_hold(self, group: Any, what: Any) -> None:
        self.held.append(group)
        self.live.add(group)
        self.most = max(self.most, len(self.live))

    def user_wrote(self, group: Any) -> None:
        self.wrote.add(group)

    def user_settle(self) -> None:
        self.live.clear()

    def real_local(self, group: Any, index: int) -> torch.Tensor:
        return self.tensors[group]


def _stand_ins(n: int = 1, window: int = 2) -> tuple[Keeper, list[torch.Tensor], list[ShardStandIn]]:
    real = [torch.arange(12.0).view(3, 4) + 10 * i for i in range(n)]
    keeper = Keeper(real, window)
    return keeper, real, [ShardStandIn(t, keeper, i, 0) for i, t in enumerate(real)]


def test_reads_run_on_the_real_tensor() -> None:
    keeper, (real,), (s,) = _stand_ins()
    assert torch.equal(s.norm(), real.norm()) and torch.equal(s * 2, real * 2)
    assert type(s * 2) is torch.Tensor and set(keeper.held) == {0} and not keeper.wrote


def test_writes_are_reported_and_land_in_the_real_tensor() -> None:
    keeper, (real,), (s,) = _stand_ins()
    assert s.mul_(2) is s  # an in-place op returns its stand-in, not the real tensor
    assert keeper.wrote == {0} and real[0, 1] == 2.0
    keeper.wrote.clear()
    torch.add(torch.ones(3, 4), 1, out=s)
    assert keeper.wrote == {0} and torch.equal(real, torch.full((3, 4), 2.0))


def test_a_view_is_a_stand_in_replayed_at_each_use() -> None:
    keeper, (real,), (s,) = _stand_ins()
    v = s.view_as(s)[1]  # to_local(), then a row
    assert isinstance(v, ShardStandIn) and v.shape == (4,)
    parts = s.split(1)
    assert all(isinstance(p, ShardStandIn) for p in parts)
    real.add_(1)  # the shard refilled with new values: views see them
    assert torch.equal(v.clone(), real[1]) and torch.equal(parts[2].clone(), real[2:])
    v.fill_(0.5)
    assert keeper.wrote == {0} and torch.equal(real[1], torch.full((4,), 0.5))


def test_a_foreach_op_over_many_groups_runs_window_groups_at_a_time() -> None:
    keeper, real, ins = _stand_ins(n=5, window=2)
    ema = [torch.zeros(3, 4) for _ in ins]
    torch._foreach_lerp_(ema, ins, 0.5)
    assert keeper.most == 2 and sorted(keeper.held) == [0, 1, 2, 3, 4]
    assert all(torch.equal(e, r * 0.5) for e, r in zip(ema, real, strict=True))
    sums = torch._foreach_add(ins, 1.0)
    assert all(torch.equal(a, r + 1) for a, r in zip(sums, real, strict=True))
    torch._foreach_mul_(ins, 2.0)
    assert keeper.wrote == {0, 1, 2, 3, 4} and real[4][0, 0] == 80.0


def test_save_repr_and_deepcopy_get_the_values() -> None:
    _, (real,), (s,) = _stand_ins()
    buf = io.BytesIO()
    torch.save([s], buf)
    buf.seek(0)
    (loaded,) = torch.load(buf)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, real)
    assert repr(s) == repr(real)
    assert torch.equal(copy.deepcopy(s), real)


def test_what_cannot_be_served_raises() -> None:
    _, _, (s,) = _stand_ins()
    with pytest.raises(TierError, match=r"tier\.resident\(\)"):
        s.t_()
    with pytest.raises(TierError, match=r"tier\.resident\(\)"):
        s.resize_(2)
    with pytest.raises(TierError, match=r"tier\.resident\(\)"):
        s.data_ptr()
    assert s.untyped_storage().nbytes() == 0  # holds no memory (NVMeAdamW skips it)


def test_a_view_reads_nothing_until_used() -> None:
    keeper, (real,), (s,) = _stand_ins()
    v = s.detach().view(-1)[2:]
    assert isinstance(v, ShardStandIn) and not keeper.held  # shaped without a read
    assert torch.equal(v.clone(), real.view(-1)[2:]) and keeper.held == [0]


def test_a_write_that_raises_is_still_reported() -> None:
    keeper, _, (s,) = _stand_ins()
    with pytest.raises(RuntimeError):
        s.add_(torch.ones(5))  # may have written part of the shard before raising
    assert keeper.wrote == {0}


def test_an_unsafe_alias_of_the_shard_is_a_stand_in() -> None:
    keeper, (real,), (s,) = _stand_ins()
    a = torch.ops.aten._unsafe_view(s, [-1])  # no alias in its schema, yet shares the storage
    parts = s.unsafe_chunk(3)
    assert isinstance(a, ShardStandIn) and all(isinstance(p, ShardStandIn) for p in parts)
    real.add_(1)
    assert torch.equal(a.clone(), real.view(-1)) and torch.equal(parts[1].clone(), real[1:2])
