"""aio.zero.checkpoint: resume exactly where training stopped, refuse what
does not match; and checkpoints that can be trusted: loading never runs code
from the files (weights_only), a failed load changes nothing, and a checkpoint
counts as written only once every file and folder is on the drive and its
``complete`` marker is there."""

import json
import os
import zlib

import pytest
import torch

import aio.zero
from aio.swap import OptimizerSwapper
from aio.train import build_gpt

from .common import H, L, S, V, W, cfg_for, gpt, loss_of, train_engine

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class _Evil:
    """Unpickling this creates the file `path`: stands for any code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _crc(path):
    with open(path, "rb") as f:
        return zlib.crc32(f.read())


def _replace(path, obj):
    """What an attacker who can write the checkpoint does: swap in a file
    and fix up the size listed in every enclosing ``complete`` marker."""
    torch.save(obj, path)
    _remark(path)


def _remark(path):
    """Fix up every ``complete`` marker enclosing `path` after it changed."""
    d = os.path.dirname(path)
    while os.path.exists(os.path.join(d, "latest")) is False and d != "/":
        marker = os.path.join(d, "complete")
        if os.path.exists(marker):
            with open(marker) as f:
                m = json.load(f)
            m["files"] = {rel: os.path.getsize(os.path.join(d, rel)) for rel in m["files"]}
            m["crc32"] = {rel: _crc(os.path.join(d, rel)) for rel in m.get("crc32", {})}
            with open(marker, "w") as f:
                json.dump(m, f)
        d = os.path.dirname(d)


@pytest.mark.parametrize(
    "param,opt,victim",
    [
        ("nvme", "nvme", "client_state.pt"),
        ("nvme", "nvme", "optimizer/scalars.pt"),
        ("cpu", "cpu", "optimizer/optimizer.pt"),
        ("cpu", "cpu", "params/params.pt"),
    ],
)
def test_tampered_pickle_does_not_run(tmp_path, param, opt, victim):
    ckpt = tmp_path / "ckpt"
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a", param, opt)) as engine:
        train_engine(engine, 1)
        path = engine.save_checkpoint(str(ckpt))
        ran = tmp_path / "code-ran"
        _replace(os.path.join(path, victim), {"x": _Evil(str(ran))})
        with pytest.raises(ValueError, match="refusing to load"):
            engine.load_checkpoint(str(ckpt))
        assert not ran.exists()


def _tamper(path, what):
    """Change one saved value of the checkpoint at `path` as `what` says."""
    if what == "scaler":
        f = os.path.join(path, "engine.json")
        with open(f) as fh:
            meta = json.load(fh)
        meta["scaler"]["scale"] = "big"
        with open(f, "w") as fh:
            json.dump(meta, fh)
        _remark(f)
        return
    if what == "group lr":
        f = os.path.join(path, "schedule.pt")
        state = torch.load(f, weights_only=True)
        state["param_groups"][0]["lr"] = "oops"
        return _replace(f, state)
    f = os.path.join(path, "optimizer", "optimizer.pt")
    saved = torch.load(f, weights_only=True)
    if what == "master dtype":
        saved["master"][0] = saved["master"][0].double()
    elif what == "no state":
        del saved["optimizer"]["state"]
    elif what == "state shape":
        st = next(iter(saved["optimizer"]["state"].values()))
        st["exp_avg"] = st["exp_avg"][:1]
    else:
        saved["optimizer"]["param_groups"][0]["betas"] = 0.9
    _replace(f, saved)


@pytest.mark.parametrize(
    "what", ["scaler", "group lr", "master dtype", "no state", "state shape", "betas a number"]
)
def test_a_malformed_value_in_a_checkpoint_is_refused_before_anything_changes(tmp_path, what):
    """Values of the wrong kind (a loss scale that is a string, an lr that is
    one, master weights in float64, an optimizer state missing or of another
    shape, betas that are no pair) are a ValueError at load, raised before
    anything changes: training goes on as if no load had been tried (they
    were applied, and failed in the next step or corrupted it)."""
    extra = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}} if what == "scaler" else {}
    opt = "nvme" if what in ("scaler", "group lr") else "cpu"
    ckpt = tmp_path / "ckpt"
    cfg = cfg_for(tmp_path / "a", "cpu", opt, **extra)
    with aio.zero.initialize(gpt(), cfg) as engine:
        train_engine(engine, 1)
        path = engine.save_checkpoint(str(ckpt))
        _tamper(path, what)
        with pytest.raises(ValueError):
            engine.load_checkpoint(str(ckpt))
        got = train_engine(engine, 2, start=1)
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "b", "cpu", opt, **extra)) as engine:
        train_engine(engine, 1)
        want = train_engine(engine, 2, start=1)
    assert got == want


def test_client_state_must_be_plain_data(tmp_path):
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a", "cpu", "cpu")) as engine:
        train_engine(engine, 1)
        with pytest.raises(TypeError, match="client_state"):
            engine.save_checkpoint(str(tmp_path / "c"), client_state={"x": _Evil("/nonexistent")})
        assert not (tmp_path / "c" / "global_step1").exists()
        ok = {"epoch": 3, "lr": [1e-3, 2e-3], "rng": torch.arange(4), "name": "run", "n": None}
        engine.save_checkpoint(str(tmp_path / "c"), client_state=ok)
        _, client = engine.load_checkpoint(str(tmp_path / "c"))
    assert client.keys() == ok.keys() and torch.equal(client["rng"], ok["rng"])


def _files(top):
    out = {}
    for d, _, fs in os.walk(top):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), top)] = fh.read()
    return out


def _damage_last_file(path, opt):
    if opt == "nvme":
        last = max(
            (f for f in os.listdir(os.path.join(path, "optimizer")) if f.startswith("subgroup_")),
            key=lambda f: int(f[len("subgroup_") : -len(".bin")]),
        )
        with open(os.path.join(path, "optimizer", last), "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))  # same size: only its checksum can tell
        return OSError, "checksum"
    with open(os.path.join(path, "optimizer", "optimizer.pt"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    return ValueError, "optimizer.pt has"


@pytest.mark.parametrize("param,opt", [("nvme", "nvme"), ("cpu", "cpu")])
def test_failed_load_leaves_state_intact(tmp_path, param, opt):
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "drive", param, opt)) as engine:
        train_engine(engine, 2)
        a = engine.save_checkpoint(str(tmp_path / "a"))
        train_engine(engine, 2, start=2)
        engine.save_checkpoint(str(tmp_path / "b"))  # state B, for comparison
        exc, what = _damage_last_file(a, opt)
        with pytest.raises(exc, match=what):
            engine.load_checkpoint(str(tmp_path / "a"))
        assert engine.global_steps == 4
        engine.save_checkpoint(str(tmp_path / "c"), tag="global_step4")
        assert _files(tmp_path / "c") == _files(tmp_path / "b")  # exactly B, nothing of A
        more = train_engine(engine, 1, start=4)
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "drive2", param, opt)) as engine:
        engine.load_checkpoint(str(tmp_path / "b"))
        assert train_engine(engine, 1, start=4) == more


@pytest.mark.parametrize("victim", ["params/params.pt", "optimizer/optimizer.pt", "engine.json"])
def test_flipped_byte_in_plain_file_is_refused(tmp_path, victim):
    # Same size, one bit of a weight changed: only a checksum notices.
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "drive", "cpu", "cpu")) as engine:
        train_engine(engine, 1)
        path = engine.save_checkpoint(str(tmp_path / "c"))
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        target = os.path.join(path, victim)
        data = bytearray(open(target, "rb").read())
        data[len(data) // 2] ^= 0x40
        open(target, "wb").write(bytes(data))
        with pytest.raises(ValueError, match="checksum"):
            engine.load_checkpoint(str(tmp_path / "c"))
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_checkpoint_without_marker_is_refused(tmp_path):
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "drive")) as engine:
        train_engine(engine, 1)
        path = engine.save_checkpoint(str(tmp_path / "c"))
        os.unlink(os.path.join(path, "complete"))
        with pytest.raises(ValueError, match="not a complete checkpoint"):
            engine.load_checkpoint(str(tmp_path / "c"))
        os.unlink(os.path.join(path, "optimizer", "complete"))
        with pytest.raises(ValueError, match="not a complete checkpoint"):
            engine.opt.import_checkpoint(os.path.join(path, "optimizer"))


def test_every_file_and_folder_is_fsynced_marker_last(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        return real(fd)

    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "drive")) as engine:
        train_engine(engine, 1)
        monkeypatch.setattr(os, "fsync", spy)
        path = engine.save_checkpoint(str(tmp_path / "save" / "c"))
        monkeypatch.undo()

    def key(p):
        st = os.lstat(p)
        return (st.st_dev, st.st_ino)

    # the parents of the new folders save/ and save/c/ (both made by save_checkpoint)
    need = {key(tmp_path), key(tmp_path / "save"), key(tmp_path / "save" / "c")}
    for d, dirs, fs in os.walk(path):
        need |= {key(os.path.join(d, n)) for n in dirs + fs}
    need.add(key(path))
    need.add(key(os.path.join(tmp_path, "save", "c", "latest")))
    missing = [k for k in need if k not in synced]
    assert not missing, f"{len(missing)} of {len(need)} files/folders never fsynced"
    marker = synced.index(key(os.path.join(path, "complete")))
    data = [key(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs if f != "complete"]
    assert all(synced.index(k) < marker for k in data)  # the marker is written last


def test_swapper_import_failure_keeps_state(tmp_path):
    sizes = [5000, 7000, 3000]
    g = torch.Generator().manual_seed(0)

    def step(s):
        for i, n in enumerate(sizes):
            s.write_gradient(i, torch.randn(n, generator=g), async_op=False)
        s.step()

    with OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-2}, buffer_count=4) as s:
        for i, n in enumerate(sizes):
            s.register_subgroup(i, n)
            s.initialize(i, torch.randn(n, generator=g))
        step(s)
        s.export_checkpoint(str(tmp_path / "a"))
        step(s)
        step(s)
        s.export_checkpoint(str(tmp_path / "b"))
        before = [s.read_master(i) for i in range(len(sizes))]
        last = tmp_path / "a" / f"subgroup_{len(sizes) - 1}.bin"
        data = bytearray(last.read_bytes())
        data[10] ^= 1
        last.write_bytes(bytes(data))
        with pytest.raises(OSError, match="checksum"):
            s.import_checkpoint(str(tmp_path / "a"))
        assert all(torch.equal(s.read_master(i), t) for i, t in enumerate(before))
        assert s.steps == 3 and s.broken is None
        s.export_checkpoint(str(tmp_path / "c"))
    assert _files(tmp_path / "c") == _files(tmp_path / "b")


@pytest.mark.parametrize("param,opt", [("nvme", "nvme"), ("cpu", "cpu")])
def test_checkpoint_resume_matches_uninterrupted(tmp_path, reference, param, opt):
    ckpt = tmp_path / "ckpt"
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a", param, opt)) as engine:
        first = train_engine(engine, 10)
        path = engine.save_checkpoint(str(ckpt), client_state={"epoch": 3})
    assert os.path.basename(path) == "global_step10"
    assert (ckpt / "latest").read_text() == "global_step10"
    # A fresh model with different initial weights: everything must come from the checkpoint.
    torch.manual_seed(123)
    model = build_gpt(V, W, L, H, S)
    with aio.zero.initialize(model, cfg_for(tmp_path / "b", param, opt)) as engine:
        _, client = engine.load_checkpoint(str(ckpt))
        assert client == {"epoch": 3} and engine.global_steps == 10
        second = train_engine(engine, 10, start=10)
    assert first + second == reference


def test_checkpoint_refuses_mid_accumulation_and_mismatched_model(tmp_path):
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a")) as engine:
        engine.backward(loss_of(engine, 0, 0))
        engine.step()  # micro-step 1 of 2
        with pytest.raises(ValueError, match="accumulation"):
            engine.save_checkpoint(str(tmp_path / "c"))
        engine.backward(loss_of(engine, 0, 1))
        engine.step()
        engine.save_checkpoint(str(tmp_path / "c"))
    torch.manual_seed(0)
    other = build_gpt(V, W, L + 1, H, S)
    with aio.zero.initialize(other, cfg_for(tmp_path / "b")) as engine:
        with pytest.raises(ValueError, match="do not match"):
            engine.load_checkpoint(str(tmp_path / "c"))


def test_latest_is_never_written_through_a_planted_name(tmp_path):
    """R3-01: in a shared checkpoint folder another user plants the names a
    save would use as symlinks to a victim file; the save writes none of
    them, and ``latest`` ends up a regular file naming the new tag."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    ckpt = tmp_path / "shared"
    ckpt.mkdir()
    for pid in range(os.getpid() - 5, os.getpid() + 5):  # the old predictable names
        (ckpt / f".latest.tmp-{pid}").symlink_to(victim)
    (ckpt / "latest").symlink_to(victim)
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a", "cpu", "cpu")) as engine:
        train_engine(engine, 1)
        engine.save_checkpoint(str(ckpt))
        assert victim.read_text() == "precious"
        assert not (ckpt / "latest").is_symlink() and (ckpt / "latest").read_text() == "global_step1"
        left = [p for p in os.listdir(ckpt) if p.startswith(".latest.") and not p.startswith(".latest.tmp-")]
        assert left == [], "the temporary file became `latest`"
        engine.load_checkpoint(str(ckpt))
        os.replace(ckpt / "latest", ckpt / "moved")
        (ckpt / "latest").symlink_to(ckpt / "moved")  # a symlinked pointer is refused on load
        with pytest.raises(PermissionError, match="symlink"):
            engine.load_checkpoint(str(ckpt))


