"""Multi-rank cases for tests/optim/test_distributed.py, run as a script:
``python dist_worker.py WORLD OUTDIR CASE...``. Each rank joins one gloo
group (spawned here), runs every case in order and writes
``OUTDIR/<case>.rank<r>.json`` before the next: the results are judged from
those files, never from the exit status (gloo may abort at teardown).

Every case trains the same tiny model twice on the same engine, once with
torch.optim.AdamW(foreach=False) and once with aio's optimizer, and reports
whether losses and full parameters are bit-identical (torch.equal). The
parameters are float32 on the CPU here, so NVMeAdamW's default (``master=
"auto"``) keeps its master weights in them; so that the drive mode keeps
its coverage, every engine case runs aio's optimizer twice in the same
process group, with ``"auto"`` (which must pick ``"params"``) and with
``"drive"`` (torch's reference once), and checks ``master_mode``."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 4
LR = 1e-2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 63 and 65 rows: uneven shards on 2 and 3 ranks; 2 rows: a rank with none on 3.
    return torch.nn.Sequential(
        torch.nn.Linear(12, 63),
        torch.nn.ReLU(),
        torch.nn.Linear(63, 65),
        torch.nn.ReLU(),
        torch.nn.Linear(65, 2),
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 12, generator=g), torch.randn(4, 2, generator=g)


def _fsdp2(model: torch.nn.Module, offload: bool = False, bf16: bool = False) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw: dict = {"mesh": mesh}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.children():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kw)
    return fully_shard(model, **kw)


def _groups(model: torch.nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": LR / 2},
    ]


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def _train(model, opt, steps, rank, start=0, sched=None, clip=False) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        opt.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if sched is not None:
            sched.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item())
    return losses


def _nvme(params, tmp, rank, **kw):
    from aio.optim import NVMeAdamW

    return NVMeAdamW(params, lr=LR, nvme_path=os.path.join(tmp, "drive"), match_torch=True, **kw)


def _torch(params, **kw):
    return torch.optim.AdamW(params, lr=LR, foreach=False, **kw)


# (master asked for, the master_mode it must give): under gloo every parameter
# is float32 on the CPU, so "auto" picks "params"; "drive" is asked for by name.
MASTERS = (("auto", "params"), ("drive", "drive"))


def _compare(
    build, make_torch, make_aio, rank, steps=STEPS, sched=False, clip=False, masters=MASTERS
) -> dict:
    """Train build() with torch's AdamW once and with aio's under each
    master (``make_aio(model, master)``); the verdict, bit-identical and in
    the expected ``master_mode`` (``expected`` None: no such attribute)."""

    def run(make):
        model = build()
        opt = make(model)
        lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3)) if sched else None
        return _train(model, opt, steps, rank, sched=lam, clip=clip), _full(model), opt

    lt, pt, _ = run(make_torch)
    res: dict = {"losses_torch": lt, "modes": {}, "equal": True}
    for master, expected in masters:
        la, pa, opt = run(lambda m, master=master: make_aio(m, master))
        res["equal"] &= _verdict(res, master, expected, opt, la == lt and all(map(torch.equal, pt, pa)))
        res[f"losses_{master}"] = la
    return res


def _verdict(res: dict, master, expected, opt, same: bool) -> bool:
    """Record `opt`'s master_mode under `master` (closing it); whether the
    run was the same as torch's in the expected mode."""
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer's local optimizer
    mode = getattr(inner, "master_mode", None)
    res["modes"][str(master)] = mode
    if hasattr(inner, "close"):
        inner.close()
    return same and mode == expected


def _plain(tmp, rank):
    """torch's AdamW and aio's (given its master) over model.parameters()."""
    return (
        lambda m: _torch(m.parameters()),
        lambda m, master: _nvme(m.parameters(), tmp, rank, master=master),
    )


def case_fsdp2(rank, tmp):
    return _compare(lambda: _fsdp2(_model()), *_plain(tmp, rank), rank)


