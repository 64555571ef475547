"""The build of aio._C: what it exports, and that it still works when the
toolchain links libstdc++ statically (as the CUDA images' toolchains do); and
the C++ unit tests of the core (tests/cpp), compiled and run without Python.

Why exports matter: a static libstdc++ inside _C.so that exports its std::
symbols gets them bound to the shared libstdc++ torch loaded first, and every
exception thrown by the core then crashed (issue 12)."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import aio

ROOT = Path(__file__).resolve().parent.parent
NM = shutil.which("nm")
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")

needs_nm = pytest.mark.skipif(NM is None, reason="binutils' nm is not installed: cannot list exports")


def exported_symbols(so: str) -> set[str]:
    """Names defined in the dynamic symbol table of `so` (what other libraries can bind to)."""
    out = subprocess.run([NM, "-D", "--defined-only", so], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@needs_nm
def test_extension_exports_only_its_init_function():
    assert exported_symbols(aio._C.__file__) == {"PyInit__C"}


def _needed_libraries(so: str) -> set[str] | None:
    """The shared libraries `so` names as NEEDED, or None without readelf."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return None
    out = subprocess.run([readelf, "-d", so], check=True, capture_output=True, text=True).stdout
    return {ln.split("[", 1)[1].rstrip("]") for ln in out.splitlines() if "(NEEDED)" in ln and "[" in ln}


def _static_build(tmp: Path) -> Path:
    """An _C linked with a static libstdc++/libgcc: the installed one when it
    already is (CI bootstraps so, as the CUDA images' toolchains build), else
    one built into tmp."""
    needed = _needed_libraries(aio._C.__file__)
    if needed is not None and not any(n.startswith(("libstdc++", "libgcc_s")) for n in needed):
        return Path(aio._C.__file__)
    return _build_static(tmp)


def _build_static(tmp: Path) -> Path:
    """Builds _C with a statically linked libstdc++/libgcc into tmp; returns the .so."""
    pytest.importorskip("pybind11", reason="pybind11 is needed to build the extension (pip install pybind11)")
    # -O0: only the link (exports, the error translator) is checked here (CI time).
    env = dict(os.environ, LDFLAGS="-static-libstdc++ -static-libgcc", NPY_NUM_BUILD_JOBS="2", AIO_OPT="-O0")
    cmd = [
        sys.executable,
        "setup.py",
        "-q",
        "build_ext",
        "--build-lib",
        str(tmp / "lib"),
        "--build-temp",
        str(tmp / "obj"),
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    built = sorted((tmp / "lib" / "aio").glob("_C*.so"))
    assert len(built) == 1, built
    return built[0]


# Run in a child: with the old exports the first error crashed the process.
# torch is imported first so that its shared libstdc++ is loaded before ours.
_TRIGGER = textwrap.dedent(
    """
    import torch  # noqa: F401  (first, on purpose)
    import errno, os, sys
    import numpy as np
    import aio
    assert aio._C.__file__.startswith(sys.argv[1]), aio._C.__file__
    d = sys.argv[2]
    h = aio.AsyncIOHandle()
    missing = os.path.join(d, "missing.bin")
    try:
        h.sync_pread(np.zeros(4096, np.uint8), missing, 0)
        raise SystemExit("no error for a missing file")
    except FileNotFoundError as e:
        assert e.errno == errno.ENOENT and e.filename == missing, (e.errno, e.filename)
    path = os.path.join(d, "data.bin")
    assert h.sync_pwrite(np.ones(4096, np.uint8), path, 0) == 4096
    try:
        h.sync_pread(np.zeros(8192, np.uint8), path, 0)
        raise SystemExit("no error for a read past end of file")
    except aio.ReadPastEOFError as e:
        assert e.errno == errno.ENODATA and e.filename == path, (e.errno, e.filename)
    h._c.inject_fault("error", errno.EIO, "write", 0, 1)
    try:
        h.sync_pwrite(np.ones(8192, np.uint8), path, 0)
        raise SystemExit("no error for an injected EIO")
    except OSError as e:
        assert e.errno == errno.EIO and e.filename == path, (e.errno, e.filename)
    print("typed errors OK")
    """
)


@needs_nm
def test_static_libstdcxx_build_exports_nothing_and_raises_typed_errors(tmp_path):
    so = _static_build(tmp_path / "build")
    exports = exported_symbols(str(so))
    assert exports == {"PyInit__C"}, sorted(exports)[:20]

    # A package tree of the Python sources next to the static build.
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT / "aio", pkg / "aio", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy2(so, pkg / "aio" / so.name)
    data = tmp_path / "data"
    data.mkdir()
    env = dict(os.environ, PYTHONPATH=str(pkg))
    p = subprocess.run(
        [sys.executable, "-c", _TRIGGER, str(pkg), str(data)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "typed errors OK" in p.stdout, (p.returncode, p.stdout, p.stderr)


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++) on PATH")
@pytest.mark.skipif(
    bool(os.environ.get("AIO_CPP_TESTS_DONE")),
    reason=f"the C++ unit tests ran {os.environ.get('AIO_CPP_TESTS_DONE')} (AIO_CPP_TESTS_DONE)",
)
def test_cpp_unit_tests(tmp_path):
    """tests/cpp compiled with plain g++ (-Wall -Wextra -Werror) against csrc/core (no
    Python), and run."""
    build = subprocess.run(
        ["bash", str(ROOT / "scripts" / "cpp_tests.sh"), "--build-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-6000:] + build.stderr[-6000:]
    assert " passed, 0 failed" in build.stdout, build.stdout[-6000:]
    # The slice planner's tests (tests/cpp/test_request.cpp) are linked in.
    assert "ok   plan_zero_bytes_has_no_slices" in build.stdout, build.stdout[-6000:]