@pytest.mark.parametrize("tag", ["best\n", " best", "best ", "latest", ".hidden", "a/b", "", "x\ty", "\x7f"])
def test_ambiguous_tags_are_refused_before_writing(tmp_path, tag):
    """R3-03/R3-05: a tag that ``latest`` could not name exactly (or that is
    ``latest`` itself) is refused at save, nothing written; loading by such
    a tag, or a ``latest`` naming one, is refused too (never another
    checkpoint)."""
    ckpt = tmp_path / "c"
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a", "cpu", "cpu")) as engine:
        train_engine(engine, 1)
        with pytest.raises(ValueError, match="bad checkpoint tag"):
            engine.save_checkpoint(str(ckpt), tag=tag)
        assert not ckpt.exists() or os.listdir(ckpt) == []
        engine.save_checkpoint(str(ckpt), tag="best")
        with pytest.raises(ValueError, match="bad checkpoint tag"):
            engine.load_checkpoint(str(ckpt), tag=tag)
        if tag and tag.rstrip("\n") != "best":  # "best\n" in `latest` is "best" (an editor's newline)
            (ckpt / "latest").write_text(tag)
            with pytest.raises(ValueError, match="bad checkpoint tag"):
                engine.load_checkpoint(str(ckpt))
        (ckpt / "latest").write_text("best\n")  # an editor's newline is fine
        engine.load_checkpoint(str(ckpt))