def case_fsdp2_offload(rank, tmp):
    return _compare(lambda: _fsdp2(_model(), offload=True), *_plain(tmp, rank), rank)


def case_tier_master(rank, tmp):
    """With aio.fsdp's parameter tier: master="auto" keeps the master weights
    on the drive, where the tier reads the parameters from; master="params"
    warns and the tier keeps its own copy (params_from_master off). Both
    bit-identical to torch."""
    import warnings

    from aio.fsdp import offload_params

    out = {}
    for master in ("auto", "params"):
        model = _fsdp2(_model())
        opt = _nvme(model.parameters(), tmp, rank, master=master)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tier = offload_params(model, os.path.join(tmp, "drive"), opt)
        losses = _train(model, opt, STEPS, rank)
        with tier.resident(modified=False):
            full = _full(model)
        warned = any("params_from_master" in str(w.message) for w in caught)
        out[master] = (losses, full, opt.master_mode, tier.stats()["params_from_master"], warned)
        tier.close()
        opt.close()
    ref = _fsdp2(_model())
    lt = _train(ref, _torch(ref.parameters()), STEPS, rank)
    pt = _full(ref)
    equal = all(ls == lt and all(map(torch.equal, p, pt)) for ls, p, *_ in out.values())
    return {"equal": equal, "modes": {m: v[2:] for m, v in out.items()}}


def case_fsdp2_bf16(rank, tmp):
    return _compare(lambda: _fsdp2(_model(), offload=True, bf16=True), *_plain(tmp, rank), rank)


def case_cpu_adamw_dtensor(rank, tmp):
    from aio.optim import CPUAdamW

    return _compare(
        lambda: _fsdp2(_model(), offload=True),
        lambda m: _torch(m.parameters()),
        lambda m, _: CPUAdamW(m.parameters(), lr=LR, match_torch=True),
        rank,
        masters=((None, None),),  # state in memory: no master mode
    )


def case_groups_lambda_clip(rank, tmp):
    return _compare(
        lambda: _fsdp2(_model()),
        lambda m: _torch(_groups(m)),
        lambda m, master: _nvme(_groups(m), tmp, rank, sub_group_size=700, master=master),
        rank,
        sched=True,
        clip=True,
    )


def _full_state(model: torch.nn.Module) -> dict:
    """A state_dict as of a checkpoint of an unsharded model (3 steps),
    the same on every rank."""
    g = torch.Generator().manual_seed(7)
    state = {
        k: {
            "step": torch.tensor(3.0),
            "exp_avg": 0.01 * torch.randn(p.shape, generator=g),
            "exp_avg_sq": 1e-4 * torch.rand(p.shape, generator=g),
        }
        for k, p in enumerate(model.parameters())
    }
    return {"state": state, "param_groups": [{**_torch(model.parameters()).state_dict()["param_groups"][0]}]}


def _sharded_state(sd: dict, params: list) -> dict:
    """`sd` (whole tensors) for torch's AdamW over FSDP2's DTensor `params`."""
    from torch.distributed.tensor import distribute_tensor

    def cut(t, p):  # each rank its own chunk of the same whole tensor: no communication
        return distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)

    state = {
        k: {n: v if n == "step" else cut(v, params[k]) for n, v in st.items()}
        for k, st in sd["state"].items()
    }
    return {**sd, "state": state}


