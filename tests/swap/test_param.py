"""ParamSwapper: bit-exact round trips, placement, states, pool errors, faults."""

import errno
import gc
import os

import pytest

torch = pytest.importorskip("torch")

from aio.swap import ParamSwapper, PoolExhaustedError, State, SwapStateError  # noqa: E402

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.uint8,
    torch.int8,
]


def make(tmp_path, **kw):
    args = dict(dtype=torch.float16, buffer_count=3, buffer_size=1 << 16, max_in_cpu=0, min_swap_bytes=0)
    args.update(kw)
    return ParamSwapper(str(tmp_path), **args)


def rand(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, (n,), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_bit_exact(tmp_path, dtype):
    with make(tmp_path, dtype=dtype) as s:
        vals = {i: rand(1000 * (i + 1) + i, dtype, i) for i in range(4)}
        for i, v in vals.items():
            assert s.register(i, v.numel()) == State.ON_DRIVE
            s.write(i, v)
        for i, v in vals.items():
            (t,) = s.swap_in([i])
            assert torch.equal(t.view(torch.uint8), v.view(torch.uint8))
            s.release([i])
            assert s.status(i) == "on_drive"


def test_placement_small_and_max_in_cpu(tmp_path):
    # max_in_cpu is a prefix (as in DeepSpeed): once a partition goes past it,
    # later ones go to the drive even if they would fit (this test used to
    # expect "c" to fill the gap).
    with make(tmp_path, max_in_cpu=3000, min_swap_bytes=1024) as s:
        assert s.register("tiny", 100) == State.RESIDENT  # 200 bytes: not worth an I/O
        assert s.register("a", 2000) == State.RESIDENT  # fits max_in_cpu
        assert s.register("b", 2000) == State.ON_DRIVE  # would exceed it
        assert s.register("c", 1000) == State.ON_DRIVE  # after the prefix
        assert s.register("tiny2", 100) == State.RESIDENT  # small ones stay in memory anyway
        v = rand(2000, torch.float16)
        s.write("a", v)
        (t,) = s.swap_in(["a"])
        assert torch.equal(t, v) and s.status("a") == "resident"
        assert s.stats()["drive_bytes"] == 4096 + 4096


@pytest.mark.parametrize("pin", [True, False])
def test_pinned_bytes_are_what_is_locked(tmp_path, pin):
    from aio import pinned

    gc.collect()  # an earlier test's buffers are freed now, not during this one

    before = pinned.locked_bytes()
    with make(tmp_path, max_in_cpu=3000, min_swap_bytes=1024, pin_memory=pin) as s:
        s.register("tiny", 100)
        s.register("a", 2000)
        s.register("b", 5000)
        # resident partitions lock whole pages; the buffers are not allocated yet
        assert s.pinned_bytes() == (2 * 4096 if pin else 0)
        assert pinned.locked_bytes() - before == s.pinned_bytes()
        s.write("b", rand(5000, torch.float16))
        s.swap_in(["b"])
        buffers = 3 * pinned.page_round((1 << 16) * 2)
        assert s.pinned_bytes() == (2 * 4096 + buffers if pin else 0)
        assert pinned.locked_bytes() - before == s.pinned_bytes()
        assert s.stats()["pinned_bytes"] == s.pinned_bytes()


def test_close_frees_the_buffers_once_no_view_holds_them(tmp_path, no_garbage):
    """close() lets the pinned buffers go at once (not when the swapper is
    collected); a view still held elsewhere keeps its memory valid until it
    goes too, and the closed pool hands out nothing."""
    from aio import pinned

    before = pinned.locked_bytes()
    s = make(tmp_path)
    s.register("a", 2000)
    s.register("b", 5000)
    s.write("b", rand(5000, torch.float16))
    (t,) = s.swap_in(["b"])
    assert pinned.locked_bytes() - before == s.pinned_bytes() > 0
    s.close()
    assert s.pinned_bytes() == 0
    assert torch.equal(t, rand(5000, torch.float16))  # still valid
    assert pinned.locked_bytes() > before
    del t
    assert pinned.locked_bytes() == before
    with pytest.raises(ValueError, match="closed"):
        s.pool.acquire()


def test_reserve_buffers_only_with_partitions_on_the_drive(tmp_path):
    import threading

    with make(tmp_path, max_in_cpu=3000, min_swap_bytes=1024) as s:
        s.register("tiny", 100)
        assert not s.reserve_buffers() and s.stats()["pinned_buffer_bytes"] == 0
        s.register("b", 5000)
        # Four threads at once (set-up reserves in a thread): one allocation.
        threads = [threading.Thread(target=s.reserve_buffers) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pool = s.pool
        assert pool.allocated and pool.pinned_bytes == pool.planned_bytes
        assert s.reserve_buffers() and s.pool.pinned_bytes == pool.pinned_bytes
        s.write("b", rand(5000, torch.float16))
        (t,) = s.swap_in(["b"])
        assert torch.equal(t, rand(5000, torch.float16))


def test_states_prefetch_release_swap_out(tmp_path):
    with make(tmp_path) as s:
        for i in range(3):
            s.register(i, 4096)
            s.write(i, torch.full((4096,), float(i), dtype=torch.float16))
        assert s.prefetch([0, 1]) == 2
        assert s.status(0) == "in_flight"  # until synchronize()/swap_in settles it
        s.synchronize()
        assert s.status(0) == "available"
        (t0, t1) = s.swap_in([0, 1])  # hits: no new reads
        assert s.stats()["hits"] >= 2
        t0.add_(1)  # modify in the buffer, then write back
        s.swap_out([0])
        assert s.status(0) == "on_drive"
        s.release([1])
        (t0,) = s.swap_in([0])
        assert (t0 == 1).all()
        s.release([0])
        assert s.stats()["buffers_free"] == 3


def test_prefetch_is_best_effort_and_swap_in_explains_exhaustion(tmp_path):
    with make(tmp_path, buffer_count=2) as s:
        for i in range(4):
            s.register(i, 100)
            s.write(i, torch.zeros(100, dtype=torch.float16))
        assert s.prefetch([0, 1, 2, 3]) == 2
        with pytest.raises(PoolExhaustedError, match="buffer_count"):
            s.swap_in([2])
        s.release([0, 1])
        with pytest.raises(PoolExhaustedError, match="at least 3"):
            s.swap_in([0, 2, 3])  # more partitions at once than the pool has buffers
        s.swap_in([2, 3])


def test_oversize_partition_refused_at_registration(tmp_path):
    with make(tmp_path, buffer_size=1000) as s:
        with pytest.raises(ValueError, match=r"buffer_size to at least 1001"):
            s.register("big", 1001)
        with pytest.raises(ValueError, match="non-negative"):
            s.register("negative", -1)
        assert s.register("empty", 0) == State.RESIDENT  # nothing to page
        s.register("ok", 1000)
        with pytest.raises(ValueError, match="already registered"):
            s.register("ok", 10)
        with pytest.raises(KeyError):
            s.swap_in(["nope"])


def test_write_failure_marks_invalid_and_reads_refuse(tmp_path):
    with make(tmp_path) as s:
        s.register(0, 50000)
        good = rand(50000, torch.float16)
        s.write(0, good)
        s.space.drives[0].writer._c.inject_fault("error", errno.EIO, "write", 1, 1)
        with pytest.raises(SwapStateError, match="invalid") as ei:
            s.write(0, torch.zeros(50000, dtype=torch.float16))
        assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.EIO
        assert s.status(0) == "invalid"
        with pytest.raises(SwapStateError, match="invalid"):
            s.swap_in([0])
        s.space.drives[0].writer._c.clear_fault()
        s.write(0, good)  # a successful write makes it valid again
        (t,) = s.swap_in([0])
        assert torch.equal(t, good)


def test_read_failure_raises_and_keeps_drive_copy(tmp_path):
    with make(tmp_path) as s:
        s.register(0, 50000)
        good = rand(50000, torch.float16)
        s.write(0, good)
        s.space.drives[0].reader._c.inject_fault("error", errno.EIO, "read", 1, 1)
        with pytest.raises(OSError):
            s.swap_in([0])
        assert s.status(0) == "on_drive" and s.stats()["buffers_free"] == 3
        (t,) = s.swap_in([0])
        assert torch.equal(t, good)


def test_never_written_partition(tmp_path):
    with make(tmp_path) as s:
        s.register(0, 10)
        with pytest.raises(SwapStateError, match="never written"):
            s.swap_in([0])


def test_close_removes_everything(tmp_path):
    s = make(tmp_path)
    s.register(0, 1000)
    s.write(0, torch.zeros(1000, dtype=torch.float16))
    d = s.space.dirs[0]
    s.close()
    assert not os.path.exists(d) and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="closed"):
        s.register(1, 10)


def test_from_config(tmp_path):
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(tmp_path),
                "buffer_count": 2,
                "buffer_size": 1e4,
                "max_in_cpu": 0,
            },
        },
        "aio": {"block_size": 262144, "queue_depth": 4},
    }
    with ParamSwapper.from_config(cfg, torch.bfloat16) as s:
        assert s.pool.count == 2 and s.buffer_size == 10000
        assert s.space.drives[0].reader.get_block_size() == 262144
    with pytest.raises(ValueError, match="must be 'nvme'"):
        ParamSwapper.from_config({"zero_optimization": {"stage": 3}}, torch.float16)


