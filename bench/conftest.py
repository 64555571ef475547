"""Fixtures and options for the micro-benchmarks in bench/ (pytest-benchmark).

    python -m pytest bench --benchmark-only [--bench-dir /local_nvme]
                           [--bench-io-mib 256] [--bench-subgroup 4000000]

The repository's test command (``python -m pytest`` from the root) does not
collect this directory: pyproject's ``testpaths`` names only ``tests``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("aio-bench")
    g.addoption("--bench-dir", help="directory on the drive to measure (default: a temporary directory)")
    g.addoption("--bench-io-mib", type=int, default=256, help="file size of the handle benchmarks, MiB")
    g.addoption(
        "--bench-subgroup", type=int, default=4_000_000, help="elements per optimizer sub-group (fp32)"
    )


@pytest.fixture(scope="session")
def drive_dir(request: pytest.FixtureRequest) -> Iterator[str]:
    """A private folder on the drive under test, removed at the end."""
    parent = request.config.getoption("--bench-dir")
    d = tempfile.mkdtemp(prefix="aio-micro-", dir=parent)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def io_bytes(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--bench-io-mib")) << 20


@pytest.fixture(scope="session")
def subgroup_numel(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--bench-subgroup"))


def pytest_configure(config: pytest.Config) -> None:
    # DeepSpeed's CPUAdam reference (when installed) must not look for a GPU here.
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
    except ImportError:
        pass
