"""aio.optim.NVMeAdamW's step under faults, Ctrl-C and bad input (issue 44):
an I/O error (EIO, ENOSPC through the engines' test hook) on a read or a
write of a step, for the master weights on the drive or in the parameters
and the gradients in memory or on the drive, is raised typed (errno, the
swap file's path, offset and length); the optimizer then refuses to step or
save until it is loaded, and its message says exactly what to load: the
state saved before the step alone while no parameter was written yet, the
model's weights too once some were (the parameters are then a mix of the
two steps, which costs a copy of the model to avoid: they are never a mix
*in silence*). Loading what it says continues bit-identically (torch.equal)
to a run without the fault. The same for Ctrl-C (KeyboardInterrupt at
chosen points of the swapper's pipeline, twice in a row, and real SIGINTs in
a subprocess), during state_dict() (nothing is lost: it can be taken again)
and load_state_dict(). Bad input: NaN/inf gradients as torch's AdamW,
gradients of the wrong shape/dtype, hyper-parameters out of range set
mid-run, stepping after close()."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from aio.optim import NVMeAdamW, is_bit_exact
from aio.swap import SwapStateError

bits = pytest.mark.skipif(not is_bit_exact(), reason="aio's kernel does not reproduce torch's sqrt here")

SIZE = 300  # sub-group elements: the model below spans 4 sub-groups


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 63), torch.nn.ReLU(), torch.nn.Linear(63, 5))


def _grads(m: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 12, generator=g), torch.randn(4, 5, generator=g)
    m.zero_grad()
    ((m(x) - y) ** 2).mean().backward()


def _run(m: torch.nn.Module, opt, steps: range) -> None:
    for s in steps:
        _grads(m, s)
        opt.step()


def _params(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _same_state(sa: dict, sb: dict) -> bool:
    names = ("step", "exp_avg", "exp_avg_sq")
    return set(sa["state"]) == set(sb["state"]) and all(
        torch.equal(sa["state"][k][n], sb["state"][k][n]) for k in sa["state"] for n in names
    )


def _opt(m: torch.nn.Module, tmp_path, **kw) -> NVMeAdamW:
    return NVMeAdamW(m.parameters(), lr=1e-2, nvme_path=str(tmp_path), sub_group_size=SIZE, **kw)


class _Reference:
    """A run without faults: the parameters before and after step `at`,
    and the parameters and state after `end` steps."""

    def __init__(self, tmp_path, at: int, end: int, **kw) -> None:
        m = _model()
        opt = _opt(m, tmp_path, **kw)
        _run(m, opt, range(at))
        self.old = _params(m)
        _run(m, opt, range(at, at + 1))
        self.new = _params(m)
        _run(m, opt, range(at + 1, end))
        self.final, self.state = _params(m), opt.state_dict()
        opt.close()


def _recover(m: torch.nn.Module, opt, weights: dict, saved: dict, ref: _Reference) -> None:
    """After a failed or interrupted step: what the optimizer's refusal says
    to load, loaded (the model's weights only when it names them)."""
    now = _params(m)
    why = opt.swap_stats()["broken"]
    assert why, "a step that changed the state on the drive must leave the optimizer refusing"
    if _equal(now, ref.old):
        assert "parameters are unchanged" in why, why
    else:  # never the new values alone: the drive's state is behind them
        assert "load the model's weights" in why, why
    with pytest.raises(SwapStateError, match="load_state_dict"):
        opt.step()
    with pytest.raises(SwapStateError, match="load_state_dict"):
        opt.state_dict()  # a torn state is never saved
    if "load the model's weights" in why:
        m.load_state_dict(weights)
    opt.load_state_dict(saved)
    assert opt.swap_stats()["broken"] is None


def _arm(opt, op: str, err: int, nth: int):
    drive = opt._swapper.space.drives[0]
    handle = drive.reader if op == "read" else drive.writer
    handle._c.inject_fault("error", err, op, nth, 1)
    return handle, drive.file.real_path


@pytest.mark.parametrize("master", ["params", "drive"])
@pytest.mark.parametrize("gradients", ["cpu", "nvme"])
@pytest.mark.parametrize("op", ["read", "write"])
# The 4th: the last read and write of step 3 in the leanest mode (master="params", gradients
# in memory: 4 buffers keep two of the 4 sub-groups, two moments each of the other two move).
@pytest.mark.parametrize(("err", "nth"), [(errno.EIO, 1), (errno.ENOSPC, 3), (errno.EIO, 4)])
def test_an_io_error_in_a_step_is_raised_and_refused_until_what_it_names_is_loaded(
    tmp_path, master, gradients, op, err, nth
) -> None:
    """The Nth read or write of step 3 fails: an OSError with errno, path,
    operation, offset and length. A write of a gradient to the drive, before
    the swapped step, changes nothing (the step is simply taken again);
    anything later leaves the optimizer refusing, the parameters unchanged
    or -- said so -- a mix, and loading what it names continues exactly."""
    kw = {"master": master, "gradients": gradients}
    ref = _Reference(tmp_path, 2, 5, **kw)
    m = _model()
    opt = _opt(m, tmp_path, **kw)
    _run(m, opt, range(2))
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in m.state_dict().items()}
    handle, path = _arm(opt, op, err, nth)
    _grads(m, 2)
    with pytest.raises(OSError) as ei:
        opt.step()
    e = ei.value
    assert handle._c.fault_hits() == 1
    assert e.errno == err and e.filename == path and e.operation == op
    assert e.length > 0 and e.offset >= 0
    handle._c.clear_fault()
    if opt.swap_stats()["broken"] is None:  # a gradient write before the swapped step
        assert gradients == "nvme" and op == "write" and _equal(_params(m), ref.old)
        assert {float(s["step"]) for s in opt.state.values()} == {2.0}
    else:
        _recover(m, opt, weights, saved, ref)
    _run(m, opt, range(2, 5))
    assert _equal(_params(m), ref.final) and _same_state(opt.state_dict(), ref.state)
    opt.close()


