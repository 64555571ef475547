"""docs/huggingface.md's complete fine-tuning script, run as the page shows
it on a tiny GPT-2: it trains, saves checkpoints, and a run resumed from a
checkpoint continues with the losses and learning rates of the run that was
not interrupted."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tf = pytest.importorskip("transformers", reason="transformers is in the test extras")

ROOT = Path(__file__).resolve().parents[2]


def the_script():
    page = (ROOT / "docs" / "huggingface.md").read_text()
    blocks = re.findall(r"```python\n(# hf_finetune\.py.*?)```", page, re.S)
    assert len(blocks) == 1, "docs/huggingface.md must hold the hf_finetune.py block once"
    return blocks[0]


def run(tmp_path, *extra):
    args = ["--model", "tiny", "--nvme", "nvme", "--out", "out", "--steps", "4", "--accum", "2",
            "--batch", "2", "--seq", "16", "--lr", "1e-3", "--warmup", "2", "--save-every", "2"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [sys.executable, "hf_finetune.py", *args, *extra],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def test_the_documented_recipe_trains_and_resumes(tmp_path):
    import torch

    torch.manual_seed(0)
    tiny = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32)
    tf.GPT2LMHeadModel(tiny).save_pretrained(tmp_path / "tiny")
    (tmp_path / "hf_finetune.py").write_text(the_script())
    (tmp_path / "nvme").mkdir()
    full = run(tmp_path)
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert full[1]["lr"] == 1e-3 and full[-1]["lr"] == 0.0  # warm-up, then linear decay
    # As if the run had died after its step-2 checkpoint:
    shutil.rmtree(tmp_path / "out" / "global_step4")
    (tmp_path / "out" / "latest").write_text("global_step2")
    resumed = run(tmp_path, "--resume")
    assert resumed == full[2:]
    # The recipe's last line wrote the trained weights where from_pretrained reads them.
    final = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "out" / "final")
    assert all(p.abs().sum() > 0 for p in final.parameters())
