"""copy_chunks (the checkpoint copier): reads run ahead of writes through
two buffers, CRCs chain per key, nothing is left in flight when it raises;
and checkpoints written through it survive striping, truncation and a
failing drive."""

import errno
import os
import zlib

import pytest

torch = pytest.importorskip("torch")

from aio.swap import OptimizerSwapper, ParamSwapper, SwapStateError  # noqa: E402
from aio.swap.copy import Chunk, copy_chunks, land_all  # noqa: E402


class FakeFuture:
    """Finishes when asked for its outcome; logs it."""

    def __init__(self, log, name, action=None, exc=None):
        self.log, self.name, self.action, self.exc = log, name, action, exc
        self.settled = False
        log.append(("start", name))

    def done(self):
        return self.settled

    def exception(self, timeout=None):
        if not self.settled:
            self.settled = True
            if self.action is not None:
                self.action()
            self.log.append(("done", self.name))
        return self.exc

    def result(self, timeout=None):
        exc = self.exception()
        if exc is not None:
            raise exc
        return 0


def _chunks(log, sources, sink, fail=None):
    out = []
    for k, data in enumerate(sources):

        def read(view, k=k, data=data):
            def fill():
                view[: len(data)] = data

            return FakeFuture(log, f"read{k}", fill, OSError(errno.EIO, "bad") if fail == k else None)

        def write(view, k=k):
            return FakeFuture(log, f"write{k}", lambda: sink.__setitem__(k, bytes(view)))

        out.append(Chunk(len(data), k % 2, read=read, write=write))
    return out


def test_next_read_starts_before_the_last_write_is_waited_for():
    log, sink = [], {}
    sources = [bytes([k]) * 100 for k in range(5)]
    crcs = copy_chunks(_chunks(log, sources, sink), [memoryview(bytearray(128)) for _ in range(2)])
    assert [sink[k] for k in range(5)] == sources
    assert crcs == {0: zlib.crc32(sources[4], zlib.crc32(sources[2], zlib.crc32(sources[0]))),
                    1: zlib.crc32(sources[3], zlib.crc32(sources[1]))}  # fmt: skip
    # read 1 is in flight while write 0 is: both start before write 0 is done
    assert log.index(("start", "read1")) < log.index(("start", "write0")) < log.index(("done", "write0"))


def test_one_buffer_copies_serially():
    log, sink = [], {}
    sources = [b"a" * 10, b"b" * 20]
    copy_chunks(_chunks(log, sources, sink), [memoryview(bytearray(32))])
    assert [sink[0], sink[1]] == sources
    assert log.index(("done", "write0")) < log.index(("start", "read1"))


def test_a_failed_read_raises_after_everything_settled():
    log, sink = [], {}
    sources = [bytes([k]) * 50 for k in range(4)]
    with pytest.raises(OSError) as ei:
        copy_chunks(_chunks(log, sources, sink, fail=2), [memoryview(bytearray(64)) for _ in range(2)])
    assert ei.value.errno == errno.EIO
    started = {n for e, n in log if e == "start"}
    finished = {n for e, n in log if e == "done"}
    assert started == finished, "nothing is left in flight"
    assert sorted(sink) == [0, 1] and [sink[0], sink[1]] == sources[:2]


def test_land_all_waits_for_every_future_before_raising_the_first_failure():
    """One wait for a batch of I/O serves the copies and the optimizer's step
    (aio.swap.step_io): every future lands (None skipped) before the first
    failure is raised, or none with `quiet`."""
    for quiet in (False, True):
        log = []
        futs = [
            FakeFuture(log, "a"),
            None,
            FakeFuture(log, "b", exc=OSError(errno.EIO, "first")),
            FakeFuture(log, "c", exc=OSError(errno.ENOSPC, "second")),
            FakeFuture(log, "d"),
        ]
        if quiet:
            land_all(futs, quiet=True)
        else:
            with pytest.raises(OSError) as ei:
                land_all(futs)
            assert ei.value.errno == errno.EIO
        assert [n for e, n in log if e == "done"] == ["a", "b", "c", "d"]
    land_all([])


def test_chunk_larger_than_a_buffer_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        copy_chunks(_chunks([], [b"x" * 100], []), [memoryview(bytearray(10))])


def _param_swapper(path, **kw):
    args = dict(dtype=torch.float32, buffer_count=3, buffer_size=1 << 16, max_in_cpu=0, min_swap_bytes=0)
    args.update(kw)
    return ParamSwapper(path, **args)


def test_param_checkpoint_from_two_drives_loads_on_one(tmp_path):
    dirs = [str(tmp_path / n) for n in ("d1", "d2", "one")]
    for d in dirs:
        os.mkdir(d)
    vals = {i: torch.randn(20_000 + 7 * i) for i in range(5)}
    with _param_swapper(dirs[:2]) as a:
        for i, v in vals.items():
            a.register(i, v.numel())
            a.write(i, v)
        a.export_checkpoint(str(tmp_path / "ck"))
    with _param_swapper(dirs[2]) as b:
        for i, v in vals.items():
            b.register(i, v.numel())
        b.import_checkpoint(str(tmp_path / "ck"))
        for i, v in vals.items():
            (t,) = b.swap_in([i])
            assert torch.equal(t, v)
            b.release([i])


