"""SwapSpace: one swap space striped over several directories (one per
drive): the layout, round trips against a plain byte model, every drive
used, errors naming the drive, nothing left behind on failure."""

import errno
import os
import random

import pytest

torch = pytest.importorskip("torch")

from aio.swap import ParamSwapper  # noqa: E402
from aio.swap.drives import STRIPE_BYTES, StripedFuture, SwapSpace, nvme_path_list  # noqa: E402
from aio.swap.storage import ALIGN, root_name  # noqa: E402


@pytest.fixture
def two_dirs(tmp_path):
    """One directory on the disk, one on tmpfs when there is one (two kinds
    of file system: O_DIRECT on one, buffered on the other)."""
    a = tmp_path / "disk"
    a.mkdir()
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        b = os.path.join(shm, f"aio-test-{os.getpid()}-{random.randrange(1 << 30)}")
        os.mkdir(b)
    else:
        b = str(tmp_path / "second")
        os.mkdir(b)
    yield [str(a), b]
    if b.startswith(shm):
        os.rmdir(b)


def _swap_folders(d):
    root = os.path.join(d, root_name())
    return os.listdir(root) if os.path.isdir(root) else []


@pytest.mark.parametrize("ndirs", [1, 2, 3])
@pytest.mark.parametrize("stripe", [ALIGN, 4 * ALIGN, STRIPE_BYTES])
def test_random_io_matches_a_byte_model(tmp_path, ndirs, stripe):
    dirs = [str(tmp_path / f"d{i}") for i in range(ndirs)]
    for d in dirs:
        os.mkdir(d)
    rng = random.Random(ndirs * 7 + stripe)
    with_space = SwapSpace(dirs, "param", "x.swp", stripe_bytes=stripe)
    try:
        sizes = [rng.choice([1, 4095, 4096, 5000, 70_000, 3 * stripe + 17]) for _ in range(8)]
        extents = [(with_space.allocate(n), n) for n in sizes]
        model = {}
        for off, n in extents:
            data = torch.randint(0, 256, (n,), dtype=torch.uint8)
            with_space.sync_write(data, off)
            model[off] = data
        for off, n in extents:  # whole extents, and a slice inside each
            back = torch.empty(n, dtype=torch.uint8)
            assert with_space.sync_read(back, off) == n
            assert torch.equal(back, model[off])
            lo = rng.randrange(0, n) // ALIGN * ALIGN
            part = bytearray(min(n - lo, 2 * stripe + 5))
            with_space.sync_read(part, off + lo)
            assert bytes(part) == model[off][lo : lo + len(part)].numpy().tobytes()
    finally:
        with_space.close()
    for d in dirs:
        assert _swap_folders(d) == [], "close() removes every drive's folder"


def test_pieces_stripe_over_every_drive(tmp_path):
    dirs = [str(tmp_path / f"d{i}") for i in range(2)]
    for d in dirs:
        os.mkdir(d)
    with SwapSpace(dirs, "param", "x.swp") as sp:
        big = sp.allocate(4 * STRIPE_BYTES)
        pieces = sp.pieces(big, 4 * STRIPE_BYTES)
        assert [p[0] for p in pieces] == [0, 1, 0, 1]
        assert [p[3] for p in pieces] == [STRIPE_BYTES] * 4
        assert [p[2] for p in pieces] == [i * STRIPE_BYTES for i in range(4)]
        # A small extent is still cut in two: both drives work on it.
        small = sp.allocate(64 * 1024)
        assert [(p[0], p[3]) for p in sp.pieces(small, 64 * 1024)] == [(0, 32 * 1024), (1, 32 * 1024)]
        sizes = [s["drive_bytes"] for s in sp.stats()]
        assert sizes[0] == sizes[1] > 0
        with pytest.raises(ValueError, match="one allocated extent"):
            sp.pieces(big + 4 * STRIPE_BYTES - 4096, 8192)


def test_one_directory_is_one_plain_request(tmp_path):
    with SwapSpace(str(tmp_path), "param", "x.swp") as sp:
        a = sp.allocate(10_000)
        b = sp.allocate(3 * STRIPE_BYTES)
        c = sp.allocate(STRIPE_BYTES + 4096)  # not a whole number of stripes: reserved as is
        assert sp.stats()[0]["drive_bytes"] == c + STRIPE_BYTES + 4096
        assert (a, b) == (0, 12288)
        assert sp.pieces(b, 3 * STRIPE_BYTES) == [(0, b, 0, 3 * STRIPE_BYTES)]
        t = torch.arange(1000, dtype=torch.float32)
        fut = sp.write(t, a)
        assert not isinstance(fut, StripedFuture)
        fut.result()


