"""aio.optim: the fused CPU Adam/AdamW kernel compared with torch.equal (bit
for bit): with match_torch=True against torch's single-tensor Adam/AdamW
(foreach=False), by default against the same operations in torch with the
correctly rounded square root; plus the drop-in optimizers, their
state_dicts and the options they refuse."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch

from aio import _C, optim
from aio.optim import CPUAdam, CPUAdamW, adam_update, fast_cpu_optimizer

# match_torch=True: only where the kernel can reproduce torch's square root.
torch_bits = pytest.mark.skipif(not optim.is_bit_exact(), reason="kernel does not reproduce torch here")
MATCH = [False, pytest.param(True, marks=torch_bits)]

SIZES = [1, 7, 63, 64 * 1024 + 3, 1024 * 1024 + 5]


def _data(n: int, seed: int, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # Values over many magnitudes, so every rounding step is exercised.
    p0 = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    grads = [torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3) for _ in range(steps)]
    return p0, grads


def _torch_run(p0, grads, *, decoupled, grad_scale=None, **hyper):
    p = p0.clone().requires_grad_(True)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([p], foreach=False, **hyper)
    for grad in grads:
        p.grad = grad.clone()
        if grad_scale is not None:
            p.grad.mul_(grad_scale)
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def _ieee_run(
    p0, grads, *, decoupled, lr, betas, weight_decay, eps=1e-8, grad_scale=None, sqrt=None, state=None
):
    """torch's single-tensor Adam/AdamW step (torch/optim/adam.py, CPU,
    foreach=False) op for op, with `sqrt` for its ``exp_avg_sq.sqrt()``: by
    default the correctly rounded root (float64's, rounded once more to
    float32, which is exact for a square root). `state`: (steps done,
    exp_avg, exp_avg_sq) to start from, else a fresh one."""
    sqrt = sqrt or (lambda t: t.double().sqrt().float())
    done, m, v = state or (0, torch.zeros_like(p0), torch.zeros_like(p0))
    p, m, v = p0.clone(), m.clone(), v.clone()
    beta1, beta2 = betas
    for step, grad in enumerate(grads, start=done + 1):
        grad = grad.clone() if grad_scale is None else grad.mul(grad_scale)
        if weight_decay != 0 and not decoupled:
            grad = grad.add(p, alpha=weight_decay)
        if decoupled:
            p.mul_(1 - lr * weight_decay)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (sqrt(v) / (1 - beta2**step) ** 0.5).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
    return p, m, v


def _want(p0, grads, *, match, **kw):
    """What the kernel must give: torch's Adam (match_torch), else _ieee_run."""
    return _torch_run(p0, grads, **kw) if match else _ieee_run(p0, grads, **kw)


@torch_bits
@pytest.mark.parametrize("decoupled", [False, True])
def test_ieee_reference_is_torch_with_another_sqrt(decoupled):
    """_ieee_run with torch's own square root is torch's Adam, bit for bit: the
    reference differs from torch in the square root alone."""
    p0, grads = _data(4099, 11, 10)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, grad_scale=0.5)
    want = _torch_run(p0, grads, decoupled=decoupled, **hyper)
    _assert_same(_ieee_run(p0, grads, decoupled=decoupled, sqrt=torch.sqrt, **hyper), want)


def test_default_sqrt_is_not_torchs_here_but_close():
    """Where torch's square root is not the correctly rounded one, the two
    steps differ in some last bits (so the comparisons above can fail), by
    no more than rounding."""
    p0, grads = _data(64 * 1024 + 3, 12, 5)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    ours = _kernel_run(p0, grads, decoupled=True, **hyper)
    theirs = _torch_run(p0, grads, decoupled=True, **hyper)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-8)
    for a, b in zip(ours[1:], theirs[1:], strict=True):
        assert torch.equal(a, b)  # AdamW's moments do not use the root
    if not optim._matches_torch(optim._IEEE_SQRT):  # torch's root is not the correctly rounded one
        assert not torch.equal(ours[0], theirs[0])


def _kernel_run(p0, grads, *, decoupled, lr, betas, weight_decay, eps=1e-8, **kw):
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for step, grad in enumerate(grads, start=1):
        hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        adam_update(p, grad, m, v, step=step, decoupled=decoupled, **hyper, **kw)
    return p, m, v


def _assert_same(a, b):
    for x, y, name in zip(a, b, ("param", "exp_avg", "exp_avg_sq"), strict=True):
        assert torch.equal(x, y), f"{name}: {(x != y).sum().item()} of {x.numel()} differ"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("match", MATCH)
def test_equal_to_reference(n, decoupled, weight_decay, match):
    steps = 20 if n < 1_000_000 else 5
    p0, grads = _data(n, n, steps)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=weight_decay, decoupled=decoupled)
    want = _want(p0, grads, match=match, **hyper)
    _assert_same(_kernel_run(p0, grads, threads=2, match_torch=match, **hyper), want)


# beta1 >= 0.5 takes ATen lerp's other formula (weight 1 - beta1 < 0.5).
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.9), (0.5, 0.5), (0.0, 0.0), (0.99, 0.9999)])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("match", MATCH)
def test_betas(betas, decoupled, match):
    p0, grads = _data(64 * 1024 + 3, 3, 20)
    hyper = dict(lr=3e-3, betas=betas, weight_decay=0.01, eps=1e-6, decoupled=decoupled)
    want = _want(p0, grads, match=match, **hyper)
    _assert_same(_kernel_run(p0, grads, match_torch=match, **hyper), want)


@pytest.mark.parametrize("grad_scale", [0.5, 1 / 3, 65536.0])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("match", MATCH)
def test_grad_scale_rounds_like_mul(grad_scale, decoupled, match):
    p0, grads = _data(1000, 4, 20)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, decoupled=decoupled, grad_scale=grad_scale)
    want = _want(p0, grads, match=match, **hyper)
    _assert_same(_kernel_run(p0, grads, match_torch=match, **hyper), want)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("match", MATCH)
