"""The main job on several ranks: ``aio-train --nproc 2`` (torchrun, gloo)
trains the GPT with FSDP2, NVMeAdamW and the parameter tier, prints each
rank's figures, and its losses are bit-identical to the same FSDP2 training
in memory; each rank's peak RSS is within the job's own prediction."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from aio.optim import is_bit_exact

pytestmark = [
    pytest.mark.skipif(not is_bit_exact(), reason="aio's kernel does not reproduce torch's sqrt here"),
    pytest.mark.timeout(300),
]


def _main_job(tmp_path, *flags: str) -> tuple[str, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    out = str(tmp_path / "rank{rank}.json")
    cmd = [sys.executable, "-m", "aio.train", "--nproc", "2", "--layers", "2", "--width", "64"]
    cmd += ["--heads", "4", "--steps", "3", "--json", out, *flags]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "losses bit-identical to the in-memory FSDP2 run: yes" in proc.stdout
    runs = []
    for rank in (0, 1):
        assert f"[rank {rank}] step   3" in proc.stdout and "pinned" in proc.stdout
        with open(tmp_path / f"rank{rank}.json") as f:
            runs.append(json.load(f))
    return proc.stdout, runs


@pytest.mark.parametrize("gradients", ["cpu", "nvme"])
def test_two_ranks_bit_identical_to_fsdp2_in_memory(tmp_path, gradients: str) -> None:
    """Built on the meta device and filled group by group through the tier
    (no rank holds the whole model), with the fp32 gradients held in memory
    or streamed to the drive during backward (--gradients nvme: clipped by
    the stream): the losses of the in-memory FSDP2 run, bit for bit."""
    stdout, runs = _main_job(tmp_path, "--gradients", gradients)
    assert ("streamed to the drive" in stdout) == (gradients == "nvme"), stdout[-2000:]
    for run in runs:
        assert run["bit_identical"] is True and run["losses"] == run["losses_in_memory"]
        tier = run["tier"]
        # Read ahead from the second step on; read from the optimizer's master weights, so the
        # parameters were written only at set-up (each group made once, by the fill, not read).
        assert tier["sync_fetches"] == 0 and tier["params_from_master"] == tier["groups"]
        assert tier["materialized"] == tier["groups"] and tier["user_fetches"] == 0, tier
        # With --unit linear (the default) a block's group holds its two layer norms, between
        # which its Linears' groups push it out of the window: filled in two visits, written twice.
        assert tier["writes"] <= tier["groups"] + 2 + 1 and tier["resident_bytes"] == 0, tier
        assert all(r > 0 and w > 0 for r, w in run["bytes"]), run["bytes"]
        assert 0 < run["pinned_bytes"] and 0 < run["peak_rss"] <= run["predicted_peak_rss"], run
        grads = run["gradients"]
        if gradients == "nvme":  # every sub-group's gradient written once per step, from pinned buffers
            assert grads["subgroups_written"] == 3 * grads["subgroups"] and grads["unpinned_buffers"] == 0
        else:
            assert grads is None


def test_units_prefetch_and_sub_groups_keep_the_losses(tmp_path) -> None:
    """--unit block with FSDP2's backward prefetch (the job before its
    memory work) and --unit linear with NVMeAdamW sub-groups smaller than a
    parameter (each cut in pieces): both bit-identical to the in-memory run
    with the same units. At 2 layers: 3 FSDP groups by block (2 blocks and
    the root), 11 by linear (5 a block and the root)."""
    for flags, groups in (
        (("--unit", "block", "--backward-prefetch"), 2 + 1),
        (("--unit", "linear", "--sub-group-size", "1000", "--gradients", "nvme"), 2 * 5 + 1),
    ):
        stdout, runs = _main_job(tmp_path, *flags)
        for run in runs:
            assert run["bit_identical"] is True and run["losses"] == run["losses_in_memory"], stdout[-2000:]
            assert run["tier"]["groups"] == groups and run["tier"]["sync_fetches"] == 0, run["tier"]
            assert 0 < run["peak_rss"] <= run["predicted_peak_rss"], run
        if "--sub-group-size" in flags:
            # 64-wide blocks: fc.weight alone has 4 x 64 x 64 / 2 = 8192 local elements.
            assert runs[0]["gradients"]["subgroups"] > runs[0]["tier"]["groups"], runs[0]["gradients"]


def test_shard_gpt_units() -> None:
    """shard_gpt refuses an unknown unit by name (before touching the model)."""
    import argparse

    import torch

    from aio.fsdp.train import UNITS, backward_prefetch, build_parser, shard_gpt

    assert UNITS == ("linear", "block")
    with pytest.raises(ValueError, match="unit must be one of"):
        shard_gpt(argparse.Namespace(), None, "layer")
    args = build_parser().parse_args([])
    assert args.unit == "linear" and args.backward_prefetch is None and args.sub_group_size == 1 << 22
    # Unset: on GPU ranks (NCCL overlaps it), off on CPU ranks; asked for, as asked.
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert (backward_prefetch(args, cpu), backward_prefetch(args, cuda)) == (False, True)
    on, off = (build_parser().parse_args([f]) for f in ("--backward-prefetch", "--no-backward-prefetch"))
    assert backward_prefetch(on, cpu) and not backward_prefetch(off, cuda)
