"""scripts/check_docstrings.py: finds public names without a docstring."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_docstrings.py"


def run(*paths: Path | str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, paths)], capture_output=True, text=True, timeout=60
    )


def test_reports_each_undocumented_public_name(tmp_path):
    (tmp_path / "m.py").write_text(
        textwrap.dedent(
            '''
            """Module."""

            def public(): pass
            def _private(): pass

            class Thing:
                """Documented."""
                def method(self): pass
                def _helper(self): pass
                def __init__(self): pass
                @property
                def size(self):
                    """Documented."""
                @size.setter
                def size(self, v): pass

            class _Hidden:
                def method(self): pass
            '''
        )
    )
    r = run(tmp_path)
    assert r.returncode == 1
    found = sorted(line.split(": ")[1] for line in r.stdout.splitlines())
    assert found == ["Thing.method has no docstring", "public has no docstring"]


def test_module_without_docstring_and_clean_file(tmp_path):
    (tmp_path / "bare.py").write_text("x = 1\n")
    (tmp_path / "ok.py").write_text('"""Fine."""\n\ndef f():\n    """Does f."""\n')
    assert "<module>" in run(tmp_path / "bare.py").stdout
    r = run(tmp_path / "ok.py")
    assert r.returncode == 0 and r.stdout == ""


def test_swap_handle_and_tools_are_documented():
    paths = [
        "aio/swap",
        "aio/integrations",
        "aio/handle.py",
        "aio/future.py",
        "aio/_args.py",
        "aio/pinned.py",
        "aio/_buffers.py",
        "aio/_errors.py",
        "aio/_cli.py",
        "aio/quickcheck.py",
        "aio/sweep.py",
        "aio/run.py",
    ]
    r = run(*(ROOT / p for p in paths))
    assert r.returncode == 0, r.stdout
