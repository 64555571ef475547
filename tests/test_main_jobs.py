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
    assert "can come from a cache" in out and "--size 16G" in out  # a small sample says so
    assert os.listdir(tmp_path) == []  # cleaned up


def test_quickcheck_sustained_sample_has_no_cache_note(capsys, tmp_path, monkeypatch):
    from aio import quickcheck as qc

    monkeypatch.setattr(qc, "SUSTAINED_SIZE", 4 << 20)
    assert qc.main(["--size", "4M", "--repeat", "1", "--dir", str(tmp_path)]) == 0
    assert "cache" not in capsys.readouterr().out


def test_a_sample_larger_than_the_buffer_moves_through_it(tmp_path, monkeypatch):
    """Past BUFFER_LIMIT the sample is written and read through one bounded
    buffer (a check past the host's cache needs no memory of its size); a
    tail shorter than the buffer included."""
    import aio
    from aio import quickcheck as qc

    monkeypatch.setattr(qc, "BUFFER_LIMIT", 1 << 20)
    made = []
    real = qc.scratch_buffer
    monkeypatch.setattr(qc, "scratch_buffer", lambda n, log: made.append(n) or real(n, log))
    seen = []

    class Recording(aio.AsyncIOHandle):
        def close(self) -> None:
            seen.append(self.stats())
            super().close()

    monkeypatch.setattr(qc, "AsyncIOHandle", Recording)
    total = (5 << 19) + 4096  # 2.5 MiB and a page
    rates = qc.drive_rates(str(tmp_path), total, repeat=2)
    assert made == [1 << 20] and rates["read"] > 0 and rates["write"] > 0
    (st,) = seen
    assert st["bytes_written"] == 3 * total and st["bytes_read"] == 2 * total, st  # once untimed, then 2 each
    assert os.listdir(tmp_path) == []


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