def test_two_swappers_share_nvme_path(tmp_path):
    with make(tmp_path) as a, make(tmp_path) as b:
        for s, val in ((a, 1.0), (b, 2.0)):
            s.register(0, 5000)
            s.write(0, torch.full((5000,), val, dtype=torch.float16))
        assert (a.swap_in([0])[0] == 1).all() and (b.swap_in([0])[0] == 2).all()
        assert a.space.dirs[0] != b.space.dirs[0]


def test_checkpoint_roundtrip_and_corruption(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    vals = {i: rand(3000 + 1000 * i, torch.bfloat16, i) for i in range(4)}
    with make(tmp_path / "a", dtype=torch.bfloat16, max_in_cpu=3000, min_swap_bytes=0) as a:
        for i, v in vals.items():
            a.register(i, v.numel())
            a.write(i, v)
        assert a.status(0) == "resident" and a.status(1) == "on_drive"
        a.swap_in([2])  # a buffered partition is exported from its buffer
        a.export_checkpoint(str(tmp_path / "ck"))
    with make(tmp_path / "b", dtype=torch.bfloat16, max_in_cpu=0) as b:
        for i, v in vals.items():
            b.register(i, v.numel())
        b.import_checkpoint(str(tmp_path / "ck"))
        for i, v in vals.items():
            (t,) = b.swap_in([i])
            assert torch.equal(t.view(torch.int16), v.view(torch.int16))
            b.release([i])
        raw = bytearray((tmp_path / "ck" / "params.bin").read_bytes())
        raw[10] ^= 1
        (tmp_path / "ck" / "params.bin").write_bytes(bytes(raw))
        with pytest.raises(OSError, match="checksum"):
            b.import_checkpoint(str(tmp_path / "ck"))
        with pytest.raises(FileExistsError):
            b.export_checkpoint(str(tmp_path / "ck"))


def _owner_range(tmp_path, values, at):
    """Another swapper's space whose extent holds `values` (float32) at byte `at`."""
    from aio.swap.drives import SwapSpace

    (tmp_path / "owner").mkdir()
    owner = SwapSpace(str(tmp_path / "owner"), "owner", "owner.swp")
    base = owner.allocate(1 << 20)
    region = torch.zeros((1 << 20) // 4)
    region[at // 4 : at // 4 + values.numel()] = values
    owner.sync_write(region, base)
    return owner, base


@pytest.mark.parametrize("at", [0, 12, 4096 + 2000])
def test_alias_reads_the_owners_range_until_written(tmp_path, at):
    mine, theirs, newer, own = (rand(5000, torch.float32, seed) for seed in range(4))
    owner, base = _owner_range(tmp_path, theirs, at)
    with make(tmp_path / "owner", dtype=torch.float32) as s, owner:
        s.register(0, 5000)
        s.write(0, mine)
        written = s.counters["bytes_written"]
        assert s.alias(0, owner, base + at) and s.is_aliased(0) and s.stats()["aliased"] == 1
        (t,) = s.swap_in([0])
        assert torch.equal(t, theirs)
        # Read at the offset's alignment in the buffer: the aligned middle goes direct.
        assert (t.data_ptr() - (base + at)) % 4096 == 0
        s.owner_wrote(0, newer)  # the owner has new values: the buffered copy takes them
        assert torch.equal(t, newer) and s.counters["bytes_written"] == written
        s.release([0])
        out = torch.empty(5000)
        s.read_into(0, out)
        assert torch.equal(out, theirs)  # the drive copy is the owner's range (not rewritten here)
        s.write(0, own)  # values of its own end the alias
        assert not s.is_aliased(0)
        (t,) = s.swap_in([0])
        assert torch.equal(t, own)
        s.release([0])
        owner.sync_read(out, base + at)
        assert torch.equal(out, theirs)  # the owner's range was never written through the alias
        with pytest.raises(ValueError, match="not aliased"):
            s.owner_wrote(0, newer)


def test_alias_checkpoint_exports_the_owners_values(tmp_path):
    theirs = rand(5000, torch.float32, 1)
    owner, base = _owner_range(tmp_path, theirs, 12)
    with make(tmp_path / "owner", dtype=torch.float32) as s, owner:
        s.register(0, 5000)
        s.write(0, rand(5000, torch.float32, 2))
        s.alias(0, owner, base + 12)
        s.export_checkpoint(str(tmp_path / "ck"))
        s.import_checkpoint(str(tmp_path / "ck"))  # stored in its own extent: the alias ends
        assert not s.is_aliased(0)
        (t,) = s.swap_in([0])
        assert torch.equal(t, theirs)


def test_alias_refused_where_it_cannot_hold(tmp_path):
    owner, base = _owner_range(tmp_path, torch.zeros(1), 0)
    with make(tmp_path / "owner", dtype=torch.float32, buffer_size=4096, min_swap_bytes=1024) as s, owner:
        s.register("small", 10)  # CPU-resident
        s.register("full", 4096)  # fills a buffer: only at an aligned offset
        s.write("full", rand(4096, torch.float32))
        assert not s.alias("small", owner, base)
        assert not s.alias("full", owner, base + 4)
        assert s.alias("full", owner, base + 4096)


# -- found by a review of the swap storage layer (each failed before its fix) ---------------


def test_a_striped_write_cut_part_way_is_never_read_back(tmp_path):
    """Some pieces of a write over two drives went out, then submitting the
    next failed (or Ctrl-C landed between them): the extent holds old and new
    bytes, so the partition is invalid, not read back as valid."""
    from aio.swap.drives import STRIPE_BYTES

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    kw = {"dtype": torch.float32, "buffer_size": 8 << 20, "max_in_cpu": 0, "pin_memory": False}
    kw["buffer_count"] = 2
    with ParamSwapper([str(d) for d in dirs], **kw) as s:
        n = STRIPE_BYTES  # 4 stripes of fp32 over the two drives
        s.register(0, n)
        s.write(0, torch.zeros(n))
        d1 = s.space.drives[1]

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        d1.writer.async_pwrite = interrupted
        with pytest.raises(KeyboardInterrupt):
            s.write(0, torch.ones(n))
        del d1.writer.async_pwrite
        with pytest.raises(SwapStateError, match="invalid"):
            s.swap_in([0])
        s.write(0, torch.full((n,), 2.0))  # written whole again: readable
        assert torch.equal(s.swap_in([0])[0], torch.full((n,), 2.0))


class _InterruptedWait:
    """A finished I/O's future whose first wait is cut by Ctrl-C."""

    def __init__(self, fut, outcome):
        self.fut, self.outcome, self.waits = fut, outcome, 0

    def exception(self, timeout=None):
        self.waits += 1
        self.fut.exception()
        if self.waits == 1:
            raise KeyboardInterrupt
        return self.outcome

    def done(self):
        return True


@pytest.mark.parametrize("releasing", [False, True])
def test_ctrl_c_while_waiting_for_a_write_keeps_its_outcome(tmp_path, releasing):
    """Ctrl-C inside the wait for a write: the next wait still applies the
    write's outcome (a failed write used to be forgotten and its old bytes
    read back as valid, and swap_out's buffer was never given back)."""
    kw = {"dtype": torch.float32, "buffer_size": 1 << 20, "max_in_cpu": 0, "pin_memory": False}
    kw["buffer_count"] = 1
    with ParamSwapper(str(tmp_path), **kw) as s:
        n = 65536
        s.register(0, n)
        s.write(0, torch.zeros(n))
        if releasing:
            s.swap_in([0])
            s.swap_out([0], async_op=True)
        else:
            s.write(0, torch.ones(n), async_op=True)
        p = s.parts[0]
        p.future = _InterruptedWait(p.future, None if releasing else OSError(errno.EIO, "EIO"))
        with pytest.raises(KeyboardInterrupt):
            s.wait([0])
        if releasing:
            s.wait([0])
            assert s.pool.available() == 1 and torch.equal(s.swap_in([0])[0], torch.zeros(n))
        else:
            with pytest.raises(SwapStateError, match="failed"):
                s.wait([0])
            with pytest.raises(SwapStateError):
                s.swap_in([0])
