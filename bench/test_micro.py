"""Micro-benchmarks under pytest-benchmark, for catching regressions across
commits (docs/performance.md says how to save and compare runs):

- AsyncIOHandle read / write GB/s against buffered I/O (os.preadv /
  os.pwrite + fsync, page cache evicted before reads) on the same file;
- one optimizer step over one sub-group: torch AdamW single-tensor (what
  aio.zero ran before issue 14), torch's fused CPU AdamW, aio.optim.adam_update
  (when that module exists) and DeepSpeedCPUAdam (when DeepSpeed is installed);
- one aio.zero training step (forward, backward, step()) of a small MLP,
  CPU offload and NVMe offload.

    python -m pytest bench --benchmark-only

Each figure is pytest-benchmark's own statistics over its rounds; the GB/s
of the I/O cases is in ``extra_info``. These are not interleaved A/B runs:
for claims about aio against DeepSpeed use bench/train_step.py and
bench/throughput.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("pytest_benchmark", reason="pip install pytest-benchmark (the 'bench' extra)")
torch = pytest.importorskip("torch")

import aio  # noqa: E402

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _gbps(benchmark: Any, nbytes: int) -> None:
    """Record the median and best GB/s of the rounds just measured."""
    if benchmark.stats is None:  # --benchmark-disable: the call ran once, untimed
        return
    st = benchmark.stats.stats
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["GB/s median"] = round(nbytes / st.median / 1e9, 3)
    benchmark.extra_info["GB/s max"] = round(nbytes / st.min / 1e9, 3)


# -- handle against buffered I/O ------------------------------------------------------------
@pytest.fixture(scope="module")
def data_file(drive_dir: str, io_bytes: int) -> str:
    path = os.path.join(drive_dir, "micro-io.bin")
    with open(path, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(io_bytes >> 20):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return path


def _evict(path: str) -> None:
    """Drop the file from the page cache so a read goes to the drive."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _buffered(direction: str, path: str, buf: memoryview) -> Callable[[], None]:
    def read() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done:]], done)
                if n <= 0:
                    raise OSError(f"short read at {done} of {path}")
                done += n
        finally:
            os.close(fd)

    def write() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            done = 0
            while done < len(buf):
                done += os.pwrite(fd, buf[done:], done)
            os.fsync(fd)  # the same bytes reach the drive as with O_DIRECT
        finally:
            os.close(fd)

    return read if direction == "read" else write


@pytest.mark.parametrize("direction", ["read", "write"])
@pytest.mark.parametrize("tool", ["aio", "buffered"])
def test_handle_io(benchmark: Any, tool: str, direction: str, data_file: str, io_bytes: int) -> None:
    """GB/s of one whole-file read or write: aio's handle (block 1 MiB, depth 8,
    its own locked buffer) or plain buffered I/O."""
    benchmark.group = f"handle-{direction}"
    buf = aio.new_locked_tensor(io_bytes, torch.uint8)
    buf.random_(0, 256)
    if tool == "aio":
        h = aio.AsyncIOHandle(block_size=1 << 20, queue_depth=8)
        op = h.sync_pread if direction == "read" else h.sync_pwrite

        def run() -> None:
            op(buf, data_file)

    else:
        h = None
        run = _buffered(direction, data_file, memoryview(buf.numpy()))

    def setup() -> None:
        if direction == "read":
            _evict(data_file)

    try:
        benchmark.pedantic(run, setup=setup, rounds=5, iterations=1, warmup_rounds=1)
    finally:
        if h is not None:
            h.close()
    _gbps(benchmark, io_bytes)


# -- optimizer step on one sub-group ----------------------------------------------------------
def _param(n: int) -> Any:
    g = torch.Generator().manual_seed(7)
    p = torch.nn.Parameter(torch.randn(n, generator=g))
    p.grad = torch.randn(n, generator=g)
    return p


def _torch_step(kind: str, n: int) -> Callable[[], None]:
    p = _param(n)
    opt = torch.optim.AdamW([p], foreach=False, fused=(kind == "fused") or None, **HYPER)
    return opt.step


def _aio_step(n: int) -> Callable[[], None]:
    try:
        import aio.optim as optim  # written for issue 14; absent before it lands
    except ImportError as e:
        pytest.skip(f"aio.optim.adam_update is not in this tree yet ({e})")
    # A shared editable install can resolve aio.optim from another checkout
    # while aio itself comes from this one (whose _C lacks the kernel).
    here = os.path.dirname(os.path.abspath(optim.__file__ or ""))
    if here not in [os.path.abspath(p) for p in aio.__path__] or not hasattr(optim, "adam_update"):
        pytest.skip(f"aio.optim.adam_update is not in this tree yet (aio.optim found at {here})")
    adam_update = optim.adam_update
    p = _param(n)
    m, v = torch.zeros(n), torch.zeros(n)
    lowp = torch.empty(n, dtype=torch.bfloat16)
    count = [0]
    b1, b2 = HYPER["betas"]

    def step() -> None:
        count[0] += 1
        adam_update(
            p.data, p.grad, m, v, step=float(count[0]), lr=HYPER["lr"], beta1=b1, beta2=b2,
            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], decoupled=True, lowp_out=lowp,
        )  # fmt: skip

    return step


