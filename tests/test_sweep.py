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
        "engine",
    }
    assert isinstance(block["aio"]["single_submit"], bool)
    cfg = load_config(block)  # pastes into aio.config unchanged
    assert cfg.aio.to_deepspeed()["block_size"] == block["aio"]["block_size"]
    assert cfg.aio.engine == block["aio"]["engine"] in sw.ENGINE_TAGS
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
        if k == "engine":  # aio's own key: DeepSpeed reads the others and ignores it
            assert k not in got
            continue
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


class EngineDrive(FakeDrive):
    """io_uring 10% faster than kernel AIO at every setting."""

    def run(self, s, direction):
        return super().run(s, direction) / (1.1 if s.engine == "io_uring" else 1.0)


def test_engine_is_a_dimension_of_the_search_and_of_the_block():
    from aio.config import load_config

    space = sw.Space([256 << 10, 1 << 20], [8, 32], [1, 2], [False], [True], ["kernel_aio", "io_uring"])
    assert space.size() == 16 and {s.engine for s in space.all()} == {"kernel_aio", "io_uring"}
    sm = sw.Sweep(EngineDrive(0.0, 0), space, ["read", "write"], repeats=1, quiet=True)
    sm.smart()
    assert {t.setting.engine for t in sm.trials if t.stage == "coarse"} == {"kernel_aio"}
    assert {t.setting.engine for t in sm.trials if t.stage == "refine"} == {"kernel_aio", "io_uring"}
    best = sm.best()
    assert best.engine == "io_uring" and "uring" in best.short()
    block = load_config({"aio": best.aio_block()}).aio
    assert block.engine == "io_uring" and block.handle_kwargs()["engine"] == "io_uring"


def test_engines_flag_refuses_an_unknown_engine(capsys):
    with pytest.raises(SystemExit):
        sw.build_parser().parse_args(["--engines", "spdk"])
    assert "unknown engine 'spdk'" in capsys.readouterr().err


def test_progress_fits_the_terminal_and_names_each_stage(monkeypatch, capsys):
    """On a terminal the bar is redrawn in place (one line per stage, never
    one per trial), never wider than the terminal, and says which of the
    stages announced up front is running."""
    import shutil

    monkeypatch.setattr(sw.sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=None: os.terminal_size((60, 24)))
    space = sw.Space([128 << 10, 1 << 20, 4 << 20], [4, 16, 64], [1, 2], [False, True], [True, False])
    sm = sw.Sweep(FakeDrive(0.03, 0), space, ["read", "write"], repeats=2, quiet=False)
    plan = sm.plan("smart")
    assert plan.startswith("1. coarse") and "3. confirm" in plan
    sm.smart()
    sm.progress.close()
    err = capsys.readouterr().err
    lines = err.split("\n")
    assert len(lines) == 4 and lines[-1] == "", lines  # one finished line per stage
    for line in lines[:-1]:
        for frame in line.split("\r")[1:]:
            assert len(frame.replace("\x1b[K", "")) <= 59, frame
    for i, stage in enumerate(("coarse", "refine", "confirm"), 1):
        assert f"{stage}, stage {i} of 3" in lines[i - 1]


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


def test_block_sizes_larger_than_a_trial_left_out(tmp_path, capsys):
    # Every block size past --io-size moves the trial in one request: they
    # measured the same, and one of them could be printed as the best.
    with pytest.raises(SystemExit) as ei:
        sw.main([str(tmp_path), "--io-size", "1M", "--block-sizes", "4M,2M"])
    assert ei.value.code == 2 and "each is larger than --io-size" in capsys.readouterr().err
    argv = [str(tmp_path), "--io-size", "1M", "--block-sizes", "512K,1M,2M,4M"]
    ap = sw.build_parser()
    ns = ap.parse_args(argv)
    space = sw.validate_args(ap, ns)
    assert space.block_sizes == [512 << 10, 1 << 20]
    assert any("2097152, 4194304 left out: larger than --io-size" in n for n in ns.engine_notes)