def case_accelerate_swap(rank, tmp):
    """Accelerate/Trainer: the optimizer is built over the unsharded model,
    which is sharded afterwards and its parameters swapped in param_groups:
    as is ("swap"), after AcceleratedOptimizer's reload of its own empty
    state ("reload"), and after a checkpoint loaded into it before the
    reload ("loaded": the whole tensors' state cut to each rank's shards)."""
    refs = {}
    for loaded in (False, True):
        model_t = _fsdp2(_model())
        opt_t = _torch(model_t.parameters())
        if loaded:
            opt_t.load_state_dict(_sharded_state(_full_state(_model()), list(model_t.parameters())))
        refs[loaded] = (_train(model_t, opt_t, STEPS, rank), _full(model_t))
    res: dict = {"losses_torch": refs[False][0], "modes": {}, "equal": True}
    for variant in ("swap", "reload", "loaded"):
        lt, pt = refs[variant == "loaded"]
        for master, expected in MASTERS:
            model = _model()
            opt = _nvme(model.parameters(), tmp, rank, master=master)  # before sharding
            if variant == "loaded":
                opt.load_state_dict(_full_state(model))  # laid out on the whole tensors
            if variant != "swap":
                opt.load_state_dict(opt.state_dict())  # as AcceleratedOptimizer.__init__
            sharded = _fsdp2(model)
            opt.param_groups[0]["params"] = list(sharded.parameters())  # fsdp2_switch_optimizer_parameters
            la = _train(sharded, opt, STEPS, rank)
            same = la == lt and all(map(torch.equal, pt, _full(sharded)))
            res["equal"] &= _verdict(res, master, expected, opt, same)
            res[f"equal_{variant}_{master}"] = same
    return res


def case_no_hidden_step(rank, tmp):
    """get_optimizer_state_dict leaves state, step and parameters alone and
    gives torch's AdamW state, bit for bit."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def run(opt_of):
        model = _fsdp2(_model())
        opt = opt_of(model)
        _train(model, opt, 2, rank)
        before = _full(model)
        opt.zero_grad(set_to_none=True)  # as after a training step: no gradients
        osd1 = get_optimizer_state_dict(model, opt)
        osd2 = get_optimizer_state_dict(model, opt)
        return osd1, osd2, all(map(torch.equal, before, _full(model))), opt

    t1 = run(lambda m: _torch(m.parameters()))[0]
    res: dict = {"modes": {}, "equal": True, "steps": [], "params_same": True, "state_match": True}
    for master, expected in MASTERS:
        a1, a2, same, opt = run(lambda m, master=master: _nvme(m.parameters(), tmp, rank, master=master))
        steps = sorted({float(s["step"]) for s in a2["state"].values()})
        match = set(t1["state"]) == set(a1["state"]) and all(
            torch.equal(_local(t1["state"][k][n]), _local(a1["state"][k][n]))
            and torch.equal(_local(a1["state"][k][n]), _local(a2["state"][k][n]))
            for k in t1["state"]
            for n in ("step", "exp_avg", "exp_avg_sq")
        )
        res["steps"] = sorted(set(res["steps"]) | set(steps))
        res["params_same"] &= same
        res["state_match"] &= match
        res["equal"] &= _verdict(res, master, expected, opt, same and match and steps == [2.0])
    return res


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _ckpt_run(kind, rank, tmp, load_from=None, save_to=None, steps=3, start=0):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _fsdp2(_model())
    if kind == "torch":
        opt = _torch(model.parameters())
    else:
        opt = _nvme(model.parameters(), tmp, rank, master="drive" if kind == "aio-drive" else "auto")
    if load_from:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=load_from)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = _train(model, opt, steps, rank, start=start)
    if save_to:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=save_to)
    full = _full(model)
    if hasattr(opt, "close"):
        opt.close()
    return losses, full


CKPT_KINDS = ("torch", "aio", "aio-drive")  # aio: master weights in the parameters here


def case_dcp_save(rank, tmp):
    """3 steps, then a DCP save, by torch's AdamW and by aio's (both masters)."""
    out = {}
    for kind in CKPT_KINDS:
        out[kind] = _ckpt_run(kind, rank, tmp, save_to=os.path.join(tmp, f"ckpt_{kind}"))
    return {"equal": out["torch"][0] == out["aio"][0] == out["aio-drive"][0], "losses": out["aio"][0]}


def case_dcp_load(rank, tmp):
    """Load the checkpoints the 2-rank group saved (resharded to this
    world), 3 more steps: aio from aio's and from torch's (interchange),
    torch from torch's and from aio's, aio with either master from a
    checkpoint of the other -- all bit-identical."""
    pairs = [(k, s) for k in ("torch", "aio") for s in ("torch", "aio")]
    pairs += [("aio-drive", "aio"), ("aio", "aio-drive")]
    runs = {
        (kind, src): _ckpt_run(kind, rank, tmp, load_from=os.path.join(tmp, f"ckpt_{src}"), start=3)
        for kind, src in pairs
    }
    ref_l, ref_p = runs[("torch", "torch")]
    equal = all(ls == ref_l and all(map(torch.equal, p, ref_p)) for ls, p in runs.values())
    return {"equal": equal, "losses": {f"{k}<-{s}": v[0] for (k, s), v in runs.items()}}


def _stream_run(
    kind, rank, tmp, load_from=None, save_to=None, steps=3, start=0, streamed_load=True, fail=False
):
    """_ckpt_run with NVMeAdamW's streamed DCP save (always) and load
    (unless `streamed_load` is False: DCP's default load of the
    checkpoint): the moments one parameter at a time, through
    streamed_state() and aio.optim's planners. Small sub-groups: a
    parameter's local moment spans several, a resharded checkpoint's
    pieces cross them. `fail`: the first streamed load fails on rank 1
    between two pieces of a moment (every rank sees it fail), then is
    retried with the same state dict in the same block."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from aio.optim import DriveLoadPlanner, DriveSavePlanner

    model = _fsdp2(_model())
    master = "drive" if kind == "aio-drive" else "auto"
    opt = _nvme(model.parameters(), tmp, rank, master=master, sub_group_size=STREAM_SUB_GROUP)
    if load_from:
        with opt.streamed_state() if streamed_load else _nothing():
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            if fail and not _failed_load(state, load_from, rank):
                raise RuntimeError("the injected failure of the streamed load did not happen")
            planner = DriveLoadPlanner() if streamed_load else None
            dcp.load(state, checkpoint_id=load_from, planner=planner)  # after `fail`: the retry
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = _train(model, opt, steps, rank, start=start)
    if save_to:
        with opt.streamed_state():
            msd, osd = get_state_dict(model, opt)
            writer = FileSystemWriter(save_to, single_file_per_rank=False)
            dcp.save({"model": msd, "optim": osd}, storage_writer=writer, planner=DriveSavePlanner())
    full = _full(model)
    opt.close()
    return losses, full