def _deepspeed_step(n: int) -> Callable[[], None]:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the reference is optional)")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = _param(n)
        opt = DeepSpeedCPUAdam([p], adamw_mode=True, **HYPER)
    except Exception as e:  # noqa: BLE001 - its JIT build can fail in many ways; the reference is optional
        pytest.skip(f"DeepSpeedCPUAdam unavailable here: {type(e).__name__}: {str(e)[:200]}")
    return opt.step


@pytest.mark.parametrize("kind", ["torch-single", "torch-fused", "aio", "deepspeed"])
def test_optimizer_subgroup(benchmark: Any, kind: str, subgroup_numel: int) -> None:
    """One AdamW step over one fp32 sub-group (param, grad, two moments)."""
    benchmark.group = f"adamw-subgroup-{subgroup_numel}"
    if kind == "aio":
        step = _aio_step(subgroup_numel)
    elif kind == "deepspeed":
        step = _deepspeed_step(subgroup_numel)
    else:
        step = _torch_step("fused" if kind == "torch-fused" else "single", subgroup_numel)
    step()  # creates the state outside the timing
    benchmark.pedantic(step, rounds=10, iterations=1, warmup_rounds=2)
    # param + grad read, param + two moments read and written: 7 fp32 passes
    _gbps(benchmark, 7 * 4 * subgroup_numel)


# -- a model's small tensors through the optimizer classes ------------------------------------
SMALL_SIZES = [768] * 74 + [2304] * 12 + [3072] * 12  # GPT-2 124M's biases and norms


def _class_step(kind: str) -> Callable[[], None]:
    params = [_param(n) for n in SMALL_SIZES]
    if kind == "deepspeed":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the reference is optional)")
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER).step
        except Exception as e:  # noqa: BLE001 - its JIT build can fail in many ways
            pytest.skip(f"DeepSpeedCPUAdam unavailable here: {type(e).__name__}: {str(e)[:200]}")
    if kind == "aio":
        from aio.optim import CPUAdamW

        return CPUAdamW(params, **HYPER).step
    return torch.optim.AdamW(params, fused=True, **HYPER).step


@pytest.mark.parametrize("kind", ["torch-fused", "aio", "deepspeed"])
def test_optimizer_small_tensors(benchmark: Any, kind: str) -> None:
    """One AdamW step over 98 small tensors (in cache): what each tensor
    costs beyond its update, through the optimizer classes."""
    benchmark.group = "adamw-98-small-tensors"
    step = _class_step(kind)
    step()  # creates the state outside the timing
    benchmark.pedantic(step, rounds=50, iterations=1, warmup_rounds=5)
    _gbps(benchmark, 7 * 4 * sum(SMALL_SIZES))


# -- one aio.zero step -------------------------------------------------------------------------
WIDTH, LAYERS, BATCH = 512, 4, 8


def _zero_config(mode: str, nvme: str) -> dict:
    zero: dict[str, Any] = {"stage": 3, "sub_group_size": 1_000_000, "stage3_param_persistence_threshold": 0}
    if mode == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    else:
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme,
            "buffer_count": 8,
            "buffer_size": WIDTH * WIDTH,
        }
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 4}
        zero["offload_optimizer"].update(pipeline_read=True, pipeline_write=True)
    return {
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": dict(HYPER, betas=list(HYPER["betas"]))},
        "gradient_clipping": 1.0,
        "aio": {"block_size": 1 << 20, "queue_depth": 8},
    }


@pytest.fixture(params=["cpu", "nvme"])
def zero_trainer(request: pytest.FixtureRequest, drive_dir: str) -> Iterator[tuple[str, Any]]:
    import aio.zero

    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(LAYERS):
        mods += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    model = torch.nn.Sequential(*mods)
    trainer = aio.zero.initialize(model, _zero_config(request.param, drive_dir))
    try:
        yield request.param, trainer
    finally:
        trainer.close()


def test_zero_step(benchmark: Any, zero_trainer: tuple[str, Any]) -> None:
    """One training step (forward, backward, step()) of a 1M-parameter MLP."""
    mode, trainer = zero_trainer
    benchmark.group = "aio.zero-step"
    benchmark.extra_info["offload"] = mode
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)

    def step() -> None:
        loss = torch.nn.functional.mse_loss(trainer(x), y)
        trainer.backward(loss)
        trainer.step()

    before = trainer.io_bytes()
    benchmark.pedantic(step, rounds=8, iterations=1, warmup_rounds=2)
    benchmark.extra_info["drive bytes/step"] = (trainer.io_bytes() - before) // 10
