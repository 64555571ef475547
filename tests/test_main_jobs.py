"""Smoke runs of the main job and the benchmark at tiny sizes (no timing asserted)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickcheck_runs(capsys, tmp_path):
    from aio.quickcheck import main

    assert main(["--size", "4M", "--repeat", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GB/s" in out and "write" in out and "read" in out
    assert os.listdir(tmp_path) == []  # cleaned up


def test_quickcheck_rejects_bad_size():
    from aio._cli import parse_size

    assert parse_size("1G") == 1 << 30 and parse_size("256K") == 256 << 10
    assert parse_size("4096") == 4096 and parse_size("1.5M") == 3 << 19
    import argparse

    import pytest

    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_throughput_bench_tiny(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "throughput.py"),
            "--size",
            "4M",
            "--rounds",
            "1",
            "--gap",
            "0",
            "--tools",
            "aio,buffered",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert set(data["directions"]) == {"read", "write"}
    assert data["directions"]["read"]["median_ratio"]["buffered"] > 0
    assert [p for p in os.listdir(tmp_path) if p.endswith(".bin")] == []