def _interrupt_at(monkeypatch, owner, name: str, call: int, after: bool = False) -> None:
    """`owner.name` raises KeyboardInterrupt (a Ctrl-C) at its `call`-th
    call: before doing anything, or `after` doing its work."""
    real, calls = getattr(owner, name), {"n": 0}

    def hooked(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call and not after:
            raise KeyboardInterrupt
        out = real(*args, **kwargs)
        if calls["n"] == call:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(owner, name, hooked)


@pytest.mark.parametrize("master", ["params", "drive"])
@pytest.mark.parametrize(
    ("where", "call", "after"),
    [
        ("StepIO.take_read", 1, False),  # waiting for the first sub-group's reads: nothing updated
        ("StepIO.take_read", 3, False),  # after two sub-groups were updated and written back
        ("NVMeAdamW._write_back", 2, False),  # new weights, before they reach the parameters
        # Right after a sub-group's update, its proxy parameter still holding
        # the gradient: the next step stepped it again, into another's buffer.
        ("optim.step_scaled", 2, True),
        ("StepIO.done_stepping", 4, False),  # the last sub-group's write-back starting
    ],
)
def test_ctrl_c_inside_the_pipeline_is_refused_until_what_it_names_is_loaded(
    tmp_path, monkeypatch, master, where, call, after
) -> None:
    import aio.optim
    from aio.swap.step_io import StepIO

    kw = {"master": master}
    ref = _Reference(tmp_path, 2, 4, **kw)
    m = _model()
    opt = _opt(m, tmp_path, **kw)
    _run(m, opt, range(2))
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in m.state_dict().items()}
    owner, name = where.split(".")
    owners = {"StepIO": StepIO, "NVMeAdamW": NVMeAdamW, "optim": aio.optim}
    _interrupt_at(monkeypatch, owners[owner], name, call, after)
    _grads(m, 2)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.undo()
    pool = opt._swapper.pool
    assert pool.available() == pool.count  # every buffer back, no I/O left in flight
    _recover(m, opt, weights, saved, ref)
    _run(m, opt, range(2, 4))
    assert _equal(_params(m), ref.final) and _same_state(opt.state_dict(), ref.state)
    opt.close()


