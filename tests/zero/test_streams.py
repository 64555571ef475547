"""aio.zero.streams: copies ordered by events (fake streams here; real CUDA where present)."""

import pytest
import torch

from aio.zero.streams import DeviceCopies, HostCopies, PinnedRing, copies_for

from .fake_streams import FakeBackend


def test_host_copies_copy_nothing():
    h = torch.arange(4.0)
    (got,), ticket = HostCopies().upload([h])
    assert got is h and ticket.done()
    host, ticket = HostCopies().download(h)
    assert host is h and ticket.done()
    assert isinstance(copies_for("cpu"), HostCopies)


@pytest.mark.parametrize("n", [1, 3])
def test_upload_is_waited_for_by_compute_not_by_host(n):
    """The compute stream waits on the copy's event (a kernel queued after the
    upload sees the values even when compute runs first); the host never
    synchronizes; the device tensors are marked used on the compute stream."""
    b = FakeBackend(first="compute")
    copies = DeviceCopies(b)
    hosts = [torch.arange(5.0) + 10 * i for i in range(n)]
    devs, ticket = copies.upload(hosts)
    assert not ticket.done()
    seen = []
    b.kernel(lambda: seen.extend(d.clone() for d in devs))
    b.run_all()
    assert ticket.done()
    assert all(torch.equal(s, h) for s, h in zip(seen, hosts, strict=True))
    assert b.synchronizes() == 0
    assert ("record_stream", "compute") in b.log
    assert [e for e in b.log if e[0] == "copy"] == [("copy", "side")] * (1 if n > 1 else n)


def test_small_tensors_go_up_in_one_copy_and_keep_their_dtypes():
    b = FakeBackend()
    copies = DeviceCopies(b)
    hosts = [torch.arange(3.0), torch.arange(7, dtype=torch.bfloat16), torch.ones(1, dtype=torch.float64)]
    devs, _ = copies.upload(hosts)
    b.run_all()
    assert copies.counters["h2d_copies"] == 1
    for d, h in zip(devs, hosts, strict=True):
        assert d.dtype == h.dtype and torch.equal(d, h)


def test_upload_staging_is_reused_only_after_its_copy_finished():
    b = FakeBackend(first="compute")
    copies = DeviceCopies(b)
    copies.up = PinnedRing(b, 1024)
    hosts = [torch.full((16,), 1.0), torch.full((16,), 2.0)]  # 128 bytes staged per upload
    results = []
    for k in range(8):  # exactly fills the ring: nothing waited
        results.append(copies.upload([h + k for h in hosts])[0])
    assert b.synchronizes() == 0
    results.append(copies.upload([h + 8 for h in hosts])[0])  # reuses the first region
    assert b.synchronizes() == 1
    b.run_all()
    for k, devs in enumerate(results):
        assert torch.equal(devs[0], hosts[0] + k) and torch.equal(devs[1], hosts[1] + k)


def test_finished_uploads_give_their_staging_back_without_waiting():
    """An upload whose copy has finished gives its staging region (and its
    event) back at the next upload: a 16 MiB ring of small parameter packs
    used to keep every one of them, with its CUDA event, until the ring was
    full (thousands), and each upload scanned them all."""
    b = FakeBackend()
    copies = DeviceCopies(b)
    hosts = [torch.full((16,), 1.0), torch.full((16,), 2.0)]
    for k in range(100):
        devs, ticket = copies.upload([h + k for h in hosts])
        b.run_all()
        assert ticket.done() and torch.equal(devs[1], hosts[1] + k)
    assert len(copies.up_tickets) == len(copies.up.live) == 1  # the last one's
    assert b.synchronizes() == 0


def test_download_waits_for_compute_then_host_waits_for_ticket():
    """The side stream copies only after the compute stream produced the
    gradient (run side first: a missing wait would copy the old zeros)."""
    b = FakeBackend(first="side")
    copies = DeviceCopies(b)
    grad = torch.zeros(6)
    b.kernel(lambda: grad.copy_(torch.arange(6.0)))
    host, ticket = copies.download(grad)
    assert not ticket.done() and b.synchronizes() == 0
    ticket.wait()
    assert torch.equal(host, torch.arange(6.0))
    assert b.synchronizes() == 1


def test_download_staging_full_until_recycled():
    b = FakeBackend()
    copies = DeviceCopies(b)
    copies.down = PinnedRing(b, 256)
    a = copies.download(torch.ones(32))  # 128 bytes
    assert copies.download(torch.ones(32)) is not None
    assert copies.download(torch.ones(32)) is None  # full: the caller must recycle
    a[1].wait()
    copies.recycle()
    assert copies.download(torch.ones(32)) is not None
    assert b.pinned_allocs == 1


def test_ring_hands_out_aligned_regions_first_in_first_out():
    ring = PinnedRing(FakeBackend(), 256)
    assert ring.pinned_bytes() == 0
    r1 = ring.take(10)
    r2 = ring.take(100)
    assert r1.numel() == 10 and r2.data_ptr() - r1.data_ptr() == 64
    assert ring.take(128) is None  # 64 + 128 taken, 64 left at the end, the start is taken
    ring.give_back()
    assert ring.take(64) is not None  # the freed start
    with pytest.raises(ValueError):
        ring.take(257)
    assert ring.pinned_bytes() == 256


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip():
    copies = copies_for("cuda")
    hosts = [torch.randn(1000).pin_memory(), torch.randn(3).pin_memory(), torch.randn(5).pin_memory()]
    devs, ticket = copies.upload(hosts)
    devs += copies.upload(hosts[:1])[0]
    out = [d * 2 for d in devs]
    got = [copies.download(o) for o in out]
    for (h, t), o in zip(got, out, strict=True):
        t.wait()
        assert torch.equal(h, o.cpu())
        copies.recycle()
    ticket.wait()


def test_packed_upload_out_of_device_memory_gives_its_staging_back():
    """Device memory running out in a packed upload (a retry loop catches
    it): its staging region goes back at once. It was held with no ticket,
    so every later region was freed one upload late."""

    class OutOfMemoryOnce(FakeBackend):
        fail = False

        def empty(self, numel, dtype):
            if self.fail:
                self.fail = False
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return super().empty(numel, dtype)

    b = OutOfMemoryOnce()
    c = DeviceCopies(b)
    hosts = [torch.ones(1000), torch.full((1000,), 2.0)]  # small: one packed upload
    c.upload(hosts)
    b.run_all()
    b.fail = True
    with pytest.raises(torch.OutOfMemoryError):
        c.upload(hosts)
    assert len(c.up.live) == len(c.up_tickets)  # none held without a ticket
    devs, _ticket = c.upload(hosts)
    b.run_all()
    assert len(c.up.live) == len(c.up_tickets) and [d.tolist() for d in devs] == [h.tolist() for h in hosts]


def test_ring_untake_frees_the_newest_region_for_the_next_take():
    b = FakeBackend()
    ring = PinnedRing(b, 4096 * 4)
    first, second = ring.take(4096), ring.take(4096)
    ring.untake()
    again = ring.take(4096)
    assert again.data_ptr() == second.data_ptr() != first.data_ptr() and len(ring.live) == 2
    ring.untake()
    ring.untake()
    assert not ring.live and ring.take(4096).data_ptr() == first.data_ptr()
