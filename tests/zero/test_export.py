"""Streamed weight export (aio/zero/export.py, aio/zero/export_cli.py):
``engine.save_pretrained`` from a live trainer and ``aio-export`` from a
checkpoint give the trained values bit for bit, load with from_pretrained,
shard, convert, and refuse damaged or old checkpoints without leaving files."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import aio.zero
from aio.zero.export_cli import main as export_main

from .common import cfg_for, gpt, loss_of

tf = pytest.importorskip("transformers", reason="transformers is in the test extras")


def _trained(tmp_path, param="nvme", steps=2):
    """A GPT trained `steps` steps, its state dict, its checkpoint folder; engine open."""
    model = gpt()
    engine = aio.zero.initialize(model, cfg_for(tmp_path / "drive", param=param, gas=1, clip=0))
    for step in range(steps):
        engine.backward(loss_of(engine, step, 0))
        engine.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    return model, engine, want


def _read_folder(folder):
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    out = {}
    for f in files:
        out.update(load_file(os.path.join(folder, f)))
    return out


def _assert_same(got, want, dtype=None):
    assert set(got) == set(want)
    for k, v in want.items():
        v = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_live_and_checkpoint_exports_equal_the_state_dict(tmp_path):
    model, engine, want = _trained(tmp_path)
    with engine:
        done = []
        files = engine.save_pretrained(str(tmp_path / "live"), progress=lambda d, t: done.append((d, t)))
        assert files == ["model.safetensors"]
        _assert_same(_read_folder(tmp_path / "live"), want)
        total = sum(v.nbytes for v in want.values())
        assert done[-1] == (total, total) and len(done) == len(want)
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "off"), "--quiet"]) == 0
    _assert_same(_read_folder(tmp_path / "off"), want)
    assert not [f for f in os.listdir(tmp_path / "off") if f.startswith(".")]  # no temporary left


def test_sharding_dtype_and_memory_backend(tmp_path):
    model, engine, want = _trained(tmp_path, param="cpu")
    with engine:
        files = engine.save_pretrained(str(tmp_path / "live"), dtype="bf16", max_shard_size=20_000)
    assert len(files) > 2 and files[-1] == "model.safetensors.index.json"
    index = json.loads((tmp_path / "live" / files[-1]).read_text())
    assert set(index["weight_map"]) == set(want) and set(index["weight_map"].values()) == set(files[:-1])
    _assert_same(_read_folder(tmp_path / "live"), want, torch.bfloat16)
    # aio-export of the memory backend's checkpoint (params.pt), one shard now:
    # the earlier save's shards in the folder are removed, not mixed in.
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "live"), "--quiet"]) == 0
    assert sorted(os.listdir(tmp_path / "live")) == ["model.safetensors"]
    _assert_same(_read_folder(tmp_path / "live"), want)


def test_hf_model_round_trips_through_from_pretrained(tmp_path):
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16)
    drive = tmp_path / "drive"
    zero = cfg_for(drive, gas=1, clip=0)
    torch.manual_seed(0)
    with aio.zero.Init(zero):
        model = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 96, (2, 8))
    with aio.zero.initialize(model, zero) as engine:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        engine.save_pretrained(str(tmp_path / "live"))
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="one")
    assert sorted(os.listdir(tmp_path / "live")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert "lm_head.weight" not in load_file(tmp_path / "live" / "model.safetensors")  # tied: written once
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "off"), "--tag", "one", "--quiet"]) == 0
    for folder in ("live", "off"):
        back = tf.GPT2LMHeadModel.from_pretrained(tmp_path / folder)
        assert back.lm_head.weight is back.transformer.wte.weight
        _assert_same(back.state_dict(), want)


def test_damaged_checkpoint_is_refused_and_writes_nothing(tmp_path, capsys):
    _model, engine, _want = _trained(tmp_path)
    engine.close()
    ckpt = tmp_path / "ckpt" / "global_step2"
    data = ckpt / "params" / "params.bin"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--quiet"]) == 2
    assert "checksum" in capsys.readouterr().err
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


def test_old_checkpoint_without_keys_names_the_way_that_works(tmp_path, capsys, monkeypatch):
    from aio.zero import checkpoint

    meta = checkpoint._meta
    monkeypatch.setattr(
        checkpoint, "_meta", lambda t: {k: v for k, v in meta(t).items() if k != "state_dict"}
    )
    _model, engine, _want = _trained(tmp_path)  # saved as an aio before the key was written
    engine.close()
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--quiet"]) == 2
    assert "engine.save_pretrained" in capsys.readouterr().err


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert export_main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "latest" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        export_main([str(tmp_path), str(tmp_path / "out"), "--dtype", "int8"])
    assert e.value.code == 2


def test_export_peak_memory_is_a_tensor_not_the_model(tmp_path):
    """A 24 x 8 MiB model: the exporting process's peak RSS grows by far less
    than the model (one tensor at a time), measured in a fresh process."""
    build = f"""
