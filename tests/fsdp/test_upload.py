"""aio.fsdp.upload: device-resident shards up from the tier's pinned slot on
a side stream, under the strict CUDA simulator (tests/zero/cuda_sim.py).

Each ordering step of the design is taken out once and the simulator must
catch it: a read of the shard the host did not wait for (on the compute
stream, or on a stream that only the compute stream waited for -- FSDP's
copy-in stream), the slot given back before the copy read it, a free whose
block the side stream may reuse before the compute stream's last use."""

from __future__ import annotations

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


@pytest.mark.parametrize("scheduler,seed", [("lazy", 0), ("random", 3)])
def test_the_tier_moves_fsdp_shards_up_through_it_bit_identical(tmp_path, scheduler: str, seed: int) -> None:
    """Real FSDP2 training (one gloo rank) with the tier, its shards adopted as
    simulated device storages: every read goes up through the uploader,
    nothing unordered, bit-identical to the same training without the tier."""
    worker = os.path.join(os.path.dirname(__file__), "sim_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    subprocess.run(
        [sys.executable, worker, str(tmp_path), scheduler, str(seed)], env=env, timeout=240, check=False
    )
    with open(tmp_path / "result.json") as f:
        res = json.load(f)
    assert res["ok"], res["error"]
    assert res["equal"]
    tier, sim = res["tier"], res["sim"]
    assert tier["uploads"] == tier["reads"] > 0 and tier["staging_registered"] and tier["sync_fetches"] == 0
    assert sim["pageable_h2d"] == 0 and sim["pageable_d2h"] == 0  # DMA copies from registered staging
