"""Swap folders on a shared drive: private per-user folders that are
verified before use, files that never follow a planted symlink, and the
folders of killed jobs reclaimed by the next job (never a live job's)."""

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import zlib

import pytest

from aio.swap import SwapStorage
from aio.swap.storage import MARKER, root_name

NOBODY = 65534


def test_private_root_is_0700_and_owned(tmp_path):
    s = SwapStorage(str(tmp_path), "param")
    st = os.lstat(s.root)
    assert s.root == str(tmp_path / root_name())
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(s.dir).st_mode) == 0o700
    s.close()


def test_root_open_to_others_is_refused(tmp_path):
    root = tmp_path / root_name()
    root.mkdir()
    os.chmod(root, 0o777)  # e.g. pre-created by someone else for everyone
    with pytest.raises(PermissionError) as ei:
        SwapStorage(str(tmp_path), "param")
    assert ei.value.filename == str(root) and "0777" in str(ei.value)
    assert os.listdir(root) == []  # never used


def test_root_symlink_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    os.symlink(victim, tmp_path / root_name())
    with pytest.raises(PermissionError) as ei:
        SwapStorage(str(tmp_path), "param")
    assert "symbolic link" in str(ei.value)
    assert os.listdir(victim) == []


def test_root_of_another_owner_is_refused(tmp_path, monkeypatch):
    # We cannot chown as a normal user: pretend to be another uid instead, so
    # the folder named for that uid exists but belongs to someone else (us).
    fake = os.geteuid() + 4242
    root = tmp_path / f"aio-swap-{fake}"
    root.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: fake)
    with pytest.raises(PermissionError) as ei:
        SwapStorage(str(tmp_path), "param")
    assert f"owned by uid {os.getuid()}" in str(ei.value)


def test_planted_symlink_for_swap_file_is_not_followed(tmp_path):
    s = SwapStorage(str(tmp_path), "param")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, os.path.join(s.dir, "params.swp"))
    with pytest.raises(FileExistsError):
        s.file("params.swp").allocate(8192)
    assert victim.read_text() == "precious"
    s.close()
    assert victim.read_text() == "precious" and not os.path.exists(s.dir)


def test_io_goes_through_held_folder_descriptor(tmp_path):
    # Renaming the folder away and planting a symlink in its place must not
    # redirect the swap file: I/O resolves through the descriptor we hold.
    from aio.handle import AsyncIOHandle

    s = SwapStorage(str(tmp_path), "param")
    f = s.file("x.swp")
    off = f.allocate(4096)
    victim = tmp_path / "victim"
    victim.mkdir()
    os.rename(s.root, tmp_path / "moved")
    os.symlink(victim, s.root)
    import torch

    with AsyncIOHandle() as h:
        h.sync_pwrite(torch.full((1024,), 7, dtype=torch.int32), f.path, off)
    assert os.listdir(victim) == []
    assert os.path.getsize(tmp_path / "moved" / os.path.basename(s.dir) / "x.swp") == 4096
    os.unlink(s.root)
    os.rename(tmp_path / "moved", s.root)
    s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_two_users_share_a_sticky_drive():
    shared = tempfile.mkdtemp(prefix="aio-shared-")
    try:
        os.chmod(shared, 0o1777)
        mine = SwapStorage(shared, "param")
        mine.file("a.swp").allocate(4096)
        pid = os.fork()
        if pid == 0:  # the other user: no exec needed, aio is already imported
            code = 1
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                theirs = SwapStorage(shared, "param")
                theirs.file("a.swp").allocate(4096)
                code = 0 if os.lstat(theirs.root).st_uid == NOBODY else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert sorted(os.listdir(shared)) == sorted([root_name(), f"aio-swap-{NOBODY}"])
        mine.close()
    finally:
        subprocess.run(["rm", "-rf", shared], check=True)


_JOB = textwrap.dedent(
    """
    import sys, time
    from aio.swap import SwapStorage
    s = SwapStorage(sys.argv[1], "param", job_id=sys.argv[2])
    s.file("a.swp").allocate(1 << 16)
    print(s.dir, flush=True)
    time.sleep(600)
    """
)