def test_space_past_the_system_aio_limit_refused_before_measuring(tmp_path, monkeypatch, capsys):
    # io_setup failed with EAGAIN mid-sweep (queue depth x threads past
    # fs.aio-max-nr) and exit 2 lost every measurement: refused up front.
    limits = {"/proc/sys/fs/aio-max-nr": 65536, "/proc/sys/fs/aio-nr": 1000}
    monkeypatch.setattr(sw, "_read_int", limits.get)
    argv = [str(tmp_path), "--queue-depths", "16384", "--threads", "1,4", "--engines", "kernel_aio"]
    with pytest.raises(SystemExit) as ei:
        sw.main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "65536 kernel AIO events" in err and "fs.aio-max-nr is 65536" in err
    assert _leftovers(tmp_path) == []
    ns = sw.build_parser().parse_args([str(tmp_path), "--queue-depths", "16384", "--threads", "1,3"])
    sw._check_aio_events(sw.build_parser(), ns, ["kernel_aio"])  # 49152 fits
    ns.threads = [4]
    sw._check_aio_events(sw.build_parser(), ns, ["io_uring"])  # takes none


def test_tmpfs_refused_unless_allowed_and_warned(tmp_path, monkeypatch, capsys):
    # tmpfs takes O_DIRECT since Linux 6.6: the probe passed, and a sweep
    # there printed memory-copy rates as a drive's best block, with no word.
    monkeypatch.setattr(sw, "fs_type", lambda p: "tmpfs")
    assert sw.main([str(tmp_path), *TINY]) == 2
    err = capsys.readouterr().err
    assert "is on tmpfs, in memory" in err and "--allow-buffered" in err
    assert _leftovers(tmp_path) == []
    assert sw.main([str(tmp_path), *TINY, "--allow-buffered", "--no-fio"]) == 0
    assert "in memory (tmpfs/ramfs): its figures are memory copies" in capsys.readouterr().out
    d = sw.Drive([str(tmp_path)], 1 << 20, allow_buffered=True)
    d.check()
    assert d.memory == [True] and d.buffered


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_dev_shm_is_not_a_drive():
    if sw.fs_type("/dev/shm") not in sw.MEMORY_FILESYSTEMS:
        pytest.skip("/dev/shm is not tmpfs here")
    d = sw.Drive(["/dev/shm"], 1 << 20, allow_buffered=False)
    with pytest.raises(sw.SweepError, match="in memory"):
        d.check()


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


# -- several directories: each drive alone, the set together -------------------------


# Two configurations: a real search (coarse pass and head to head) that stays
# short, since every trial opens and closes one handle per drive.
TWO = [*TINY, "--block-sizes", "1M", "--threads", "1", "--single-submit", "false", "--overlap-events", "true"]


def _two_dirs(tmp_path):
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.mkdir()
    d2.mkdir()
    return str(d1), str(d2)


def test_two_dirs_same_device(tmp_path, capsys):
    d1, d2 = _two_dirs(tmp_path)
    j = tmp_path / "trials.json"
    assert sw.main([d1, d2, *TWO, "--json", str(j)]) == 0
    out = capsys.readouterr().out
    # The table: each drive alone, the set, the two ratios; and the plain note.
    assert "set of 2, together" in out and "set / best single" in out and "set / sum of singles" in out
    assert "scaling efficiency" in out
    assert f"{d1} and {d2} are on the same device" in out and "cannot beat one drive" in out
    # The snippet: the aio block and both paths as nvme_path of both offload blocks.
    block = json.loads(out[out.index('{\n  "aio"') :])
    for key in ("offload_param", "offload_optimizer"):
        assert block["zero_optimization"][key] == {"device": "nvme", "nvme_path": [d1, d2]}
    assert load_config({"aio": block["aio"]}).aio.to_deepspeed()["block_size"] == block["aio"]["block_size"]
    assert "DeepSpeed takes one string only" in out
    # The JSON: both drives and the set, consistent with each other.
    data = json.loads(j.read_text())
    assert [x["dir"] for x in data["drives"]] == [d1, d2] and data["set"]["dirs"] == [d1, d2]
    assert data["drives"][0]["st_dev"] == data["drives"][1]["st_dev"]
    assert any("same device" in n for n in data["notes"])
    for fig in [*data["drives"], data["set"]]:
        assert fig["read_gbps"] > 0 and fig["write_gbps"] > 0 and fig["score_gbps"] > 0
        assert len(fig["samples_gbps"]["read"]) == data["compare_rounds"] >= 3
    best = max(x["score_gbps"] for x in data["drives"])
    total = sum(x["score_gbps"] for x in data["drives"])
    assert data["set"]["vs_best_single"]["score"] == pytest.approx(data["set"]["score_gbps"] / best)
    assert data["set"]["scaling_efficiency"]["score"] == pytest.approx(data["set"]["score_gbps"] / total)
    assert data["compare_setting"] == data["best"] == block["aio"]
    assert _leftovers(d1) == [] and _leftovers(d2) == []