# -- found by a review of the checkpoint code (each failed before its fix) ------------------


def _realigned_after_load(tmp_path, name, pretrain):
    """Micro-steps of the first window after loading a gas=2 checkpoint into a
    gas=3 trainer, and the parameters after it."""
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / name, "cpu", "cpu", gas=3)) as e:
        if pretrain:
            train_engine(e, 1, gas=3)  # leaves a gradient in the buffers
        e.load_checkpoint(str(tmp_path / "ck"))
        assert e.micro_steps % e.gas == 0
        g0, n = e.global_steps, 0
        while e.global_steps == g0:
            e.backward(loss_of(e, 10, n))
            e.step()
            n += 1
        return n, e.state_dict()


def test_another_accumulation_count_on_resume_starts_a_whole_window(tmp_path):
    """Saved at gradient_accumulation_steps 2, loaded at 3: the first window
    after loading has 3 micro-steps from zeroed gradients, whatever the
    trainer did before loading (it used to start mid-window and add onto the
    gradient left in the buffers)."""
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a", "cpu", "cpu", gas=2)) as e:
        train_engine(e, 2, gas=2)
        e.save_checkpoint(str(tmp_path / "ck"))
    n1, s1 = _realigned_after_load(tmp_path, "b", pretrain=False)
    n2, s2 = _realigned_after_load(tmp_path, "c", pretrain=True)
    assert n1 == n2 == 3
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_scheduler_of_another_kind_is_refused_before_anything_changes(tmp_path):
    step_lr = lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5)  # noqa: E731
    constant = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0)  # noqa: E731
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a", "cpu", "cpu"), lr_scheduler=step_lr) as e:
        train_engine(e, 2)
        e.save_checkpoint(str(tmp_path / "ck"))
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "b", "cpu", "cpu"), lr_scheduler=constant) as e:
        train_engine(e, 1)
        before, steps = e.state_dict(), e.global_steps
        with pytest.raises(ValueError, match="LambdaLR"):
            e.load_checkpoint(str(tmp_path / "ck"))
        after = e.state_dict()
        assert e.global_steps == steps and all(torch.equal(before[k], after[k]) for k in before)