def _start_job(drive, job):
    p = subprocess.Popen([sys.executable, "-c", _JOB, str(drive), job], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


@pytest.mark.timeout(120)
def test_killed_jobs_folders_reclaimed_live_ones_kept(tmp_path):
    dead, dead_dir = _start_job(tmp_path, "dead")
    live, live_dir = _start_job(tmp_path, "live")
    term, term_dir = _start_job(tmp_path, "term")
    try:
        assert os.path.isdir(dead_dir) and os.path.isdir(live_dir) and os.path.isdir(term_dir)
        dead.send_signal(signal.SIGKILL)
        term.send_signal(signal.SIGTERM)  # the default action skips exit handlers
        dead.wait(60)
        term.wait(60)
        assert os.path.isdir(dead_dir) and os.path.isdir(term_dir)  # left behind
        s = SwapStorage(str(tmp_path), "param")
        assert not os.path.exists(dead_dir) and not os.path.exists(term_dir)
        assert sorted(s.reclaimed) == sorted(os.path.basename(d) for d in (dead_dir, term_dir))
        assert os.path.isfile(os.path.join(live_dir, "a.swp"))  # a live job's is kept
        s.close()
    finally:
        live.kill()
        live.wait(60)
        dead.kill()
        term.kill()


def _fake_job_folder(root, name, **owner):
    d = os.path.join(root, name)
    os.mkdir(d, 0o700)
    with open(os.path.join(d, MARKER), "w") as f:
        json.dump(owner, f)
    with open(os.path.join(d, "a.swp"), "w") as f:
        f.write("x")
    return d


def test_reclaim_spares_other_hosts_reused_pids_and_unknown_markers(tmp_path):
    s = SwapStorage(str(tmp_path), "param")
    with open(os.path.join(s.dir, MARKER)) as f:
        me = json.load(f)
    s.close()
    root = str(tmp_path / root_name())
    os.mkdir(root, 0o700)
    # pid 1 is alive here; a marker naming it with another start time is a
    # reused pid (dead owner), with its real start time it is a live owner.
    with open("/proc/1/stat") as f:
        start1 = f.read().rsplit(")", 1)[1].split()[19]
    reused = _fake_job_folder(root, "reused", **{**me, "pid": 1, "start": "1"})
    alive = _fake_job_folder(root, "alive", **{**me, "pid": 1, "start": start1})
    other = _fake_job_folder(root, "other-host", **{**me, "host": me["host"] + "-x", "pid": 2**22 + 1})
    junk = _fake_job_folder(root, "no-marker")
    os.unlink(os.path.join(junk, MARKER))
    os.symlink("/etc/hostname", os.path.join(junk, MARKER))  # a symlinked marker is not read
    s = SwapStorage(str(tmp_path), "param")
    assert s.reclaimed == ["reused"] and not os.path.exists(reused)
    assert all(os.path.exists(os.path.join(d, "a.swp")) for d in (alive, other, junk))
    s.close()


def test_forked_child_does_not_remove_parents_folder(tmp_path):
    s = SwapStorage(str(tmp_path), "param")
    pid = os.fork()
    if pid == 0:
        try:
            s.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.isdir(s.dir)
    s.close()
    assert not os.path.exists(s.dir)


@pytest.mark.parametrize("kind", ["symlink to an empty folder", "file"])
def test_a_checkpoint_onto_a_symlink_or_a_file_is_refused_before_any_work(tmp_path, kind):
    """The final rename replaces an empty folder only: a symbolic link (even to
    an empty folder) or a file at the checkpoint's name is refused before
    anything is written, naming it; what it points to is untouched."""
    from aio.swap.storage import checkpoint_dir

    target = tmp_path / "elsewhere"
    target.mkdir()
    dest = tmp_path / "ckpt"
    if kind == "file":
        dest.write_text("x")
    else:
        dest.symlink_to(target)
    with pytest.raises(FileExistsError, match="symbolic link|not a folder") as err:
        with checkpoint_dir(str(dest)):
            pytest.fail("the body ran: the refusal came late")
    assert err.value.filename == str(dest)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "elsewhere"] and not os.listdir(target)


