"""Smoke runs of the scripts in bench/: each one at tiny sizes, in its own
process, must exit 0 and print its table. Nothing is timed: this only keeps
the benchmarks runnable (a script that crashes at its defaults or after a
refactor of aio fails here instead of when someone next measures).

DeepSpeed and fio are left out of every run (the scripts' own --variants,
--tools, --sides, --skip-deepspeed) but deepspeed_step.py's, whose subject
DeepSpeed is: DeepSpeed's ops JIT-build for a minute and fio is not
installed everywhere. deepspeed_step.py runs its aio side alone with torch's
AdamW (--sides aio --torch-adam), which builds no op beyond the shm_comm
one DeepSpeed's CPU accelerator builds for tests/integrations anyway.
Every script in bench/ needs an entry in CASES; a new one without an entry
fails test_every_bench_script_has_a_case.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
NOT_SCRIPTS = {"conftest.py"}  # bench/test_micro.py's pytest fixtures and options
TIMEOUT_S = 180


@dataclass(frozen=True)
class Case:
    """How to smoke-run one bench script.

    ``args`` (split as a shell would) follow the script's path (with
    ``pytest``: ``python -m pytest``); ``{dir}`` and ``{dir2}`` become two
    empty folders under tmp_path. The run passes when its exit status is in
    ``ok``, it printed no traceback and every string of ``expect`` is in its
    stdout. ``skip``: why this script cannot run here at all. ``clean``:
    ``{dir}`` must be empty again after the run (swap folders and
    per-rank files removed).
    """

    args: str = ""
    expect: tuple[str, ...] = ()
    ok: tuple[int, ...] = (0,)
    pytest: bool = False
    needs: tuple[str, ...] = ()  # modules that must be importable, else skip
    skip: str | None = None
    # Runs only with AIO_BENCH_SMOKE=all (CI time: these take 10-30 s even at
    # tiny sizes, mostly interpreter and library start-up); their --help
    # still runs in test_every_bench_script_help.
    slow: bool = False
    clean: bool = False


CASES: dict[str, Case] = {
    "buffer_placement.py": Case("--dir {dir} --buffers 2 --mib 1 --repeat 1", expect=("median", "GB/s")),
    "checkpoint.py": Case(
        # fp32: DeepSpeed left out (and bf16 is slow on a CPU without native bf16);
        # --drive-size 0: no drive measurement (train_step.py's case runs that code).
        "--dir {dir} --variants aio,torch --fp32 --rounds 1 --steps 1 --width 32 --layers 1"
        " --vocab 64 --seq 8 --heads 2 --batch 1 --idle 0 --drive-size 0",
        expect=("| variant |", "restore check (save, train a step, load, save again): ok"),
        slow=True,  # ~20 s; tests/zero/test_checkpoint.py covers the save/restore it times
    ),
    "fsdp_step.py": Case(
        "--world 2 --layers 1 --width 32 --heads 2 --vocab 64 --seq 8 --steps 1 --drive-mib 0 "
        "--variants torch,cpu-adam,nvme --dir {dir} --sub-group-size 2000",
        expect=("| nvme |", "CPUAdamW step", "opt / replay"),
        slow=True,
        clean=True,
    ),
    "deepspeed_step.py": Case(
        # Its aio side alone (DeepSpeed's own async_io op is JIT-built, and only with
        # libaio-dev), stepping with torch's AdamW (DeepSpeedCPUAdam is JIT-built).
        "--dir {dir} --sides aio --torch-adam --rounds 1 --idle 0 --steps 1 --warmup 0"
        " --width 32 --layers 1 --batch 2 --param-buffers 4 --optimizer-buffers 4",
        expect=("median step aio", "torch AdamW"),
        needs=("deepspeed",),
        slow=True,  # ~20 s (imports DeepSpeed); tests/integrations run DeepSpeed on aio
    ),
    "gpu_sim_counts.py": Case("--steps 1 --ahead 1 --gpus lazy", expect=("modules_ahead", "| lazy |")),
    "hf_load_rss.py": Case(
        "--layers 1 --width 32 --vocab 64 --dir {dir}",
        expect=("peak anonymous memory, under Init / in memory",),
        needs=("transformers",),
        slow=True,  # ~33 s (three interpreters import transformers); tests/zero/test_hf.py runs it
    ),
    "optimizer_kernel.py": Case(
        "--total 20000 --group 10000 --rounds 1 --threads 1 --skip-deepspeed",
        expect=("sub-groups:", "one tensor:", "torch single/aio"),
    ),
    "optimizer_states.py": Case(
        "--steps 2 --layers 1 --width 32 --vocab 64 --seq 8 --batch 1 --rounds 1",
        expect=("bf16 states save",),
        slow=True,
    ),
    "pinned_memory.py": Case(
        "--dir {dir} --width 32 --layers 1 --sides aio",
        expect=("pinned_bytes()", "aio-config estimate"),
        slow=True,  # ~16 s; tests/zero/test_pinned_accounting.py checks the same counts
    ),
    "profile_step.py": Case(
        "zero-cpu --fp32 --model gpt --layers 1 --width 32 --heads 2 --vocab 64 --seq 8 --batch 1"
        " --dir {dir}",
        expect=("forward / backward / step() / whole", "Self CPU"),
        slow=True,  # ~15 s: two interpreters import torch and aio.zero
    ),
    "scale.py": Case(
        # aio alone (DeepSpeed's ops JIT-build); the helpers are tested in test_scale_helpers.
        "--dir {dir} --variants aio --layers 1 --width 32 --heads 2 --vocab 64 --seq 8 --batch 1"
        " --warmup 1 --steps 1 --drive-mib 1",
        expect=("| aio.zero | ok |", "bytes per step by category"),
        slow=True,  # ~10 s: two interpreters import torch and aio.zero
    ),
    "striped_io.py": Case(
        "--dirs {dir} {dir2} --rounds 1 --idle 0 --extents 2 --extent-mib 0.25 --group 1"
        " --train-rounds 1 --steps 1 --warmup 0 --layers 1 --width 32 --heads 2 --vocab 64"
        " --seq 8 --batch 1",
        expect=("losses identical",),
        slow=True,  # ~17 s; tests/swap/test_drives.py and test_train_cli's two drives cover striping
    ),
    "swap.py": Case(
        "--dir {dir} --subgroups 2 --numel 64K --partitions 4 --partition-numel 64K"
        " --param-buffers 2 --rounds 1 --gap 0",
        expect=("overlap efficiency", "parameter fetch in use order"),
    ),
    "sweep_check.py": Case(
        # One configuration: both searches measure just it, so the picks agree. Its exit
        # status is the acceptance bar (smart in <= 1/4 of the exhaustive time), which a
        # one-point grid cannot meet: 1 is a verdict here, not a crash.
        "--dir {dir} --rounds 1 --block-sizes 1M --queue-depths 8 --threads 1"
        " --single-submit false --overlap-events true --io-size 1M --repeats 1",
        expect=("smart search:", "exhaustive search:", "head to head"),
        ok=(0, 1),
        slow=True,  # ~13 s; tests/test_sweep.py runs both searches
    ),
    "test_micro.py": Case(
        "bench/test_micro.py --benchmark-disable -q -x -p no:cacheprovider --bench-dir {dir}"
        " --bench-io-mib 4 --bench-subgroup 100000 -k 'not deepspeed'",
        expect=("passed",),
        pytest=True,
        needs=("pytest_benchmark",),
        slow=True,
    ),
    "throughput.py": Case(
        "--dir {dir} --size 2M --rounds 1 --gap 0 --tools aio,buffered",
        expect=("median over", "aio / buffered", "CPU"),
    ),
    "train_step.py": Case(
        "--dir {dir} --variants zero-nvme --fp32 --rounds 1 --steps 1 --warmup 0 --width 32"
        " --layers 1 --batch 2 --idle 0 --drive-size 1048576 --param-buffers 4 --optimizer-buffers 4",
        expect=("| variant", "aio.zero, NVMe"),
    ),
}


def bench_scripts() -> list[str]:
    """Every script in bench/, by file name."""
    return sorted(p.name for p in BENCH.glob("*.py") if p.name not in NOT_SCRIPTS)


def child_env(tmp_path: Path) -> dict[str, str]:
    """The repository importable, temporary files under tmp_path, DeepSpeed (if a
    script imported it anyway) on its CPU accelerator."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    return dict(os.environ, PYTHONPATH=path, TMPDIR=str(tmp), DS_ACCELERATOR="cpu")


