"""Memory estimate before allocation, and the aio-config CLI."""

import json
import re

import pytest

from aio.config import dtype_bytes, estimate_memory, load_config
from aio.config.__main__ import main as config_main

CFG = {
    "zero_optimization": {
        "stage": 3,
        "sub_group_size": 1e8,
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/p",
            "buffer_count": 5,
            "buffer_size": 1e7,
            "max_in_cpu": 1e6,
        },
        "offload_optimizer": {"device": "nvme", "nvme_path": "/o", "buffer_count": 4},
    }
}


RESIDENT = "offload_param in CPU (max_in_cpu, small)"


def _pages(n):
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    return -(-n // page) * page


def _pool(count, n):
    """A pool of `count` buffers of `n` bytes: one allocation, locked as one."""
    from aio.pinned import locked_size

    return locked_size(count * _pages(n))


def test_estimate_components():
    est = estimate_memory(CFG, 1e9, "bf16")
    assert est.pinned["offload_param buffers"] == _pool(5, 10**7 * 2)
    assert est.pinned[RESIDENT] == _pages(10**6 * 2)
    # Each optimizer buffer holds ONE fp32 tensor of the largest sub-group
    # (DeepSpeed's meaning; it used to be a whole sub-group with its states).
    assert est.pinned["offload_optimizer buffers"] == _pool(4, 10**8 * 4)
    assert est.pinned_bytes == sum(est.pinned.values())
    assert est.nvme == {"/p": (10**9 - 10**6) * 2, "/o": 10**9 * 16}
    assert "pinned CPU memory per process" in est.format()


def test_estimate_predicts_peak_rss_from_buffers_and_working_set():
    from aio.config.memory import RUNTIME_BYTES

    est = estimate_memory(CFG, 1e9, "bf16")
    sub = 10**8  # min(sub_group_size, params)
    assert est.working == {
        "runtime (python, torch, aio)": RUNTIME_BYTES,
        "largest tensors in use (3 x fp32)": 3 * 4 * sub,
    }
    assert est.peak_rss_bytes == est.cpu_bytes + RUNTIME_BYTES + 12 * sub
    assert "--activations" in est.format()  # unknown activations are said to be missing
    with_act = estimate_memory(CFG, 1e9, "bf16", activation_bytes=5 << 20)
    assert with_act.peak_rss_bytes == est.peak_rss_bytes + (5 << 20)
    # what the gradient budget counts for aio itself: all but the activations
    assert with_act.held_bytes == est.held_bytes == est.peak_rss_bytes
    assert "--activations" not in with_act.format() and with_act.as_dict()["peak_rss_bytes"] > 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="activation_bytes"):
            estimate_memory(CFG, 1e9, "bf16", activation_bytes=bad)


def test_estimate_small_model_caps_subgroup_and_resident():
    est = estimate_memory(CFG, 1000, "fp32")
    assert est.pinned["offload_optimizer buffers"] == 4 * 4096
    assert est.pinned[RESIDENT] == _pages(1000 * 4)
    assert "offload_param buffers" not in est.pinned  # all in CPU: never allocated


def test_estimate_from_parameter_sizes_is_exact():
    from aio.config.memory import largest_subgroup

    cfg = {
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 2_000_000,
            "stage3_param_persistence_threshold": 2000,
            "offload_param": {
                "device": "nvme",
                "nvme_path": "/p",
                "buffer_count": 3,
                "buffer_size": 1 << 20,
                "max_in_cpu": 1_500_000,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": "/o", "buffer_count": 6},
        }
    }
    numels = [1 << 20, 1024] * 3 + [16384, 16]
    # aio packs a sub-group until the next parameter would not fit
    big = (1 << 20) + 1024 + 16384 + 16  # the last layer joins the last sub-group
    assert largest_subgroup(numels, 2_000_000) == big
    est = estimate_memory(cfg, None, "fp32", param_numels=numels)
    assert est.num_params == sum(numels)
    # first layer in CPU (then max_in_cpu is passed: the rest go to the drive), biases too
    assert est.pinned[RESIDENT] == _pages(4 << 20) + 3 * 4096 + 4096
    assert est.pinned["offload_param buffers"] == _pool(3, 4 << 20)
    assert est.pinned["offload_optimizer buffers"] == _pool(6, big * 4)
    same = estimate_memory(cfg, sum(numels), "fp32", largest_subgroup_numel=big)
    assert same.pinned["offload_optimizer buffers"] == est.pinned["offload_optimizer buffers"]
    with pytest.raises(ValueError, match="num_params or param_numels"):
        estimate_memory(cfg, None)


