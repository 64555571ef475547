"""The framework recipes of docs/fsdp.md ("Recipes"), run on CPU with gloo and
2 ranks: Lightning's ModelParallelStrategy (FSDP2) through
configure_optimizers, Accelerate with the optimizer built before prepare,
HF Trainer with optimizer_cls_and_kwargs, and a torchtitan-style loop (FSDP2,
get_state_dict / set_state_dict, dcp.save, resume). Each trains a tiny model
with torch.optim.AdamW(foreach=False) and with aio.optim.NVMeAdamW
(match_torch=True); losses and full parameters must be bit-identical
(torch.equal) and each rank's swap files must be in its own folder on its
own drive (``nvme_path=".../nvme{local_rank}"``).

What does not run on CPU is not here (docs/fsdp.md says why): Lightning's
FSDPStrategy (FSDP1) and the FSDP paths of Accelerate and HF Trainer, which
keep DDP on CPU. Accelerate's FSDP2 prepare is run forced on CPU
(``accelerate_fsdp2``: its reload of the optimizer's state before the
parameter swap), and the DCP loop also with torchtitan's flattened
optimizer state (``dcp_flat``); both were aio bugs (issue 44).

One launch (recipe_worker.py) runs every case in one 2-rank process group;
each case's verdict is written per rank before the next starts, so a gloo
abort at teardown cannot hide or fake a result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

from aio.optim import is_bit_exact

pytestmark = [
    pytest.mark.skipif(not is_bit_exact(), reason="aio's kernel does not reproduce torch's sqrt here"),
    pytest.mark.timeout(300),
    # One worker runs them all: the process group (the module fixture) starts once.
    pytest.mark.xdist_group("optim-recipes"),
]

WORKER = os.path.join(os.path.dirname(__file__), "recipe_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 2
# case -> the packages it needs (the test extras install them all; skipped without).
NEEDS = {
    "lightning_fsdp2": ("lightning",),
    "accelerate": ("accelerate",),
    "hf_trainer": ("transformers", "accelerate"),
    "dcp": (),
    "dcp_flat": (),
    "accelerate_fsdp2": ("accelerate",),
}


def _missing(case: str) -> list[str]:
    # find_spec, not importorskip: importing Lightning or Trainer here would
    # cost the parent as much time as the whole launch.
    return [m for m in NEEDS[case] if find_spec(m) is None]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = str(tmp_path_factory.mktemp("recipes"))
    cases = [c for c in NEEDS if not _missing(c)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (ROOT, env.get("PYTHONPATH"))))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    # The exit status is not judged: gloo may abort at teardown after every result is written.
    subprocess.run([sys.executable, WORKER, out, *cases], env=env, timeout=280, check=False)
    return {c: [_read(os.path.join(out, f"{c}.rank{r}.json")) for r in range(WORLD)] for c in cases}


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"ok": False, "error": f"no result: {path} (the rank died before writing it)"}


def _per_rank(results: dict, case: str) -> list[dict]:
    missing = _missing(case)
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed")
    per_rank = results[case]
    for rank, res in enumerate(per_rank):
        assert res["ok"], f"{case}, rank {rank}:\n{res.get('error')}"
    return per_rank


def _own_folders(per_rank: list[dict]) -> None:
    """Each rank's swap folder: under its own drive (nvme{local_rank}), in
    aio's per-user folder, named for the rank, holding the state files."""
    assert len({r["swap_dir"] for r in per_rank}) == WORLD
    assert len({r["drive"] for r in per_rank}) == WORLD
    for rank, r in enumerate(per_rank):
        assert r["drive"].endswith(f"nvme{rank}"), r
        assert r["swap_dir"].startswith(r["drive"] + os.sep), r
        assert os.path.basename(os.path.dirname(r["swap_dir"])) == f"aio-swap-{os.geteuid()}", r
        assert f"-rank{rank}-optimizer-" in os.path.basename(r["swap_dir"]), r
        assert r["files"] >= 1 and r["drive_bytes"] > 0, r


@pytest.mark.parametrize("case", ["lightning_fsdp2", "accelerate", "hf_trainer", "dcp"])
def test_recipe_bit_identical_to_torch_adamw(results: dict, case: str) -> None:
    per_rank = _per_rank(results, case)
    for rank, res in enumerate(per_rank):
        assert res["equal"] is True, f"{case}, rank {rank}: {res}"
    _own_folders(per_rank)


def test_dcp_resume_continues_bit_identically(results: dict) -> None:
    for res in _per_rank(results, "dcp"):
        assert res["resumed_equal_torch"] and res["resumed_equal_aio"], res


def test_accelerate_fsdp2_prepare(results: dict) -> None:
    """Accelerate's real FSDP2 prepare (forced on CPU): AcceleratedOptimizer
    calls optimizer.load_state_dict(optimizer.state_dict()) before
    fsdp2_switch_optimizer_parameters. That load (an empty state) must not
    lay NVMeAdamW's sub-groups out on the unsharded parameters it holds
    then: it trained those, in silence. HF Trainer with FSDP2 takes the
    same path."""
    per_rank = _per_rank(results, "accelerate_fsdp2")
    assert all(r["sharded"] for r in per_rank), per_rank  # FSDP2 really ran, not DDP
    for rank, res in enumerate(per_rank):
        assert res["equal"] is True, f"accelerate_fsdp2, rank {rank}: {res}"
    _own_folders(per_rank)


def test_dcp_flattened_optimizer_state(results: dict) -> None:
    """torchtitan saves and loads with flatten_optimizer_state_dict=True:
    set_optimizer_state_dict rebuilds each parameter's state from the keys
    of optim.state[p], which must be torch's (it kept only "step")."""
    per_rank = _per_rank(results, "dcp_flat")
    for rank, res in enumerate(per_rank):
        assert res["equal"] is True and res["resumed_equal_aio"], f"dcp_flat, rank {rank}: {res}"
    _own_folders(per_rank)
