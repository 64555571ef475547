"""aio.integrations.accelerate.prepare: Accelerate's own loop (accumulate,
backward, clip_grad_norm_, step, schedule, bf16 autocast) with aio.zero's
engine behind the model and the optimizer, bit for bit the same loop in
memory; and docs/huggingface.md's acc_finetune.py recipe, run by
``accelerate launch`` as the page shows it, resumed bit for bit from its
checkpoint, its weights loaded by from_pretrained."""

import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aio.zero

tf = pytest.importorskip("transformers", reason="transformers is in the test extras")
accelerate = pytest.importorskip("accelerate", reason="accelerate is in the test extras")

from aio.integrations.accelerate import prepare  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
V = 96


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps one state per process and refuses another mixed
    precision in it; each test here makes its own Accelerator (as
    Accelerate's own tests reset it)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _gpt2():
    cfg = tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(cfg)


def _loop(drive=None, steps=3, accum=2):
    """Accelerate's loop, in memory or (`drive`) on aio.zero: each micro-batch's
    loss, each step's gradient norm and learning rate."""
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=accum, mixed_precision="bf16", cpu=True)
    data = [
        {"input_ids": torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(i))}
        for i in range(16)
    ]
    for d in data:
        d["labels"] = d["input_ids"]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    config = {
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 20_000,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(drive),
                "buffer_count": 64,
                "buffer_size": 20_000,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": str(drive), "buffer_count": 11},
        },
    }
    if drive is None:
        model = _gpt2()
    else:
        with aio.zero.Init(config):
            model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 2))
    if drive is None:
        model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    else:
        model, optimizer, loader, schedule = prepare(accelerator, config, model, optimizer, loader, schedule)
    torch.manual_seed(1)  # the same dropout masks in both runs
    model.train()
    out = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            norm = (
                accelerator.clip_grad_norm_(model.parameters(), 1.0) if accelerator.sync_gradients else None
            )
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        out.append((loss.item(), None if norm is None else norm.item(), schedule.get_last_lr()[0]))
        if len(out) == steps * accum:
            break
    if drive is not None:
        model.engine.close()
    return out


def test_prepare_trains_as_accelerate_in_memory(tmp_path):
    want = _loop()
    got = _loop(tmp_path)
    assert got == want
    assert [n is not None for _, n, _ in got] == [False, True] * 3  # clipped by the engine at each step


def the_recipe():
    page = (ROOT / "docs" / "huggingface.md").read_text()
    blocks = re.findall(r"```python\n(# acc_finetune\.py.*?)```", page, re.S)
    assert len(blocks) == 1, "docs/huggingface.md must hold the acc_finetune.py block once"
    return blocks[0]


ARGS = [
    "--model",
    "tiny",
    "--nvme",
    "nvme",
    "--out",
    "out",
    "--accum",
    "2",
    "--batch",
    "2",
    "--seq",
    "16",
    "--lr",
    "1e-3",
    "--warmup",
    "2",
    "--save-every",
    "2",
]


@pytest.fixture
def workdir(tmp_path):
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(
        tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=32)
    ).save_pretrained(tmp_path / "tiny")
    (tmp_path / "acc_finetune.py").write_text(the_recipe())
    (tmp_path / "nvme").mkdir()
    return tmp_path


def _in_process(workdir, capsys, monkeypatch, *extra):
    """The recipe as `accelerate launch --num_processes 1 --mixed_precision bf16`
    runs it, in this process (the launcher's environment, no new interpreter)."""
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setattr(sys, "argv", ["acc_finetune.py", *ARGS, *extra])
    capsys.readouterr()
    runpy.run_path(str(workdir / "acc_finetune.py"), run_name="__main__")
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_the_documented_recipe_resumes_bit_for_bit(workdir, capsys, monkeypatch):
    full = _in_process(workdir, capsys, monkeypatch, "--steps", "4")
    assert [r["step"] for r in full] == [1, 2, 3, 4] and full[-1]["lr"] == 0.0
    shutil.rmtree(workdir / "out" / "global_step4")  # as if the run had died after step 2
    (workdir / "out" / "latest").write_text("global_step2")
    assert _in_process(workdir, capsys, monkeypatch, "--steps", "4", "--resume") == full[2:]


def test_the_documented_recipe_under_accelerate_launch(workdir):
    launcher = shutil.which("accelerate")
    if launcher is None:
        pytest.skip("the accelerate command is not installed")
    cmd = [
        launcher,
        "launch",
        "--cpu",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "bf16",
        "--dynamo_backend",
        "no",
        "acc_finetune.py",
        *ARGS,
        "--steps",
        "2",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["step"] for row in rows] == [1, 2]
    final = tf.GPT2LMHeadModel.from_pretrained(workdir / "out" / "final")
    tiny = tf.GPT2LMHeadModel.from_pretrained(workdir / "tiny")
    assert not torch.equal(final.transformer.wte.weight, tiny.transformer.wte.weight)  # trained