def test_truncated_checkpoint_file_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    with _param_swapper(str(tmp_path / "d")) as s:
        s.register(0, 50_000)
        s.write(0, torch.randn(50_000))
        s.export_checkpoint(str(tmp_path / "ck"))
        data = tmp_path / "ck" / "params.bin"
        os.truncate(data, data.stat().st_size - 4096)
        with pytest.raises(ValueError, match="params.bin"):
            s.import_checkpoint(str(tmp_path / "ck"))


def test_param_import_failing_on_the_drive_invalidates(tmp_path):
    (tmp_path / "d").mkdir()
    with _param_swapper(str(tmp_path / "d")) as s:
        for i in range(3):
            s.register(i, 30_000)
            s.write(i, torch.full((30_000,), float(i)))
        s.export_checkpoint(str(tmp_path / "ck"))
        s.space.drives[0].writer._c.inject_fault("error", errno.ENOSPC, "write", 2, 1)
        with pytest.raises(OSError) as ei:
            s.import_checkpoint(str(tmp_path / "ck"))
        assert ei.value.errno == errno.ENOSPC
        s.space.drives[0].writer._c.clear_fault()
        assert {s.status(i) for i in range(3)} == {"invalid"}  # no mix of old and new is ever read
        with pytest.raises(SwapStateError):
            s.swap_in([0])
        s.import_checkpoint(str(tmp_path / "ck"))  # a good import makes them valid again
        (t,) = s.swap_in([2])
        assert (t == 2).all()


def test_optimizer_checkpoint_from_two_drives_resumes_exactly(tmp_path):
    dirs = [str(tmp_path / n) for n in ("d1", "d2", "one")]
    for d in dirs:
        os.mkdir(d)
    sizes = [300_000, 123_457]
    grads = [torch.randn(n) for n in sizes]

    def make(path):
        sw = OptimizerSwapper(path, torch.optim.AdamW, {"lr": 1e-2}, buffer_count=4)
        for i, n in enumerate(sizes):
            sw.register_subgroup(i, n)
            sw.initialize(i, torch.linspace(-1, 1, n))
        return sw

    def step(sw):
        for i, g in enumerate(grads):
            sw.write_gradient(i, g, async_op=False)
        sw.step()

    a = make(dirs[:2])
    step(a)
    a.export_checkpoint(str(tmp_path / "ck"))
    step(a)
    want = [a.read_master(i) for i in range(len(sizes))]
    a.close()
    b = make(dirs[2])
    b.import_checkpoint(str(tmp_path / "ck"))
    step(b)
    for i, w in enumerate(want):
        assert torch.equal(b.read_master(i), w)
    b.close()


class InterruptedFuture(FakeFuture):
    """Its first wait is interrupted (Ctrl-C) while the I/O goes on."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.interrupt = True

    def exception(self, timeout=None):
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return super().exception(timeout)


@pytest.mark.parametrize("victim", ["read0", "write0", "memory-write"])
def test_ctrl_c_leaves_nothing_in_flight(victim):
    log, futs = [], []

    def fut(name, action=None):
        cls = InterruptedFuture if name == victim else FakeFuture
        futs.append(cls(log, name, action))
        return futs[-1]

    chunks = [Chunk(8, "m", data=b"m" * 8, write=lambda src: fut("memory-write"))]
    for k in range(3):
        chunks.append(
            Chunk(8, k, read=lambda view, k=k: fut(f"read{k}"), write=lambda view, k=k: fut(f"write{k}"))
        )
    if victim != "memory-write":
        chunks = chunks[1:]
    with pytest.raises(KeyboardInterrupt):
        copy_chunks(chunks, [memoryview(bytearray(8)) for _ in range(2)])
    assert all(f.settled for f in futs), [f.name for f in futs if not f.settled]


def test_optimizer_checkpoint_with_every_buffer_taken_says_so(tmp_path):
    sw = OptimizerSwapper(str(tmp_path), torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, buffer_count=3)
    sw.register_subgroup(0, 1000)
    sw.initialize(0, torch.zeros(1000))
    held = [sw.acquire_buffer(0) for _ in range(3)]
    with pytest.raises(ValueError, match="buffer_count"):
        sw.export_checkpoint(str(tmp_path / "ck"))
    for lease in held:
        lease.release()
    sw.export_checkpoint(str(tmp_path / "ck"))
    sw.close()


def test_param_checkpoint_of_resident_partitions_pins_no_buffer(tmp_path):
    with _param_swapper(str(tmp_path), max_in_cpu=10**9) as s:
        for i in range(3):
            s.register(i, 20_000)
            s.write(i, torch.ones(20_000))
        assert s.stats()["pinned_buffer_bytes"] == 0
        s.export_checkpoint(str(tmp_path / "ck"))
        s.import_checkpoint(str(tmp_path / "ck"))
        assert s.stats()["pinned_buffer_bytes"] == 0