def test_threads_do_not_change_results(threads, match):
    p0, grads = _data(1024 * 1024 + 5, 5, 3)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, decoupled=True)
    want = _want(p0, grads, match=match, **hyper)
    _assert_same(_kernel_run(p0, grads, threads=threads, match_torch=match, **hyper), want)


def _mapped_omp_runtimes() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({ln.split()[-1] for ln in f if "libgomp" in ln or "libiomp" in ln or "libomp" in ln})


@torch_bits
def test_kernel_runs_on_the_openmp_runtime_torch_loaded():
    """Where torch brought an OpenMP runtime, the kernel splits its work over
    that runtime's team (whose threads spin between torch's jobs) and not over
    a second pool competing with them; the bits are the same either way."""
    runtimes = _mapped_omp_runtimes()
    address = optim._omp_parallel()
    assert (address != 0) == bool(runtimes), runtimes
    assert optim._loaded_omp_runtimes() == sorted(
        optim._loaded_omp_runtimes(), key=lambda p: "torch" not in p
    ), "torch's own runtime is preferred"
    p0, grads = _data(1024 * 1024 + 5, 8, 2)
    runs = []
    for parallel in (address, 0):
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        for step, grad in enumerate(grads, start=1):
            kind, fn, mode = optim._vector_sqrt()
            _C.adam_update(
                p.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(),
                float(step), 1e-3, 0.9, 0.999, 1e-8, 0.01, True, None, 0, "none", 2,
                kind, fn, mode, parallel,
            )  # fmt: skip
        runs.append((p, m, v))
    _assert_same(runs[0], runs[1])
    want = _torch_run(p0, grads, decoupled=True, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    _assert_same(runs[0], want)


def test_forked_child_steps_on_its_own_pool():
    """A forked child has the OpenMP runtime's state but none of its threads:
    it must neither hang nor differ (run in a subprocess with a timeout)."""
    # The child makes no torch op of its own: torch's parallel ops hang in a
    # child forked after they ran in the parent (libgomp is not fork-safe).
    script = textwrap.dedent(
        """
        import os, sys, torch
        from aio.optim import adam_update
        n = 1 << 20
        def tensors():
            return torch.ones(n), torch.full((n,), 0.5), torch.zeros(n), torch.zeros(n)
        def run(p, g, m, v):
            adam_update(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.0, decoupled=True, threads=2)
            return p.numpy().tobytes()
        want = run(*tensors())
        fresh = tensors()
        pid = os.fork()
        if pid == 0:
            os._exit(0 if run(*fresh) == want else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """
    )
    r = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# Steps every kernel variant (Adam/AdamW, lerp formulas, grad scale, both
# low-precision copies, bfloat16 moments; block tails and the thread split)
# on values over many magnitudes, zeros and subnormal second moments (MKL's
# rare-input path) included, once per square root argv[1:] asks for
# (match_torch "1" or "0"), and prints for each the instruction set, the
# square root kind torch's is reproduced with and a digest.
_ISA_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys, torch
    from aio.optim import adam_update, kernel_isa
    def digest(match):
      g = torch.Generator().manual_seed(7)
      h = hashlib.sha256()
      cases = [(n, dec, b1, st) for n in (1, 15, 16, 257, 70001) for dec in (False, True)
               for b1 in (0.9, 0.3) for st in (torch.float32, torch.bfloat16)]
      for n, decoupled, beta1, states in cases:
          p = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
          m, v = torch.zeros(n, dtype=states), torch.zeros(n, dtype=states)
          low = torch.empty(n, dtype=torch.bfloat16 if decoupled else torch.float16)
          for step in range(1, 4):
              grad = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 8)
              grad[: n // 8] = 0.0
              grad[n // 8 : n // 4] *= 1e-22
              adam_update(p, grad, m, v, step=step, lr=1e-2, beta1=beta1, beta2=0.999, eps=1e-8,
                          weight_decay=0.01, decoupled=decoupled, lowp_out=low, threads=2,
                          grad_scale=0.5 if step == 2 else None, match_torch=match)
          for t in (p, m, v, low):
              h.update(t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes())
      from aio.optim import _vector_sqrt
      return _vector_sqrt()[0], h.hexdigest()
    for arg in sys.argv[1:]:
      print(kernel_isa(), *digest(arg == "1"))
    """
)

_ISAS = ("portable", "avx2", "avx512")


@functools.cache
def _isa_runs(cap: str | None) -> dict[bool, list[str]]:
    """Both square roots' (isa, sqrt kind, digest) under an instruction-set
    cap, from one process (the uncapped reference is shared by the tests)."""
    env = {k: v for k, v in os.environ.items() if k != "AIO_MAX_CPU_ISA"}
    if cap is not None:
        env["AIO_MAX_CPU_ISA"] = cap
    r = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, "0", "1"], env=env, timeout=240,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    return {False: lines[0].split(), True: lines[1].split()}


def _run_isa(cap: str | None, match: bool) -> list[str]:
    return _isa_runs(cap)[match]


# One worker runs all four: they share _isa_runs' three child processes
# (spread over workers, each would run the uncapped reference again).
@pytest.mark.xdist_group("isa-runs")
@pytest.mark.parametrize("cap", ["avx2", "portable"])
@pytest.mark.parametrize("match", MATCH)
def test_every_instruction_set_gives_the_same_bits(cap, match):
    """The AVX-512, AVX2 and portable loops are the same operations in the
    same order, with either square root: capping the instruction set
    (AIO_MAX_CPU_ISA) changes the speed, never a bit. On a CPU without the
    wider sets the cap is the best it has, and the comparison still runs."""
    best, sqrt, want = _run_isa(None, match)
    assert best == optim.kernel_isa() and best in _ISAS
    isa, sqrt_capped, got = _run_isa(cap, match)
    assert isa == min(best, cap, key=_ISAS.index)
    # The square root is picked by checking the kernel against torch: a
    # variant that went wrong would quietly fall back to a slower one.
    assert sqrt_capped == sqrt, f"{isa} reproduces torch with {sqrt_capped}, {best} with {sqrt}"
    assert got == want, f"{isa} differs from {best}"


def _cpu_vendor() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":")[1].strip() for ln in f if ln.startswith("vendor_id")), "")


@pytest.mark.skipif(
    _cpu_vendor() != "AuthenticAMD" or not torch.backends.mkl.is_available(),
    reason="MKL runs its SSE square root on AMD CPUs only",
)
def test_amd_cpu_steps_with_mkl_sse_sqrt_inline():
    """MKL gives AMD CPUs its SSE kernel: the kernel must reproduce it in-line
    (a call into MKL per block is the slow fallback)."""
    assert optim._vector_sqrt()[0] == "mkl_sse"


def test_bad_instruction_set_cap_is_a_value_error():
    script = "from aio import optim; optim.kernel_isa()"
    env = dict(os.environ, AIO_MAX_CPU_ISA="sse9")
    r = subprocess.run([sys.executable, "-c", script], env=env, timeout=60, capture_output=True, text=True)
    assert r.returncode != 0
    assert "ValueError: AIO_MAX_CPU_ISA must be 'avx512', 'avx2' or 'portable', got 'sse9'" in r.stderr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [7, 64 * 1024 + 3])
def test_lowp_copy_equals_to_dtype(dtype, n):
    p0, grads = _data(n, 6, 2)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=dtype)
    for step, grad in enumerate(grads, start=1):
        adam_update(p, grad, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0, decoupled=True, lowp_out=out, threads=2)  # fmt: skip
        assert torch.equal(out.view(torch.int16), p.to(dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 1])
def test_lowp_rounding_edges(dtype, offset):
    """Ties, subnormals, overflow to inf, infinities and NaNs (with sign and
    payload) round like torch's .to(dtype). With lr=0 the update leaves each
    parameter as it was (signalling NaNs come out quiet), so these exact
    values reach the conversion. Into an aligned copy (non-temporal stores
    where the CPU has AVX-512) and one 2 bytes off (plain stores)."""
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    special = torch.tensor(
        [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFE000, 0x477FF000,
         0x477FEFFF, 0x477FE000, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001, 0x3F808000,
         0x3F818000, 0x00000001, 0x80000000, 0],
        dtype=torch.int64,
    ).to(torch.int32)  # fmt: skip
    p = torch.cat([bits, special]).view(torch.float32).clone()
    ref = p.clone()
    grad, m, v = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    out = torch.empty(p.numel() + offset, dtype=dtype)[offset:]
    adam_update(p, grad, m, v, step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.0, decoupled=True, lowp_out=out)  # fmt: skip
    same = p.view(torch.int32) == ref.view(torch.int32)
    assert torch.equal(same, ~ref.isnan() | same)  # only NaNs may change (quieted)
    want = p.to(dtype).view(torch.int16)
    assert torch.equal(out.view(torch.int16), want), (out.view(torch.int16) != want).sum()


@pytest.mark.parametrize("cls", [CPUAdam, CPUAdamW])
@pytest.mark.parametrize("match", MATCH)
def test_optimizer_square_root_choice(cls, match):
    """The class steps with the square root its match_torch names."""
    p0, grads = _data(70001, 13, 3)
    p = p0.clone()
    opt = cls([p], lr=1e-3, weight_decay=0.01, match_torch=match)
    for g in grads:
        p.grad = g
        opt.step()
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, decoupled=cls is CPUAdamW)
    _assert_same(
        (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]), _want(p0, grads, match=match, **hyper)
    )
    with pytest.raises(TypeError, match="match_torch"):
        cls([p], match_torch="yes")


@torch_bits
@pytest.mark.parametrize("cls,torch_cls", [(CPUAdam, torch.optim.Adam), (CPUAdamW, torch.optim.AdamW)])
def test_optimizer_equal_to_torch(cls, torch_cls):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.ReLU(), torch.nn.Linear(65, 3))
    twin = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    ours = cls(model.parameters(), lr=1e-2, weight_decay=0.01, match_torch=True)
    theirs = torch_cls(twin, lr=1e-2, weight_decay=0.01, foreach=False)
    for _ in range(20):
        x = torch.randn(16, 33)
        for opt in (ours, theirs):
            opt.zero_grad()
        model(x).square().mean().backward()
        grads = [p.grad for p in model.parameters()]
        for t, grad in zip(twin, grads, strict=True):
            t.grad = grad.clone()
        ours.step()
        theirs.step()
    for p, t in zip(model.parameters(), twin, strict=True):
        assert torch.equal(p, t)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            a, b = ours.state[p][key], theirs.state[t][key]
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key


@torch_bits
@pytest.mark.parametrize("cls,torch_cls", [(CPUAdam, torch.optim.Adam), (CPUAdamW, torch.optim.AdamW)])
def test_state_dict_round_trip_with_torch(cls, torch_cls):
    p0, grads = _data(1000, 8, 6)
    a = p0.clone().requires_grad_(True)
    b = p0.clone().requires_grad_(True)
    ref = p0.clone().requires_grad_(True)
    theirs = torch_cls([a], lr=1e-3, foreach=False)
    ref_opt = torch_cls([ref], lr=1e-3, foreach=False)
    for grad in grads[:3]:
        a.grad, ref.grad = grad.clone(), grad.clone()
        theirs.step()
        ref_opt.step()
    # torch -> ours, step on; then ours -> torch, step on.
    ours = cls([b], lr=1e-3, match_torch=True)
    with torch.no_grad():
        b.copy_(a)
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0].keys() == ref_opt.param_groups[0].keys()
    for grad in grads[3:5]:
        b.grad, ref.grad = grad.clone(), grad.clone()
        ours.step()
        ref_opt.step()
    back = torch_cls([a], lr=1e-3, foreach=False)
    with torch.no_grad():
        a.copy_(b)
    back.load_state_dict(ours.state_dict())
    a.grad, ref.grad = grads[5].clone(), grads[5].clone()
    back.step()
    ref_opt.step()
    assert torch.equal(a, ref)
    assert torch.equal(back.state[a]["exp_avg_sq"], ref_opt.state[ref]["exp_avg_sq"])
    assert back.state[a]["step"].dtype == torch.float32


def test_state_spec_matches_torch():
    from aio.swap.optimizer import discover_state_spec

    for cls, torch_cls in ((CPUAdam, torch.optim.Adam), (CPUAdamW, torch.optim.AdamW)):
        assert discover_state_spec(cls, lr=1e-3) == discover_state_spec(torch_cls, lr=1e-3)


@pytest.mark.parametrize(
    "kw", [{"amsgrad": True}, {"maximize": True}, {"capturable": True}, {"differentiable": True},
           {"foreach": True}, {"fused": True}, {"lr": torch.tensor(1e-3)}, {"lr": -1.0},
           {"betas": (1.0, 0.999)}, {"betas": (0.9, -0.1)}, {"eps": -1.0}, {"weight_decay": -0.1}],
)  # fmt: skip
@pytest.mark.parametrize("cls", [CPUAdam, CPUAdamW])
def test_refused_options(cls, kw):
    with pytest.raises(ValueError):
        cls([torch.zeros(3, requires_grad=True)], **kw)


@pytest.mark.parametrize("param", [torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.bfloat16)])
def test_refused_params(param):
    with pytest.raises(TypeError, match="float32 CPU"):
        CPUAdam([param.requires_grad_(True)])


def test_group_edited_after_construction_is_checked():
    p = torch.zeros(3, requires_grad=True)
    opt = CPUAdam([p])
    opt.param_groups[0]["amsgrad"] = True
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()


@pytest.mark.parametrize("stepped", [False, True])
def test_sparse_grad_refused(stepped):
    """Every parameter is checked before any step count moves, also one
    whose state exists (its usual quick check must not read a sparse
    gradient's pointer)."""
    p, q = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = CPUAdam([q, p])
    q.grad = torch.ones(3)
    p.grad = torch.ones(3) if stepped else None
    opt.step()
    after_one = q.detach().clone()
    p.grad = torch.ones(3).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    assert opt.state[q]["step"].item() == 1.0 and torch.equal(q, after_one)


@pytest.mark.parametrize(
    "key,bad,exc,msg",
    [("exp_avg", torch.zeros(5), ValueError, "exp_avg has 5 elements"),
     ("step", torch.tensor(float("nan")), ValueError, "step count nan cannot be counted on"),
     ("lr", float("inf"), ValueError, "lr must be finite, got inf"),
     ("eps", "1e-8", TypeError, "eps must be a number, got str")],
)  # fmt: skip
def test_refused_later_group_steps_no_group(key, bad, exc, msg):
    """The checks of every group, the kernel's own (a step count, finite
    hyper-parameters) too, come before the first group steps."""
    p, q = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    opt = CPUAdamW([{"params": [p]}, {"params": [q], "lr": 1e-2}])
    p.grad, q.grad = torch.ones(4), torch.ones(4)
    opt.step()
    before = p.detach().clone()
    if key in ("lr", "eps"):
        opt.param_groups[1][key] = bad
    else:
        opt.state[q][key] = bad
    with pytest.raises(exc, match=msg):
        opt.step()
    assert torch.equal(p, before) and opt.state[p]["step"].item() == 1.0


def test_numpy_hyper_parameters_step_as_floats():
    """numpy scalars as lr/eps/betas (torch's optimizers take them) step as
    the same Python floats do."""
    p0, grads = _data(100, 8, 2)
    ours, ref = p0.clone(), p0.clone()
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.5)
    fast = CPUAdamW([ours], **{k: np.float64(v) if k != "betas" else tuple(map(np.float32, v))
                               for k, v in hyper.items()})  # fmt: skip
    hyper["betas"] = tuple(float(np.float32(b)) for b in hyper["betas"])
    slow = CPUAdamW([ref], **hyper)
    for g in grads:
        ours.grad, ref.grad = g.clone(), g.clone()
        fast.step()
        slow.step()
    assert torch.equal(ours, ref)


def test_all_zero_tensor_gradient_steps_as_zeros():
    """autograd's memoryless all-zero gradient (``_efficientzerotensor``,
    data_ptr 0) steps as a gradient of zeros, as in torch."""
    ours, ref = torch.ones(6, requires_grad=True), torch.ones(6, requires_grad=True)
    fast, slow = CPUAdamW([ours], lr=1e-2), CPUAdamW([ref], lr=1e-2)
    for _ in range(2):
        ours.grad, ref.grad = torch._efficientzerotensor(6), torch.zeros(6)
        fast.step()
        slow.step()
    assert torch.equal(ours, ref) and fast.state[ours]["step"].item() == 2.0


@torch_bits
@pytest.mark.parametrize("threads", [1, 2])
def test_parameter_listed_twice_steps_twice_like_torch(threads):
    """torch lets a group hold one parameter twice (with a warning) and
    steps it twice; so does CPUAdamW, the two updates one after the other
    (in one kernel call they would race on the same memory), on a tensor
    large enough to be split between threads."""
    p0, grads = _data(70001, 5, 2)
    small0, small_grads = _data(9, 6, 2)
    ours, ref = [p0.clone(), small0.clone()], [p0.clone(), small0.clone()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's duplicate warning
        fast = CPUAdamW([ours[0], ours[1], ours[0]], lr=1e-2, threads=threads, match_torch=True)
        slow = torch.optim.AdamW([ref[0], ref[1], ref[0]], lr=1e-2, foreach=False)
    for g, h in zip(grads, small_grads, strict=True):
        ours[0].grad, ref[0].grad, ours[1].grad, ref[1].grad = g.clone(), g.clone(), h.clone(), h.clone()
        fast.step()
        slow.step()
    assert fast.state[ours[0]]["step"].item() == 4.0 and fast.state[ours[1]]["step"].item() == 2.0
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert torch.equal(fast.state[ours[0]]["exp_avg_sq"], slow.state[ref[0]]["exp_avg_sq"])


def test_refused_step_changes_nothing():
    """A parameter whose update is refused (here: a lowp_out of the wrong
    size) stops the whole step before anything changed: every parameter and
    step count is as it was, and the next step counts from there."""
    p, q, r = (torch.zeros(4, requires_grad=True) for _ in range(3))
    opt = CPUAdam([p, q, r])
    for t in (p, q, r):
        t.grad = torch.ones(4)
    opt.step()
    before = [t.detach().clone() for t in (p, q, r)]
    with pytest.raises(ValueError, match="lowp_out has 7 elements"):
        opt.step(lowp_out={q: torch.zeros(7, dtype=torch.bfloat16)})
    assert [opt.state[t]["step"].item() for t in (p, q, r)] == [1.0, 1.0, 1.0]
    assert all(torch.equal(t, b) for t, b in zip((p, q, r), before, strict=True))
    opt.step()
    assert [opt.state[t]["step"].item() for t in (p, q, r)] == [2.0, 2.0, 2.0]


@torch_bits
def test_step_count_of_older_state_dicts_keeps_counting():
    """A state whose step is a plain number (older checkpoints) counts on in
    a float32 tensor, as torch's Adam does, with torch's results."""
    p0, grads = _data(64, 9, 3)
    ours, ref = p0.clone(), p0.clone()
    fast, slow = CPUAdam([ours], lr=1e-2, match_torch=True), torch.optim.Adam([ref], lr=1e-2, foreach=False)
    for i, g in enumerate(grads):
        ours.grad, ref.grad = g.clone(), g.clone()
        fast.step()
        slow.step()
        if i == 0:
            fast.state[ours]["step"] = 1
    assert fast.state[ours]["step"].dtype is torch.float32 and fast.state[ours]["step"].item() == 3.0
    assert torch.equal(ours, ref)


def test_one_call_steps_a_group_as_per_tensor_updates():
    """CPUAdamW steps a whole group in one kernel call: the same bits as
    adam_update per tensor, for the usual tensors and the unusual ones mixed
    in (a transposed gradient, bfloat16 moments, a lowp copy, an empty
    tensor, a step count loaded as a plain number) and a parameter without
    a gradient; every count moves by one."""
    torch.manual_seed(1)
    sizes = [(3,), (768,), (300, 257), (0,), (5000,), (64, 64), (70001,)]
    params = [torch.randn(s) for s in sizes]
    grads = [torch.randn(s) * 1e-2 for s in sizes]
    grads[5] = torch.randn(64, 64).t()  # not contiguous
    grads[2] = None
    opt = CPUAdamW([p.clone() for p in params], lr=1e-2)
    for q, g in zip(opt.param_groups[0]["params"], grads, strict=True):
        q.grad = g
    opt.step()
    q1 = opt.param_groups[0]["params"][1]
    opt.state[q1]["exp_avg"] = opt.state[q1]["exp_avg"].bfloat16()
    opt.state[q1]["exp_avg_sq"] = opt.state[q1]["exp_avg_sq"].bfloat16()
    opt.state[opt.param_groups[0]["params"][4]]["step"] = 1
    qs = opt.param_groups[0]["params"]
    want = [(q.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[q].items()})
            for q in qs]  # fmt: skip
    low = torch.empty(70001, dtype=torch.bfloat16)
    opt.step(lowp_out={qs[6]: low})
    for k, ((p, st), q, g) in enumerate(zip(want, qs, grads, strict=True)):
        if g is None:
            assert torch.equal(q, p) and not opt.state[q]
            continue
        wlow = torch.empty(70001, dtype=torch.bfloat16) if k == 6 else None
        count = float(st["step"]) + 1
        adam_update(p, g.contiguous(), st["exp_avg"], st["exp_avg_sq"], step=count, lr=1e-2, beta1=0.9,
                    beta2=0.999, eps=1e-8, weight_decay=1e-2, decoupled=True, lowp_out=wlow)  # fmt: skip
        assert torch.equal(q, p), k
        assert torch.equal(opt.state[q]["exp_avg"], st["exp_avg"]), k
        assert torch.equal(opt.state[q]["exp_avg_sq"], st["exp_avg_sq"]), k
        step = opt.state[q]["step"]
        assert step.dtype is torch.float32 and step.item() == count
        if wlow is not None:
            assert torch.equal(low, wlow)


def _jagged(n: int) -> torch.Tensor:
    """A jagged nested tensor of n float32 elements (its data_ptr() is 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
        return torch.nested.nested_tensor([torch.zeros(n // 2), torch.zeros(n - n // 2)], layout=torch.jagged)


def test_negated_view_gradient_steps_its_values():
    """A gradient that is a lazy negation view (its memory holds the negated
    values) steps with the values it stands for, as in torch."""
    p0, grads = _data(300, 4, 2)
    ours, ref = p0.clone(), p0.clone()
    fast, slow = CPUAdamW([ours], lr=1e-2), CPUAdamW([ref], lr=1e-2)
    for g in grads:
        ours.grad, ref.grad = torch._neg_view(-g), g.clone()
        fast.step()
        slow.step()
    assert torch.equal(ours, ref)
    assert torch.equal(fast.state[ours]["exp_avg"], slow.state[ref]["exp_avg"])


@pytest.mark.parametrize(
    "key,bad,exc,msg",
    [("exp_avg", np.zeros(4, np.float32), TypeError, "exp_avg must be a torch.Tensor"),
     ("exp_avg_sq", torch.zeros(5), ValueError, "exp_avg_sq has 5 elements"),
     ("exp_avg", torch.zeros(4, dtype=torch.float64), TypeError, "exp_avg must be float32"),
     ("exp_avg_sq", torch.zeros(8)[::2], ValueError, "contiguous"),
     ("exp_avg", torch._neg_view(torch.zeros(4)), ValueError, "exp_avg is a lazy negation view"),
     ("exp_avg_sq", _jagged(4), TypeError, "exp_avg_sq must be a dense .* torch.jagged"),
     *([("exp_avg", torch.zeros(4).to_mkldnn(), TypeError, "exp_avg must be a dense .* torch._mkldnn")]
       if torch.backends.mkldnn.is_available() else [])],
)  # fmt: skip
def test_bad_state_is_refused_by_name(key, bad, exc, msg):
    """A state edited or loaded wrong misses the usual parameter's quick
    check and gets the full one: its error names the tensor, nothing steps."""
    p, q = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    opt = CPUAdamW([q, p])
    p.grad, q.grad = torch.ones(4), torch.ones(4)
    opt.step()
    opt.state[p][key] = bad
    before = q.detach().clone()
    with pytest.raises(exc, match=msg):
        opt.step()
    assert torch.equal(q, before) and opt.state[q]["step"].item() == 1.0


def _args(n=4):
    return [torch.zeros(n) for _ in range(4)]


HYPER = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False)


@pytest.mark.parametrize(
    "i,bad,exc",
    [(0, torch.zeros(4, dtype=torch.float64), TypeError), (1, torch.zeros(4, dtype=torch.float16), TypeError),
     (2, torch.zeros(5), ValueError), (3, torch.zeros(8)[::2], ValueError), (1, [0.0] * 4, TypeError)],
)  # fmt: skip
def test_update_refuses_bad_tensors(i, bad, exc):
    args = _args()
    args[i] = bad
    with pytest.raises(exc):
        adam_update(*args, **HYPER)


def test_update_refuses_aliases_and_bad_lowp():
    p, g, m, v = _args()
    with pytest.raises(ValueError, match="different"):
        adam_update(p, g, m, m, **HYPER)
    # R3-08: partly overlapping operands (different pointers, shared memory)
    n = p.numel()
    buf = torch.zeros(2 * n)
    for args in ((p, g, buf[:n], buf[n // 2 : n // 2 + n]), (buf[:n], buf[1 : n + 1], m, v)):
        before = [t.clone() for t in args]
        with pytest.raises(ValueError, match="overlap"):
            adam_update(*args, **HYPER)
        assert all(torch.equal(a, b) for a, b in zip(args, before, strict=True))
    adam_update(p, g, buf[:n], buf[n:], **HYPER)  # adjacent, not overlapping
    with pytest.raises(TypeError, match="lowp_out"):
        adam_update(p, g, m, v, lowp_out=torch.zeros(4), **HYPER)
    with pytest.raises(ValueError, match="lowp_out"):
        adam_update(p, g, m, v, lowp_out=torch.zeros(5, dtype=torch.bfloat16), **HYPER)


def test_optimizer_refuses_overlapping_state_and_gradients():
    """R3-08 through CPUAdam.step: a gradient or state sharing part of its
    memory with another operand is refused (torch refuses it too), on the
    first step and on the fast path of later ones."""
    buf = torch.zeros(65)
    p = torch.nn.Parameter(torch.ones(64))
    opt = CPUAdam([p], lr=1e-3)
    p.grad = torch.ones(64)
    opt.step()
    st = opt.state[p]
    st["exp_avg_sq"] = buf[1:]
    st["exp_avg"] = buf[:64]
    with pytest.raises(ValueError, match="overlap"):
        opt.step()
    st["exp_avg"], st["exp_avg_sq"] = torch.zeros(64), torch.zeros(64)
    st["step"] = st["exp_avg"][3:4]  # the step count inside a state
    with pytest.raises(ValueError, match="step count"):
        opt.step()


@pytest.mark.parametrize(
    "key,value",
    [("step", 0), ("step", float("nan")), ("lr", -1.0), ("lr", float("inf")), ("beta1", 1.0),
     ("beta2", -0.5), ("eps", -1e-8), ("weight_decay", float("nan"))],
)  # fmt: skip
def test_update_refuses_bad_hyper(key, value):
    with pytest.raises(ValueError, match=key):
        adam_update(*_args(), **{**HYPER, key: value})


@pytest.mark.parametrize("threads,exc", [(0, ValueError), (1.5, TypeError)])
def test_update_refuses_bad_threads(threads, exc):
    with pytest.raises(exc, match="threads"):
        adam_update(*_args(), **HYPER, threads=threads)


def test_empty_tensors_are_a_no_op():
    adam_update(*[torch.zeros(0) for _ in range(4)], **HYPER)


def test_fast_cpu_optimizer():
    hyper = {"lr": 1e-3, "weight_decay": 0.01}
    assert fast_cpu_optimizer(torch.optim.Adam, hyper) == (CPUAdam, hyper)
    assert fast_cpu_optimizer(torch.optim.AdamW, hyper) == (CPUAdamW, hyper)
    exact = (CPUAdamW, {**hyper, "match_torch": True}) if optim.is_bit_exact() else (torch.optim.AdamW, hyper)
    assert fast_cpu_optimizer(torch.optim.AdamW, hyper, match_torch=True) == exact
    for other in ({"amsgrad": True}, {"fused": True}, {"foreach": True}, {"lr": torch.tensor(0.1)}):
        assert fast_cpu_optimizer(torch.optim.AdamW, other) == (torch.optim.AdamW, other)
    assert fast_cpu_optimizer(torch.optim.SGD, hyper) == (torch.optim.SGD, hyper)
    assert fast_cpu_optimizer(torch.optim.AdamW, {"decoupled_weight_decay": True})[0] is torch.optim.AdamW


@pytest.mark.parametrize(
    "scale", [0.37, torch.tensor(0.37), torch.tensor(1 / 3, dtype=torch.float64), torch.tensor([0.5])]
)
@pytest.mark.parametrize("cls", [CPUAdam, CPUAdamW])
@torch_bits
def test_step_grad_scale_fuses_the_multiply(scale, cls):
    from aio.optim import step_scaled

    p0, grads = _data(4099, 3, 4)
    ours, ref = p0.clone(), p0.clone()
    fast = cls([ours], lr=1e-3, weight_decay=0.01, match_torch=True)
    slow = (torch.optim.AdamW if cls is CPUAdamW else torch.optim.Adam)([ref], lr=1e-3, weight_decay=0.01)
    for g in grads:
        ours.grad, ref.grad = g.clone(), g.clone()
        step_scaled(fast, [ours.grad], scale)
        step_scaled(slow, [ref.grad], scale)
        assert torch.equal(ours.grad, g)  # fused: the gradient is left as it was
        assert torch.equal(ref.grad, g * scale)  # torch's path: multiplied in place
    assert torch.equal(ours, ref)
    assert torch.equal(fast.state[ours]["exp_avg_sq"], slow.state[ref]["exp_avg_sq"])


@torch_bits
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_step_scaled_writes_the_low_precision_copy(dtype):
    """lowp_out: aio's Adam writes each parameter's rounded copy in its pass,
    torch's optimizers get it copied after the step; the same values either
    way, and parameters left out of the mapping get none."""
    from aio.optim import step_scaled

    p0, grads = _data(4099, 4, 3)
    ours, ref, other = p0.clone(), p0.clone(), p0.clone()
    fast = CPUAdamW([ours, other], lr=1e-3, weight_decay=0.01, match_torch=True)
    slow = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01)
    out_fast, out_slow = torch.zeros(4099, dtype=dtype), torch.zeros(4099, dtype=dtype)
    for g in grads:
        ours.grad, other.grad, ref.grad = g.clone(), g.clone(), g.clone()
        step_scaled(fast, [ours.grad, other.grad], 0.5, {ours: out_fast})
        step_scaled(slow, [ref.grad], 0.5, {ref: out_slow})
        assert torch.equal(out_fast, ours.to(dtype))
        assert torch.equal(out_slow, out_fast)
    assert torch.equal(ours, ref) and torch.equal(other, ours)
    with pytest.raises(ValueError, match="lowp_out has 7 elements"):
        fast.step(lowp_out={ours: torch.zeros(7, dtype=dtype)})


def test_step_grad_scale_refuses_what_is_not_a_real_number():
    p = torch.zeros(4)
    p.grad = torch.ones(4)
    opt = CPUAdam([p])
    for bad, err in [(torch.ones(2), TypeError), (torch.tensor(1), TypeError), ("2", TypeError)]:
        with pytest.raises(err, match="grad_scale"):
            opt.step(grad_scale=bad)
    assert torch.equal(p, torch.zeros(4))


@pytest.mark.parametrize("match", MATCH)
def test_square_root_edges(match):
    """Second moments at the square root's edges -- zeros, subnormals, the
    largest floats, infinities, NaNs -- among ordinary values, in whole
    vector blocks and a ragged tail: the update equals torch's Adam bit for
    bit (its vectorized sqrt hands these lanes to a slower path), or the
    reference with the correctly rounded root."""
    g = torch.Generator().manual_seed(3)
    n = 4 * 256 + 13
    v = torch.rand(n, generator=g)
    edges = torch.tensor(
        [0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F7FF000, 0x7F7FEFFF, 0x7F800000, 0x7FC00000,
         0x80000000, 0],
        dtype=torch.int64,
    ).to(torch.int32)  # fmt: skip
    idx = torch.randperm(n, generator=g)[: 4 * edges.numel()]
    v[idx] = edges.repeat(4).view(torch.float32)
    p0, m0, grad = (torch.randn(n, generator=g) for _ in range(3))
    if match:
        ref = torch.nn.Parameter(p0.clone())
        opt = torch.optim.Adam([ref], lr=1e-3, foreach=False)
        ref.grad = grad.clone()
        opt.state[ref] = {"step": torch.tensor(4.0), "exp_avg": m0.clone(), "exp_avg_sq": v.clone()}
        opt.step()
    else:
        hyper = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, decoupled=False)
        ref = _ieee_run(p0, [grad], state=(4, m0, v), **hyper)[0]
    p, m, vv = p0.clone(), m0.clone(), v.clone()
    adam_update(p, grad, m, vv, step=5, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.0, decoupled=False, match_torch=match)  # fmt: skip
    same = p.view(torch.int32) == ref.detach().view(torch.int32)
    assert torch.equal(same | (p.isnan() & ref.isnan()), torch.ones(n, dtype=torch.bool))


@pytest.mark.parametrize("n", [7, 64 * 1024 + 3, 1024 * 1024 + 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_moments_equal_widen_update_round(n, threads):
    """bfloat16 moments (bf16 optimizer states): the same bits as widening
    them, the float32 update, and rounding back to nearest even."""
    p0, grads = _data(n, 11, 3)
    pa, ma, va = p0.clone(), torch.zeros(n), torch.zeros(n)
    pb, mb, vb = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    for step, grad in enumerate(grads, start=1):
        kw = dict(step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
        adam_update(pa, grad, ma, va, threads=threads, **kw)
        ma.copy_(ma.to(torch.bfloat16))
        va.copy_(va.to(torch.bfloat16))
        adam_update(pb, grad, mb, vb, threads=threads, **kw)
    _assert_same((pa, ma, va), (pb, mb.float(), vb.float()))


def test_moments_of_two_dtypes_are_refused():
    p, g = torch.zeros(8), torch.zeros(8)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        adam_update(p, g, torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8), **kw)
    with pytest.raises(TypeError, match="must be float32"):
        adam_update(p.bfloat16(), g, torch.zeros(8), torch.zeros(8), **kw)


def _libgomp_here() -> bool:
    return bool(optim._libgomp_parallel())


def _task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled_task_count() -> int:
    """The thread count once threads of earlier tests have finished leaving:
    objects they dropped collected first (a handle's finalizer stops its
    workers), then the same count over 0.25 s (one equal pair of samples was
    not enough: CI saw a thread leave after it, 5 counted for 4 + 2)."""
    import gc

    gc.collect()
    last, same = _task_count(), 0
    for _ in range(200):
        time.sleep(0.05)
        now = _task_count()
        same = same + 1 if now == last else 0
        if same == 5:
            return now
        last = now
    return last


@pytest.mark.skipif(not _libgomp_here(), reason="torch brought no GNU libgomp here")
def test_openmp_throttle_parks_one_shared_team(monkeypatch):
    """With libgomp a throttle parks a team of as many threads as CPUs (the
    parked thread and its workers, counted by the runtime's own members, so
    a runtime that gave fewer shows); throttles share it and the last close
    ends it, threads and all."""
    for var in optim._OMP_WAIT_VARS:
        monkeypatch.delenv(var, raising=False)
    if torch.get_num_threads() < 2:
        pytest.skip("torch runs one thread: nothing to throttle")
    cpus = max(2, len(os.sched_getaffinity(0)))
    torch.ones(1 << 22).mul(2).sum()  # torch's own team exists before counting
    before = _settled_task_count()
    with optim.OpenMPThrottle() as a:
        assert a.active and _C.omp_parked_threads() == cpus
        assert _task_count() == before + cpus
        b = optim.OpenMPThrottle()
        b.close()
        b.close()  # twice: once only
        assert _C.omp_parked_threads() == cpus
        torch.ones(1 << 22).mul(2).sum()  # torch's own team still works
    assert not a.active and _C.omp_parked_threads() == 0
    # The parked thread is joined; its workers leave the runtime's pool
    # when told to, a moment later.
    deadline = time.monotonic() + 10
    while _task_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _task_count() == before


# Process CPU time of 30 short parallel regions each followed by a 10 ms
# wait (an I/O wait of an offloaded step), with and without a throttle.
_SPIN_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        os.environ.pop(var, None)
    torch.set_num_threads(2)
    from aio.optim import OpenMPThrottle
    x = torch.ones(1 << 17)  # two threads' worth, so the spin dominates the work
    def cpu_per_region():
        t = time.process_time()
        for _ in range(30):
            x.mul(2)
            time.sleep(0.01)
        return (time.process_time() - t) / 30
    free = cpu_per_region()
    with OpenMPThrottle() as throttle:
        assert throttle.active
        quiet = cpu_per_region()
    print(free, quiet)
    """
)


@pytest.mark.skipif(not _libgomp_here(), reason="torch brought no GNU libgomp here")
def test_openmp_throttle_stops_the_spinning():
    """The effect itself, in CPU time (not wall time): unthrottled, libgomp's
    worker spins milliseconds after each region (about 9 ms of CPU per
    region here), throttled well under one (0.3 ms). The regions are small,
    so the work itself (which the throttle cannot remove) stays far below
    the spin even on a loaded machine."""
    r = subprocess.run([sys.executable, "-c", _SPIN_SCRIPT], timeout=120, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    free, quiet = (float(x) for x in r.stdout.split())
    assert quiet < free / 4, (free, quiet)


@pytest.mark.parametrize("var", ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT"])
def test_openmp_throttle_leaves_a_users_choice_alone(monkeypatch, var):
    monkeypatch.setenv(var, "passive" if var == "OMP_WAIT_POLICY" else "1000")
    with optim.OpenMPThrottle() as t:
        assert not t.active and _C.omp_parked_threads() == 0


def test_optimizer_copies_keep_their_options():
    import copy
    import pickle

    p = torch.zeros(4, requires_grad=True)
    opt = CPUAdamW([p], threads=3, match_torch=True)
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert other.threads == 3 and other.match_torch is True


def test_openmp_throttle_with_one_torch_thread_parks_nothing(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    with optim.OpenMPThrottle() as t:
        assert not t.active


@pytest.mark.skipif(not _libgomp_here(), reason="torch brought no GNU libgomp here")
def test_openmp_throttle_in_a_forked_child():
    """A child forked while a team is parked has none of its threads: its
    throttles park nothing, and closing the parent's neither hangs nor
    touches the parent's team (a subprocess with a timeout)."""
    script = textwrap.dedent(
        """
        import os, sys, torch
        for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            os.environ.pop(var, None)
        torch.set_num_threads(max(2, len(os.sched_getaffinity(0))))
        from aio import _C
        from aio.optim import OpenMPThrottle
        parent = OpenMPThrottle()
        assert parent.active, "nothing parked in the parent"
        pid = os.fork()
        if pid == 0:
            ok = not OpenMPThrottle().active and _C.omp_parked_threads() == 0
            parent.close()
            os._exit(0 if ok and _C.omp_parked_threads() == 0 else 3)
        _, status = os.waitpid(pid, 0)
        assert _C.omp_parked_threads() > 0
        parent.close()
        sys.exit(os.waitstatus_to_exitcode(status) or _C.omp_parked_threads())
        """
    )
    r = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