STREAM_SUB_GROUP = 300  # elements: the 2-rank shards of the first two weights span 2 and 7 sub-groups


def _failed_load(state, load_from, rank) -> bool:
    """A streamed load failing on rank 1 after its 3rd placeholder piece
    (rank 1 of 3 takes each moment of the first weight in two pieces from
    the 2-rank checkpoint); True once every rank saw it fail."""
    import torch.distributed.checkpoint as dcp

    from aio.optim import DriveLoadPlanner

    class Failing(DriveLoadPlanner):
        committed = 0

        def commit_tensor(self, read_item, tensor):
            super().commit_tensor(read_item, tensor)
            if read_item.dest_index.fqn in self.drive:
                self.committed += 1
                if rank == 1 and self.committed == 3:
                    raise OSError(5, "Input/output error (injected)")

    try:
        dcp.load(state, checkpoint_id=load_from, planner=Failing())
    except BaseException as e:  # DCP's CheckpointException (a BaseException), on every rank
        return "injected" in str(e)
    return False


def _nothing():
    import contextlib

    return contextlib.nullcontext()


STREAM_KINDS = ("aio", "aio-drive")


def case_dcp_stream_save(rank, tmp):
    """3 steps, then a streamed DCP save (FSDP2 DTensor moments read from
    the drive one parameter at a time), with either master: the same losses
    as torch's AdamW, and the checkpoint what torch's is: torch's AdamW
    resumed from it (DCP's default load) goes on as from torch's own."""
    lt = _ckpt_run("torch", rank, tmp, save_to=os.path.join(tmp, "ckpt_stream_ref"))[0]
    out = {
        kind: _stream_run(kind, rank, tmp, save_to=os.path.join(tmp, f"ckpt_stream_{kind}"))
        for kind in STREAM_KINDS
    }
    ref = _ckpt_run("torch", rank, tmp, load_from=os.path.join(tmp, "ckpt_stream_ref"), steps=2, start=3)
    resumed = [
        _ckpt_run("torch", rank, tmp, load_from=os.path.join(tmp, f"ckpt_stream_{kind}"), steps=2, start=3)
        for kind in STREAM_KINDS
    ]
    same = all(ls == ref[0] and all(map(torch.equal, p, ref[1])) for ls, p in resumed)
    return {"equal": same and all(ls == lt for ls, _ in out.values()), "losses": out["aio"][0]}