def test_two_dirs_given_settings_emit_config(tmp_path, capsys):
    """One setting given (no search): stdout is only the snippet, notes go to stderr."""
    d1, d2 = _two_dirs(tmp_path)
    fixed = ["--block-sizes", "1M", "--queue-depths", "8", "--threads", "1"]
    fixed += ["--single-submit", "false", "--overlap-events", "true"]
    assert sw.main([d1, d2, *TWO, *fixed, "--read-only", "--emit-config"]) == 0
    cap = capsys.readouterr()
    block = json.loads(cap.out)
    assert block["aio"]["block_size"] == 1 << 20 and block["aio"]["queue_depth"] == 8
    assert block["zero_optimization"]["offload_param"]["nvme_path"] == [d1, d2]
    assert "set of 2, together" in cap.err and "same device" in cap.err
    from aio.config import load_train_config

    load_train_config(block)  # the snippet passes our own validation (it lacked stage 3)


def test_set_trial_gives_each_drive_its_own_handle(tmp_path, monkeypatch):
    d1, d2 = _two_dirs(tmp_path)
    submits = []

    class Recording(sw.AsyncIOHandle):
        def async_pread(self, buffer, path, file_offset=0):
            submits.append((id(self), path, buffer.data_ptr()))
            return super().async_pread(buffer, path, file_offset)

    drive = sw.Drive([d1, d2], 1 << 20, allow_buffered=False)
    drive.check()
    drive.prepare(log=lambda *x: None)
    try:
        monkeypatch.setattr(sw, "AsyncIOHandle", Recording)
        assert drive.run(sw.Setting(1 << 20, 4, 1, False, True), "read") > 0
        assert len({h for h, _, _ in submits}) == 2  # one handle per drive
        assert sorted(p for _, p, _ in submits) == sorted(drive.fds)  # each its own file
        assert len({b for _, _, b in submits}) == 2  # and its own buffer
        submits.clear()
        drive.run(sw.Setting(1 << 20, 4, 1, False, True), "read", [1])  # one drive alone
        assert [p for _, p, _ in submits] == [drive.fds[1]]
    finally:
        drive.cleanup()


class TwoFakeDrives(sw.Drive):
    """Drive 0 does 2 GB/s alone, drive 1 1 GB/s, the two together 2.7 GB/s."""

    RATES = {(0,): 2.0, (1,): 1.0, (0, 1): 2.7}

    def __init__(self) -> None:
        super().__init__(["/fake0", "/fake1"], 1 << 30, False)
        self.paths = ["/fake0/f", "/fake1/f"]
        self.fds = [10, 11]
        self.calls: list[tuple[int, ...]] = []

    def run(self, s, direction, which=None):
        which = tuple(range(2)) if which is None else tuple(which)
        self.calls.append(which)
        rate = self.RATES[which] * (0.5 if direction == "write" else 1.0)
        return self.io_size * len(which) / (rate * 1e9)


def test_compare_figures_and_ratios():
    drive = TwoFakeDrives()
    s = sw.Setting(1 << 20, 8, 1, False, True)
    comp = sw.compare(drive, s, ["read", "write"], rounds=3)
    assert sorted(set(drive.calls)) == [(0,), (0, 1), (1,)] and len(drive.calls) == 3 * 3 * 2
    alone = comp.alone_rows()
    assert alone[0]["read"] == pytest.approx(2.0) and alone[1]["write"] == pytest.approx(0.5)
    st = comp.set_row()
    assert st["read"] == pytest.approx(2.7) and st["write"] == pytest.approx(1.35)
    assert st["score"] == pytest.approx(2 / (1 / 2.7 + 1 / 1.35))
    assert comp.vs_best_single()["read"] == pytest.approx(2.7 / 2.0)
    assert comp.efficiency()["read"] == pytest.approx(2.7 / 3.0)
    assert comp.efficiency()["write"] == pytest.approx(1.35 / 1.5)