def test_estimate_unpinned_and_cpu_devices():
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": False},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        }
    }
    est = estimate_memory(cfg, 100, "fp16")
    # aio never locks the optimizer's state in CPU memory, pin_memory or not
    assert est.cpu == {
        "offload_param (all in CPU; pinned for a GPU model)": 200,
        "offload_optimizer (all in CPU)": 1600,
    }
    assert est.pinned == {}
    assert est.nvme == {}


def test_check_against_machine(tmp_path, monkeypatch):
    # A machine of known size, so the answer does not depend on where the
    # suite runs (a 128 GiB GPU host holds the "huge" pinned pools below).
    import collections

    import psutil

    mem = collections.namedtuple("mem", "available total")(8 << 30, 16 << 30)
    disk = collections.namedtuple("disk", "total used free")(100 << 30, 0, 100 << 30)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem)
    monkeypatch.setattr(psutil, "disk_usage", lambda path: disk)
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        }
    }
    assert estimate_memory(cfg, 1000).check() == []
    huge = estimate_memory(cfg, 10**15)
    problems = huge.check()
    assert any("drive space" in p for p in problems)
    assert any("CPU memory" in p for p in problems)
    with pytest.warns(ResourceWarning):
        huge.warn()


@pytest.mark.parametrize("bad", [0, -5, 1.5, "many", True])
def test_bad_num_params(bad):
    with pytest.raises((ValueError, TypeError)):
        estimate_memory(CFG, bad)


def test_dtypes():
    torch = pytest.importorskip("torch")
    assert dtype_bytes("bf16") == 2 and dtype_bytes(torch.float32) == 4 and dtype_bytes(8) == 8
    with pytest.raises(ValueError, match="accepted"):
        dtype_bytes("fp12")


def test_cli_estimate_and_validate(tmp_path, capsys):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(CFG))
    assert config_main(["estimate", str(p), "--params", "1e9", "--dtype", "bf16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pinned_bytes"] == estimate_memory(load_config(CFG), 1e9, "bf16").pinned_bytes
    assert config_main(["validate", str(p)]) == 0
    capsys.readouterr()
    sizes = ["--param-numels", "1e6x3,1000", "--largest-subgroup", "2e6", "--json"]
    assert config_main(["estimate", str(p), *sizes]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_params"] == 3 * 10**6 + 1000 and out["dtype_bytes"] == 4  # no fp16/bf16 block: fp32
    assert out["pinned"]["offload_optimizer buffers"] == _pool(4, 8 * 10**6)
    assert config_main(["estimate", str(p), "--params", "1e9", "--activations", "64M"]) == 0
    text = capsys.readouterr().out
    assert "predicted peak RSS" in text and re.search(r"activations +64\.0 MiB", text)
    with pytest.raises(SystemExit):
        config_main(["estimate", str(p), "--param-numels", "12x0"])
    with pytest.raises(SystemExit):
        config_main(["estimate", str(p)])  # a size is required
    capsys.readouterr()
    too_many = (
        ["--params", "1e30"],
        ["--params", "1e9", "--largest-subgroup", "1e30"],
        ["--param-numels", "1e15x10"],
    )
    for args in too_many:  # printed exabytes of drive space
        with pytest.raises(SystemExit):
            config_main(["estimate", str(p), *args])
        assert "at most 9.0e+15 (2**53) elements" in capsys.readouterr().err
    p.write_text(json.dumps({"aio": {"queue_depth": 0}}))
    assert config_main(["validate", str(p)]) == 2
    assert "aio.queue_depth" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,key",
    [
        ('"gradient_clipping": NaN', "gradient_clipping"),
        ('"gradient_clipping": "1.0"', "gradient_clipping"),
        ('"gradient_accumulation_steps": Infinity', "gradient_accumulation_steps"),
        ('"optimizer": {"type": "AdamW", "params": {"lr": NaN}}', "optimizer.params"),
    ],
)
def test_cli_validate_checks_training_keys(tmp_path, capsys, extra, key):
    # validate must refuse what aio.zero.initialize refuses.
    p = tmp_path / "c.json"
    p.write_text('{"zero_optimization": {"stage": 3}, ' + extra + "}")
    assert config_main(["validate", str(p)]) == 2
    assert key in capsys.readouterr().err


def _estimate_cli(tmp_path, capsys, extra, *args):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({**CFG, **extra}))
    capsys.readouterr()
    rc = config_main(["estimate", str(p), "--params", "1e9", *args])
    return rc, capsys.readouterr()


