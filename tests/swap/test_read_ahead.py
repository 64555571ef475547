"""OptimizerSwapper.step() with every gradient held in memory and few
buffers keeps the drive busy: a read ahead that found no free buffer when
sub-group i's read was started is tried again as soon as the write-back
started beside it lands (during the wait for i's reads, else after them),
so the next sub-group is read during i's update instead of after it; the
write-back the next read waits for starts before `after` runs; a read
takes each buffer back as its own write lands. The drive's timing is
made deterministic by futures that report done only once opened (by a
later read, or after a patience)."""

import errno
import time

import pytest

torch = pytest.importorskip("torch")

from aio.optim import CPUAdam  # noqa: E402
from aio.swap import OptimizerSwapper, SwapStateError  # noqa: E402
from aio.swap.step_io import StepIO  # noqa: E402


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
    real_write, real_take = sw.space.write, StepIO.take_read
    real_start = StepIO.start_read
    started = []  # (sub-group, must) of every read started

    def write(buf, offset):
        gates.append(_Gated(real_write(buf, offset)))
        return gates[-1]

    def take_read(io, i, *rest, **kw):
        out = real_take(io, i, *rest, **kw)
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
    monkeypatch.setattr(StepIO, "take_read", take_read)
    monkeypatch.setattr(StepIO, "start_read", start_read)
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


class _SlowRead:
    """A read's future that reports done only once a later read started (or
    `patience` seconds passed): a drive slower for reads than for writes."""

    def __init__(self, fut, started, patience):
        self.fut, self.started, self.n = fut, started, len(started)
        self.deadline = time.monotonic() + patience

    def _open(self):
        return len(self.started) > self.n or time.monotonic() > self.deadline

    def done(self):
        return self._open() and self.fut.done()

    def wait(self, timeout=None):
        end = time.monotonic() + (timeout if timeout is not None else 1e9)
        while not self._open() and time.monotonic() < min(end, self.deadline):
            time.sleep(0.0005)
        return self.done() or (self._open() and self.fut.wait(max(0.0, end - time.monotonic())))

    def exception(self, timeout=None):
        while not self._open():
            time.sleep(0.0005)
        return self.fut.exception(timeout)

    def result(self, timeout=None):
        self.exception(timeout)
        return self.fut.result(timeout)

    def __getattr__(self, name):
        return getattr(self.fut, name)


PATIENCE = 1.0  # seconds a slow read waits for a later read to start


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
def test_a_write_back_landing_during_a_read_starts_the_read_ahead_in_the_wait(tmp_path, monkeypatch):
    """While sub-group i's reads are waited for, the write-back started
    beside them lands first: the next sub-group's read starts then, not once
    i's reads landed (the drive otherwise ran one read alone, ~6 ms of each
    ~14 ms sub-group in bench/fsdp_step.py's nvme-params), and the results
    are torch's bits."""
    n, count, steps = 4096, 6, 3
    sw, masters, ref, ref_opt = _in_place(tmp_path, n, count)
    real_read, real_take = sw.space.read, StepIO.take_read
    started: list[int] = []  # the sub-group of every read started
    order: list[tuple[str, int]] = []  # ("read", i) at a read's start, ("took", i) when i's reads landed

    def read(buf, offset):
        started.append(offset)
        return _SlowRead(real_read(buf, offset), started, patience=PATIENCE)

    def take_read(io, i, *rest, **kw):
        out = real_take(io, i, *rest, **kw)
        order.append(("took", i))
        return out

    real_start = StepIO.start_read

    def start_read(io, i, must, partly=False):
        ok = real_start(io, i, must, partly)
        if ok:
            order.append(("read", i))
        return ok

    monkeypatch.setattr(sw.space, "read", read)
    monkeypatch.setattr(StepIO, "take_read", take_read)
    monkeypatch.setattr(StepIO, "start_read", start_read)
    t0 = time.monotonic()
    _step_both(sw, ref, ref_opt, order, steps, count, n)
    # Step 3 (odd steps go in reverse, even ones forward): sub-groups 0 and 1
    # kept from step 2; from sub-group 2 on, each one's successor starts
    # reading before its own reads are taken (before: right after).
    last = order[order.index(("step", 2)) + 1 :]
    for i in (2, 3, 4):
        assert last.index(("read", i + 1)) < last.index(("took", i)), last
    # A read waited out its patience only where none could start (the last
    # of each step: ~3 s); before, every read did (~15 s). Whether the read
    # ahead started in the wait or just before it (counters["ahead_in_wait"])
    # depends on when the real write landed: the order above is the check.
    assert time.monotonic() - t0 < PATIENCE * 8
    for i in range(count):
        assert torch.equal(masters[i], ref[i].detach()), i
    sw.close()