def _small_checkpoint(path):
    """A checkpoint folder of two files (one in a sub-folder) with its marker."""
    from aio.swap.storage import checkpoint_dir

    with checkpoint_dir(str(path)) as tmp:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            f.write('{"a": 1}')
        os.mkdir(os.path.join(tmp, "part"))
        with open(os.path.join(tmp, "part", "data.bin"), "wb") as f:
            f.write(b"\0" * 4096)


def _rewrite_marker(path, edit):
    with open(path / "complete") as f:
        listing = json.load(f)
    edit(listing)
    with open(path / "complete", "w") as f:
        json.dump(listing, f)


@pytest.mark.parametrize("how", ["symlink", "fifo", "unlisted file", "empty listing", "marker symlink"])
def test_a_checkpoint_with_anything_but_its_listed_regular_files_is_refused(tmp_path, how):
    """A checkpoint holds exactly the regular files its ``complete`` marker
    lists: a listed file swapped for a symbolic link to the same bytes
    elsewhere (marker rewritten to match), a FIFO (which would block the
    checksum's read forever), a planted file, a marker listing nothing or a
    marker that is itself a link are refused with a ValueError naming it."""
    from aio.swap.storage import require_complete

    ck = tmp_path / "ck"
    _small_checkpoint(ck)
    require_complete(str(ck))  # whole as written
    (ck / ".DS_Store").write_bytes(b"x")  # hidden files are no part of it (a file browser's)
    require_complete(str(ck))
    if how == "symlink":
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_text('{"a": 2}')
        (ck / "meta.json").unlink()
        (ck / "meta.json").symlink_to(elsewhere)
        _rewrite_marker(ck, lambda m: m["crc32"].update({"meta.json": zlib.crc32(b'{"a": 2}')}))
        match = "meta.json is a symbolic link"
    elif how == "fifo":
        (ck / "meta.json").unlink()
        os.mkfifo(ck / "meta.json")
        _rewrite_marker(ck, lambda m: m["files"].update({"meta.json": 0}))
        match = "meta.json is not a regular file"
    elif how == "unlisted file":
        (ck / "part" / "extra.bin").write_bytes(b"x")
        match = "does not list: part/extra.bin"
    elif how == "empty listing":
        _rewrite_marker(ck, lambda m: (m["files"].clear(), m["crc32"].clear()))
        match = "does not list: meta.json, part/data.bin"
    else:
        real = tmp_path / "marker"
        os.rename(ck / "complete", real)
        (ck / "complete").symlink_to(real)
        match = "symbolic link"
    with pytest.raises(ValueError, match=match):
        require_complete(str(ck))