@pytest.mark.parametrize("master", ["params", "drive"])
def test_a_second_ctrl_c_while_a_failed_step_drains_still_leaves_it_refusing(
    tmp_path, monkeypatch, master
) -> None:
    """Ctrl-C twice: the second lands while the failed step drains its I/O.
    The optimizer must still refuse (it stepped on in silence from a
    half-updated state), and the buffers come back once a load finishes the
    drain (they were leaked: every later step failed for want of buffers)."""
    from aio.swap.step_io import StepIO

    kw = {"master": master}
    ref = _Reference(tmp_path, 2, 4, **kw)
    m = _model()
    opt = _opt(m, tmp_path, **kw)
    _run(m, opt, range(2))
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in m.state_dict().items()}
    _interrupt_at(monkeypatch, StepIO, "take_read", 3)
    _interrupt_at(monkeypatch, StepIO, "abort", 1)
    _grads(m, 2)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.undo()
    _recover(m, opt, weights, saved, ref)
    pool = opt._swapper.pool
    assert pool.available() == pool.count
    _run(m, opt, range(2, 4))
    assert _equal(_params(m), ref.final) and _same_state(opt.state_dict(), ref.state)
    opt.close()


@pytest.mark.parametrize("master", ["params", "drive"])
@pytest.mark.parametrize("then", ["state_dict", "step"])
def test_ctrl_c_during_state_dict_loses_nothing_and_it_can_be_taken_again(
    tmp_path, monkeypatch, master, then
) -> None:
    """With the gradients in memory a step leaves its last sub-groups only
    in buffers; state_dict() writes them back first. A Ctrl-C during that
    write-back used to drop them and leave the optimizer refusing until a
    load (a Ctrl-C while saving a checkpoint lost the training state). The
    state_dict() taken again, or the next step (which must not step
    buffers with their write-back still in flight), goes on exactly."""
    from aio.swap import step_io

    ref = _Reference(tmp_path, 2, 4, master=master)
    m = _model()
    opt = _opt(m, tmp_path, master=master)
    _run(m, opt, range(3))
    real, armed = step_io.land_all, {"on": True}

    def interrupted(futs):
        if armed["on"] and futs:  # with the write-back's first writes in flight
            armed["on"] = False
            raise KeyboardInterrupt
        return real(futs)

    monkeypatch.setattr(step_io, "land_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.state_dict()
    assert not armed["on"] and opt.swap_stats()["broken"] is None
    if then == "state_dict":
        assert {float(s["step"]) for s in opt.state_dict()["state"].values()} == {3.0}
    monkeypatch.undo()
    _run(m, opt, range(3, 4))
    assert _equal(_params(m), ref.final) and _same_state(opt.state_dict(), ref.state)
    pool = opt._swapper.pool
    opt._swapper.drop_cached()
    assert pool.available() == pool.count  # no buffer tracked twice, none leaked
    opt.close()


_CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import torch
    sys.path.insert(0, {tests!r})
    from optim.test_nvme_faults import _Reference, _equal, _grads, _model, _opt, _params, _run, _same_state
    from aio.optim import NVMeAdamW
    from aio.swap import OptimizerSwapper

    tmp = sys.argv[1]


    def run(master):
        ref = _Reference(tmp, 2, 4, master=master)

        def ctrl_c_at(cls, name, call, times=1):
            # Real SIGINTs, sent from inside the call: Python runs the handler a
            # few bytecodes later, wherever the step is by then.
            real, n = getattr(cls, name), [0]
            def hooked(*a, **k):
                n[0] += 1
                if n[0] == call:
                    for _ in range(times):
                        os.kill(os.getpid(), signal.SIGINT)
                return real(*a, **k)
            setattr(cls, name, hooked)
            return lambda: setattr(cls, name, real)

        def interrupted(call, *args):
            try:
                call(*args)
                raise SystemExit("no KeyboardInterrupt")
            except KeyboardInterrupt:
                pass

        def fresh():
            m = _model()
            opt = _opt(m, tmp, master=master)
            _run(m, opt, range(2))
            return m, opt, opt.state_dict(), {{k: v.clone() for k, v in m.state_dict().items()}}

        def recover(m, opt, weights, saved):
            why = opt.swap_stats()["broken"]
            if why is None:  # interrupted before the swapped step, or after it (its count)
                now = _params(m)
                assert _equal(now, ref.old) or _equal(now, ref.new), "a silent mix"
                if _equal(now, ref.old):
                    _grads(m, 2)
                    opt.step()
                return
            if "load the model's weights" in why:
                m.load_state_dict(weights)
            else:
                assert _equal(_params(m), ref.old), why
            opt.load_state_dict(saved)
            _run(m, opt, range(2, 3))

        def check(m, opt):
            _run(m, opt, range(3, 4))
            assert _equal(_params(m), ref.final) and _same_state(opt.state_dict(), ref.state)
            opt.close()

        # One Ctrl-C in a step, from inside the pipeline: held until the step
        # is whole, then raised; the optimizer goes on (or saves) as after any step.
        for hook in [(NVMeAdamW, "_write_back", 2), (OptimizerSwapper, "_step_subgroup", 3)]:
            m, opt, saved, weights = fresh()
            posts = []
            opt.register_step_post_hook(lambda *_: posts.append(1))  # runs: the step is whole
            undo = ctrl_c_at(*hook)
            _grads(m, 2)
            interrupted(opt.step)
            undo()
            assert posts == [1], posts
            assert opt.swap_stats()["broken"] is None and _equal(_params(m), ref.new), hook
            assert {{float(s["step"]) for s in opt.state_dict()["state"].values()}} == {{3.0}}
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            check(m, opt)
        # A state written into .state (as ZeroRedundancyOptimizer's load does) is
        # loaded by the next step: one Ctrl-C there waits for it too.
        m, opt, saved, weights = fresh()
        _run(m, opt, range(2, 3))
        m.load_state_dict(weights)
        for k, p in enumerate(m.parameters()):
            opt.state[p] = {{n: v.clone() for n, v in saved["state"][k].items()}}
        undo = ctrl_c_at(OptimizerSwapper, "write_state", 2)
        _grads(m, 2)
        interrupted(opt.step)
        undo()
        assert opt.swap_stats()["broken"] is None and _equal(_params(m), ref.new)
        check(m, opt)
        # Twice: the second stops it at once, part-way; refused until what it names is loaded.
        m, opt, saved, weights = fresh()
        undo = ctrl_c_at(OptimizerSwapper, "_step_subgroup", 3, times=2)
        _grads(m, 2)
        interrupted(opt.step)
        undo()
        assert opt.swap_stats()["broken"] is not None
        recover(m, opt, weights, saved)
        check(m, opt)
        # From a timer at times across a step: whole or refused, never a silent mix.
        hit = 0
        for delay in [0.0005 * k for k in range(12)]:
            m, opt, saved, weights = fresh()
            _grads(m, 2)
            timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
            try:
                timer.start()
                opt.step()
                time.sleep(0.05)  # the signal, if it comes late, lands here
            except KeyboardInterrupt:
                hit += 1
                recover(m, opt, weights, saved)
            timer.join()
            check(m, opt)
        # Ctrl-C in state_dict() and in load_state_dict().
        m, opt, saved, weights = fresh()
        _run(m, opt, range(2, 3))
        undo = ctrl_c_at(OptimizerSwapper, "read_state", 2)
        interrupted(opt.state_dict)
        undo()
        assert opt.swap_stats()["broken"] is None
        check(m, opt)
        # In load_state_dict(): once, held until the load is whole; twice, refused until loaded again.
        for times in (1, 2):
            m, opt, saved, weights = fresh()
            _run(m, opt, range(2, 3))
            undo = ctrl_c_at(OptimizerSwapper, "write_state", 2, times=times)
            m.load_state_dict(weights)
            interrupted(opt.load_state_dict, saved)
            undo()
            if times == 2:
                assert "load_state_dict" in opt.swap_stats()["broken"]
                opt.load_state_dict(saved)
            assert opt.swap_stats()["broken"] is None
            _run(m, opt, range(2, 3))
            check(m, opt)
        print("OK", master, hit, flush=True)


    for master in sys.argv[2:]:
        run(master)
    """
)


def test_real_sigints_in_step_state_dict_and_load_exit_cleanly(tmp_path) -> None:
    """SIGINT delivered by the kernel (from inside the swapper's pipeline,
    and from a timer at times across a whole step): one SIGINT is held until
    the step is whole, then raised (the optimizer not refusing, its state
    and parameters exactly the uninterrupted step's, Python's handler back
    in place); a second one stops the step at once, refused until what it
    names is loaded; nothing hangs; recovering as the optimizer says goes on
    exactly; every optimizer closes and the process exits 0 (no I/O left
    aiming at freed memory)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=tests))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "params", "drive"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert r.returncode == 0 and "OK params" in r.stdout and "OK drive" in r.stdout, r.stdout + r.stderr