class _MasterOnDrive(OptimizerSwapper):
    def gradient_slot(self):
        return False


def _master_on_drive(tmp_path, n, count):
    """A swapper of `count` sub-groups of `n` elements, master weights on the
    drive, gradients held, four buffers (three tensors a sub-group); torch's
    reference parameters and optimizer from the same start."""
    sw = _MasterOnDrive(str(tmp_path), CPUAdam, {"lr": 1e-2}, buffer_count=4)
    masters = [torch.randn(n) for _ in range(count)]
    ref = [torch.nn.Parameter(m.clone()) for m in masters]
    for i in range(count):
        sw.register_subgroup(i, n)
        sw.initialize(i, masters[i])
    return sw, ref, CPUAdam(ref, lr=1e-2)


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
def test_the_write_back_the_next_read_waits_for_starts_before_after_runs(tmp_path, monkeypatch):
    """Master weights on the drive, three tensors a sub-group in four
    buffers: the next sub-group's read needs the stepped one's buffers, so
    its write-back starts before `after` copies the new weights out (the
    drive idled through that copy, ~2 ms a sub-group in bench/fsdp_step.py's
    nvme-drive); the last sub-group of a step, whose buffers nothing needs,
    stays kept. The results are torch's bits."""
    n, count = 4096, 5
    sw, ref, ref_opt = _master_on_drive(tmp_path, n, count)
    real_write = sw.space.write
    written: list[int] = []  # the sub-group of every write started

    def write(buf, offset):
        written.append(next(i for i, g in sw.groups.items() if g.offset <= offset < g.offset + g.nbytes))
        fut = real_write(buf, offset)
        fut.wait()  # landed at once: which write-back is in flight must not hang on the drive's timing
        return fut

    seen: list[tuple[int, bool]] = []  # (sub-group, its write-back started) as `after` runs
    out = [None] * count

    def after(i, master):
        seen.append((i, i in written))
        out[i] = master.clone()
        written.clear()

    monkeypatch.setattr(sw.space, "write", write)
    for _ in range(3):
        grads = [torch.randn(n) for _ in range(count)]
        for i in range(count):
            sw.hold_gradient(i, grads[i])
            ref[i].grad = grads[i].clone()
        sw.step(after=after)
        ref_opt.step()
    orders = [list(range(count)), list(reversed(range(count))), list(range(count))]  # odd steps in reverse
    assert seen == [(i, i != order[-1]) for order in orders for i in order]
    for i in range(count):
        assert torch.equal(out[i], ref[i].detach()), i
    sw.close()


class _Late(_SlowRead):
    """A write's future that reports done only once a read started after it
    (or `patience` seconds passed)."""