import os, torch, aio.zero
drive = {str(tmp_path / "drive")!r}
os.makedirs(drive)
cfg = {{"zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
    "offload_param": {{"device": "nvme", "nvme_path": drive, "buffer_count": 2,
                      "buffer_size": 2097152, "max_in_cpu": 0}}}},
    "optimizer": {{"type": "SGD", "params": {{"lr": 0.1}}}}}}
with aio.zero.Init(cfg):
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 2048, bias=False) for _ in range(24)])
with aio.zero.initialize(model, cfg) as engine:
    engine.save_checkpoint({str(tmp_path / "ckpt")!r})
"""
    export = f"""
import resource
from aio.zero.export_cli import main
import torch, safetensors  # what the export imports, before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert main([{str(tmp_path / "ckpt")!r}, {str(tmp_path / "out")!r}, "--quiet"]) == 0
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    for script in (build, export):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
    grew_mib = int(out.stdout.split()[-1])
    assert grew_mib < 64, f"export peak RSS grew by {grew_mib} MiB for a 192 MiB model"
    assert len(load_file(tmp_path / "out" / "model.safetensors")) == 24


def test_the_documented_example_runs():
    page = (Path(__file__).resolve().parents[2] / "docs" / "huggingface.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if '/weights")' in b]
    assert len(blocks) == 1, "docs/huggingface.md: the weights-out example"
    out = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


_SLOW_EXPORT = """
import sys, time
from aio.zero import export
read = export._SavedParams._read
def slow(self, e, dtype):
    time.sleep(0.1)  # a slow drive: the export is interrupted part-way
    return read(self, e, dtype)
export._SavedParams._read = slow
from aio.zero.export_cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_exits_130_and_leaves_nothing(tmp_path, sig):
    _model, engine, _want = _trained(tmp_path)
    engine.close()
    out = tmp_path / "out"
    p = subprocess.Popen(
        [sys.executable, "-c", _SLOW_EXPORT, str(tmp_path / "ckpt"), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (out.exists() and any(f.name.startswith(".aio-export-") for f in out.iterdir())):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)
    p.send_signal(sig)
    _stdout, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert list(out.iterdir()) == []


def test_config_files_are_never_written_through_a_link_and_go_in_with_the_weights(tmp_path):
    cfg = tf.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=96, n_positions=16)
    zero = cfg_for(tmp_path / "drive", gas=1, clip=0)
    with aio.zero.Init(zero):
        model = tf.GPT2LMHeadModel(cfg)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out").mkdir()
    os.symlink(victim, tmp_path / "out" / "config.json")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").mkdir()  # the config cannot be renamed there
    with aio.zero.initialize(model, zero) as engine:
        engine.save_pretrained(str(tmp_path / "out"))
        with pytest.raises(OSError):
            engine.save_pretrained(str(tmp_path / "bad"))
    assert victim.read_text() == "precious" and not os.path.islink(tmp_path / "out" / "config.json")
    assert tf.GPT2LMHeadModel.from_pretrained(tmp_path / "out").config.n_embd == 32
    assert os.listdir(tmp_path / "bad") == ["config.json"]  # no weights without their config


class _WithExtraState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)

    def get_extra_state(self):
        return {"note": "not a tensor"}

    def set_extra_state(self, state):
        pass


def test_entries_that_are_no_tensors_are_left_out_with_a_word(tmp_path, caplog):
    model = _WithExtraState()
    with aio.zero.initialize(model, cfg_for(tmp_path / "drive", gas=1, clip=0)) as engine:
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
        engine.save_pretrained(str(tmp_path / "live"))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert "_extra_state" in caplog.text
    assert set(load_file(tmp_path / "live" / "model.safetensors")) == {"lin.weight", "lin.bias"}
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "off"), "--quiet"]) == 0
    assert set(load_file(tmp_path / "off" / "model.safetensors")) == {"lin.weight", "lin.bias"}


def test_exporting_into_the_checkpoint_itself_is_refused(tmp_path, capsys):
    _model, engine, _want = _trained(tmp_path)
    engine.close()
    target = tmp_path / "ckpt" / "global_step2" / "out"
    assert export_main([str(tmp_path / "ckpt"), str(target), "--quiet"]) == 2
    assert "inside the checkpoint" in capsys.readouterr().err and not target.exists()


_CUT_AT_CREATE = """
import os, signal, sys
from aio.zero import safetensors_writer as w
create = w._create
def create_then_signal(out_dir):
    made = create(out_dir)
    os.kill(os.getpid(), signal.SIGTERM)  # the moment the temporary file exists
    return made
w._create = create_then_signal
from aio.zero.export_cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_as_a_temporary_file_is_made_leaves_nothing(tmp_path):
    """SIGTERM the moment a shard's temporary file exists (before its name
    reached the list the export removes on failure): it is removed too (it
    was left in OUT_DIR when the signal landed between the two)."""
    _model, engine, _want = _trained(tmp_path)
    engine.close()
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-c", _CUT_AT_CREATE, str(tmp_path / "ckpt"), str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 130, r.stderr
    assert "interrupted" in r.stderr and "Traceback" not in r.stderr
    assert list(out.iterdir()) == []
