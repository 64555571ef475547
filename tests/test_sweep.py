"""aio-sweep: a tiny real run, the search logic on a synthetic drive, errors
before any I/O, cleanup on interrupt, and output that pastes into configs."""

import errno
import json
import os
import random
import types
import warnings

import pytest

from aio import sweep as sw
from aio.config import load_config

TINY = [
    "--io-size",
    "2M",
    "--block-sizes",
    "256K,1M",
    "--queue-depths",
    "2,8",
    "--threads",
    "1,2",
    "--repeats",
    "1",
    "--no-fio",
]


def _leftovers(d):
    return [p for p in os.listdir(d) if p.startswith("aio-sweep") or p.startswith(".aio-sweep")]


def test_tiny_real_sweep(tmp_path, capsys):
    j = tmp_path / "trials.json"
    d = tmp_path / "drive"
    d.mkdir()
    assert sw.main([str(d), *TINY, "--json", str(j)]) == 0
    out = capsys.readouterr().out
    block = json.loads(out[out.index("{") :])
    assert set(block["aio"]) == {
        "block_size",
        "queue_depth",
        "intra_op_parallelism",
        "single_submit",
        "overlap_events",
    }
    assert isinstance(block["aio"]["single_submit"], bool)
    cfg = load_config(block)  # pastes into aio.config unchanged
    assert cfg.aio.to_deepspeed()["block_size"] == block["aio"]["block_size"]
    data = json.loads(j.read_text())
    assert data["best"] == block["aio"] and len(data["trials"]) >= 2
    assert {t["direction"] for t in data["trials"]} == {"read", "write"}
    assert all(t["gbps"] > 0 for t in data["trials"])
    assert _leftovers(d) == []


def test_emit_config_prints_only_the_block(tmp_path, capsys):
    assert sw.main([str(tmp_path), *TINY, "--read-only", "--emit-config"]) == 0
    out = capsys.readouterr().out
    block = json.loads(out)  # nothing but JSON on stdout
    assert "aio" in block


def test_block_loads_in_deepspeed(tmp_path, capsys):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install .[deepspeed])")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    assert sw.main([str(tmp_path), *TINY, "--write-only", "--emit-config"]) == 0
    out = capsys.readouterr().out  # DeepSpeed's import may log to stdout first
    block = json.loads(out[out.index('{\n  "aio"') :])
    got = get_aio_config(block)
    for k, v in block["aio"].items():
        assert got[k] == v


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    png = tmp_path / "s.png"
    assert sw.main([str(tmp_path), *TINY, "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


# -- the search on a synthetic drive (no I/O): smart vs exhaustive ----------------


def _landscape(s: sw.Setting, direction: str) -> float:
    """GB/s of an imaginary drive: saturates with bytes in flight, threads help
    a little, single_submit costs a little, and overlap helps a little."""
    inflight = s.block_size * s.queue_depth * s.thread_count
    base = 3.0 * (1 - 2.718 ** (-inflight / (8 << 20)))
    base *= 1.0 - 0.04 * s.single_submit + 0.03 * s.overlap_events + 0.02 * (s.thread_count == 2)
    base *= 1.0 if direction == "read" else 0.8
    return base / (1 + 0.00000002 * s.block_size)  # very large blocks lose a bit


class FakeDrive(sw.Drive):
    def __init__(self, noise: float, seed: int) -> None:
        super().__init__(["/fake"], 256 << 20, False)
        self.paths = ["/fake/f"]
        self.rng = random.Random(seed)
        self.noise = noise
        self.calls = 0

    def run(self, s, direction):
        self.calls += 1
        g = _landscape(s, direction) * (1 + self.rng.uniform(-self.noise, self.noise))
        return self.io_size / (g * 1e9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_smart_search_finds_near_best_in_quarter_of_trials(seed):
    space = sw.Space(
        [128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20],
        [4, 8, 16, 32, 64],
        [1, 2, 4],
        [False, True],
        [True, False],
    )
    ex_drive, sm_drive = FakeDrive(0.03, seed), FakeDrive(0.03, seed + 100)
    ex = sw.Sweep(ex_drive, space, ["read", "write"], repeats=2, seed=seed, quiet=True)
    ex.exhaustive()
    sm = sw.Sweep(sm_drive, space, ["read", "write"], repeats=2, seed=seed, quiet=True)
    sm.smart()
    truth = {s: 2 / (1 / _landscape(s, "read") + 1 / _landscape(s, "write")) for s in space.all()}
    best_true = max(truth.values())
    assert truth[sm.best()] >= 0.95 * truth[ex.best()]
    assert truth[sm.best()] >= 0.95 * best_true
    assert sm_drive.calls <= ex_drive.calls / 4, (sm_drive.calls, ex_drive.calls)


def test_budget_stops_early():
    space = sw.Space([1 << 20, 4 << 20], [4, 8], [1], [False], [True])
    s = sw.Sweep(FakeDrive(0.0, 0), space, ["read"], repeats=3, budget_seconds=0.0, quiet=True)
    s.smart()
    assert s.out_of_budget and len(s.trials) == 0


# -- errors before any I/O ----------------------------------------------------------


def test_missing_dir(tmp_path, capsys):
    assert sw.main([str(tmp_path / "nope"), *TINY]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_file_instead_of_dir(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert sw.main([str(f), *TINY]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_not_enough_space(tmp_path, capsys):
    assert sw.main([str(tmp_path), "--io-size", "1000T", "--no-fio"]) == 2
    err = capsys.readouterr().err
    assert "free" in err and "--io-size" in err
    assert _leftovers(tmp_path) == []


def _no_o_direct(monkeypatch):
    """The filesystem refuses O_DIRECT: F_SETFL with O_DIRECT fails with EINVAL."""
    import fcntl

    from aio import _cli

    def refuse_direct(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return fcntl.fcntl(fd, cmd, arg)

    fake = types.SimpleNamespace(F_GETFL=fcntl.F_GETFL, F_SETFL=fcntl.F_SETFL, fcntl=refuse_direct)
    monkeypatch.setattr(_cli, "fcntl", fake)


def test_no_o_direct_refused_unless_allowed(tmp_path, capsys, monkeypatch):
    _no_o_direct(monkeypatch)
    assert sw.main([str(tmp_path), *TINY]) == 2
    assert "--allow-buffered" in capsys.readouterr().err
    assert _leftovers(tmp_path) == []
    d = sw.Drive([str(tmp_path)], 1 << 20, allow_buffered=True)
    d.check()
    assert d.buffered


@pytest.mark.parametrize(
    "argv",
    [
        ["--block-sizes", "1000"],
        ["--queue-depths", "0"],
        ["--threads", "x"],
        ["--io-size", "100"],
        ["--repeats", "0"],
        ["--single-submit", "maybe"],
    ],
)
def test_bad_arguments(tmp_path, argv):
    with pytest.raises(SystemExit) as ei:
        sw.main([str(tmp_path), *argv])
    assert ei.value.code == 2


def test_interrupt_cleans_up(tmp_path, monkeypatch, capsys):
    calls = {"n": 0}
    real = sw.Drive.run

    def interrupted(self, s, d):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, s, d)

    monkeypatch.setattr(sw.Drive, "run", interrupted)
    assert sw.main([str(tmp_path), *TINY]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert _leftovers(tmp_path) == []