class _WriteGate:
    """The swap space's write and read for a test: a write whose offset
    `lands_at_once` does not accept lands at once, the others (`_Late`)
    only once a read started after them (or after 0.3 s: what waits for all
    of them waits this long); `overlapped` counts the reads started while
    such a write was still in flight."""

    def __init__(self, sw, lands_at_once) -> None:
        self.real_write, self.real_read = sw.space.write, sw.space.read
        self.lands_at_once = lands_at_once
        self.reads: list[int] = []  # every read started
        self.late: list[_Late] = []
        self.overlapped = 0

    def write(self, buf, offset):
        fut = self.real_write(buf, offset)
        fut.wait()  # the gate is the only lateness, not the drive's timing
        if self.lands_at_once(offset):
            return fut
        self.late.append(_Late(fut, self.reads, patience=0.3))
        return self.late[-1]

    def read(self, buf, offset):
        self.overlapped += any(not w._open() for w in self.late)
        self.reads.append(offset)
        return self.real_read(buf, offset)


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
def test_a_read_reuses_each_buffer_as_its_write_back_lands(tmp_path, monkeypatch):
    """Master weights on the drive, three tensors a sub-group in four
    buffers: the rest of the next sub-group's read starts tensor by tensor
    as the stepped one's writes land, not once all three did (measured: the
    first landed ~2.5 ms after they started, the last ~8 ms). Here the
    master weights' write lands at once and the moments' only once a later
    read started: each step's reads then go on while moments are still
    being written. The results are torch's bits."""
    n, count = 4096, 5
    sw, ref, ref_opt = _master_on_drive(tmp_path, n, count)
    gate = _WriteGate(
        sw, lambda offset: any(offset == g.offset + g.parts["param"][0] for g in sw.groups.values())
    )
    monkeypatch.setattr(sw.space, "write", gate.write)
    monkeypatch.setattr(sw.space, "read", gate.read)
    out = [None] * count
    for _ in range(3):
        grads = [torch.randn(n) for _ in range(count)]
        for i in range(count):
            sw.hold_gradient(i, grads[i])
            ref[i].grad = grads[i].clone()
        sw.step(after=lambda i, master: out.__setitem__(i, master.clone()))
        ref_opt.step()
    assert gate.overlapped >= 2 * (count - 2), (
        gate.overlapped
    )  # steps 2 and 3: every sub-group read after a write-back
    for i in range(count):
        assert torch.equal(out[i], ref[i].detach()), i
    sw.close()


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
@pytest.mark.parametrize("nth", [1, 2, 3, 5, 8])
def test_a_write_back_failing_while_its_buffers_are_reused_poisons_and_leaks_nothing(
    tmp_path, monkeypatch, nth
):
    """The pipeline above (master weights on the drive, four buffers, each
    read reusing a write-back's buffers as its writes land: the master
    weights' at once, the moments' late) with the nth write of step 2
    failing (1: a master weights' write, whose buffer a read takes back
    before the moments landed): the step raises the I/O error, the swapper
    refuses use, that sub-group reads as invalid and every buffer is back."""
    n, count = 4096, 5
    sw, _, _ = _master_on_drive(tmp_path, n, count)
    real_write, real_read = sw.space.write, sw.space.read
    reads: list[int] = []

    def write(buf, offset):
        fut = real_write(buf, offset)
        fut.wait()  # the gate below is the only lateness, not the drive's timing
        if any(offset == g.offset + g.parts["param"][0] for g in sw.groups.values()):
            return fut
        return _Late(fut, reads, patience=0.3)

    def read(buf, offset):
        reads.append(offset)
        return real_read(buf, offset)

    monkeypatch.setattr(sw.space, "write", write)
    monkeypatch.setattr(sw.space, "read", read)
    for step in range(2):
        for i in range(count):
            sw.hold_gradient(i, torch.randn(n))
        if step == 1:
            sw.space.drives[0].writer._c.inject_fault("error", errno.EIO, "write", nth, 1)
            with pytest.raises(OSError) as ei:
                sw.step(after=lambda i, master: None)
            assert ei.value.errno == errno.EIO
        else:
            sw.step(after=lambda i, master: None)
    sw.space.drives[0].writer._c.clear_fault()
    assert sw.broken and "partly updated" in sw.broken
    assert not all(g.valid for g in sw.groups.values())
    assert sw.pool.available() == 4
    with pytest.raises(SwapStateError, match="partly updated"):
        sw.step(after=lambda i, master: None)
    sw.close()


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
def test_a_read_starts_each_tensor_as_its_buffer_comes_back(tmp_path, monkeypatch):
    """Master weights stepped in place, gradients held, two moments a
    sub-group in four buffers (bench/fsdp_step.py's nvme-params): the next
    sub-group's read starts its first tensor as soon as one write of the
    write-back it waits for lands, not once both did (the drive otherwise
    ran the other write alone, ~5 of each ~10 ms sub-group). Here exp_avg's
    write lands at once and exp_avg_sq's only once a later read started (or
    after a patience): every read after a write-back then starts while one
    is still in flight; before, each waited out the patience. The results
    are torch's bits."""
    n, count, steps = 4096, 5, 3
    sw, masters, ref, ref_opt = _in_place(tmp_path, n, count)
    gate = _WriteGate(sw, lambda offset: any(offset == g.part_io("exp_avg")[0] for g in sw.groups.values()))
    monkeypatch.setattr(sw.space, "write", gate.write)
    monkeypatch.setattr(sw.space, "read", gate.read)
    t0 = time.monotonic()
    for _ in range(steps):
        grads = [torch.randn(n) for _ in range(count)]
        for i in range(count):
            sw.hold_gradient(i, [grads[i]])
            ref[i].grad = grads[i].clone()
        sw.step()
        ref_opt.step()
    # Steps 2 and 3 each read count - 2 sub-groups, every one after a write-back.
    assert gate.overlapped >= 2 * (count - 2), gate.overlapped
    assert time.monotonic() - t0 < 0.3 * 2 * (count - 2)  # before: each such read waited 0.3 s
    for i in range(count):
        assert torch.equal(masters[i], ref[i].detach()), i
    sw.close()


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
def test_a_read_ahead_takes_a_write_backs_buffer_as_its_own_write_lands(tmp_path, monkeypatch):
    """As above (stepped in place, exp_avg's write landing at once and
    exp_avg_sq's only once a later read started): the next sub-group's read
    ahead starts in the buffer whose write landed, before the current
    sub-group's update, not after it once the whole write-back landed. The
    results are torch's bits."""
    n, count, steps = 4096, 5, 3
    sw, masters, ref, ref_opt = _in_place(tmp_path, n, count)
    real_write, real_read = sw.space.write, sw.space.read
    real_start, real_step = StepIO.start_read, sw._step_subgroup
    reads: list[int] = []
    order: list[tuple] = []  # ("ahead", i): a read ahead started; ("update", i)

    def write(buf, offset):
        fut = real_write(buf, offset)
        fut.wait()
        if any(offset == g.part_io("exp_avg")[0] for g in sw.groups.values()):
            return fut
        return _Late(fut, reads, patience=0.3)

    def read(buf, offset):
        reads.append(offset)
        return real_read(buf, offset)

    def start_read(io, i, must, partly=False):
        ok = real_start(io, i, must, partly)
        if ok and not must:
            order.append(("ahead", i))
        return ok

    def step_subgroup(g, *rest):
        order.append(("update", g.index))
        return real_step(g, *rest)

    monkeypatch.setattr(sw.space, "write", write)
    monkeypatch.setattr(sw.space, "read", read)
    monkeypatch.setattr(StepIO, "start_read", start_read)
    monkeypatch.setattr(sw, "_step_subgroup", step_subgroup)
    _step_both(sw, ref, ref_opt, order, steps, count, n)
    # Step 3 goes 0..4 with 0 and 1 kept from step 2: sub-groups 3 and 4 are
    # read ahead before 2's and 3's updates (2's own read waits for 0's
    # write-back, started only once 1 is updated).
    last = order[order.index(("step", 2)) + 1 :]
    for i in (3, 4):
        assert ("ahead", i) in last and last.index(("ahead", i)) < last.index(("update", i - 1)), last
    for i in range(count):
        assert torch.equal(masters[i], ref[i].detach()), i
    sw.close()


def _step_both(sw, ref, ref_opt, order: list, steps: int, count: int, n: int) -> None:
    """`steps` steps of the swapper and of torch's optimizer over the same
    random gradients (held in memory), each step's start marked in `order`."""
    for s in range(steps):
        grads = [torch.randn(n) for _ in range(count)]
        for i in range(count):
            sw.hold_gradient(i, [grads[i]])
            ref[i].grad = grads[i].clone()
        order.append(("step", s))
        sw.step()
        ref_opt.step()


def _in_place(tmp_path, n: int, count: int):
    """A swapper without a master slot, `count` sub-groups of `n` elements
    stepped in place in their masters (4 buffers), and torch's reference:
    (swapper, masters, reference parameters, reference optimizer)."""
    sw = _NoMasterSlot(str(tmp_path), CPUAdam, {"lr": 1e-2}, buffer_count=4)
    masters = [torch.randn(n) for _ in range(count)]
    ref = [torch.nn.Parameter(m.clone()) for m in masters]
    ref_opt = CPUAdam(ref, lr=1e-2)
    for i in range(count):
        sw.register_subgroup(i, n)
        sw.initialize_in_place(i, lambda i=i: [masters[i]])
    return sw, masters, ref, ref_opt
