"""aio's buffer rules inside DeepSpeed's ZeRO-3 NVMe swappers on a GPU
(issue 43 item 6): one rank, DS_ACCELERATOR=cuda, NCCL, the configs where
DeepSpeed's own swappers assert (HF's block: 6 weights, 5 buffers; the
pipelined optimizer swapper; prefetch on a tied GPT). On a GPU the gathered
partitions go up with NoGatherHandle's non-blocking copies, so a buffer
given back before its copy has completed would corrupt the weights: the
losses must equal DeepSpeed's CPU-offload run of the same model bit for
bit. Records peak GPU memory and aio's locked bytes per case
(``AIO_GPU_FIGURES``). scripts/gpu_acceptance.sh runs it (``-k cuda``; the
deepspeed step too), with DeepSpeed carried as a wheel (docs/gpu.md)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install .[deepspeed])")

from .ds_swapper_run import run_ranks  # noqa: E402
from .test_ds_swappers import MLP6, PIPE, PREFETCH, counters, trained  # noqa: E402

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here or in CI)"),
]

CASES = [
    {"name": "mlp6-cpu", "offload": "cpu", **MLP6},
    {"name": "mlp6", **MLP6},
    {"name": "mlp8-cpu", "offload": "cpu", "layers": 8, "sub_group_size": 300_000},
    {"name": "pipe", **PIPE},
    {"name": "prefetch-cpu", "offload": "cpu", **PREFETCH},
    {"name": "prefetch", **PREFETCH},
]


@pytest.fixture(scope="module")
def on_gpu(tmp_path_factory):
    res = run_ranks(tmp_path_factory.mktemp("ds-cuda"), CASES, world=1, env={"DS_ACCELERATOR": "cuda"})
    figures = os.environ.get("AIO_GPU_FIGURES")
    if figures:  # the acceptance report keeps them, pass or fail
        keep = ("losses", "error", "param_counters", "optimizer_counters", "pinned_bytes", "peak_gpu_bytes")
        with open(os.path.join(figures, "ds_swappers_cuda.json"), "w") as f:
            json.dump({n: {k: r.get(k) for k in keep} for n, r in res[0].items() if n[0] != "_"}, f, indent=1)
    return res


def test_cuda_held_partitions_equal_cpu_offload(on_gpu):
    assert trained(on_gpu, "mlp6") == trained(on_gpu, "mlp6-cpu")
    c = counters(on_gpu, "mlp6")
    assert c["evicted"] > 0 and c["held_peak"] > 0


def test_cuda_pipelined_optimizer_equals_cpu_offload(on_gpu):
    assert trained(on_gpu, "pipe") == trained(on_gpu, "mlp8-cpu")
    assert counters(on_gpu, "pipe")["writes_completed_early"] > 0


def test_cuda_prefetch_on_a_tied_gpt_equals_cpu_offload(on_gpu):
    assert trained(on_gpu, "prefetch") == trained(on_gpu, "prefetch-cpu")
    assert counters(on_gpu, "prefetch")["deduplicated"] > 0
