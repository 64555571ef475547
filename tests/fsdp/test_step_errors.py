"""A step that raises, and reads inside a step, with the parameter tier on
NVMeAdamW's master path (one rank, gloo). Run in a subprocess: the failure
being guarded against is a SIGSEGV (a read of a freed shard), which must
fail the test, not kill pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from aio.fsdp import TierError, offload_params
    from aio.optim import NVMeAdamW
    tmp = sys.argv[1]
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    for b in m:
        fully_shard(b)
    fully_shard(m)
    opt = NVMeAdamW(m.parameters(), lr=1e-2, nvme_path=tmp, match_torch=True)
    tier = offload_params(m, tmp, opt)
    ps = list(m.parameters())

    def backward():
        opt.zero_grad()
        m(torch.randn(4, 8)).pow(2).mean().backward()

    for _ in range(2):
        backward()
        opt.step()
    assert tier.stats()["params_from_master"] == 3
    backward()
    ps[0].grad = None  # NVMeAdamW raises: a parameter without a gradient
    try:
        opt.step()
        raise SystemExit("the step did not raise")
    except ValueError:
        pass
    print("after raise:", tier._resident_depth, tier.resident_bytes(), flush=True)
    try:
        m.state_dict()
        raise SystemExit("state_dict outside resident() allowed after a failed step")
    except TierError:
        pass
    with tier.resident(modified=False):
        sub_sd = {k: v.detach().clone() for k, v in m[1].state_dict().items()}
    for call in (m[1].state_dict, lambda: m[1].load_state_dict(sub_sd)):  # an inner FSDP module
        try:
            call()
            raise SystemExit("an inner module's state_dict/load_state_dict allowed outside resident()")
        except TierError:
            pass
    print("norm", sum(p.norm().full_tensor().item() for p in ps), flush=True)

    def closure():  # reads the parameters inside the step
        backward()
        return sum(p.to_local().pow(2).sum() for p in ps)
    register_optimizer_step_post_hook(lambda o, *_: [p.norm() for p in ps])
    opt.step(closure)
    print("closure ok", tier._resident_depth, flush=True)
    backward()
    opt.step()
    try:
        ps[0].to_local().data_ptr()
        raise SystemExit("data_ptr() of a stand-in did not raise")
    except TierError:
        pass

    # A read that fails (EIO) inside resident(): it raises; the failed group is
    # freed and re-read at its next use (not passed as loaded: a SIGSEGV), and
    # the group never read keeps its source, the master weights.
    with tier.resident(modified=False):
        truth = [p.full_tensor().clone() for p in ps]
    class Flaky:
        def __init__(self, space):
            self.space = space
        def read(self, buf, offset):
            from concurrent.futures import Future
            f = Future()
            f.set_exception(OSError(5, "EIO (injected)"))
            return f
    saved = list(tier.groups[0].master.reads)
    tier.groups[0].master.reads[:] = [(Flaky(r[0]), *r[1:]) for r in saved]
    try:
        with tier.resident():
            raise SystemExit("resident() ran its block after a failed read")
    except OSError:
        pass
    tier.groups[0].master.reads[:] = saved
    assert tier.groups[0].where == "released" and tier.groups[2].master is not None
    [p.norm().full_tensor() for p in ps]  # the failed group read again
    with tier.resident(modified=False):
        assert all(torch.equal(p.full_tensor(), t) for p, t in zip(ps, truth)), "values changed"
    # An async collective on stand-ins: waited for before their shards can be freed.
    works = [dist.all_reduce(p.to_local(), async_op=True) for p in ps]
    assert all(w.is_completed() for w in works), "a collective left in flight on a shard"
    for w in works:
        w.wait()
    tier.close()
    print("done", flush=True)
    """
)


def test_a_failed_step_and_reads_inside_a_step(tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert "after raise: 0 0" in r.stdout and "closure ok 0" in r.stdout and "done" in r.stdout
