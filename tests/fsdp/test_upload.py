"""aio.fsdp.upload: device-resident shards up from the tier's pinned slot on
a side stream, under the strict CUDA simulator (tests/zero/cuda_sim.py).

Each ordering step of the design is taken out once and the simulator must
catch it: a read of the shard the host did not wait for (on the compute
stream, or on a stream that only the compute stream waited for -- FSDP's
copy-in stream), the slot given back before the copy read it, a free whose
block the side stream may reuse before the compute stream's last use.
Then the tier on the simulator: real FSDP2 training (tests/fsdp/sim_worker.py,
in a subprocess), and in this process its failure paths (a Ctrl-C or error
in a wait, a fill or close()), its staging's pinning and a gather FSDP
issued that nothing waited for."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from zero.cuda_sim import CudaSim, Hazard

from aio.fsdp.upload import ShardUploader
from aio.pinned import PinnedPool

SLOT = 1 << 13
# Two shards as the tier lays them out: (staging pos, shard, byte in shard, bytes) and FSDP's
# padding rows (shard, first byte): the second shard's last 200 bytes are padding.
SIZES = (4000, 1200)
COPIES = ((0, 0, 0, 4000), (4096, 1, 0, 1000))
ZEROS = ((1, 1000),)
SIDE_WRITE = r"is not ordered after write \(.*\) on side"  # the side stream's allocation or copy
SCHEDULES = [("lazy", 0)] + [("random", seed) for seed in range(5)]


def _staged(sim: CudaSim, pool: PinnedPool, seed: int = 0) -> tuple[object, torch.Tensor, list[torch.Tensor]]:
    """A leased slot holding the shards' bytes (as a drive read leaves it) and the expected shards."""
    g = torch.Generator().manual_seed(seed)
    lease = pool.acquire()
    staging = lease.tensor(torch.uint8)
    want = []
    for (pos, _, _, nbytes), size in zip(COPIES, SIZES, strict=True):
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        staging[pos : pos + nbytes].copy_(data)
        want.append(torch.cat([data, torch.zeros(size - nbytes, dtype=torch.uint8)]))
    return lease, staging, want


