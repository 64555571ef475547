"""One FSDP2 rank on a GPU with aio's NVMe tiers (issue 44 item 7, issue 45
item 5), through tests/fsdp/cuda_worker.py: NVMeAdamW bit-identical to
torch's AdamW with ``CPUOffloadPolicy(pin_memory=True)``, the parameter tier
bit-identical to the same FSDP2 training in memory (device-resident shards
and CPU-offloaded ones, under torch's AdamW and NVMeAdamW), with peak GPU
memory and pinned bytes; device-resident shards must have gone up on the
tier's side stream (its upload counters). scripts/gpu_acceptance.sh runs it (its ``-k cuda``
selects this file), also under ``TORCH_CUDA_SANITIZER=1``, and keeps the
figures (``AIO_GPU_FIGURES``).

The same cases run here on gloo (the CPU twin): the GPU run is rare, and a
mistake in the script must not cost it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from aio.optim import is_bit_exact

pytestmark = [
    pytest.mark.skipif(not is_bit_exact(), reason="aio's kernel does not reproduce torch's sqrt here"),
    pytest.mark.timeout(300),
]

WORKER = os.path.join(os.path.dirname(__file__), "cuda_worker.py")
CASES = ("optim_offload", "optim_resident", "tier")


def _results(device: str, out: str, **extra_env: str) -> dict[str, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    # The exit status is not judged: every verdict is in its file before teardown.
    subprocess.run([sys.executable, WORKER, device, out, *CASES], env=env, timeout=280, check=False)
    found = {}
    for name in CASES:
        try:
            with open(os.path.join(out, f"{name}.json")) as f:
                found[name] = json.load(f)
        except FileNotFoundError:
            found[name] = {"ok": False, "error": f"no result for {name} (the worker died before writing it)"}
    return found


def _check(res: dict[str, dict], exact_resident: bool, on_gpu: bool = False) -> None:
    for name in CASES:
        r = res[name]
        assert r["ok"], f"{name}: {r['error']}"
    for name in ("optim_offload", "tier"):
        for variant, v in res[name].items():
            if isinstance(v, dict):
                assert v["equal"], f"{name}/{variant}: not bit-identical (max |diff| {v['max_abs_diff']})"
    resident = res["optim_resident"]["auto"]
    assert resident["aio"]["master_mode"] == ("params" if exact_resident else "drive")
    if exact_resident:
        assert resident["equal"]
    else:  # torch's AdamW on the GPU, aio's on the CPU: the same math, maybe other roundings
        assert resident["max_abs_diff"] < 1e-5, resident
    # The tier reads every group ahead of FSDP (counted) and the optimizer's master feeds it.
    assert res["tier"]["torch"]["aio"]["tier"]["reads"] > 0
    assert res["tier"]["nvme"]["aio"]["tier"]["params_from_master"] > 0
    # Device-resident shards go up on the side stream (aio/fsdp/upload.py), from CUDA-registered
    # staging; CPU shards (the twin, CPUOffloadPolicy) touch no stream.
    for variant, v in res["tier"].items():
        if isinstance(v, dict):
            figures = v["aio"]["tier"]
            side = on_gpu and not variant.endswith("_offload")
            assert (figures["uploads"] > 0) == side, (variant, figures)
            assert figures["staging_registered"] == side, (variant, figures)
            if side:
                assert figures["upload_bytes"] > 0 and figures["upload_waits"] <= figures["uploads"]


def test_cuda_rank_cases_on_the_cpu_twin(tmp_path) -> None:
    _check(_results("cpu", str(tmp_path)), exact_resident=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here or in CI)")
def test_cuda_rank_nvme_tiers_on_the_gpu(tmp_path) -> None:
    from aio.fsdp import SUPPORTED

    # The GPU image's torch (2.11) is not one CI runs: the tier is tried there by opting in.
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    extra = {} if version in SUPPORTED else {"AIO_FSDP_UNTESTED_TORCH": "1"}
    res = _results("cuda", str(tmp_path), **extra)
    res["torch"] = {"ok": True, "version": torch.__version__, "opted_in": bool(extra)}
    figures = os.environ.get("AIO_GPU_FIGURES")
    if figures:  # the acceptance report keeps them, pass or fail
        name = "fsdp_cuda_rank" + ("_sanitizer" if os.environ.get("TORCH_CUDA_SANITIZER") else "") + ".json"
        with open(os.path.join(figures, name), "w") as f:
            json.dump(res, f, indent=1, default=str)
    _check(res, exact_resident=False, on_gpu=True)