def test_every_bench_script_has_a_case() -> None:
    """A new script in bench/ needs a smoke case; a removed one loses its case."""
    scripts = bench_scripts()
    assert scripts, f"no scripts found in {BENCH}"
    assert sorted(CASES) == scripts, (
        f"bench/ scripts without a smoke case: {sorted(set(scripts) - set(CASES))}; "
        f"cases without a script: {sorted(set(CASES) - set(scripts))}"
    )


def _skip_reason(script: str) -> str | None:
    case = CASES[script]
    if case.skip:
        return case.skip
    if case.slow and os.environ.get("AIO_BENCH_SMOKE") != "all":
        return f"bench/{script} smoke-runs with AIO_BENCH_SMOKE=all (10-30 s; CI time); its --help ran"
    for mod in case.needs:
        if importlib.util.find_spec(mod) is None:
            return f"bench/{script} needs {mod}, which is not installed"
    return None


def _run(script: str, base: Path) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    case = CASES[script]
    dirs = {"dir": base / "drive", "dir2": base / "drive2"}
    for d in dirs.values():
        d.mkdir(parents=True)
    args = [a.format(**dirs) for a in shlex.split(case.args)]
    cmd = (
        [sys.executable, "-m", "pytest", *args]
        if case.pytest
        else [sys.executable, str(BENCH / script), *args]
    )
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(base), capture_output=True, text=True, timeout=TIMEOUT_S)
    return cmd, p


