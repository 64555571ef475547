"""aio-check --gpu, scripts/gpu_acceptance.sh and scripts/gpu_stress.py: what
they do without CUDA (one line, exit 2 / 77), the pure helpers, and the
aio.zero comparison run on the CPU; with CUDA, aio-check --gpu passes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aio import gpucheck
from aio.gpucheck import Check, RateRow, Spec, compare_runs, format_rate_table, rate_checks

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
no_cuda_only = pytest.mark.skipif(CUDA, reason="checks the no-CUDA path")


def run(*cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@no_cuda_only
def test_aio_check_gpu_without_cuda_prints_one_line_and_exits_2():
    r = run(sys.executable, "-m", "aio.quickcheck", "--gpu")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        "aio-check --gpu: no CUDA device (torch.cuda.is_available() is False); nothing to check"
    ]
    assert "Traceback" not in r.stderr


@no_cuda_only
def test_acceptance_script_without_cuda_prints_one_line_and_exits_77(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    r = subprocess.run(
        ["bash", "scripts/gpu_acceptance.sh"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 77, r.stdout + r.stderr
    assert len(r.stdout.splitlines()) == 1 and "no CUDA device" in r.stdout
    assert r.stderr == ""
    assert not any(tmp_path.iterdir())  # no report without a GPU


def test_acceptance_script_refuses_an_unknown_step():
    r = run("bash", "scripts/gpu_acceptance.sh", "tests", "benchmark")
    assert r.returncode == 2
    assert "unknown step 'benchmark'" in r.stderr and r.stdout == ""


def test_acceptance_script_parses():
    assert run("bash", "-n", "scripts/gpu_acceptance.sh").returncode == 0


@no_cuda_only
def test_stress_script_without_cuda_exits_77():
    r = run(sys.executable, "scripts/gpu_stress.py", "--steps", "1")
    assert r.returncode == 77, r.stdout + r.stderr
    assert len(r.stdout.splitlines()) == 1 and "no CUDA device" in r.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_aio_check_gpu_passes_on_cuda(tmp_path):
    r = run(
        sys.executable, "-m", "aio.quickcheck", "--gpu", "--size", "64M", "--dir", str(tmp_path), timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and r.stdout.count("PASS ") >= 6


# -- pure helpers -------------------------------------------------------------------------------
def rows(aio_h2d=50.0, aio_d2h=49.0, aio_pinned=True, exact=True):
    return [
        RateRow("aio new_locked_tensor (cuda_register)", aio_pinned, aio_h2d, aio_d2h, exact),
        RateRow("aio PinnedPool slot (mlock)", False, 20.0, 10.0),
        RateRow(gpucheck.TORCH_PINNED, True, 50.0, 50.0),
        RateRow("pageable torch.empty", False, 25.0, 12.5),
    ]


def test_rate_table_shows_ratios_to_torch_pinned_memory():
    lines = format_rate_table(rows(), 256 << 20, 3)
    assert lines[0] == "host <-> GPU copies, 256 MiB, best of 3:"
    assert "x torch" in lines[1]
    pool = next(x for x in lines if "PinnedPool" in x).split()
    assert "0.40x" in pool and "0.20x" in pool and pool[-1] == "yes"
    pageable = next(x for x in lines if "pageable" in x).split()
    assert "0.50x" in pageable and "0.25x" in pageable and "no" in pageable
    assert len({len(x) for x in lines[1:]}) == 1  # columns line up


def test_rate_table_without_a_torch_pinned_row_prints_dashes():
    lines = format_rate_table(rows()[:2], 1 << 20, 1)
    assert "-" in lines[2].split() and "1 MiB" in lines[0]


def test_rate_checks_pass_pinned_speed_and_note_the_pool():
    checks, notes = rate_checks(rows())
    assert [c.ok for c in checks] == [True, True]
    assert "0.98x" in checks[1].detail  # D2H 49 / 50
    assert len(notes) == 1 and "PinnedPool" in notes[0] and "pageable" in notes[0]


@pytest.mark.parametrize(
    "kw,failing",
    [({"aio_h2d": 30.0}, 1), ({"aio_d2h": 34.0}, 1), ({"aio_pinned": False}, 1), ({"exact": False}, 0)],
)
def test_rate_checks_fail_slow_unpinned_or_inexact_copies(kw, failing):
    checks, _ = rate_checks(rows(**kw))
    assert [c.ok for c in checks].index(False) == failing
    assert checks[failing].line().startswith("FAIL ")


def test_check_lines():
    assert Check("x", True).line() == "PASS x"
    assert Check("x", False, "why").line() == "FAIL x: why"


def test_compare_runs_needs_bit_identical_losses_and_parameters():
    a = ([1.0, 0.5], {"w": torch.ones(3), "b": torch.zeros(2)})
    assert compare_runs(a, ([1.0, 0.5], {"b": torch.zeros(2), "w": torch.ones(3)})) is None
    assert "losses differ" in compare_runs(a, ([1.0, 0.5000001], a[1]))
    assert "losses differ" in compare_runs(a, ([1.0, float("nan")], a[1]))
    w = torch.ones(3)
    w[1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert "w differs" in compare_runs(a, (a[0], {"w": w, "b": torch.zeros(2)}))
    assert "names differ" in compare_runs(a, (a[0], {"w": torch.ones(3)}))
    assert "float64" in compare_runs(
        a, (a[0], {"w": torch.ones(3, dtype=torch.float64), "b": torch.zeros(2)})
    )


def test_zero_config_offloads_both_parts_to_the_drive_or_cpu(tmp_path):
    from aio.config import load_train_config

    spec = Spec()
    nvme = gpucheck.zero_config(str(tmp_path / "d"), "nvme", spec)
    z = nvme["zero_optimization"]
    assert z["offload_param"]["device"] == z["offload_optimizer"]["device"] == "nvme"
    assert (tmp_path / "d").is_dir()
    assert spec.sub_group >= spec.vocab * spec.width  # the tied embedding fits a sub-group
    cpu = gpucheck.zero_config("", "cpu", spec)["zero_optimization"]
    assert cpu["offload_param"] == cpu["offload_optimizer"] == {"device": "cpu"}
    load_train_config(nvme)
    with pytest.raises(ValueError):
        gpucheck.zero_config("", "disk", spec)


def test_zero_checks_pass_on_the_cpu(tmp_path):
    """The aio.zero part of aio-check --gpu, run on the CPU: NVMe == CPU offload
    == the reference training, bit for bit; with accumulation and clipping too."""
    for spec in (Spec(width=64, vocab=256, layers=1), Spec(width=64, vocab=256, layers=1, gas=2, clip=0.5)):
        checks = gpucheck.zero_checks(str(tmp_path), "cpu", spec)
        assert [c.ok for c in checks] == [True, True], [c.line() for c in checks]


def test_zero_checks_see_a_different_optimizer_step(tmp_path, monkeypatch):
    """A reference that steps differently (lr 10% higher) fails the check."""
    spec = Spec(width=64, vocab=256, layers=1)
    real = gpucheck.train_reference

    def off(device, s):
        return real(device, Spec(**{**s.__dict__, "lr": s.lr * 1.1}))

    monkeypatch.setattr(gpucheck, "train_reference", off)
    checks = gpucheck.zero_checks(str(tmp_path), "cpu", spec)
    assert [c.ok for c in checks] == [True, False]
    assert "differ" in checks[1].detail


def test_run_section_turns_an_exception_into_a_fail_line():
    def boom():
        raise RuntimeError("no\nluck")

    (c,) = gpucheck.run_section("part", boom)
    assert not c.ok and c.line() == "FAIL part: RuntimeError: no luck"


# -- gpu_stress.py ---------------------------------------------------------------------------------
def stress_module():
    spec = importlib.util.spec_from_file_location("gpu_stress", ROOT / "scripts" / "gpu_stress.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stress_patches_fail_loudly_when_an_internal_is_renamed(monkeypatch):
    from aio.zero import streams

    mod = stress_module()
    monkeypatch.delattr(streams.PinnedRing, "give_back")
    counts = dict.fromkeys(["copies delayed", "forwards delayed", "ring regions poisoned"], 0)
    with pytest.raises(RuntimeError, match=r"PinnedRing has no attribute 'give_back'.*stress_patches"):
        with mod.stress_patches(10, counts):
            pass


def test_stress_patches_are_undone():
    import aio.pinned
    from aio.zero import streams

    mod = stress_module()
    before = (streams.CudaBackend.copy, streams.PinnedRing.give_back, aio.pinned.Lease.release)
    hooks = dict(torch.nn.modules.module._global_forward_pre_hooks)
    with mod.stress_patches(10, {}):
        assert streams.CudaBackend.copy is not before[0]
        assert aio.pinned.Lease.release is not before[2]
        assert len(torch.nn.modules.module._global_forward_pre_hooks) == len(hooks) + 1
    assert (streams.CudaBackend.copy, streams.PinnedRing.give_back, aio.pinned.Lease.release) == before
    assert dict(torch.nn.modules.module._global_forward_pre_hooks) == hooks


def test_stress_pool_slot_is_poisoned_before_it_goes_back(tmp_path):
    """The release patch fills a slot with NaN bytes before the pool can hand it out again."""
    import aio

    mod = stress_module()
    counts = {"pool slots poisoned": 0}
    pool = aio.PinnedPool(1, 4096, lock=False)
    with mod.stress_patches(10, counts):
        lease = pool.acquire()
        lease.tensor(torch.float32).fill_(1.0)
        lease.release()
        lease.release()  # idempotent: not poisoned twice
        nxt = pool.acquire(timeout=5)
        assert torch.isnan(nxt.tensor(torch.float32)).all()
        nxt.release()
    assert counts["pool slots poisoned"] == 2


def test_stress_table_and_patch_problems():
    mod = stress_module()
    lines = mod.table([("nvme", "default", [1.5, 1.25], "-"), ("cpu", "stressed", [], "ERROR x")])
    assert "1.50000000" in lines[1] and "1.25000000" in lines[1] and lines[2].endswith("ERROR x")
    zero = dict.fromkeys(
        ["copies delayed", "forwards delayed", "ring regions poisoned", "pool slots poisoned"], 0
    )
    assert len(mod.patch_problems("nvme", zero)) == 4 and len(mod.patch_problems("cpu", zero)) == 3
    assert (
        mod.patch_problems(
            "cpu", {**zero, "copies delayed": 1, "forwards delayed": 2, "ring regions poisoned": 3}
        )
        == []
    )
