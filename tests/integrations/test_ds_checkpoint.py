"""aio.integrations.ds_checkpoint.restore() on a stand-in ZeRO-3 optimizer:
what it puts back, and the checkpoints it refuses before changing anything.

The stand-in has the attributes restore() reads from DeepSpeed's
DeepSpeedZeroOptimizer_Stage3; the checkpoint file has the layout of its
state_dict() (test_deepspeed_e2e.py checks the same against DeepSpeed).
"""

import errno
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install .[deepspeed])")

from deepspeed.runtime.fp16.loss_scaler import LossScaler  # noqa: E402

from aio.integrations.ds_checkpoint import restore  # noqa: E402

SIZES = [4, 2]  # sub-group 0 swapped to NVMe, sub-group 1 kept in memory
SWAPPED = [True, False]


class StandInOptimizer:
    """The parts of DeepSpeed's ZeRO-3 optimizer that restore() uses."""

    def __init__(self, sizes=SIZES, swapped=SWAPPED):
        self.swap_optimizer = True
        self.fp32_partitioned_groups_flat = [torch.zeros(n) for n in sizes]
        self.fp16_groups = [[None] for _ in sizes]
        self.fp16_partitioned_groups_flat_numel = list(sizes)
        self.sub_group_to_group_id = {sg: 0 for sg in range(len(sizes))}
        self.optimizer = SimpleNamespace(param_groups=[{}], state=defaultdict(dict))
        self.loss_scaler = LossScaler(1.0)
        self.dynamic_loss_scale = False
        self.overflow = False
        self.rewritten = []
        self._swapped = list(swapped)

    def _swappable_optimizer_subgroup(self, sg):
        return self._swapped[sg]

    def _partitioned_params_swap_out(self, sg):
        self.rewritten.append(sg)

    def state(self, sg):
        return self.optimizer.state[self.fp32_partitioned_groups_flat[sg]]