HF_AUTO = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}


def test_cli_estimate_says_the_dtype_it_assumes_for_auto(tmp_path, capsys):
    rc, out = _estimate_cli(tmp_path, capsys, HF_AUTO)
    assert rc == 0
    first = out.out.splitlines()[0]
    assert first.startswith("parameter dtype: fp32 (assumed: bf16.enabled and fp16.enabled are 'auto'")
    assert "--dtype bf16" in first and "4 bytes each" in out.out
    rc, out = _estimate_cli(tmp_path, capsys, HF_AUTO, "--dtype", "bf16", "--json")
    got = json.loads(out.out)
    assert rc == 0 and got["dtype"] == "bf16" and got["dtype_bytes"] == 2
    assert got["dtype_source"].startswith("from --dtype")
    assert got["pinned_bytes"] == estimate_memory(load_config(CFG), 1e9, "bf16").pinned_bytes


@pytest.mark.parametrize(
    "extra,flag,dtype",
    [
        ({}, None, "fp32"),  # no precision block: DeepSpeed trains fp32
        ({}, "bf16", "bf16"),  # ... and --dtype may say otherwise (Lightning adds the block)
        ({"bf16": {"enabled": True}}, None, "bf16"),
        ({"bfloat16": {"enabled": True}}, "bf16", "bf16"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": False}}, None, "fp16"),
        ({"bf16": {"enabled": False}}, "fp16", "fp16"),
        ({"fp16": {"enabled": "auto"}}, "fp16", "fp16"),
    ],
)
def test_cli_estimate_dtype_from_config_or_flag(tmp_path, capsys, extra, flag, dtype):
    rc, out = _estimate_cli(tmp_path, capsys, extra, *(["--dtype", flag] if flag else []), "--json")
    got = json.loads(out.out)
    assert rc == 0 and got["dtype"] == dtype and got["dtype_bytes"] == dtype_bytes(dtype)


@pytest.mark.parametrize(
    "extra,flag,text",
    [
        ({"bf16": {"enabled": True}}, "fp32", "--dtype fp32 conflicts with bf16.enabled: true"),
        ({"fp16": {"enabled": True}}, "bf16", "--dtype bf16 conflicts with fp16.enabled: true"),
        ({"bf16": {"enabled": False}}, "bf16", "--dtype bf16 conflicts with bf16.enabled: false"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, None, "both true"),
    ],
)
def test_cli_estimate_dtype_conflicts_are_errors(tmp_path, capsys, extra, flag, text):
    rc, out = _estimate_cli(tmp_path, capsys, extra, *(["--dtype", flag] if flag else []))
    assert rc == 2 and text in out.err and out.out == ""


def test_cli_estimate_refuses_other_dtypes(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _estimate_cli(tmp_path, capsys, {}, "--dtype", "fp8")
    assert "invalid choice" in capsys.readouterr().err


def test_cli_estimate_auto_threshold_is_named(tmp_path, capsys):
    cfg = json.loads(json.dumps(CFG))
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = "auto"
    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg))
    assert config_main(["estimate", str(p), "--param-numels", "1e6x3"]) == 2
    err = capsys.readouterr().err
    assert "zero_optimization.stage3_param_persistence_threshold: 'auto'" in err and "hidden_size" in err


