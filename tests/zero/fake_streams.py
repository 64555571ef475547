"""A stand-in for CUDA streams and events, for testing the ordering logic of
aio.zero.streams on machines without a GPU.

Work queued on a fake stream (copies, kernels, event records, waits) runs
only when the simulation runs it, in an order the test picks, so a missing
wait shows up as a wrong value. Tensors are CPU tensors."""

from __future__ import annotations

import collections
import contextlib

import torch


class Deadlock(RuntimeError):
    pass


class FakeEvent:
    def __init__(self, sim):
        self.sim = sim
        self.recorded = False
        self.complete = False

    def record(self, stream):
        self.recorded = True
        self.complete = False
        stream.ops.append(("record", self))

    def query(self):
        return self.complete

    def synchronize(self):
        if not self.complete:  # only a wait that blocks is logged
            self.sim.log.append(("synchronize", self))
            self.sim.run_until(lambda: self.complete)


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.ops = collections.deque()

    def wait_event(self, ev):
        self.ops.append(("wait", ev))

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeBackend:
    """Implements the methods aio.zero.streams.DeviceCopies calls on its backend.

    `first`: which stream runs first whenever both could make progress."""

    def __init__(self, first="side"):
        self.side = FakeStream("side")
        self.comp = FakeStream("compute")
        self.current = self.comp
        self.first = first
        self.log = []
        self.pinned_allocs = 0

    # -- the backend interface --
    def compute(self):
        return self.comp

    def event(self):
        return FakeEvent(self)

    @contextlib.contextmanager
    def on(self, stream):
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev

    def empty(self, numel, dtype):
        t = torch.empty(numel, dtype=dtype)
        if t.is_floating_point():
            t.fill_(float("nan"))  # never-written device memory reads as garbage
        return t

    def pinned(self, nbytes):
        self.pinned_allocs += 1
        return torch.zeros(nbytes, dtype=torch.uint8)

    def copy(self, dst, src):
        self.log.append(("copy", self.current.name))
        self.current.ops.append(("copy", dst, src))

    def record_stream(self, t, stream):
        self.log.append(("record_stream", stream.name))

    def synchronize(self):
        """cudaDeviceSynchronize: both streams run dry (logged as a device wait)."""
        self.log.append(("device_synchronize",))
        self.run_all()

    # -- the simulation --
    def kernel(self, fn):
        """Queue `fn` on the compute stream (a stand-in for a compute kernel)."""
        self.comp.ops.append(("kernel", fn))

    def _step(self, stream):
        if not stream.ops:
            return False
        op = stream.ops[0]
        if op[0] == "wait" and not op[1].complete:
            return False
        stream.ops.popleft()
        if op[0] == "record":
            op[1].complete = True
        elif op[0] == "copy":
            op[1].copy_(op[2])
        elif op[0] == "kernel":
            op[1]()
        return True

    def _order(self):
        return [self.side, self.comp] if self.first == "side" else [self.comp, self.side]

    def run_until(self, cond):
        while not cond():
            # Run the preferred stream as far as it goes before the other one.
            if not any(self._run(s) for s in self._order()):
                raise Deadlock("no stream can make progress")

    def _run(self, stream):
        moved = False
        while self._step(stream):
            moved = True
        return moved

    def run_all(self):
        self.run_until(lambda: not self.side.ops and not self.comp.ops)

    def synchronizes(self):
        return sum(1 for e in self.log if e[0] == "synchronize")