def engine_for(opt):
    return SimpleNamespace(
        optimizer=opt,
        _get_zero_ckpt_name=lambda d, tag: os.path.join(d, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    )


def saved_state(step, sizes=SIZES):
    """Adam state at `step` as DeepSpeed saves it: the swapped sub-group's
    moments are empty placeholders (the files hold them), the in-memory one's
    are values; `step` is a 0-dim tensor for both."""
    return {
        0: {"step": torch.tensor(float(step)), "exp_avg": torch.empty(0)},
        1: {"step": torch.tensor(float(step)), "exp_avg": torch.full((sizes[1],), 5.0)},
    }


def write_checkpoint(tmp_path, states, flats=None, drop=(), scale=7.0):
    inner = {"state": states, "param_groups": [{"params": sorted(states)}]}
    sd = {
        "loss_scaler": LossScaler(scale),
        "dynamic_loss_scale": False,
        "overflow": True,
        "optimizer_state_dict": inner,
        "fp32_flat_groups": flats if flats is not None else [torch.full((n,), 3.0) for n in SIZES],
    }
    for key in drop:
        if key == "state":
            del inner["state"]
        else:
            del sd[key]
    (tmp_path / "tag").mkdir(exist_ok=True)
    path = tmp_path / "tag" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": sd}, path)
    return str(path)


def trained(opt, step=4):
    """The live state of an engine that has stepped: the swapped sub-group's
    moment is registered with the swapper (memory released between steps)."""
    opt.state(0).update(step=torch.tensor(float(step)), exp_avg=torch.empty(0))
    opt.state(1).update(step=torch.tensor(float(step)), exp_avg=torch.zeros(SIZES[1]))
    return opt


def test_fresh_engine_gets_every_subgroup_back(tmp_path):
    write_checkpoint(tmp_path, saved_state(2))
    opt = StandInOptimizer()
    assert restore(engine_for(opt), str(tmp_path), "tag")
    assert float(opt.state(0)["step"]) == 2 and opt.state(0)["exp_avg"].numel() == SIZES[0]
    assert float(opt.state(1)["step"]) == 2 and (opt.state(1)["exp_avg"] == 5).all()
    assert (opt.fp32_partitioned_groups_flat[1] == 3).all() and opt.rewritten == [1]
    assert (opt.fp32_partitioned_groups_flat[0] == 0).all()  # swapped: from its file


def test_engine_that_has_trained_gets_the_checkpoints_step(tmp_path):
    # Loading into an engine that has already stepped (its live state is not
    # empty): the swapped sub-group's moments come from the files DeepSpeed
    # copied back, but `step` is in no file and must come from the checkpoint.
    write_checkpoint(tmp_path, saved_state(2))
    opt = trained(StandInOptimizer())
    registered = opt.state(0)["exp_avg"]
    assert restore(engine_for(opt), str(tmp_path), "tag")
    assert float(opt.state(0)["step"]) == 2
    assert opt.state(0)["exp_avg"] is registered  # still the swapper's tensor
    assert float(opt.state(1)["step"]) == 2 and (opt.state(1)["exp_avg"] == 5).all()


def test_loss_scaler_is_restored(tmp_path):
    write_checkpoint(tmp_path, saved_state(2), scale=7.0)
    opt = StandInOptimizer()
    restore(engine_for(opt), str(tmp_path), "tag")
    assert opt.loss_scaler.cur_scale == 7.0 and opt.overflow is True and opt.dynamic_loss_scale is False


def test_missing_optimizer_file_is_an_error(tmp_path):
    (tmp_path / "tag").mkdir()
    opt = StandInOptimizer()
    with pytest.raises(FileNotFoundError) as ei:
        restore(engine_for(opt), str(tmp_path), "tag")
    assert ei.value.errno == errno.ENOENT
    assert ei.value.filename.endswith(os.path.join("tag", "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert "optim_states" in str(ei.value)


def test_missing_latest_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError) as ei:
        restore(engine_for(StandInOptimizer()), str(tmp_path), None)
    assert ei.value.filename == str(tmp_path / "latest")


@pytest.mark.parametrize(
    "damage",
    ["state", "subgroup", "count", "scaler", "not-started"],
)
def test_damaged_checkpoint_is_refused_before_anything_changes(tmp_path, damage):
    states, flats, drop = saved_state(2), None, ()
    opt = trained(StandInOptimizer())
    if damage == "state":
        drop = ("state",)
    elif damage == "subgroup":
        del states[1]
    elif damage == "count":
        flats = [torch.full((n,), 3.0) for n in [*SIZES, 4]]
    elif damage == "scaler":
        drop = ("loss_scaler",)
    else:  # saved before the first step, loaded into an engine that has stepped
        states = {}
    path = write_checkpoint(tmp_path, states, flats=flats, drop=drop)
    before = {sg: {k: v.clone() for k, v in opt.state(sg).items()} for sg in range(2)}
    with pytest.raises(ValueError, match=path):
        restore(engine_for(opt), str(tmp_path), "tag")
    for sg in range(2):
        assert {k: v.tolist() for k, v in opt.state(sg).items()} == {
            k: v.tolist() for k, v in before[sg].items()
        }
    assert opt.loss_scaler.cur_scale == 1.0 and opt.rewritten == []


def test_size_mismatch_is_found_before_the_first_subgroup_changes(tmp_path):
    # Sub-group 1 (in memory) does not fit; sub-group 0 (also in memory here)
    # must not have been restored by then.
    opt = StandInOptimizer(swapped=[False, False])
    opt.state(0).update(step=torch.tensor(4.0), exp_avg=torch.zeros(SIZES[0]))
    opt.state(1).update(step=torch.tensor(4.0), exp_avg=torch.zeros(SIZES[1]))
    states = {**saved_state(2), 0: {"step": torch.tensor(2.0), "exp_avg": torch.full((4,), 5.0)}}
    write_checkpoint(tmp_path, states, flats=[torch.full((4,), 3.0), torch.full((3,), 3.0)])
    with pytest.raises(ValueError, match="sub-group 1 has 3 elements"):
        restore(engine_for(opt), str(tmp_path), "tag")
    assert float(opt.state(0)["step"]) == 4 and (opt.state(0)["exp_avg"] == 0).all()
    assert (opt.fp32_partitioned_groups_flat[0] == 0).all() and opt.rewritten == []


def test_nothing_to_do_without_nvme_optimizer(tmp_path):
    opt = StandInOptimizer()
    opt.swap_optimizer = False
    assert restore(engine_for(opt), str(tmp_path), "tag") is False
