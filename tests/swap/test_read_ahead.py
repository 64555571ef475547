"""OptimizerSwapper.step() with every gradient held in memory and few
buffers: a read ahead that found no free buffer when sub-group i's read was
started is tried again once i's read landed (the write-back started beside
it has freed buffers by then), so the next sub-group is read during i's
update instead of after it. Deterministic: the write-backs here report
done only once a step has waited for a read."""

import pytest

torch = pytest.importorskip("torch")

from aio.optim import CPUAdam  # noqa: E402
from aio.swap import OptimizerSwapper  # noqa: E402
from aio.swap import optimizer as swap_optimizer  # noqa: E402


class _Gated:
    """A write's future that reports done() only once opened."""

    def __init__(self, fut):
        self.fut, self.open = fut, False

    def done(self):
        return self.open and self.fut.done()

    def result(self, timeout=None):
        return self.fut.result(timeout)

    def exception(self, timeout=None):
        return self.fut.exception(timeout)

    def __getattr__(self, name):
        return getattr(self.fut, name)


class _NoMasterSlot(OptimizerSwapper):
    def master_slot(self):
        return False

    def gradient_slot(self):
        return False


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
def test_a_read_ahead_refused_for_want_of_buffers_is_retried_after_the_read(tmp_path, monkeypatch):
    sw = _NoMasterSlot(str(tmp_path), CPUAdam, {"lr": 1e-2}, buffer_count=4)
    n, count = 4096, 6
    masters = [torch.randn(n) for _ in range(count)]
    for i in range(count):
        sw.register_subgroup(i, n)
        sw.initialize_in_place(i, lambda i=i: [masters[i]])
    gates = []
    real_write, real_take = sw.space.write, swap_optimizer._StepIO.take_read
    real_start = swap_optimizer._StepIO.start_read
    started = []  # (sub-group, must) of every read started

    def write(buf, offset):
        gates.append(_Gated(real_write(buf, offset)))
        return gates[-1]

    def take_read(io, i):
        out = real_take(io, i)
        for g in gates:  # every write-back in flight lands while i's read is waited for
            g.fut.exception()
            g.open = True
        return out

    def start_read(io, i, must, partly=False):
        ok = real_start(io, i, must, partly)
        if ok:
            started.append((i, must))
        return ok

    monkeypatch.setattr(sw.space, "write", write)
    monkeypatch.setattr(swap_optimizer._StepIO, "take_read", take_read)
    monkeypatch.setattr(swap_optimizer._StepIO, "start_read", start_read)
    for _ in range(3):
        for i in range(count):
            sw.hold_gradient(i, [torch.randn(n)])  # pieces: held for one step
        sw.step()
    # Two sub-groups of two buffers each fit. Steps 2 and 3 start with the
    # two the step before kept; every other read is started ahead, during
    # the update before it (without the retry, each waited for its turn).
    steady = started[count:]  # step 1's reads
    assert [i for i, _ in steady] == [3, 2, 1, 0, 2, 3, 4, 5], started  # odd steps go in reverse
    assert not any(must for _, must in steady), started
    assert sw.counters["cached_subgroups"] == 2 * 2
    sw.close()