@pytest.mark.parametrize("script", bench_scripts())
def test_bench_smoke(script: str, tmp_path: Path) -> None:
    """One bench script at tiny sizes: it must finish and print its result.
    Each is its own test, so pytest-xdist spreads them over its workers."""
    if script not in CASES:
        pytest.fail(f"bench/{script} has no smoke case: add one to CASES in {Path(__file__).name}")
    why = _skip_reason(script)
    if why is not None:
        pytest.skip(why)
    cmd, p = _run(script, tmp_path / "run")
    case = CASES[script]
    log = f"$ {' '.join(cmd)}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
    assert p.returncode in case.ok, f"exit {p.returncode}\n{log}"
    assert "Traceback (most recent call last)" not in p.stderr, log
    for word in case.expect:
        assert word in p.stdout, f"{word!r} not in the output\n{log}"
    if case.clean:
        assert not any((tmp_path / "run" / "drive").iterdir()), log


HELP = r"""
import contextlib, io, runpy, sys

bad = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    code = "no exit"
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
    if code not in (0, None) or "usage:" not in out.getvalue():
        bad.append(f"{path}: exit {code!r}, printed:\n{out.getvalue()[-1000:]}")
print("\n".join(bad) or "all ok")
"""


def test_every_bench_script_help(tmp_path: Path) -> None:
    """``--help`` of every script exits 0 with its usage (one process for all:
    each would otherwise import torch on its own)."""
    scripts = [str(BENCH / s) for s in bench_scripts() if not CASES.get(s, Case()).pytest]
    p = subprocess.run(
        [sys.executable, "-c", HELP, *scripts],
        cwd=ROOT,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("all ok"), p.stdout[-4000:] + p.stderr[-4000:]


def test_scale_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/scale.py's pure parts, in this process (no torch, no run): the
    size flags, the shared config, the failure messages and the table."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # scale.py puts bench/ on it for train_step
    spec = importlib.util.spec_from_file_location("bench_scale", BENCH / "scale.py")
    assert spec is not None and spec.loader is not None
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)

    assert scale.layers_for(2e9, 2560, 32000, 64) == 24
    assert scale.layers_for(1, 64, 256, 8) == 1
    own, targs = scale.parse(["--params", "2e9", "--dtype", "bf16", "--batch", "3"])
    assert (targs.layers, targs.width, targs.heads, targs.vocab, targs.batch) == (24, 2560, 20, 32000, 3)
    assert targs.dtype == "bf16" and own.variant_list == ["aio", "ds", "ds-safe"]
    for bad in (["--config", "x.json"], ["--params", "1e9", "--layers", "2"], ["--variants", "aio,nope"]):
        with pytest.raises(SystemExit) as e:
            scale.parse(bad)
        assert e.value.code == 2, bad

    cfg = scale.variant_config(targs, "aio", "/nvme")
    assert cfg == scale.variant_config(targs, "ds", "/nvme")  # one dict for both engines
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["bf16"] == {"enabled": True}
    safe = scale.variant_config(targs, "ds-safe", "/nvme")["zero_optimization"]
    assert safe["stage3_max_reuse_distance"] == 0
    assert not safe["offload_optimizer"]["pipeline_read"] and not safe["offload_optimizer"]["pipeline_write"]

    log = (
        '@@ [ds] set-up 9.0 s\nTraceback (most recent call last):\n  File "x.py", line 3, in f\n'
        "    assert b is not None\nAssertionError: no\n  buffers\n[W] gloo warning\n"
    )
    assert (
        scale.failure(1, False, 5, log, None)
        == "exit 1: AssertionError: no buffers; last progress: [ds] set-up 9.0 s"
    )
    assert scale.failure(1, False, 5, log, {"error": "E: x"}).startswith("E: x; ")
    assert scale.failure(-9, False, 5, "", None).startswith("killed by SIGKILL")
    assert scale.failure(-9, True, 5, "", None) == "timed out after 5 s (killed)"
    try:
        raise ValueError("bad\n  value")
    except ValueError as e:
        text = scale.describe_exception(e)  # the message on one line, then the raising line
    assert text.startswith("ValueError: bad value (test_bench_smoke.py:"), text
    assert text.endswith('raise ValueError("bad\\n  value"))'), text

    row = {"label": "aio.zero", "status": "ok", "step_s": 4.0, "read_b": 2e9, "write_b": 1e9}
    row.update(peak_rss=3 * 2**30, predicted_peak_rss=2.5 * 2**30)
    row["drive"] = {"read": 2.0, "write": 1.0}
    scale.add_floor(row)
    assert (row["floor_s"], row["io_eff"]) == (2.0, 2.0)
    failed = {"label": "ds", "status": "failed", "drive": {"error": "x"}}
    table = scale.markdown(scale.COLUMNS, [scale.table_row(row), scale.table_row(failed)])
    assert (
        "| aio.zero | ok | - | 4.00 | 3.00 | 2.50 (1.20) | - | 2.00 | 1.00 | 2.00 / 1.00 | 2.0 | 2.00 |"
        in table
    )
    assert "| ds | failed | - | - | - | - | - |" in table