def test_a_save_killed_part_way_leaves_a_folder_the_next_save_removes(tmp_path):
    """A checkpoint save killed inside its temporary folder (SIGKILL: no
    cleanup runs) left it for good, as big as the checkpoint. The next save
    beside it removes it once its process is gone; a save still running, and
    a folder whose owner is unknown, are left alone."""
    from aio.swap.storage import checkpoint_dir, reclaim_killed_saves

    script = textwrap.dedent(
        f"""
        import os
        from aio.swap.storage import checkpoint_dir
        with checkpoint_dir({str(tmp_path / "killed")!r}) as tmp:
            open(os.path.join(tmp, "big.bin"), "wb").write(b"x" * 4096)
            os.kill(os.getpid(), 9)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    (stale,) = [n for n in os.listdir(tmp_path) if n.startswith(".killed.tmp-")]
    unknown = tmp_path / ".other.tmp-0123abcd"
    unknown.mkdir()  # no owner marker: cannot tell, kept
    with checkpoint_dir(str(tmp_path / "running")) as tmp:
        (tmp_path / "x").mkdir()  # not a save's folder
        assert reclaim_killed_saves(str(tmp_path)) == []  # the first save above removed it already
        assert not (tmp_path / stale).exists()
        assert os.path.isdir(tmp) and unknown.is_dir()  # a save running, an unknown owner: kept
        with open(os.path.join(tmp, "data"), "w") as f:
            f.write("ok")
    assert (tmp_path / "running" / "data").read_text() == "ok"
    assert sorted(os.listdir(tmp_path / "running")) == ["complete", "data"]  # no owner marker left in it


# -- a shared checkpoint folder (a team's 1777 folder): planted temporary folders -----------------
def _deep_chain(top, depth):
    """`depth` nested folders named ``d`` under `top`, made through held
    descriptors (their path would pass PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


def _remove_deep(top):
    """Remove a tree of any depth without recursion (shutil.rmtree, and so
    pytest's own clean-up, raise RecursionError on one): each sub-folder is
    first moved up beside `top`, so every path stays short."""
    if not os.path.lexists(top):
        return
    todo, done = [str(top)], []
    while todo:
        folder = todo.pop()
        for name in os.listdir(folder):
            p = os.path.join(folder, name)
            if os.path.isdir(p) and not os.path.islink(p):
                flat = tempfile.mkdtemp(dir=os.path.dirname(str(top)), prefix=".flat-")
                os.rmdir(flat)
                os.rename(p, flat)
                todo.append(flat)
            else:
                os.unlink(p)
        done.append(folder)
    for folder in done:
        os.rmdir(folder)


def _planted_save_folder(parent, marker=None, name=".x.tmp-0123abcd"):
    """A folder named as a save's temporary one, whose owner marker says its
    process is gone (pid 1 with another start time: a reused pid)."""
    from aio.swap.storage import _identity

    d = parent / name
    d.mkdir(mode=0o700)
    owner = json.dumps({**_identity(), "pid": 1, "start": "1"}) if marker is None else marker
    (d / MARKER).write_text(owner)
    return d


_SAVE = textwrap.dedent(
    """
    import logging, os, sys
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    from aio.swap.storage import checkpoint_dir, require_complete
    with checkpoint_dir(os.path.join(sys.argv[1], "ck")) as tmp:
        open(os.path.join(tmp, "data"), "w").write("ok")
    require_complete(os.path.join(sys.argv[1], "ck"))
    print("saved", flush=True)
    """
)


@pytest.mark.timeout(120)
def test_a_planted_deep_tree_beside_a_save_does_not_fail_it(tmp_path):
    """Anyone who can write to a shared checkpoint folder could plant a
    save's temporary folder with a dead owner over a 2000-deep tree: the
    next save there removed it by recursion and raised RecursionError,
    writing nothing (a periodic save crashed the job). Reclaiming is bounded
    and never fails a save: the tree goes, or stays with a log line. In a
    subprocess: a recursion this deep may take the interpreter down."""
    planted = _planted_save_folder(tmp_path)
    try:
        _deep_chain(planted, 2000)
        r = subprocess.run(
            [sys.executable, "-c", _SAVE, str(tmp_path)], capture_output=True, text=True, timeout=90
        )
        assert r.returncode == 0 and "saved" in r.stdout, r.stderr[-2000:]
        assert "RecursionError" not in r.stderr
        assert (tmp_path / "ck" / "data").read_text() == "ok"
        if planted.exists():  # given up on: said so, in one line naming it
            (line,) = [x for x in r.stderr.splitlines() if planted.name in x]
            assert line.startswith("aio.swap WARNING") and "left" in line, r.stderr
    finally:
        _remove_deep(planted)


def test_a_marker_nested_too_deeply_does_not_fail_a_save(tmp_path):
    """A planted owner marker of 4000 nested JSON lists raised RecursionError
    out of json.loads and failed the save; it is an unreadable marker (an
    unknown owner: the folder is kept)."""
    planted = _planted_save_folder(tmp_path, marker="[" * 4000)
    r = subprocess.run(
        [sys.executable, "-c", _SAVE, str(tmp_path)], capture_output=True, text=True, timeout=90
    )
    assert r.returncode == 0 and "saved" in r.stdout, r.stderr[-2000:]
    assert (planted / MARKER).exists()


def test_a_planted_folder_of_another_user_is_left_alone(tmp_path, monkeypatch):
    """A save removes only its own user's killed saves: a folder of another
    owner (planted in a shared folder, or another user's) is never touched,
    whatever its marker says, even by root."""
    from aio.swap.storage import checkpoint_dir

    planted = _planted_save_folder(tmp_path)
    (planted / "theirs").mkdir()
    (planted / "theirs" / "data").write_text("x")
    if os.geteuid() == 0:
        for p in (planted, planted / MARKER, planted / "theirs", planted / "theirs" / "data"):
            os.chown(p, 12345, 12345)
    else:  # as in test_root_of_another_owner_is_refused: be another uid instead
        fake = os.geteuid() + 4242
        monkeypatch.setattr(os, "geteuid", lambda: fake)
    with checkpoint_dir(str(tmp_path / "ck")) as tmp:
        with open(os.path.join(tmp, "data"), "w") as f:
            f.write("ok")
    assert (planted / MARKER).exists() and (planted / "theirs" / "data").read_text() == "x"


def test_a_symlink_planted_in_a_killed_save_is_not_followed(tmp_path):
    """Reclaiming removes entries relative to the held folder descriptors: a
    symbolic link inside (to a folder or a file outside) is removed as a
    link, its target survives."""
    from aio.swap.storage import reclaim_killed_saves

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    planted = _planted_save_folder(tmp_path)
    (planted / "sub").mkdir()
    (planted / "sub" / "to-folder").symlink_to(outside)
    (planted / "to-file").symlink_to(outside / "keep")
    assert reclaim_killed_saves(str(tmp_path)) == [planted.name]
    assert not planted.exists() and (outside / "keep").read_text() == "x"


def test_reclaiming_removes_the_folder_whose_marker_it_read(tmp_path, monkeypatch):
    """In a folder that is not sticky, a save's folder of ours whose marker
    was read (dead owner) could be renamed away and another folder of ours
    (a real checkpoint) moved to its name before the removal, which went by
    path and removed the checkpoint. Removal goes through the descriptor the
    marker was read from: the checkpoint is kept."""
    from aio.swap import storage

    real = tmp_path / "step1"
    _small_checkpoint(real)
    planted = _planted_save_folder(tmp_path)
    (planted / "junk").write_text("x")
    moved = tmp_path / "moved-away"
    decide = storage._owner_is_dead

    def swap_then_decide(owner, me):
        os.rename(planted, moved)
        os.rename(real, planted)
        return decide(owner, me)

    monkeypatch.setattr(storage, "_owner_is_dead", swap_then_decide)
    storage.reclaim_killed_saves(str(tmp_path))
    storage.require_complete(str(planted))  # the checkpoint, whole, under the name it was moved to
    assert not (moved / "junk").exists()  # what was removed is the folder whose marker was read


@pytest.mark.timeout(120)
def test_a_checkpoint_holding_deeply_nested_folders_is_a_value_error(tmp_path):
    """A checkpoint holding a 2000-deep folder made loading raise
    RecursionError (the walk of its files recursed), not the documented
    ValueError naming the folder."""
    from aio.swap.storage import require_complete

    ck = tmp_path / "ck"
    _small_checkpoint(ck)
    try:
        (ck / "deep").mkdir()
        _deep_chain(ck / "deep", 2000)
        with pytest.raises(ValueError, match="nested") as err:
            require_complete(str(ck))
        assert str(ck) in str(err.value)
    finally:
        _remove_deep(ck)


def test_killed_saves_are_reclaimed_under_a_symlinked_folder(tmp_path):
    """The checkpoint folder's own path may go through a symbolic link (a
    ``checkpoints`` link to a drive): the save writes there, and reclaiming
    opened it with O_NOFOLLOW, failed and never removed a killed save."""
    from aio.swap.storage import reclaim_killed_saves

    real = tmp_path / "on-the-drive"
    real.mkdir()
    (tmp_path / "checkpoints").symlink_to(real)
    planted = _planted_save_folder(real)
    assert reclaim_killed_saves(str(tmp_path / "checkpoints")) == [planted.name]
    assert not planted.exists()