def case_dcp_stream_load(rank, tmp):
    """The 2-rank checkpoints resharded to this world, 3 more steps: a
    streamed load (either master) of the streamed checkpoints, of aio's
    default one and of torch's; one failing on rank 1 between two pieces
    of a moment, retried in the same block; DCP's default load of a
    streamed checkpoint into aio's and torch's optimizers -- all
    bit-identical to torch's AdamW resumed from torch's checkpoint. Then a
    streamed save on this world (the last weight's 2 rows: a rank with a
    0-element moment) resumes torch's AdamW as torch's own checkpoint does."""
    ref_l, ref_p = _ckpt_run(
        "torch",
        rank,
        tmp,
        load_from=os.path.join(tmp, "ckpt_torch"),
        start=3,
        save_to=os.path.join(tmp, "ck3_torch"),
    )
    ck = {src: os.path.join(tmp, f"ckpt_{src}") for src in ("stream_aio", "stream_aio-drive", "aio", "torch")}
    runs = {}
    for kind in STREAM_KINDS:
        for src in ck:
            runs[(kind, src, "streamed")] = _stream_run(kind, rank, tmp, load_from=ck[src], start=3)
        runs[(kind, "stream_aio", "retried")] = _stream_run(
            kind, rank, tmp, load_from=ck["stream_aio"], start=3, fail=True,
            save_to=os.path.join(tmp, f"ck3_{kind}"),
        )  # fmt: skip
    runs[("aio", "stream_aio", "default")] = _stream_run(
        "aio", rank, tmp, load_from=ck["stream_aio"], start=3, streamed_load=False
    )
    runs[("torch", "stream_aio-drive", "default")] = _ckpt_run(
        "torch", rank, tmp, load_from=ck["stream_aio-drive"], start=3
    )
    equal = all(ls == ref_l and all(map(torch.equal, p, ref_p)) for ls, p in runs.values())
    ref2 = _ckpt_run("torch", rank, tmp, load_from=os.path.join(tmp, "ck3_torch"), steps=2, start=6)
    for kind in STREAM_KINDS:
        got = _ckpt_run("torch", rank, tmp, load_from=os.path.join(tmp, f"ck3_{kind}"), steps=2, start=6)
        runs[("torch", f"ck3_{kind}", "default")] = got
        equal = equal and got[0] == ref2[0] and all(map(torch.equal, got[1], ref2[1]))
    return {"equal": equal, "runs": len(runs), "losses": {"<-".join(k): v[0] for k, v in runs.items()}}


def case_ddp(rank, tmp):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return _compare(lambda: DDP(_model()), *_plain(tmp, rank), rank)


def case_zero1(rank, tmp):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return _compare(
        lambda: DDP(_model()),
        lambda m: _zero("torch", m, tmp),
        lambda m, master: _zero(master, m, tmp),
        rank,
    )