def test_training_io_uses_every_drive(two_dirs):
    with ParamSwapper(two_dirs, dtype=torch.float32, buffer_count=2, buffer_size=1 << 20, max_in_cpu=0) as s:
        vals = {i: torch.randn(300_000 + i) for i in range(3)}
        for i, v in vals.items():
            s.register(i, v.numel())
            s.write(i, v)
        for i, v in vals.items():
            (t,) = s.swap_in([i])
            assert torch.equal(t, v)
            s.release([i])
        drives = s.stats()["drives"]
        assert [d["nvme_path"] for d in drives] == [os.path.abspath(p) for p in two_dirs]
        for d in drives:
            assert d["bytes_written"] > 0 and d["bytes_read"] > 0 and os.path.isdir(d["swap_dir"])
        assert drives[0]["o_direct"] is True  # the disk (tmpfs, the second, may not take it)
        total = sum(d["bytes_written"] for d in drives)
        assert total == sum(v.numel() * 4 for v in vals.values())


def test_failed_piece_names_its_drive_and_waits_for_the_others(two_dirs):
    with SwapSpace(two_dirs, "optimizer", "x.swp") as sp:
        off = sp.allocate(4 * STRIPE_BYTES)
        sp.drives[1].writer._c.inject_fault("error", errno.EIO, "write", 1, 1)
        fut = sp.write(torch.zeros(STRIPE_BYTES, dtype=torch.float32), off)
        assert isinstance(fut, StripedFuture)
        with pytest.raises(OSError) as ei:
            fut.result()
        assert ei.value.errno == errno.EIO
        assert ei.value.filename.startswith(sp.drives[1].storage.dir)
        assert fut.done(), "every piece has finished before the error is raised"
        sp.drives[1].writer._c.clear_fault()


def test_bad_directory_lists_are_refused(tmp_path):
    with pytest.raises(ValueError, match="same directory"):
        nvme_path_list([str(tmp_path), str(tmp_path) + "/."])
    with pytest.raises(ValueError, match="list of directories"):
        nvme_path_list([])
    # One form for every swapper: a path or a list/tuple of them; a set (no order
    # to stripe in), bytes or a generator is a TypeError naming what came.
    for bad, name in (
        ({str(tmp_path)}, "set"),
        (os.fsencode(str(tmp_path)), "bytes"),
        (iter([]), "list_iterator"),
    ):
        with pytest.raises(
            TypeError, match=f"nvme_path must be a directory path or a list of them, got {name}"
        ):
            nvme_path_list(bad)
    assert nvme_path_list((str(tmp_path),)) == [str(tmp_path)]


@pytest.mark.parametrize("how", ["param", "param-list", "optimizer", "list-item"])
def test_an_empty_path_is_refused_not_the_current_directory(tmp_path, monkeypatch, how):
    """R3-06: abspath("") is the current directory; "" must be refused with
    nothing created there."""
    from aio.swap import OptimizerSwapper

    monkeypatch.chdir(tmp_path)
    make = {
        "param": lambda: ParamSwapper("", dtype=torch.float32),
        "param-list": lambda: ParamSwapper([""], dtype=torch.float32),
        "optimizer": lambda: OptimizerSwapper("", torch.optim.Adam),
        "list-item": lambda: nvme_path_list([str(tmp_path), ""]),
    }[how]
    with pytest.raises(ValueError, match="empty path"):
        make()
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="not a directory path"):
        nvme_path_list([str(tmp_path), 3])


_OBJECT_READ = """
import os, sys, numpy as np, torch
from aio.swap.drives import SwapSpace
for dirs in (sys.argv[1:2], sys.argv[1:]):  # one drive, then striped over two
    sp = SwapSpace(dirs, "param", "x.swp", stripe_bytes=4096)
    off = sp.allocate(1 << 16)
    sp.sync_write(torch.full((1 << 16,), 7, dtype=torch.uint8), off)
    victim = np.array([object() for _ in range(1 << 13)], dtype=object)
    for buf, err in ((victim, TypeError), (bytes(1 << 16), ValueError)):
        try:
            sp.sync_read(buf, off)
        except err as e:
            print(len(dirs), type(e).__name__, e)
        else:
            raise SystemExit("accepted " + type(buf).__name__)
    sp.close()
print("ok")
"""


