"""aio.config.gradients: where fp32 gradients wait for the step under
``aio_zero.gradients`` and ``host_memory_budget``; the estimate and the engine
take the same decision."""

import json
import warnings

import pytest

from aio.config import ConfigError, load_train_config
from aio.config.gradients import host_memory_budget, place_gradients, warn_if_over_budget

GIB = 1 << 30


def _cfg(tmp_path, optimizer="nvme", **aio_zero):
    z = {"stage": 3, "offload_optimizer": {"device": optimizer}}
    if optimizer == "nvme":
        z["offload_optimizer"]["nvme_path"] = str(tmp_path)
    return {"zero_optimization": z, "aio_zero": aio_zero}


def test_budget_is_a_fraction_of_available_or_bytes():
    assert host_memory_budget(0.5, available=10 * GIB) == 5 * GIB
    assert host_memory_budget(1, available=10 * GIB) == 10 * GIB
    assert host_memory_budget(3 * GIB, available=10 * GIB) == 3 * GIB
    assert host_memory_budget(0.25) > 0  # this machine's available memory


@pytest.mark.parametrize("bad", [0, -1, 2.5, "half", True])
def test_bad_budget_names_the_key(tmp_path, bad):
    with pytest.raises(ConfigError, match="aio_zero.host_memory_budget"):
        load_train_config(_cfg(tmp_path, host_memory_budget=bad))


def test_auto_keeps_gradients_in_memory_within_the_budget(tmp_path):
    cfg = load_train_config(_cfg(tmp_path))
    assert cfg.aio_zero.gradients == "auto" and cfg.aio_zero.host_memory_budget == 0.5
    # 1e9 parameters: 4 GB of gradients + 1 GiB of buffers within half of 12 GiB
    p = place_gradients(cfg, 10**9, GIB, available=12 * GIB)
    assert (p.where, p.setting, p.nbytes, p.budget) == ("cpu", "auto", 4 * 10**9, 6 * GIB)
    assert not p.over_budget and p.in_memory_bytes == p.nbytes
    assert "fit the budget" in p.reason and "host_memory_budget 0.5" in p.reason


def test_auto_puts_gradients_on_the_drive_past_the_budget(tmp_path):
    cfg = load_train_config(_cfg(tmp_path))
    # 3.2e9 parameters: 12.8 GB of gradients do not fit half of 24 GiB
    p = place_gradients(cfg, 3_200_000_000, 2 * GIB, available=24 * GIB)
    assert (p.where, p.setting, p.in_memory_bytes) == ("nvme", "auto", 0)
    assert "exceed the budget" in p.reason and "8 more bytes of drive I/O" in p.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_over_budget(p)  # auto stays within: no warning


def test_bytes_budget_decides_at_the_boundary(tmp_path):
    cfg = load_train_config(_cfg(tmp_path, host_memory_budget=5000))
    assert place_gradients(cfg, 1000, 1000).where == "cpu"  # 4000 + 1000 == 5000
    assert place_gradients(cfg, 1000, 1001).where == "nvme"


def test_explicit_cpu_past_the_budget_warns_and_stays(tmp_path):
    cfg = load_train_config(_cfg(tmp_path, gradients="cpu", host_memory_budget=1000))
    p = place_gradients(cfg, 10**6, 0)
    assert p.where == "cpu" and p.over_budget
    want = "'cpu' holds 3.8 MiB of fp32 gradients.*'auto' would put them on the drive"
    with pytest.warns(UserWarning, match=want):
        warn_if_over_budget(p)


def test_buffers_alone_past_the_budget_warn(tmp_path):
    cfg = load_train_config(_cfg(tmp_path, host_memory_budget=1000))
    p = place_gradients(cfg, 10, 5000)
    assert p.where == "nvme"
    want = "past the host-memory budget of 1000 B .* even with the gradients on the drive"
    with pytest.warns(UserWarning, match=want):
        warn_if_over_budget(p)


def test_explicit_nvme_and_optimizer_in_memory(tmp_path):
    cfg = load_train_config(_cfg(tmp_path, gradients="nvme"))
    assert place_gradients(cfg, 10, 0).where == "nvme"
    mem = place_gradients(load_train_config(_cfg(tmp_path, optimizer="cpu", host_memory_budget=1)), 10**12, 0)
    assert (mem.where, mem.setting) == ("cpu", "optimizer in memory")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_over_budget(mem)


@pytest.mark.parametrize("budget,where", [(10**12, "cpu"), (10**6, "nvme")])
def test_aio_config_estimate_prints_the_placement(tmp_path, capsys, budget, where):
    from aio.config.__main__ import main

    cfg = _cfg(tmp_path, host_memory_budget=budget)
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 4
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    args = ["estimate", str(path), "--params", "1e8", "--dtype", "bf16"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"fp32 gradients: {where} (auto: 381.5 MiB of gradients" in text
    assert ("fp32 gradients (aio_zero.gradients)" in text) == (where == "cpu")
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gradients"]["where"] == where and data["gradients"]["bytes"] == 4 * 10**8
    assert data["cpu"].get("fp32 gradients (aio_zero.gradients)", 0) == (4 * 10**8 if where == "cpu" else 0)


def test_aio_config_estimate_of_a_config_aio_zero_refuses_notes_it(tmp_path, capsys):
    """An offload config aio.zero would not train (stage 2 here) still gets its
    estimate, with a note instead of a gradient placement."""
    from aio.config.__main__ import main

    cfg = _cfg(tmp_path)
    cfg["zero_optimization"]["stage"] = 2
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert main(["estimate", str(path), "--params", "1e6", "--dtype", "fp32"]) == 0
    out, err = capsys.readouterr()
    assert "pinned CPU memory per process" in out and "fp32 gradients:" not in out
    assert "gradient placement not estimated, not an aio.zero config" in err
