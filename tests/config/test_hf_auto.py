"""aio-config validate on configs meant for the HF Trainer: the "auto" values
HF and Accelerate fill are checked with stand-ins, everything else as written."""

import json

import pytest

from aio.config.__main__ import main
from aio.config.hf_auto import STAND_INS, stand_in_autos
from aio.config.models import AUTO_FILLED

HF_TEMPLATE = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "sub_group_size": 100000000,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "offload_param": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 5, "buffer_size": 100000000},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 4},
    },
}


def write(tmp_path, cfg):
    p = tmp_path / "ds_config.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def test_the_hf_template_validates_and_names_what_hf_fills(tmp_path, capsys):
    assert main(["validate", write(tmp_path, HF_TEMPLATE)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"config OK: {tmp_path / 'ds_config.json'} (3 notes below)"
    ]  # the verdict only
    assert "the HF Trainer fills" in err and "optimizer.params.lr" in err and "bf16.enabled" in err


def test_the_resolved_config_comes_after_the_verdict_with_a_flag(tmp_path, capsys):
    assert main(["validate", write(tmp_path, HF_TEMPLATE), "--resolved"]) == 0
    verdict, _, rest = capsys.readouterr().out.partition("\n")
    assert verdict.startswith("config OK")
    assert json.loads(rest)["zero_optimization"]["offload_param"]["buffer_count"] == 5


def test_the_documented_template_pages_parameters(tmp_path, capsys):
    """docs/huggingface.md's DeepSpeed template validates with no note that
    parameters stay in CPU memory (it sets max_in_cpu: 0)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "huggingface.md").read_text()
    blocks = [b for b in re.findall(r"```json\n(.*?)```", page, re.S) if '"offload_param"' in b]
    assert blocks, "docs/huggingface.md: the DeepSpeed template"
    cfg = json.loads(blocks[0])
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path)
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path)
    assert main(["validate", write(tmp_path, cfg)]) == 0
    assert "max_in_cpu" not in capsys.readouterr().err


def test_an_auto_nobody_fills_is_still_refused(tmp_path, capsys):
    cfg = json.loads(json.dumps(HF_TEMPLATE))
    cfg["zero_optimization"]["sub_group_size"] = "auto"
    assert main(["validate", write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err
    assert "zero_optimization.sub_group_size" in err and "not filled in by anyone" in err


def test_the_rest_is_still_checked_with_its_key_path_and_file(tmp_path, capsys):
    cfg = json.loads(json.dumps(HF_TEMPLATE))
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = -1
    path = write(tmp_path, cfg)
    assert main(["validate", path]) == 2
    err = capsys.readouterr().err
    assert "zero_optimization.offload_param.buffer_count" in err and path in err


@pytest.mark.parametrize("path", sorted(STAND_INS))
def test_every_stand_in_is_a_key_an_integration_fills(path):
    assert path in AUTO_FILLED
    data = {}
    node = data
    *parents, last = path.split(".")
    for k in parents:
        node = node.setdefault(k, {})
    node[last] = "auto"
    out, done = stand_in_autos(data)
    assert done == [path] and "auto" not in json.dumps(out)


def test_validate_says_when_max_in_cpu_keeps_parameters_off_the_drive(tmp_path, capsys):
    """The HF template leaves max_in_cpu at DeepSpeed's 1e9: a note says so."""
    assert main(["validate", write(tmp_path, HF_TEMPLATE)]) == 0
    assert "max_in_cpu=1000000000" in capsys.readouterr().err
    cfg = json.loads(json.dumps(HF_TEMPLATE))
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 0
    assert main(["validate", write(tmp_path, cfg)]) == 0
    assert "max_in_cpu" not in capsys.readouterr().err