def test_reads_into_object_arrays_are_refused_on_any_number_of_drives(tmp_path):
    """R3-07: striped over two drives, a read into a numpy object array
    wrote over its PyObject pointers (SIGSEGV); it is a TypeError, as with
    one drive, and a read into read-only memory a ValueError. (One process
    for both layouts: a crash-prone case, and importing torch twice costs CI
    time.)"""
    import subprocess
    import sys

    dirs = [str(tmp_path / f"d{i}") for i in range(2)]
    for d in dirs:
        os.mkdir(d)
    cmd = [sys.executable, "-c", _OBJECT_READ, *dirs]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.splitlines()[-1] == "ok"


def test_a_missing_drive_leaves_nothing_behind(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError) as ei:
        SwapSpace([str(good), str(missing)], "param", "x.swp")
    assert ei.value.filename == str(missing)
    assert _swap_folders(str(good)) == []


def test_full_drive_fails_at_allocation_naming_its_file(tmp_path):
    dirs = [str(tmp_path / f"d{i}") for i in range(2)]
    for d in dirs:
        os.mkdir(d)
    with SwapSpace(dirs, "param", "x.swp") as sp:
        with pytest.raises(OSError) as ei:
            sp.allocate(1 << 62)
        assert ei.value.errno in (errno.ENOSPC, errno.EFBIG, errno.EINVAL)
        assert ei.value.filename.startswith(sp.drives[0].storage.dir)


def test_a_drive_without_o_direct_is_said_up_front(tmp_path, monkeypatch, caplog):
    import aio.swap.drives as drives

    dirs = [str(tmp_path / f"d{i}") for i in range(2)]
    for d in dirs:
        os.mkdir(d)
    real = drives._takes_o_direct
    monkeypatch.setattr(
        drives, "_takes_o_direct", lambda path: False if "/d1/" in os.path.realpath(path) else real(path)
    )
    with caplog.at_level("WARNING", logger="aio.swap"):
        with SwapSpace(dirs, "param", "x.swp") as sp:
            assert [d["o_direct"] for d in sp.stats()] == [True, False]
    said = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(said) == 1 and dirs[1] in said[0]


@pytest.mark.parametrize("ndirs", [2, 3, 4])
@pytest.mark.parametrize("nbytes", [4096, 5 * STRIPE_BYTES, 4 * STRIPE_BYTES + 4096, 13_100_000])
def test_each_drive_reserves_only_its_stripes(tmp_path, ndirs, nbytes):
    dirs = [str(tmp_path / f"d{i}") for i in range(ndirs)]
    for d in dirs:
        os.mkdir(d)
    with SwapSpace(dirs, "param", "x.swp") as sp:
        off = sp.allocate(nbytes)
        (ext,) = sp._extents
        assert sum(s["drive_bytes"] for s in sp.stats()) == ext.size  # no stripe reserved beyond the data
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        sp.sync_write(data, off)
        back = torch.empty_like(data)
        sp.sync_read(back, off)
        assert torch.equal(back, data)


def test_allocation_failing_on_one_drive_gives_the_others_back(tmp_path, monkeypatch):
    dirs = [str(tmp_path / f"d{i}") for i in range(2)]
    for d in dirs:
        os.mkdir(d)
    with SwapSpace(dirs, "param", "x.swp") as sp:
        sp.allocate(2 * STRIPE_BYTES)
        before = [s["drive_bytes"] for s in sp.stats()]

        def full(nbytes):
            raise OSError(errno.ENOSPC, "cannot reserve", "x")

        monkeypatch.setattr(sp.drives[1].file, "allocate", full)
        with pytest.raises(OSError):
            sp.allocate(8 * STRIPE_BYTES)
        assert [s["drive_bytes"] for s in sp.stats()] == before
        assert [os.path.getsize(d.file.real_path) for d in sp.drives] == before
        monkeypatch.undo()
        off = sp.allocate(STRIPE_BYTES * 2)  # the next extent starts where it should
        assert sp.pieces(off, 2 * STRIPE_BYTES) == [
            (0, STRIPE_BYTES, 0, STRIPE_BYTES),
            (1, STRIPE_BYTES, STRIPE_BYTES, STRIPE_BYTES),
        ]