# -- bad input ---------------------------------------------------------------------------------
@bits
@pytest.mark.parametrize("master", ["params", "drive"])
def test_nan_and_inf_gradients_step_as_torchs_adamw(tmp_path, master) -> None:
    """torch's AdamW propagates NaN and inf into the weights and moments,
    without an error: so does NVMeAdamW, bit for bit (a NaN check is the
    GradScaler's or the caller's)."""
    a, b = _model(), _model()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    ob = _opt(b, tmp_path, master=master, match_torch=True)
    for step in range(3):
        for m, o in ((a, oa), (b, ob)):
            _grads(m, step)
            if step == 2:  # the last: a NaN weight would make every later gradient NaN
                m[0].weight.grad[0, 0] = float("nan")
                m[2].weight.grad[1, :3] = float("inf")
                m[2].bias.grad[0] = -float("inf")
            o.step()
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    pairs = [*zip(_params(a), _params(b), strict=True)]
    pairs += [(sa[k][n], sb[k][n]) for k in sa for n in ("step", "exp_avg", "exp_avg_sq")]
    assert all(_same_bits(x, y) for x, y in pairs)
    assert torch.isnan(b[0].weight).any() and torch.isnan(b[2].weight).any()
    ob.close()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, a NaN equal to a NaN (at the same places)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


