"""Swap storage: per-job/rank folders, aligned preallocated extents, cleanup."""

import os
import subprocess
import sys
import textwrap

import pytest

from aio.swap import SwapStorage
from aio.swap.storage import MARKER, root_name


def test_folders_are_namespaced_and_cleaned(tmp_path):
    a = SwapStorage(str(tmp_path), "param", job_id="job/1", rank=0)
    b = SwapStorage(str(tmp_path), "param", job_id="job/1", rank=0)  # same job+rank: still distinct
    c = SwapStorage(str(tmp_path), "optimizer", job_id="other", rank=3)
    assert len({a.dir, b.dir, c.dir}) == 3
    assert os.path.basename(a.dir).startswith("job_1-rank0-param-")
    assert "rank3-optimizer" in c.dir
    assert all(os.path.isfile(os.path.join(s.dir, MARKER)) for s in (a, b, c))
    foreign = tmp_path / root_name() / "someone-else"
    foreign.mkdir()
    (foreign / "data").write_text("keep me")
    for s in (a, b, c):
        s.close()
    assert not any(os.path.exists(s.dir) for s in (a, b, c))
    assert (foreign / "data").read_text() == "keep me"  # never touched
    foreign.joinpath("data").unlink()
    foreign.rmdir()


def test_root_removed_when_empty(tmp_path):
    s = SwapStorage(str(tmp_path), "param")
    s.close()
    assert not (tmp_path / root_name()).exists()
    s.close()  # idempotent


def test_extents_aligned_and_preallocated(tmp_path):
    s = SwapStorage(str(tmp_path), "param")
    f = s.file("x.swp")
    offs = [f.allocate(n) for n in (1, 4096, 5000, 123)]
    assert offs == [0, 4096, 8192, 16384]
    assert all(o % 4096 == 0 for o in offs)
    assert os.path.getsize(f.path) == f.size == 20480
    assert os.stat(f.path).st_blocks * 512 >= 20480  # really allocated, not sparse
    with pytest.raises(ValueError):
        f.allocate(0)
    s.close()


def test_no_space_reported_at_allocation(tmp_path):
    s = SwapStorage(str(tmp_path), "param")
    with pytest.raises(OSError) as ei:
        s.file("x.swp").allocate(1 << 60)
    assert "swap space" in str(ei.value)
    s.close()


def test_bad_nvme_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        SwapStorage(str(tmp_path / "missing"), "param")
    with pytest.raises(ValueError):
        SwapStorage("", "param")


def test_env_job_and_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("AIO_JOB_ID", "train42")
    monkeypatch.setenv("RANK", "7")
    s = SwapStorage(str(tmp_path), "param")
    assert os.path.basename(s.dir).startswith("train42-rank7-param-")
    s.close()


def test_removed_at_interpreter_exit(tmp_path):
    code = textwrap.dedent(
        f"""
        from aio.swap import SwapStorage
        s = SwapStorage({str(tmp_path)!r}, "param")
        s.file("a.swp").allocate(1 << 20)
        print(s.dir)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(r.stdout.strip())
    assert not (tmp_path / root_name()).exists()


def test_load_plain_of_a_cut_file_is_a_value_error_naming_it(tmp_path):
    import torch

    from aio.swap.storage import load_plain, save_plain

    path = str(tmp_path / "x.pt")
    save_plain({"a": torch.ones(10)}, path, "x")
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="x.pt"):
        load_plain(path)


def test_a_storage_dropped_without_close_removes_its_folder(tmp_path):
    """A swapper garbage-collected without close() used to leave its folder
    and preallocated files on the drive after a clean exit."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import gc, os
        from aio.swap.storage import SwapStorage
        s = SwapStorage({str(tmp_path)!r}, "param")
        s.file("x").allocate(1 << 20)
        folder = s.dir
        del s
        gc.collect()
        print("gone at collection:", not os.path.exists(folder))
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "gone at collection: True" in r.stdout, r.stdout + r.stderr
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs] == []