def test_missing_second_dir_named_before_any_file(tmp_path, capsys, monkeypatch):
    d1, _ = _two_dirs(tmp_path)
    missing = str(tmp_path / "nope")
    created = []
    real_open = sw.open_scratch
    monkeypatch.setattr(sw, "open_scratch", lambda *a, **k: created.append(a) or real_open(*a, **k))
    assert sw.main([d1, missing, *TINY]) == 2
    err = capsys.readouterr().err
    assert f"{missing}: no such directory" in err
    assert created == [] and os.listdir(d1) == []  # not even the O_DIRECT probe in d1


def test_unwritable_dir_named(tmp_path, capsys, monkeypatch):
    d1, d2 = _two_dirs(tmp_path)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **k: p != d2 and real_access(p, m, **k))
    assert sw.main([d1, d2, *TINY]) == 2
    assert f"{d2}: not writable by this user" in capsys.readouterr().err
    assert os.listdir(d1) == [] and os.listdir(d2) == []


def test_same_dir_twice_refused(tmp_path, capsys):
    d1, _ = _two_dirs(tmp_path)
    assert sw.main([d1, d1 + "/", *TINY]) == 2
    assert "given twice" in capsys.readouterr().err
    assert os.listdir(d1) == []


def test_shared_filesystem_needs_room_for_every_file(tmp_path, capsys, monkeypatch):
    """Each directory alone has room for its file, the two together do not."""
    import shutil

    d1, d2 = _two_dirs(tmp_path)
    usage = shutil.disk_usage(d1)
    room = (2 << 20) + (64 << 20) + (1 << 20)  # one 2M file plus headroom, not two
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=room))
    assert sw.main([d1, d2, *TINY]) == 2
    err = capsys.readouterr().err
    assert "--io-size" in err and f"one file for each of {d1}, {d2}" in err
    assert os.listdir(d1) == [] and os.listdir(d2) == []


def test_notes_name_no_o_direct_and_memory(tmp_path, monkeypatch):
    d1, d2 = _two_dirs(tmp_path)
    _no_o_direct(monkeypatch)
    drive = sw.Drive([d1, d2], 1 << 20, allow_buffered=True)
    drive.check()
    assert drive.direct == [False, False]
    notes = sw.device_notes(drive)
    assert any("same device" in n for n in notes)
    assert any(n.startswith(d2) and "no O_DIRECT" in n for n in notes)
    assert sw.fs_type("/proc/self") == "proc"
    monkeypatch.setattr(sw, "fs_type", lambda p: "tmpfs")
    assert any("is on tmpfs (memory, no O_DIRECT)" in n for n in sw.device_notes(drive))


def test_an_interrupted_sweep_prints_what_it_measured(tmp_path):
    """Ctrl-C after some trials: the table so far (no aio block from it), exit 130."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = [str(tmp_path), "--repeats", "1000", "--io-size", "1M", "--no-fio"]
    p = subprocess.Popen(
        [sys.executable, "-m", "aio.sweep", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines = []
    for line in p.stdout:
        lines.append(line)
        if "set-up done" in line:
            break
    assert any("set-up:" in x for x in lines), lines  # said before the set-up, not after
    time.sleep(3)  # some trials of 1 MiB
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "interrupted after" in out and "rank" in out and "best aio block" not in out
    assert os.listdir(tmp_path) == []


def test_a_row_on_one_sample_is_marked(capsys):
    from types import SimpleNamespace

    one, two = sw.Setting(1 << 20, 8, 1, False, True), sw.Setting(1 << 20, 16, 1, False, True)
    samples = {one: [2.0], two: [1.0, 1.1]}
    sweep = SimpleNamespace(
        directions=["read"],
        confirmed={},
        median=lambda s, d: sorted(samples[s])[0],
        samples=lambda s, d: samples[s],
        spread=lambda s: (min(samples[s]), max(samples[s])),
        score=lambda s: max(samples[s]),
    )
    sw._ranking_table(SimpleNamespace(top=8), sweep, [one, two], print)
    out = capsys.readouterr().out.splitlines()
    assert out[2].lstrip().startswith("1*") and not out[3].lstrip().startswith("2*")
    assert "single trial" in out[-1]
