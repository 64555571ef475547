"""Pinned-memory accounting is honest: after a training step with NVMe
offload, trainer.pinned_bytes() equals what aio has page-locked
(aio.locked_bytes()), the kernel's own count (VmLck in /proc/self/status)
agrees within 5%, and so does ``aio-config estimate`` for the same config and
parameter sizes. Each case trains in a fresh process, so VmLck holds only what
that training locked."""

import json
import os
import subprocess
import sys

import pytest

from aio.config.__main__ import main as config_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WIDTH, LAYERS = 256, 4

# Trains the GPT-like MLP of bench/train_step.py (small) for one step and
# prints what it locked; exit 3 when the kernel refuses to lock (RLIMIT_MEMLOCK).
SCRIPT = r"""
import errno, json, sys
import torch
import aio, aio.zero

cfg = json.loads(sys.argv[1])
width, layers = int(sys.argv[2]), int(sys.argv[3])

def vmlck():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return None

torch.manual_seed(0)
mods = []
for _ in range(layers):
    mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
mods.append(torch.nn.Linear(width, 16))
model = torch.nn.Sequential(*mods)
numels = [p.numel() for p in model.parameters()]
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
base = vmlck()
try:
    with aio.zero.initialize(model, cfg, optimizer=opt) as engine:
        x, y = torch.randn(4, width), torch.randn(4, 16)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        out = {
            "pinned_bytes": engine.pinned_bytes(),
            "locked_bytes": aio.locked_bytes(),
            "vmlck": vmlck() - base,
            "param_numels": numels,
        }
except OSError as e:
    if e.errno in (errno.EPERM, errno.ENOMEM, errno.EAGAIN) and "RLIMIT_MEMLOCK" in str(e):
        print(str(e), file=sys.stderr)
        sys.exit(3)
    raise
print(json.dumps(out))
"""


def _config(drive, *, pin=True, max_in_cpu=0, threshold=0, opt_buffers=16):
    """bench/train_step.py's zero_block(), scaled to the small model."""
    return {
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 100_000,
            "stage3_param_persistence_threshold": threshold,
            "stage3_prefetch_bucket_size": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(drive),
                "buffer_count": 8,
                "buffer_size": max(70_000, WIDTH * WIDTH),
                "max_in_cpu": max_in_cpu,
                "pin_memory": pin,
            },
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(drive),
                "buffer_count": opt_buffers,
                "pipeline_read": True,
                "pipeline_write": True,
                "pin_memory": pin,
            },
        },
        "aio": {"block_size": 1048576, "queue_depth": 8},
    }


def _train(cfg):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(cfg), str(WIDTH), str(LAYERS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode == 3:
        pytest.skip(f"the kernel refuses to lock this much memory (RLIMIT_MEMLOCK): {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _estimate(tmp_path, cfg, numels, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    sizes = ",".join(str(n) for n in numels)
    capsys.readouterr()
    assert config_main(["estimate", str(path), "--param-numels", sizes, "--dtype", "fp32", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["pinned_bytes"]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmLck needs Linux /proc")
@pytest.mark.parametrize(
    "kw",
    [
        {},  # everything on the drive, as in bench/train_step.py
        {"max_in_cpu": 70_000, "threshold": 1000},  # a layer and the small biases in CPU memory
        {"opt_buffers": 5},  # too few buffers to pipeline: less overlap, same accounting
    ],
    ids=["all-on-drive", "some-in-cpu", "few-buffers"],
)
def test_pinned_bytes_match_locked_vmlck_and_estimate(tmp_path, capsys, kw):
    cfg = _config(tmp_path, **kw)
    got = _train(cfg)
    pinned = got["pinned_bytes"]
    assert pinned > 0
    # Nothing else in that process locks memory: aio's own count is exact...
    assert got["locked_bytes"] == pinned
    # ...the kernel's agrees (VmLck counts whole pages)...
    assert abs(got["vmlck"] - pinned) <= 0.05 * pinned, got
    # ...and the estimate from the config and the parameter sizes does too.
    est = _estimate(tmp_path, cfg, got["param_numels"], capsys)
    assert abs(est - pinned) <= 0.05 * pinned, (est, pinned)


def test_nothing_locked_without_pin_memory(tmp_path, capsys):
    cfg = _config(tmp_path, pin=False, max_in_cpu=70_000, threshold=1000)
    got = _train(cfg)
    assert got["pinned_bytes"] == got["locked_bytes"] == got["vmlck"] == 0
    assert _estimate(tmp_path, cfg, got["param_numels"], capsys) == 0