def _zero(kind, model, tmp):
    """ZeroRedundancyOptimizer over `model` with torch's AdamW ("torch") or aio's (kind: its master)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as Z

    from aio.optim import NVMeAdamW

    if kind == "torch":
        return Z(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, foreach=False)
    path = os.path.join(tmp, "drive")
    return Z(
        model.parameters(), optimizer_class=NVMeAdamW, lr=LR, nvme_path=path, match_torch=True, master=kind
    )


# (kind resumed, kind whose checkpoint it loads): each from its own, and interchange.
ZERO1_RESUMES = (
    ("torch", "torch"),
    ("auto", "auto"),
    ("drive", "drive"),
    ("auto", "torch"),
    ("torch", "drive"),
)
ZERO1_MODES = {"torch": None, "auto": "params", "drive": "drive"}


def case_zero1_checkpoint(rank, tmp):
    """DDP + ZeRO-1: 2 steps, consolidate_state_dict(to=0) + state_dict()
    saved by rank 0, loaded into a fresh model and ZeRO on every rank, 2
    more: bit-identical to torch's uninterrupted run, aio from its own
    checkpoint (either master) and from torch's, torch from aio's. ZeRO's
    load_state_dict writes each rank's state straight into the local
    optimizer's state[p] and never calls its load_state_dict: NVMeAdamW
    trained on fresh moments after it, in silence (issue 44). The
    consolidated states are torch's, bit for bit; ZeRO's own copy of the
    loaded state can be dropped (aio's resumes clear it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = DDP(_model())
    lt, pt = _train(ref, _zero("torch", ref, tmp), STEPS, rank), _full(ref)
    res: dict = {"losses_torch": lt, "modes": {}, "equal": True, "state_match": True}
    first = {kind: _zero1_save(kind, rank, tmp, res) for kind in ZERO1_MODES}
    for kind, src in ZERO1_RESUMES:
        ck = torch.load(os.path.join(tmp, f"zero1_{src}.pt"))
        model = DDP(_model())
        model.module.load_state_dict(ck["model"])
        opt = _zero(kind, model, tmp)
        opt.load_state_dict(ck["optim"])
        if kind != "torch":
            opt.state.clear()  # ZeRO's own reference to the loaded state (docs/fsdp.md): unused
        la = first[src] + _train(model, opt, STEPS - 2, rank, start=2)
        same = la == lt and all(map(torch.equal, pt, _full(model)))
        res[f"equal_{kind}<-{src}"] = same
        res["equal"] &= _verdict(res, kind, ZERO1_MODES[kind], opt, same)
    del res["modes"]["torch"]
    res["equal"] &= res["state_match"]
    return res


def _zero1_save(kind, rank, tmp, res: dict) -> list[float]:
    """2 steps of DDP + ZeRO-1 with `kind`, consolidated to rank 0 and saved
    there (aio's state compared with torch's, saved first); the losses."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    opt = _zero(kind, model, tmp)
    losses = _train(model, opt, 2, rank)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        sd = opt.state_dict()
        if kind != "torch":
            ref = torch.load(os.path.join(tmp, "zero1_torch.pt"))["optim"]
            res["state_match"] &= _same_optim_state(ref, sd)
        torch.save({"model": model.module.state_dict(), "optim": sd}, os.path.join(tmp, f"zero1_{kind}.pt"))
    dist.barrier()
    if hasattr(opt.optim, "close"):
        opt.optim.close()
    return losses


def _same_optim_state(a: dict, b: dict) -> bool:
    """Whether two optimizer state_dicts hold the same step and moments, bit for bit."""
    names = ("step", "exp_avg", "exp_avg_sq")
    return set(a["state"]) == set(b["state"]) and all(
        torch.equal(a["state"][k][n], b["state"][k][n]) for k in a["state"] for n in names
    )


class _SmallFirst(torch.nn.Module):
    """A 1-element gate and 2-row layers, the gate first: on 2 ranks one
    rank holds no element of a parameter that is not the last, on 3 one
    holds no element of any."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate = torch.nn.Parameter(torch.full((1,), 0.7))
        self.inp = torch.nn.Linear(12, 2)
        self.out = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x))) * self.gate