@pytest.mark.parametrize("master", ["params", "drive"])
def test_a_gradient_of_another_shape_or_dtype_is_refused_and_changes_nothing(tmp_path, master) -> None:
    """A gradient of the parameter's element count in another shape was
    stepped as if flat (torch's AdamW fails on it): refused, naming the
    parameter and both shapes, as another dtype is. Nothing changes and the
    optimizer is not broken. (A gradient on another device than its
    parameter: torch's own grad setter refuses it.)"""
    m = _model()
    opt = _opt(m, tmp_path, master=master)
    _run(m, opt, range(1))
    before, saved = _params(m), opt.state_dict()
    w = m[2].weight
    shape = r"parameter 2 .*gradient has shape \(63, 5\), the parameter \(5, 63\)"
    for bad, err, what in (
        (torch.ones(63, 5), ValueError, shape),
        (
            torch.ones(5, 63, dtype=torch.float64),
            TypeError,
            r"parameter 2 .*dense float32, got torch.float64",
        ),
    ):
        _grads(m, 1)
        w.grad.data = bad
        with pytest.raises(err, match=what):
            opt.step()
        assert _equal(_params(m), before) and _same_state(opt.state_dict(), saved)
    _run(m, opt, range(1, 2))  # nothing was broken
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}
    opt.close()