def test_a_reservation_out_of_space_part_way_gives_the_space_back(tmp_path, monkeypatch):
    """posix_fallocate can fail with ENOSPC after growing the file: the
    OSError names the file, and the file is back at its size before."""
    import errno

    from aio.swap.storage import SwapStorage

    s = SwapStorage(str(tmp_path), "param")
    try:
        f = s.file("x")
        f.allocate(1 << 20)
        real = os.posix_fallocate

        def partly(fd, off, length):
            real(fd, off, length // 2)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", partly)
        with pytest.raises(OSError) as ei:
            f.allocate(1 << 20)
        assert ei.value.errno == errno.ENOSPC and ei.value.filename == f.real_path
        assert os.path.getsize(f.real_path) == 1 << 20 and f.size == 1 << 20
    finally:
        s.close()


@pytest.mark.parametrize("fail", ["mkdir", "marker"])
def test_a_failed_creation_leaks_no_descriptor(tmp_path, monkeypatch, fail):
    """The folder's creation failing for another reason than a vanished user
    folder (out of space, quota), or its marker failing to write, closes the
    descriptors it opened: a retrying job must not run out of them."""
    import errno

    from aio.swap import storage

    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    SwapStorage(str(tmp_path), "param").close()  # the user folder exists from here on
    real_mkdir = os.mkdir
    if fail == "mkdir":
        monkeypatch.setattr(
            os, "mkdir", lambda name, *a, **k: no_space() if "dir_fd" in k else real_mkdir(name, *a, **k)
        )
    else:
        monkeypatch.setattr(storage.SwapStorage, "_write_marker", no_space)
    before = open_fds()
    for _ in range(3):
        with pytest.raises(OSError, match="No space"):
            SwapStorage(str(tmp_path), "param")
    assert open_fds() == before


def test_without_procfs_the_handle_gets_the_real_path(tmp_path, monkeypatch):
    """Where /proc/self/fd is missing (no procfs mounted), a swap file's I/O
    path is its real path in the private folder: a striped space still round
    trips its bytes and an I/O error names that file."""
    torch = pytest.importorskip("torch")
    from aio.swap import storage
    from aio.swap.drives import SwapSpace

    monkeypatch.setattr(storage, "_PROC_FD", False)
    space = SwapSpace(str(tmp_path), "param", "x.swp")
    try:
        f = space.drives[0].file
        assert f.path == f.real_path and f.path.startswith(str(tmp_path)) and os.path.isfile(f.path)
        off = space.allocate(3 * 4096)
        data = torch.arange(3 * 1024, dtype=torch.float32)
        space.write(data, off).result()
        back = torch.empty_like(data)
        space.read(back, off).result()
        assert torch.equal(back, data)
        with pytest.raises(OSError) as ei:  # past the end of the file: a short read, named
            space.drives[0].reader.sync_pread(torch.empty(1024), f.path, f.size + 4096)
        assert f.real_path in str(ei.value)
    finally:
        space.close()
    assert not os.path.exists(space.dirs[0])


def test_the_user_folder_removed_by_another_rank_while_opening_is_made_again(tmp_path, monkeypatch) -> None:
    """Two ranks of one user share the per-user folder; one closing (its
    rmdir of the emptied folder) between the other's mkdir and its checks
    made the other fail with FileNotFoundError (seen as a hung 2-rank job):
    the opening is redone."""
    from aio.swap import storage as st

    real, calls = st._open_private_root, []

    def removed_once(path: str):
        calls.append(path)
        if len(calls) == 1:
            os.rmdir(os.path.join(path, st.root_name()))  # the other rank's close, just now
            raise FileNotFoundError(2, "No such file or directory", os.path.join(path, st.root_name()))
        return real(path)

    os.mkdir(tmp_path / st.root_name(), 0o700)
    monkeypatch.setattr(st, "_open_private_root", removed_once)
    s = st.SwapStorage(str(tmp_path), "optimizer")
    try:
        assert len(calls) == 2 and os.path.isdir(s.dir)
    finally:
        s.close()
