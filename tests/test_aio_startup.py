"""AIO_DEEPSPEED=1 for processes that never import aio: the aio_deepspeed.pth
line and the _aio_startup hook it imports.

Each case runs in a fresh interpreter. "simulated" runs the .pth line from the
source tree before the script, as site.py would; "installed" relies on the
.pth file in site-packages and is skipped only when this environment has none
(the simulated case still checks the hook then).
"""

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install .[deepspeed])")

ROOT = Path(__file__).resolve().parent.parent
PTH = ROOT / "aio_deepspeed.pth"

# Only what the script imports itself: the hook must not import torch,
# DeepSpeed or aio before the script asks for DeepSpeed.
SCRIPT = """
import json, sys
early = sorted(m for m in ("torch", "deepspeed", "aio") if m in sys.modules)
import deepspeed
from deepspeed.ops.op_builder import AsyncIOBuilder
from deepspeed.runtime.swap_tensor import partitioned_param_swapper as pps
# Loading DeepSpeed's own op would JIT-compile it: only load aio's.
served = AsyncIOBuilder.__module__.startswith("aio")
handle = AsyncIOBuilder().load(verbose=False).aio_handle(block_size=65536, queue_depth=4) if served else None
print(json.dumps({
    "early": early,
    "handle": type(handle).__module__ + "." + type(handle).__qualname__ if served else None,
    "swapper_builder": pps.AsyncIOBuilder.__module__,
    "ds_op_loaded": [m for m in ("async_io", "deepspeed.ops.aio.async_io_op") if m in sys.modules],
    "aio_modules": sorted(m for m in sys.modules if m in ("aio", "_aio_startup") or m.startswith("aio.")),
}))
"""


def pth_line() -> str:
    lines = [ln for ln in PTH.read_text().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("import "), "site.py runs only 'import ...' lines"
    return lines[0]


def installed_pth() -> Path | None:
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    found = [Path(d, PTH.name) for d in dirs if Path(d, PTH.name).is_file()]
    return found[0] if found else None


def run(how: str, tmp_path: Path, value: str | None) -> dict:
    if how == "installed":
        where = installed_pth()
        if where is None:
            pytest.skip(f"{PTH.name} is not installed here (pip install -e . puts it in site-packages)")
        assert where.read_text().strip() == pth_line(), f"{where} is stale: reinstall aio"
        script = tmp_path / "train.py"
        script.write_text(SCRIPT)
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-c", pth_line() + "\n" + SCRIPT]
    env = {k: v for k, v in os.environ.items() if k != "AIO_DEEPSPEED"}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    if value is not None:
        env["AIO_DEEPSPEED"] = value
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("how", ["simulated", "installed"])
def test_deepspeed_gets_aio_without_importing_aio(tmp_path, how):
    out = run(how, tmp_path, "1")
    assert out["early"] == []  # nothing heavy at startup
    assert out["handle"] == "aio.integrations.deepspeed.DeepSpeedAioHandle"
    assert out["swapper_builder"] == "aio.integrations.deepspeed"
    assert out["ds_op_loaded"] == []  # DeepSpeed's own op never built nor loaded


@pytest.mark.parametrize("how", ["simulated", "installed"])
def test_unset_variable_imports_nothing_of_aio(tmp_path, how):
    out = run(how, tmp_path, None)
    assert out["aio_modules"] == []
    assert out["handle"] is None and out["swapper_builder"].startswith("deepspeed")


@pytest.mark.parametrize("value", ["0", "no", ""])
def test_false_values_leave_deepspeed_alone(tmp_path, value):
    out = run("simulated", tmp_path, value)
    assert [m for m in out["aio_modules"] if m != "_aio_startup"] == []
    assert out["swapper_builder"].startswith("deepspeed")


PRELUDES = {
    "transformers": "from transformers.integrations import is_deepspeed_available as a; assert a()",
    "accelerate": "from accelerate.utils import is_deepspeed_available; assert is_deepspeed_available()",
    "hf-trainer": "from transformers import Trainer, TrainingArguments",
}


@pytest.mark.parametrize("prelude", list(PRELUDES))
def test_served_after_libraries_ask_whether_deepspeed_exists(tmp_path, prelude):
    """transformers' and accelerate's is_deepspeed_available() call
    importlib.util.find_spec('deepspeed'): the hook must survive that and
    serve the import that comes later (the real libraries, not fakes)."""
    lib = prelude.split("-")[0]
    if lib in ("transformers", "accelerate", "hf"):
        pytest.importorskip("transformers" if lib == "hf" else lib)
    cmd = [sys.executable, "-c", pth_line() + "\n" + PRELUDES[prelude] + "\n" + SCRIPT]
    env = {k: v for k, v in os.environ.items() if k != "AIO_DEEPSPEED"}
    env.update(DS_ACCELERATOR="cpu", AIO_DEEPSPEED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["handle"] == "aio.integrations.deepspeed.DeepSpeedAioHandle"
    assert out["swapper_builder"] == "aio.integrations.deepspeed"
