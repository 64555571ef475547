"""aio.optim under PyTorch's own engines, many ranks on gloo (CPU): FSDP2
(+- CPUOffloadPolicy(pin_memory=False), bf16 MixedPrecisionPolicy, uneven
shards, a rank holding no rows of a parameter), FSDP1 use_orig_params, DDP,
DDP + ZeroRedundancyOptimizer (and its consolidated checkpoint, saved and
resumed), param groups + LambdaLR + clip_grad_norm_ on
DTensors, the Accelerate-style parameter swap, get_optimizer_state_dict
without a hidden step, a DCP save on 2 ranks loaded on 3 (torch <-> aio
both ways, master weights in the parameters <-> on the drive), and
aio.fsdp's parameter tier with either master, and NVMeAdamW's streamed DCP
save (2 ranks) and load (3 ranks; aio.optim.dcp's planners) against the
default path and torch's checkpoints. Every case is bit-identical
(torch.equal) to torch.optim.AdamW(foreach=False) on the same engine. Every
engine case runs aio's optimizer with the master weights in the parameters
("auto", which picks them: fp32 CPU parameters under gloo) and on the drive,
in the same process group (no extra group: the CI time is in starting them).

Two process groups (2 and 3 ranks) run all the cases (dist_worker.py); each
case's verdict is written per rank before the next starts, so a gloo abort
at teardown cannot hide or fake a result. World 1 (a gloo group of one
rank in the test's own process, no spawn): FSDP2 +- CPUOffloadPolicy and
DDP + ZeroRedundancyOptimizer with two param groups, LambdaLR and
clip_grad_norm_, and get_optimizer_state_dict without a hidden step, on
dist_worker's helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from aio.optim import is_bit_exact

from . import dist_worker as w

pytestmark = [
    pytest.mark.skipif(not is_bit_exact(), reason="aio's kernel does not reproduce torch's sqrt here"),
    pytest.mark.timeout(600),
    # One worker runs them all: the process groups (the module fixture) start once.
    pytest.mark.xdist_group("optim-distributed"),
]

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")
TWO = [
    "fsdp2", "fsdp2_offload", "fsdp2_bf16", "cpu_adamw_dtensor", "groups_lambda_clip",
    "accelerate_swap", "no_hidden_step", "dcp_save", "ddp", "zero1", "zero1_checkpoint", "fsdp1",
    "rank_folders", "tier_master", "dcp_stream_save", "full_state",
]  # fmt: skip
THREE = ["fsdp2", "dcp_load", "zero1", "fsdp1", "rank_folders", "dcp_stream_load", "full_state"]
# Cases that run aio's optimizer under both masters (dist_worker.MASTERS).
BOTH = {"fsdp2", "fsdp2_offload", "fsdp2_bf16", "groups_lambda_clip", "accelerate_swap", "no_hidden_step",
        "ddp", "zero1", "zero1_checkpoint", "fsdp1", "full_state"}  # fmt: skip


def _run(world: int, out: str, cases: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    # The exit status is not judged: gloo may abort at teardown after every result is written.
    subprocess.run([sys.executable, WORKER, str(world), out, *cases], env=env, timeout=540, check=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], list[dict]]:
    out = str(tmp_path_factory.mktemp("dist"))
    found: dict[tuple[int, str], list[dict]] = {}
    for world, cases in ((2, TWO), (3, THREE)):  # 3 loads the checkpoints 2 saved
        sub = os.path.join(out, f"w{world}")
        os.makedirs(sub)
        if world == 3:
            ckpts = ("ckpt_torch", "ckpt_aio", "ckpt_aio-drive", "ckpt_stream_aio", "ckpt_stream_aio-drive")
            for name in ckpts:
                src = os.path.join(out, "w2", name)
                if os.path.isdir(src):
                    os.symlink(src, os.path.join(sub, name))
        _run(world, sub, cases)
        for name in cases:
            found[(world, name)] = [_read(os.path.join(sub, f"{name}.rank{r}.json")) for r in range(world)]
    return found


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"ok": False, "error": f"no result: {path} (the rank died before writing it)"}


@pytest.mark.parametrize("world,case", [(2, c) for c in TWO] + [(3, c) for c in THREE])
def test_bit_identical_to_torch_adamw(results: dict, world: int, case: str) -> None:
    for rank, res in enumerate(results[(world, case)]):
        assert res["ok"], f"rank {rank}:\n{res.get('error')}"
        assert res["equal"] is True, f"rank {rank}: {res}"


@pytest.mark.parametrize("world,case", [(w, c) for w, cs in ((2, TWO), (3, THREE)) for c in cs if c in BOTH])
def test_each_engine_case_runs_under_both_masters(results: dict, world: int, case: str) -> None:
    # auto picks the parameters (fp32 on the CPU here); drive keeps them on the drive.
    for rank, res in enumerate(results[(world, case)]):
        assert res.get("modes") == {"auto": "params", "drive": "drive"}, f"rank {rank}: {res}"


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_its_own_folder_and_share(results: dict, world: int) -> None:
    per_rank = results[(world, "rank_folders")]
    dirs = [r["swap_dir"] for r in per_rank]
    assert len(set(dirs)) == world
    for rank, r in enumerate(per_rank):
        assert f"-rank{rank}-optimizer-" in os.path.basename(r["swap_dir"])
        assert os.path.basename(os.path.dirname(r["swap_dir"])) == f"aio-swap-{os.geteuid()}"
        # Per local element 8 bytes (two moments; the master weights are the
        # parameters) or 12 (master on the drive too), whole 4 KiB blocks per tensor.
        for master, per in (("params", 8), ("drive", 12)):
            got = r["drive_bytes"][master]
            assert per * r["local"] <= got <= per * r["local"] + 3 * 4096 * 8, (master, got)
        assert r["local"] <= r["total"] // world + 3 * 65


def test_the_parameter_tier_and_the_master(results: dict) -> None:
    # auto: on the drive, where the tier reads every group's parameters from;
    # params: a warning, and the tier keeps its own copy of every group.
    for res in results[(2, "tier_master")]:
        modes = res["modes"]
        assert modes["auto"][0] == "drive" and modes["auto"][1] > 0 and not modes["auto"][2], res
        assert modes["params"] == ["params", 0, True], res


def test_get_optimizer_state_dict_takes_no_step(results: dict) -> None:
    for res in results[(2, "no_hidden_step")]:
        assert res["steps"] == [2.0] and res["params_same"] and res["state_match"], res


# World 1: a gloo group of one rank, started in this process (no spawn: it
# costs well under a second), running dist_worker's helpers as they are.
@pytest.fixture
def one_rank(gloo_world_one, tmp_path):
    """An in-process gloo group of world 1 (tests/conftest.py); the folder
    dist_worker's cases write to (its drive/ made)."""
    (tmp_path / "drive").mkdir()
    return str(tmp_path)


