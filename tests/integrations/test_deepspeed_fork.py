"""A child forked from a process training under DeepSpeed on aio never
removes the parent's swap files.

aio removes the swap files DeepSpeed leaves behind with finalizers (at
``engine.destroy()``, when a swapper is collected, at exit). ``os.fork()``
copies them into the child (a DataLoader worker, a subprocess started by
fork), which runs them when it drops its copy of the engine or exits: they
must do nothing there, or the parent's next step finds its optimizer state
gone (FileNotFoundError). Each case runs in its own process: the forks
happen there, not in pytest's process.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install .[deepspeed])")

from .test_deepspeed_e2e import HERE, _port  # noqa: E402

pytestmark = pytest.mark.deepspeed

# A one-rank ZeRO-3 engine with its optimizer on NVMe (ds_train.py's config),
# one step, then children forked that drop the engine, destroy it, or exit
# with it; the parent steps again after each and reports the swap files.
ENGINE_PROGRAM = textwrap.dedent(
    """
    import argparse, gc, json, os, sys
    import torch
    import ds_train
    import aio.integrations.deepspeed as d
    d.enable()
    import deepspeed, deepspeed.comm

    nvme = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    a = argparse.Namespace(nvme=nvme, offload="nvme", pipeline=False, max_in_cpu=0, sub_group_size=400_000,
                           width=512, layers=1)
    model = ds_train.build_model(torch, a.width, a.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_train.ds_config(a, 1))
    g = torch.Generator().manual_seed(9)
    batch = (torch.randn(8, a.width, generator=g), torch.randn(8, 16, generator=g))

    def files():  # and the optimizer folder's lock; the parameter swapper's lives past destroy()
        return sorted(os.path.join(p, f) for p, _, fs in os.walk(nvme) for f in fs
                      if not (f.endswith(".aio-lock") and p.endswith("params")))

    ds_train.one_step(torch, engine, batch, 0)
    out = {"before": files(), "children": []}
    for how in ("drop", "destroy", "exit"):
        pid = os.fork()
        if pid == 0:
            if how == "drop":  # the swappers are collected: their finalizers run
                del engine, model, opt
                gc.collect()
            elif how == "destroy":
                engine.destroy()
            if how == "exit":  # a normal exit: atexit runs every finalizer left
                sys.exit(0)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        left = files()
        ds_train.one_step(torch, engine, batch, 0)  # FileNotFoundError once they are gone
        out["children"].append({"how": how, "status": status, "left": left})
    engine.destroy()
    out["after_destroy"] = files()
    ds_train.shutdown_distributed(deepspeed.comm)
    print("RESULT", json.dumps(out), flush=True)
    """
)


def _run(program, *args, timeout=240):
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_port()),
        OMP_NUM_THREADS="1",
    )
    p = subprocess.run(
        [sys.executable, "-c", program, *args],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def test_forked_child_leaves_the_parents_optimizer_swap_files(tmp_path):
    out = _run(ENGINE_PROGRAM, str(tmp_path / "nvme"))
    before = out["before"]
    assert any(os.path.basename(f).startswith("exp_avg-") for f in before), before
    assert any(f.endswith(os.path.join("optimizer", "rank0.aio-lock")) for f in before), before
    for child in out["children"]:
        assert child["status"] == 0, child
        assert child["left"] == before, child["how"]
    # The parent itself still removes them.
    assert out["after_destroy"] == []


# The parameter swapper's clean-up, registered on a stand-in swapper (the
# CPU runs above swap no parameters): a child that drops it or exits leaves
# its file; the parent's own collection of it removes the file.
PARAM_PROGRAM = textwrap.dedent(
    """
    import gc, json, os, sys
    import aio.integrations.deepspeed as d

    folder = sys.argv[1]
    os.makedirs(folder)
    path = os.path.join(folder, "3_param.tensor.swp")
    open(path, "wb").close()

    class Swapper:
        swap_folder = folder
        id_to_path = {3: path}

    class Param:
        def __init__(self, swapper):
            self.nvme_swapper = swapper

    class Module:
        def __init__(self, swapper):
            self.params = [Param(swapper)]

        def parameters(self):
            return iter(self.params)

    module = Module(Swapper())
    d._register_param_swap_cleanup(module)
    out = {}
    for how in ("drop", "exit"):
        pid = os.fork()
        if pid == 0:
            if how == "drop":
                del module
                gc.collect()
                os._exit(0)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        out[how] = [status, os.path.exists(path)]
    del module
    gc.collect()
    out["parent_dropped"] = os.path.exists(path)
    print("RESULT", json.dumps(out), flush=True)
    """
)


def test_forked_child_leaves_the_parents_parameter_swap_files(tmp_path):
    out = _run(PARAM_PROGRAM, str(tmp_path / "params"), timeout=60)
    assert out == {"drop": [0, True], "exit": [0, True], "parent_dropped": False}
