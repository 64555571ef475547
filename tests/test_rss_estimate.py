"""aio-train's predicted peak RSS follows the torch build it runs on: the
runtime term is measured in the process (the CPU wheel maps ~230 MiB, the
CUDA build ~510 MiB before anything is allocated). Run on both torches in
CI (scripts/second_torch.sh)."""

import json
import subprocess
import sys

from aio.config import estimate_memory
from aio.config.memory import RUNTIME_TRAINING_EXTRA, measured_runtime_bytes

CFG = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}


def test_the_runtime_term_is_what_this_process_holds_plus_training():
    import psutil

    rss = psutil.Process().memory_info().rss
    got = measured_runtime_bytes()
    assert got >= rss + RUNTIME_TRAINING_EXTRA
    assert got < psutil.Process().memory_info().rss + RUNTIME_TRAINING_EXTRA + (64 << 20)
    est = estimate_memory(CFG, 1e6, runtime_bytes=got)
    assert est.working["runtime (python, torch, aio)"] == got


def test_aio_train_predicts_its_peak_within_15_percent(tmp_path):
    out = tmp_path / "r.json"
    args = ["--steps", "2", "--no-baseline", "--nvme-path", str(tmp_path), "--json", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "aio.train", *args], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    off = json.loads(out.read_text())["offloaded"]
    predicted, measured = off["predicted_peak_rss"], off["peak_rss"]
    assert abs(predicted - measured) <= 0.15 * measured, (predicted >> 20, measured >> 20)