def _world_one_groups(build, make_torch, make_aio) -> dict:
    """dist_worker._compare on rank 0 of 1: two param groups, LambdaLR and clip_grad_norm_."""
    return w._compare(build, make_torch, make_aio, 0, sched=True, clip=True)


def _zero_groups(model, kind: str, tmp: str):
    """ZeroRedundancyOptimizer over dist_worker's two param groups, with
    torch's AdamW (kind "torch") or NVMeAdamW (kind: its master)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from aio.optim import NVMeAdamW

    if kind == "torch":
        return ZeroRedundancyOptimizer(
            w._groups(model), optimizer_class=torch.optim.AdamW, lr=w.LR, foreach=False
        )
    return ZeroRedundancyOptimizer(
        w._groups(model), optimizer_class=NVMeAdamW, lr=w.LR, nvme_path=os.path.join(tmp, "drive"),
        match_torch=True, master=kind,
    )  # fmt: skip


def _fsdp2_case(offload: bool):
    def case(tmp: str) -> dict:
        return _world_one_groups(
            lambda: w._fsdp2(w._model(), offload=offload),
            lambda m: w._torch(w._groups(m)),
            lambda m, master: w._nvme(w._groups(m), tmp, 0, sub_group_size=700, master=master),
        )

    return case


def _zero1_case(tmp: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return _world_one_groups(
        lambda: DDP(w._model()),
        lambda m: _zero_groups(m, "torch", tmp),
        lambda m, master: _zero_groups(m, master, tmp),
    )


def _no_hidden_step_case(tmp: str) -> dict:
    res = w.case_no_hidden_step(0, tmp)
    assert res["steps"] == [2.0] and res["params_same"] and res["state_match"], res
    return res


WORLD_ONE = {
    "fsdp2": _fsdp2_case(offload=False),
    "fsdp2_offload": _fsdp2_case(offload=True),
    "ddp_zero1": _zero1_case,
    "no_hidden_step": _no_hidden_step_case,
}


@pytest.mark.parametrize("case", list(WORLD_ONE))
def test_world_one_bit_identical_to_torch_adamw(one_rank: str, case: str) -> None:
    # Under both masters (auto picks the parameters: fp32 on the CPU), each
    # run's losses and full parameters torch.equal to torch's AdamW(foreach=False).
    res = WORLD_ONE[case](one_rank)
    assert res["modes"] == {"auto": "params", "drive": "drive"}, res
    assert res["equal"] is True, res