def _setup(sim: CudaSim, slots: int = 2) -> tuple[ShardUploader, PinnedPool, list[torch.Tensor]]:
    pool = PinnedPool(slots, SLOT, lock=False)
    up = ShardUploader("cuda")
    assert up.register(pool)
    shards = [sim.resizable(n // 4, torch.float32) for n in SIZES]
    up.free(shards)  # on the drive, as the tier leaves them between uses
    return up, pool, shards


def _fill(up: ShardUploader, pool: PinnedPool, sim: CudaSim, shards: list[torch.Tensor], seed: int = 0):
    lease, staging, want = _staged(sim, pool, seed)
    u = up.fill([(s, n) for s, n in zip(shards, SIZES, strict=True)], ZEROS, COPIES, staging, lease)
    return u, lease, want


def _read(sim: CudaSim, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a kernel on the current stream reads (a clone), brought to the host after it."""
    return [s.clone().view(torch.uint8).cpu() for s in shards]


@pytest.mark.parametrize("scheduler,seed", SCHEDULES)
@pytest.mark.parametrize("reader", ["compute", "copy_in"])
def test_a_landed_upload_is_read_right_on_any_stream(scheduler: str, seed: int, reader: str) -> None:
    with CudaSim(scheduler=scheduler, seed=seed) as sim:
        up, pool, shards = _setup(sim)
        for it in range(3):  # the same storage freed and filled again: the allocator's reuse rule
            u, _, want = _fill(up, pool, sim, shards, seed=it)
            up.land(u)
            stream = sim.current if reader == "compute" else sim.new_stream("copy_in")
            with sim.stream(stream):
                outs = [s.clone() for s in shards]  # FSDP's all-gather input, copied in
            # FSDP's copy-out makes the compute stream wait for the gather (no-op if the same).
            sim.current.wait_stream(stream)
            got = [o.view(torch.uint8).cpu() for o in outs]
            assert all(map(torch.equal, got, want))
            shards[0].mul_(1)  # the optimizer's step writes the shard on the compute stream
            up.free(shards)  # from the compute stream, as the tier frees a gathered group
        assert up.pending() == 0 and pool.available() == 2
        assert up.counters["uploads"] == 3 and up.counters["upload_bytes"] == 3 * 5000
    # The lazy schedule never runs the copies ahead: each landing blocked.
    if scheduler == "lazy":
        assert up.counters["upload_waits"] == 3


def test_a_read_the_host_did_not_wait_for_is_caught() -> None:
    with CudaSim(scheduler="lazy") as sim:
        up, pool, shards = _setup(sim)
        _fill(up, pool, sim, shards)
        with pytest.raises(Hazard, match=SIDE_WRITE):
            shards[0].clone()


def test_the_compute_stream_waiting_does_not_order_fsdps_copy_in_stream() -> None:
    """Why the host waits: FSDP's copy-in stream is ordered after the compute
    stream only once per iteration, so a wait of the compute stream alone
    leaves its read of the shard unordered."""
    with CudaSim(scheduler="lazy") as sim:
        up, pool, shards = _setup(sim)
        u, _, want = _fill(up, pool, sim, shards)
        sim.current.wait_event(u.event)
        assert all(map(torch.equal, _read(sim, shards), want))  # the compute stream is ordered
        with sim.stream(sim.new_stream("copy_in")), pytest.raises(Hazard, match=SIDE_WRITE):
            shards[1].clone()


def test_the_slot_is_held_until_the_copies_are_done() -> None:
    with CudaSim(scheduler="lazy") as sim:
        up, pool, shards = _setup(sim, slots=1)
        u, lease, _ = _fill(up, pool, sim, shards)
        assert pool.available() == 0 and not up.reclaim()  # the copies have not run
        assert up.reclaim(block=True) and pool.available() == 1 and u.done
        assert up.counters["upload_waits"] == 1
        up.land(u)  # the group's own wait, later: nothing left to wait for
        assert up.counters["upload_waits"] == 1
        pool.acquire().release()  # leased again (poisoned): no copy reads it any more


def test_a_slot_given_back_before_its_copies_ran_is_caught() -> None:
    with CudaSim(scheduler="lazy") as sim:
        up, pool, shards = _setup(sim, slots=1)
        _, lease, _ = _fill(up, pool, sim, shards)
        lease.release()  # what the tier did before: the copy was synchronous then
        with pytest.raises(Hazard, match="swap buffer leased again"):
            pool.acquire()


def test_a_free_the_side_stream_is_not_ordered_after_is_caught() -> None:
    """The block is the side stream's: freed after a write on the compute
    stream (the optimizer's step) without the side stream's wait, the next
    upload may write it while that write runs."""
    with CudaSim(scheduler="lazy") as sim:
        up, pool, shards = _setup(sim)
        up.land(_fill(up, pool, sim, shards)[0])
        shards[0].mul_(2)
        with pytest.raises(Hazard, match="freed"):
            shards[0].untyped_storage().resize_(0)
        up.free(shards)  # with the wait: no hazard
        up.land(_fill(up, pool, sim, shards)[0])


def test_a_failed_fill_keeps_its_slot_until_the_queued_copies_ran() -> None:
    with CudaSim(scheduler="lazy") as sim:
        up, pool, shards = _setup(sim, slots=1)
        lease, staging, _ = _staged(sim, pool)
        bad = (*COPIES, (0, 5, 0, 8))  # no shard 5: raises after two copies were queued
        with pytest.raises(IndexError):
            up.fill([(s, n) for s, n in zip(shards, SIZES, strict=True)], ZEROS, bad, staging, lease)
        assert up.pending() == 1 and pool.available() == 0
        up.free(shards)
        up.drain()
        assert pool.available() == 1
        pool.acquire().release()


def test_a_cpu_device_is_refused() -> None:
    with pytest.raises(ValueError, match="device"):
        ShardUploader("cpu")


def _sim_training(tmp_path, scheduler: str, seed: int, groups: int = 0, sync_reads: bool = False) -> dict:
    """tests/fsdp/sim_worker.py's result: one gloo rank trained with the tier on the simulator."""
    worker = os.path.join(os.path.dirname(__file__), "sim_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    args = [str(tmp_path), scheduler, str(seed), str(groups), str(int(sync_reads))]
    subprocess.run([sys.executable, worker, *args], env=env, timeout=240, check=False)
    with open(tmp_path / "result.json") as f:
        res = json.load(f)
    assert res["ok"], res["error"]
    assert res["equal"]
    tier, sim = res["tier"], res["sim"]
    assert tier["uploads"] == tier["reads"] > 0 and tier["staging_registered"] and tier["sync_fetches"] == 0
    assert sim["pageable_h2d"] == 0 and sim["pageable_d2h"] == 0  # DMA copies from registered staging
    return res


@pytest.mark.parametrize("scheduler,seed", [("lazy", 0), ("random", 3)])
def test_the_tier_moves_fsdp_shards_up_through_it_bit_identical(tmp_path, scheduler: str, seed: int) -> None:
    """Real FSDP2 training (one gloo rank) with the tier, its shards adopted as
    simulated device storages: every read goes up through the uploader,
    nothing unordered, bit-identical to the same training without the tier."""
    _sim_training(tmp_path, scheduler, seed)


def test_loading_every_group_with_the_slots_held_by_queued_uploads(tmp_path) -> None:
    """Seven groups, reads landed at once, copies run only when waited for:
    the optimizer step's load of every group finds each slot held by an upload
    whose copy is still queued and no drive I/O in flight. Its look-ahead
    stops there (the slots are the uploads' until their copies are done);
    it used to raise TierError ("no I/O in flight (a bug)")."""
    res = _sim_training(tmp_path, "lazy", 0, groups=7, sync_reads=True)
    assert res["tier"]["groups"] == 7


def test_a_fill_that_fails_before_holding_the_slot_leaves_it_to_the_caller() -> None:
    """The event could not be made: nothing queued, the uploader does not
    hold the lease, and the caller (the tier) gives it back."""
    with CudaSim(scheduler="lazy") as sim:
        up, pool, shards = _setup(sim, slots=1)
        lease, staging, _ = _staged(sim, pool)
        event = sim.event
        sim.event = lambda: (_ for _ in ()).throw(KeyboardInterrupt)  # noqa: E731 - Ctrl-C there
        with pytest.raises(KeyboardInterrupt):
            up.fill([(s, n) for s, n in zip(shards, SIZES, strict=True)], ZEROS, COPIES, staging, lease)
        sim.event = event
        assert up.pending() == 0 and not up.holds(lease)
        lease.release()
        u, lease, _ = _fill(up, pool, sim, shards)
        assert up.holds(lease)
        up.land(u)
        assert not up.holds(lease) and pool.available() == 1


def test_a_dropped_uploader_unregisters_after_its_copies_ran() -> None:
    """Garbage-collected without close() with a copy still queued: the
    staging's registration is undone only once the side stream ran it."""
    with CudaSim(scheduler="lazy") as sim:
        side_done = []
        register = sim.register_host

        def spy(ptr: int, nbytes: int):
            undo = register(ptr, nbytes)

            def unregister() -> None:
                side_done.append(side.query())
                undo()

            return unregister

        sim.register_host = spy
        up, pool, shards = _setup(sim, slots=1)
        side = up.side
        u, lease, _ = _fill(up, pool, sim, shards)
        # The memory outlives the pool object here (a copy run after the unregister, as
        # before the fix, reads it rather than freed memory); its views would keep the pool.
        memory = pool._c
        del up, pool, u, lease
        gc.collect()
        assert side_done == [True]
        sim.synchronize()
        del memory


# -- the tier itself on the simulator, in this process (one gloo rank) ------------------------


def _sim_model(sim: CudaSim) -> torch.nn.Module:
    """Three fully_shard-ed Linears (one gloo rank) whose shards are simulated device storages."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    mesh = init_device_mesh("cpu", (1,))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        sim.adopt(p.to_local())
    return model


@pytest.fixture
def sim_tier(tmp_path):
    """[sim, model, optimizer, tier]: one gloo rank, three FSDP groups whose
    shards are simulated device storages, the tier over them (lazy scheduler)."""
    import torch.distributed as dist

    from aio.fsdp import offload_params

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    (tmp_path / "drive").mkdir()
    made: list = []  # emptied below: pytest keeps what is yielded until after this teardown
    try:
        with CudaSim(scheduler="lazy") as sim:
            model = _sim_model(sim)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
            made += [sim, model, opt, offload_params(model, str(tmp_path / "drive"), opt)]
            del sim, model, opt
            try:
                yield made
            finally:
                made[3].close()
    finally:
        made.clear()
        dist.destroy_process_group()
    # The simulator is kept by its finalizers on the model's storages until a collection
    # frees the model (in cycles): both collected here, not in a later test's gc checks.
    gc.collect()
    gc.collect()


def _steps(model, opt, n: int = 1) -> None:
    for step in range(n):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def test_a_gather_interrupted_in_its_wait_for_the_upload_waits_again(sim_tier, monkeypatch) -> None:
    """Ctrl-C in the host's wait for a group's copies up: the group keeps its
    upload, so the next gather of it waits again (it used to be cleared
    first, and that gather read the shard unordered: a Hazard)."""
    sim, model, opt, tier = sim_tier
    _steps(model, opt, 2)
    land = ShardUploader.land

    def interrupted(self, up):
        monkeypatch.setattr(ShardUploader, "land", land)
        raise KeyboardInterrupt

    monkeypatch.setattr(ShardUploader, "land", interrupted)  # the first gather's wait
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(4, 8))
    _steps(model, opt, 1)


def test_a_fill_interrupted_before_the_uploader_took_the_slot_gives_it_back(sim_tier, monkeypatch) -> None:
    """Ctrl-C as the tier hands a landed read to the uploader, twice (as many
    as the tier's slots): each slot is given back, and training goes on (both
    leaked used to leave no slot: TierError "no I/O in flight (a bug)")."""
    sim, model, opt, tier = sim_tier
    _steps(model, opt, 1)
    fill = ShardUploader.fill
    left = [tier.window]

    def interrupted(self, *args, **kwargs):
        left[0] -= 1
        if left[0] == 0:
            monkeypatch.setattr(ShardUploader, "fill", fill)
        raise KeyboardInterrupt

    monkeypatch.setattr(ShardUploader, "fill", interrupted)
    for _ in range(tier.window):
        with pytest.raises(KeyboardInterrupt):
            model(torch.randn(4, 8))
    _steps(model, opt, 2)
    assert tier.stats()["uploads"] > 0


def test_close_unhooks_and_removes_the_folder_when_the_uploader_raises(sim_tier, monkeypatch) -> None:
    sim, model, opt, tier = sim_tier
    _steps(model, opt, 1)
    folder = tier.stats()["swap_dir"]

    def stuck(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(ShardUploader, "close", stuck)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        tier.close()
    assert tier.closed and not os.path.exists(folder)
    assert not any("unshard" in m.__dict__ for m in model.modules())  # FSDP's own methods again
    _steps(model, opt, 1)  # an ordinary FSDP2 model


def test_registered_staging_is_not_also_mlocked(sim_tier) -> None:
    """pin_memory: the staging is registered with CUDA (the simulator's
    cudaHostRegister), not mlock-ed too (locked_bytes() counted it twice)."""
    import aio.pinned

    sim, model, opt, tier = sim_tier
    assert tier.stats()["staging_registered"]
    before = aio.pinned.locked_bytes()
    tier._fit_pool(tier.stats()["slot_bytes"] * 2)  # the pool made again, as for the master's reads
    assert tier.stats()["staging_registered"]
    assert aio.pinned.locked_bytes() == before
    _steps(model, opt, 1)


def test_staging_is_mlocked_when_cuda_refuses_to_register_it(sim_tier, monkeypatch) -> None:
    import aio.pinned

    sim, model, opt, tier = sim_tier
    monkeypatch.setattr(sim, "register_host", lambda ptr, nbytes: None)
    before = aio.pinned.locked_bytes()
    tier._fit_pool(tier.stats()["slot_bytes"] * 2)
    st = tier.stats()
    assert not st["staging_registered"] and aio.pinned.locked_bytes() == before + st["pinned_bytes"]
    _steps(model, opt, 1)


def test_a_group_whose_gather_nothing_waited_for_is_kept(sim_tier) -> None:
    """An iteration that raised after FSDP issued a group's all-gather:
    release_all keeps that group (FSDP's copy-in stream may still read it;
    nothing public orders a free after it) until its gather is waited for."""
    sim, model, opt, tier = sim_tier
    _steps(model, opt, 1)
    assert tier.resident_bytes() == 0
    handle = model[1].unshard(async_op=True)  # issued; the forward that would wait raised
    tier.release_all()
    assert tier.resident_bytes() == (8 * 8 + 8) * 4  # model[1]'s weight and bias, float32
    handle.wait()
    model[1].reshard()
    _steps(model, opt, 1)
    assert tier.resident_bytes() == 0
