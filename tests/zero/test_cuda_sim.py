"""The CUDA simulator is strict: each mistake a GPU punishes raises here
(so a test passing under it means something). Scenarios drive
aio.zero.streams.DeviceCopies on the simulated backend, with one ordering
step taken out at a time."""

import pytest
import torch

import aio.zero
import aio.zero.streams as streams
from aio.zero.streams import DeviceCopies

from .common import cfg_for, gpt
from .cuda_sim import CudaSim, Hazard
from .test_gpu_sim import train_on_device


def copies(sim):
    return streams.copies_for("cuda")


def test_device_tensors_answer_like_cuda_ones():
    with CudaSim() as sim:
        x = torch.ones(4).to("cuda")
        assert x.device == torch.device("cuda", 0) and x.is_cuda
        assert torch.zeros(3, device="cuda").device.type == "cuda"
        assert (x * 2).device.type == "cuda"
        assert x.cpu().device.type == "cpu" and torch.equal(x.cpu(), torch.ones(4))
        pinned = torch.empty(8, pin_memory=True)
        assert pinned.is_pinned() and not torch.empty(8).is_pinned()
        assert sim.stats()["user_h2d"] == 2  # .to("cuda") and zeros(device="cuda")


def test_mixing_a_device_tensor_with_a_cpu_tensor_fails_like_cuda():
    with CudaSim():
        x = torch.ones(4).to("cuda")
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(4)
        assert torch.equal((x + torch.tensor(1.0)).cpu(), torch.full((4,), 2.0))  # CPU scalars mix


def test_random_ops_on_the_device_use_the_device_generator():
    torch.manual_seed(0)
    want = torch.randn(5)
    with CudaSim():
        torch.manual_seed(0)
        x = torch.empty(5).to("cuda")
        x.normal_()
        assert not torch.equal(x.cpu(), want)
        assert torch.equal(torch.randn(5), want)  # the host stream did not move


def test_new_device_memory_is_poison():
    with CudaSim(scheduler="eager") as sim:
        t = sim.empty(16, torch.float32)
        assert torch.isnan(t.cpu()).all()


def test_upload_used_by_compute_is_ordered_and_correct():
    for mode in ("lazy", "eager", "random"):
        with CudaSim(scheduler=mode) as sim:
            c = copies(sim)
            host = torch.arange(1000, dtype=torch.float32)
            (dev,), ticket = c.upload([host])
            assert torch.equal((dev * 1).cpu(), host)
            ticket.wait()


def test_missing_wait_event_is_a_hazard(monkeypatch):
    monkeypatch.setattr(DeviceCopies, "_publish", lambda self, devs, ev: None)
    with pytest.raises(Hazard, match="not ordered after"), CudaSim(scheduler="lazy") as sim:
        c = copies(sim)
        (dev,), _ = c.upload([torch.arange(1000, dtype=torch.float32)])
        dev * 2


def test_missing_record_stream_lets_a_block_be_reused_too_early(monkeypatch):
    monkeypatch.setattr(streams.DeviceCopies, "_publish", _publish_without_record_stream)
    with pytest.raises(Hazard), CudaSim(scheduler="lazy") as sim:
        c = copies(sim)
        (dev,), t1 = c.upload([torch.arange(1000, dtype=torch.float32)])
        y = dev * 2  # a compute kernel reads the block...
        del dev  # ...and the block is freed back to the side stream
        c.upload([torch.zeros(1000)])  # reused by the side stream before compute ran
        del y


def _publish_without_record_stream(self, devs, ev):
    self.backend.compute().wait_event(ev)


def test_download_without_waiting_for_the_producer_is_a_hazard(monkeypatch):
    with CudaSim(scheduler="lazy") as sim:
        c = copies(sim)
        x = torch.arange(100, dtype=torch.float32).to("cuda")
        g = x * 3  # produced on the compute stream
        monkeypatch.setattr(c.backend.side, "wait_event", lambda ev: None)
        with pytest.raises(Hazard):
            c.download(g)


def test_reading_a_download_before_its_ticket_is_a_hazard():
    with CudaSim(scheduler="lazy") as sim:
        c = copies(sim)
        g = torch.arange(100, dtype=torch.float32).to("cuda") * 3
        host, ticket = c.download(g)
        with pytest.raises(Hazard, match="host"):
            host.sum()
        ticket.wait()
        assert torch.equal(host, torch.arange(100, dtype=torch.float32) * 3)


def test_freeing_a_copy_source_before_the_copy_runs_is_a_hazard():
    with pytest.raises(Hazard, match="freed"), CudaSim(scheduler="lazy") as sim:
        c = copies(sim)
        g = torch.arange(100, dtype=torch.float32).to("cuda") * 3
        c.download(g)
        del g
        sim.event().record()  # any later simulator call reports it


def test_a_swap_buffer_released_while_its_upload_is_queued_is_a_hazard(tmp_path, monkeypatch):
    """aio.zero believing every upload done (a store that does not wait for
    its tickets) hands a swap buffer back while a queued upload still reads
    it: the next lease of that buffer is a host write the simulator refuses."""
    monkeypatch.setattr(streams._EventTicket, "done", lambda self: True)
    with pytest.raises(Hazard, match="leased again"), CudaSim(scheduler="lazy"):
        with aio.zero.initialize(gpt(), cfg_for(tmp_path), device="cuda") as engine:
            train_on_device(engine, 1)


def _publish_without_wait(self, devs, ev):
    for d in devs:
        self.backend.record_stream(d, self.backend.compute())


def _download_without_producer_wait(self, src):
    stage = self.down.take(src.nbytes)
    if stage is None:
        return None
    b = self.backend
    host = stage.view(src.dtype)
    with b.on(b.side):
        b.copy(host, src)
        ev = b.event()
        ev.record(b.side)
    return host, streams._EventTicket(ev)


@pytest.mark.parametrize("scheduler", ["lazy", "eager"])
@pytest.mark.parametrize(
    "attr,broken,where",
    [
        ("_publish", _publish_without_wait, "kernel aten.embedding"),
        ("download", _download_without_producer_wait, "copy reads"),
    ],
    ids=["upload-no-wait-event", "download-no-producer-wait"],
)
def test_training_with_an_ordering_step_missing_is_caught(
    tmp_path, monkeypatch, scheduler, attr, broken, where
):
    """The trainer's first step with one ordering step taken out of the data
    path raises, whatever the schedule (the clocks do not depend on it)."""
    monkeypatch.setattr(DeviceCopies, attr, broken)
    with pytest.raises(Hazard, match=where), CudaSim(scheduler=scheduler):
        with aio.zero.initialize(gpt(), cfg_for(tmp_path), device="cuda") as engine:
            train_on_device(engine, 1)