def test_hyper_parameters_out_of_range_mid_run_are_refused_naming_the_group(tmp_path) -> None:
    """torch's AdamW checks lr, betas, eps and weight_decay at construction
    only and steps with whatever a scheduler sets later (lr < 0 ascends);
    NVMeAdamW refuses at the step, naming the param group and the key,
    before anything changes, and goes on once the value is good again."""
    m = _model()
    opt = NVMeAdamW(
        [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}],
        lr=1e-2, nvme_path=str(tmp_path), sub_group_size=SIZE,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 1.0 - 2.0 * s])
    _run(m, opt, range(1))
    sched.step()  # group 1's lr is now -1e-2
    before = _params(m)
    for key, value, what in (
        ("lr", None, r"param group 1: Invalid learning rate: -0.01"),
        ("betas", (0.9, 1.0), r"param group 1: Invalid beta parameter at index 1: 1.0"),
        ("eps", -1.0, r"param group 1: Invalid epsilon value: -1.0"),
        ("weight_decay", float("nan"), r"param group 1: Invalid weight_decay value: nan"),
    ):
        good = opt.param_groups[1][key]
        if value is not None:
            opt.param_groups[1]["lr"] = 1e-2
            opt.param_groups[1][key] = value
        _grads(m, 1)
        with pytest.raises(ValueError, match=what):
            opt.step()
        assert _equal(_params(m), before)
        opt.param_groups[1][key] = good if value is not None else 1e-2
    _run(m, opt, range(1, 2))
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}
    opt.close()


@pytest.mark.parametrize("stepped", [True, False])
def test_stepping_saving_or_loading_after_close_is_refused_clearly(tmp_path, stepped) -> None:
    m = _model()
    opt = _opt(m, tmp_path)
    if stepped:
        _run(m, opt, range(1))
    saved = opt.state_dict()
    opt.close()
    opt.close()  # idempotent
    _grads(m, 1)
    before = _params(m)
    # Said in this optimizer's terms (before: the swapper's, "OptimizerSwapper is closed").
    for call in (opt.step, opt.state_dict, lambda: opt.load_state_dict(saved)):
        with pytest.raises(ValueError, match=r"NVMeAdamW is closed.*build a new one"):
            call()
    assert _equal(_params(m), before)
    root = tmp_path / f"aio-swap-{os.geteuid()}"
    assert not root.exists() or os.listdir(root) == []  # no swap folder made again


@pytest.mark.parametrize("buffers", [4, 16], ids=["paging", "in-buffers"])
def test_a_swap_folder_removed_while_training_takes_nothing_with_it(tmp_path, buffers) -> None:
    # An audit removed a rank's swap folder between steps: with the state in its
    # buffers the loss showed only at the next state_dict(), which could then
    # never be taken; paging, the next step failed. Each file is reached through
    # its own descriptor now: it lives on until the optimizer closes it.
    import shutil

    for d in ("ref", "run"):
        (tmp_path / d).mkdir()
    ref_m = _model()
    ref = _opt(ref_m, tmp_path / "ref", buffer_count=buffers)
    _run(ref_m, ref, range(5))
    m = _model()
    opt = _opt(m, tmp_path / "run", buffer_count=buffers)
    _run(m, opt, range(2))
    (folder,) = (d["swap_dir"] for d in opt.swap_stats()["drives"])
    shutil.rmtree(folder)
    _run(m, opt, range(2, 5))
    assert _equal(_params(m), _params(ref_m)) and _same_state(opt.state_dict(), ref.state_dict())
    assert not os.path.exists(folder)
    for o in (opt, ref):
        o.close()