def case_full_state(rank, tmp):
    """_SmallFirst under FSDP2: trained bit-identically, and its full
    optimizer state dict (full_state_dict=True: gathered DTensor by DTensor,
    in the state dict's order, on every rank) equal to torch's, in torch's
    order. Before: aio's state listed a parameter with no local elements
    after the others, so ranks paired different gathers (gloo aborted), and
    a rank holding nothing raised at step() while the others went on."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def run(make):
        model = _fsdp2(_SmallFirst())
        opt = make(model)
        losses = _train(model, opt, STEPS, rank)
        return losses, _full(model), get_optimizer_state_dict(model, opt, options=opts), opt

    lt, pt, st, _ = run(lambda m: _torch(m.parameters()))
    res: dict = {"modes": {}, "equal": True}
    for master, expected in MASTERS:
        la, pa, sa, opt = run(lambda m, master=master: _nvme(m.parameters(), tmp, rank, master=master))
        same = la == lt and all(map(torch.equal, pt, pa))
        if "state" in st:  # rank 0 (cpu_offload: the others get {})
            same &= _same_optim_state(st, sa) and list(st["state"]) == list(sa["state"])
        else:
            same &= sa == {}
        res["equal"] &= _verdict(res, master, expected, opt, same)
    return res


def case_fsdp1(rank, tmp):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def b():
        return FSDP(_model(), device_id=torch.device("cpu"), use_orig_params=True)

    def full(m):  # summon_full_params fails on CPU: every rank's local shards
        return [p.detach().clone() for p in m.parameters()]

    model = b()
    lt, pt = _train(model, _torch(model.parameters()), STEPS, rank), full(model)
    res: dict = {"losses_torch": lt, "modes": {}, "equal": True}
    for master, expected in MASTERS:
        model = b()
        opt = _nvme(model.parameters(), tmp, rank, master=master)
        la = _train(model, opt, STEPS, rank)
        res["equal"] &= _verdict(
            res, master, expected, opt, la == lt and all(map(torch.equal, pt, full(model)))
        )
    return res


def case_rank_folders(rank, tmp):
    """Each rank's swap files in its own folder under the per-user one,
    about 1/N of the state each (with either master)."""
    out = {}
    for master in ("params", "drive"):
        model = _fsdp2(_model())
        opt = _nvme(model.parameters(), tmp, rank, master=master)
        _train(model, opt, 1, rank)
        out[master] = opt.swap_stats()
        opt.close()
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    return {
        "equal": True,
        "swap_dir": out["params"]["swap_dir"],
        "drive_bytes": {m: st["drive_bytes"] for m, st in out.items()},
        "local": local,
        "total": total,
    }


def _worker(rank: int, world: int, out: str, cases: list[str]) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    os.makedirs(os.path.join(out, "drive"), exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    for name in cases:
        try:
            res = {"ok": True, **globals()[f"case_{name}"](rank, out)}
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            res = {"ok": False, "error": traceback.format_exc()}
        with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(res, f, default=str)
        if not res["ok"]:
            # The other ranks may be inside a collective of this case: a barrier
            # here would hang the group until the test's timeout. Leave: their
            # collective fails at once (gloo sees the peer gone) and they report.
            sys.stdout.flush()
            os._exit(3)
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    world, outdir, names = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    # Forked, not spawned: each rank would import torch, FSDP and DCP again (3-6 s of
    # CPU a rank, the CUDA build the most); this process has done only that, no group yet.
    mp.start_processes(_worker, args=(world, outdir, names), nprocs=world, join=True, start_method="fork")