def test_estimate_spreads_drive_bytes_over_a_list_of_drives():
    cfg = json.loads(json.dumps(CFG))
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = ["/o1", "/o2", "/o3"]
    est = estimate_memory(cfg, 1e9 + 1, "bf16")
    total = (10**9 + 1) * 16
    assert [est.nvme[p] for p in ("/o1", "/o2", "/o3")] == [total // 3 + 1, total // 3 + 1, total // 3]
    assert sum(est.nvme[p] for p in ("/o1", "/o2", "/o3")) == total
    assert load_config(cfg).nvme_paths() == ["/p", "/o1", "/o2", "/o3"]


def test_cli_validate_says_deepspeed_takes_one_directory(tmp_path, capsys):
    cfg = json.loads(json.dumps(CFG))
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = ["/o1", "/o2"]
    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg))
    assert config_main(["validate", str(p), "--resolved"]) == 0
    out = capsys.readouterr()
    resolved = json.loads(out.out.partition("\n")[2])
    assert resolved["zero_optimization"]["offload_optimizer"]["nvme_path"] == ["/o1", "/o2"]
    assert "offload_optimizer.nvme_path lists 2 drives" in out.err and "DeepSpeed" in out.err
    assert "offload_param.nvme_path lists" not in out.err


@pytest.mark.parametrize("gradients,slot", [("nvme", 4), ("cpu", 0)])
def test_cli_estimate_counts_bf16_states_at_two_bytes(tmp_path, capsys, gradients, slot):
    # Gradients held in memory have no slot on the drive (4 B/param less).
    cfg = json.loads(json.dumps(CFG))
    p = tmp_path / "c.json"
    sizes = {}
    for states in ("fp32", "bf16"):
        cfg["aio_zero"] = {"optimizer_states": states, "gradients": gradients}
        p.write_text(json.dumps(cfg))
        assert config_main(["estimate", str(p), "--params", "1e9", "--dtype", "bf16", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        sizes[states] = (out["nvme"]["/o"], out["pinned_bytes"])
    assert sizes["fp32"][0] == 10**9 * (12 + slot) and sizes["bf16"][0] == 10**9 * (8 + slot)
    assert sizes["fp32"][1] == sizes["bf16"][1]  # the buffers hold float32 either way


def _residency_per_tensor(numels, threshold, max_in_cpu, b, page):
    """ParamSwapper's rule one parameter at a time (the reference the runs must match)."""
    locked = resident = on_drive = 0
    full = False
    for n in numels:
        small = n < threshold
        if not small and not full and resident + n > max_in_cpu:
            full = True
        if small or not full:
            locked += -(-n * b // page) * page
            resident += 0 if small else n
        else:
            on_drive += 1
    return locked, resident, on_drive


def _largest_per_tensor(numels, sub_group_size):
    best = cur = 0
    for n in numels:
        if cur and cur + n > sub_group_size:
            cur = 0
        cur += n
        best = max(best, cur)
    return best


def test_runs_of_sizes_match_one_tensor_at_a_time():
    """--param-numels keeps (size, count) runs: the sub-group packing and the
    CPU residency computed per run equal the per-tensor rules."""
    import random

    from aio.config.memory import (
        _largest_subgroup_runs,
        _page,
        _param_residency,
        numel_runs,
    )

    rng = random.Random(7)
    for _ in range(300):
        sizes = [rng.choice([1, 3, 100, 1000, 4096, 5000]) for _ in range(rng.randint(1, 6))]
        numels = [rng.choice(sizes) for _ in range(rng.randint(1, 60))]
        runs = numel_runs(numels)
        assert sum(k for _, k in runs) == len(numels)
        for sub in (1, 50, 1000, 4096, 9000, 10**6):
            assert _largest_subgroup_runs(runs, sub) == _largest_per_tensor(numels, sub), (numels, sub)
        for threshold, max_in_cpu in ((0, 0), (200, 5000), (1, 10**9), (5000, 20000)):
            want = _residency_per_tensor(numels, threshold, max_in_cpu, 4, _page())
            assert _param_residency(runs, threshold, max_in_cpu, 4) == want, (numels, threshold, max_in_cpu)


def test_cli_param_numels_with_a_huge_count_is_quick(tmp_path):
    """`--param-numels 1024x300000000` built a list of 3e8 entries (minutes and
    gigabytes): the runs are kept as they are given."""
    import subprocess
    import sys

    p = tmp_path / "c.json"
    p.write_text(json.dumps(CFG))
    cmd = [sys.executable, "-m", "aio.config", "estimate", str(p), "--param-numels", "1024x300000000,7"]
    r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_params"] == 1024 * 300_000_000 + 7
    same = estimate_memory(CFG, None, "fp32", param_numel_runs=[(1024, 300_000_000), (7, 1)])
    assert json.loads(r.stdout)["pinned_bytes"] == same.pinned_bytes
    with pytest.raises(SystemExit):
        config_main(["estimate", str(p), "--param-numels", "1e400x2"])  # was an OverflowError traceback


def test_cli_estimate_names_a_misspelt_key_it_did_not_read(tmp_path, capsys):
    """A misspelt key changes the estimate (sub_grup_size: the default
    sub-group size, 1000x the buffers): estimate says it ignored it and
    what it looks like, as validate does."""
    cfg = json.loads(json.dumps(CFG))
    cfg["zero_optimization"]["sub_grup_size"] = cfg["zero_optimization"].pop("sub_group_size", 10**6)
    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg))
    assert config_main(["estimate", str(p), "--params", "1e9"]) == 0
    err = capsys.readouterr().err
    assert "zero_optimization.sub_grup_size (did you mean zero_optimization.sub_group_size?)" in err


def test_cli_validate_notes_an_nvme_path_missing_here(tmp_path, capsys):
    """validate accepts a config naming another machine's drives, but says
    when an nvme_path is no directory here (aio.zero would refuse it)."""
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nope")},
        }
    }
    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg))
    assert config_main(["validate", str(p)]) == 0
    err = capsys.readouterr().err
    assert f"offload_optimizer.nvme_path {tmp_path / 'nope'} is not an existing directory here" in err
    (tmp_path / "nope").mkdir()
    assert config_main(["validate", str(p)]) == 0
    assert "not an existing directory" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,text",
    [
        # printed as 99999999999999991611392.0 TiB of activations, exit 0
        (["--params", "1e9", "--activations", "99999999999999999999999T"], "--activations: at most 8 PiB"),
        (["--params", "1e9", "--activations", str(2**53 + 1)], "--activations: at most 8 PiB"),
        # a sub-group is some of the parameters: 130967.2 TiB of pinned buffers, exit 0
        (
            ["--params", "1e9", "--largest-subgroup", "9e15"],
            "--largest-subgroup 9,000,000,000,000,000 is more than the 1,000,000,000",
        ),
        (
            ["--param-numels", "1e6x3", "--largest-subgroup", "3000001"],
            "--largest-subgroup 3,000,001 is more than the 3,000,000",
        ),
    ],
)
def test_cli_estimate_refuses_sizes_past_what_they_can_be(tmp_path, capsys, args, text):
    """Every numeric option of aio-config estimate is bounded as --params is
    (4c8a5b4): one line naming the option, exit 2, nothing estimated."""
    p = tmp_path / "c.json"
    p.write_text(json.dumps(CFG))
    with pytest.raises(SystemExit) as ex:
        config_main(["estimate", str(p), *args])
    out = capsys.readouterr()
    assert ex.value.code == 2 and out.out == ""
    (line,) = out.err.splitlines()
    assert line.startswith("aio-config") and text in line, line
    assert config_main(["estimate", str(p), "--params", "1e9", "--activations", "8192T"]) == 0  # 8 PiB: taken
    assert config_main(["estimate", str(p), "--params", "1e9", "--largest-subgroup", "1e9"]) == 0


def test_a_largest_subgroup_past_the_parameters_is_refused():
    with pytest.raises(ValueError, match="largest_subgroup_numel"):
        estimate_memory(CFG, 1e9, largest_subgroup_numel=1e9 + 1)
    estimate_memory(CFG, 1e9, largest_subgroup_numel=1e9)