def test_checkpoint_of_another_optimizer_is_refused(tmp_path):
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a", "cpu", "cpu")) as e:
        train_engine(e, 1)
        e.save_checkpoint(str(tmp_path / "ck"))
    c = cfg_for(tmp_path / "b", "cpu", "cpu")
    c["optimizer"] = {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}
    with aio.zero.initialize(gpt(), c) as e, pytest.raises(ValueError, match="saved with optimizer"):
        e.load_checkpoint(str(tmp_path / "ck"))


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))


def _bn_loss(engine, step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    return engine(torch.randn(4, 8, generator=g) * 3 + 1).square().mean()


@pytest.mark.parametrize("drive", ["cpu", "nvme"])
def test_module_buffers_are_in_the_checkpoint(tmp_path, drive):
    """BatchNorm's running statistics come back with the parameters (they
    used to be the fresh model's: resume was not exact)."""
    with aio.zero.initialize(_bn_model(), cfg_for(tmp_path / "a", drive, drive)) as e:
        train_engine(e, 3, loss_fn=_bn_loss)
        e.save_checkpoint(str(tmp_path / "ck"))
        saved = e.state_dict()
    with aio.zero.initialize(_bn_model(), cfg_for(tmp_path / "b", drive, drive)) as e:
        e.load_checkpoint(str(tmp_path / "ck"))
        got = e.state_dict()
    assert [k for k in saved if not torch.equal(saved[k], got[k])] == []
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    other[1] = torch.nn.BatchNorm1d(16, track_running_stats=False)  # same parameters, no buffers
    with aio.zero.initialize(other, cfg_for(tmp_path / "c", drive, drive)) as e:
        with pytest.raises(ValueError, match="module buffers"):
            e.load_checkpoint(str(tmp_path / "ck"))


def test_save_after_a_backward_whose_step_has_not_run_is_refused(tmp_path):
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a", "cpu", "cpu", gas=1)) as e:
        train_engine(e, 1, gas=1)
        e.backward(loss_of(e, 1, 0))
        with pytest.raises(ValueError, match="accumulation"):
            e.save_checkpoint(str(tmp_path / "ck"))
        e.step()
        e.save_checkpoint(str(tmp_path / "ck"))


def test_engine_optimizer_state_dict_is_refused_not_empty(tmp_path):
    """engine.optimizer is a torch optimizer for schedulers; its state dict
    would lack the offloaded state (and loading one unshared the param groups
    from the user's optimizer): both say to use the engine's checkpoints."""
    with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a", "cpu", "cpu")) as e:
        train_engine(e, 1)
        with pytest.raises(RuntimeError, match="save_checkpoint"):
            e.optimizer.state_dict()
        with pytest.raises(RuntimeError, match="load_checkpoint"):
            e.optimizer.load_state_dict({"state": {}, "param_groups": []})


def test_checkpoint_folder_is_private_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        with aio.zero.initialize(gpt(), cfg_for(tmp_path / "a", "cpu", "cpu")) as e:
            train_engine(e, 1)
            path = e.save_checkpoint(str(tmp_path / "ck"))
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o700


def test_same_kind_takes_what_a_save_gives_back():
    """The kinds checked on load (aio._args.same_kind): numbers for numbers,
    a float lr where the optimizer was built with a tensor one (set_lr writes
    floats), tuples for lists of the same length, None or a bool for None."""
    from aio._args import same_kind

    assert same_kind(torch.tensor(1e-3), 2e-3) and same_kind(1e-3, torch.tensor(2e-3)) and same_kind(1, 0.5)
    assert same_kind((0.9, 0.999), [0.8, 0.99]) and same_kind(None, True) and same_kind(None, None)
    assert not same_kind(1e-3, "1e-3") and not same_kind(0.9, True) and not same_kind((0.9, 0.999), 0.9)
    assert not same_kind((0.9, 0.999), (0.9,)) and not same_kind(1e-3, None)
    assert not same_kind(torch.tensor([1.0, 2.0]), 1.0)
