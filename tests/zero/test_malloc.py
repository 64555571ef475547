"""aio.zero.malloc: the heap trim at the end of a backward. Run in a subprocess:
malloc's state is process-wide, and other tests' allocations would blur it."""

import errno
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import torch
    from aio.zero.malloc import (TRAIN_MMAP_THRESHOLD, TRAIN_TRIM_THRESHOLD, heap_free_bytes,
                                 set_mmap_threshold, trim_if_fragmented)

    def rss():
        with open("/proc/self/smaps_rollup") as f:
            return next(int(l.split()[1]) << 10 for l in f if l.startswith("Anonymous:"))

    set_mmap_threshold(TRAIN_MMAP_THRESHOLD, TRAIN_TRIM_THRESHOLD)  # as in training
    if heap_free_bytes() is None:
        print("SKIP no mallinfo2"); raise SystemExit(0)
    # Activation-sized blocks (4 MiB, under the mmap threshold) from the heap,
    # every other one freed: holes the heap cannot give back from its top.
    blocks = [torch.ones(1 << 20) for _ in range(128)]
    del blocks[::2]
    assert not trim_if_fragmented(limit=1 << 40)  # under the limit: nothing done
    before, free = rss(), heap_free_bytes()
    assert free >= 200 << 20, free
    assert trim_if_fragmented(limit=64 << 20)
    after = rss()
    print("OK", before - after, free)
    assert before - after >= 200 << 20, (before, after)
    assert all(float(b.sum()) == b.numel() for b in blocks)  # live blocks untouched
    """
)


def test_trim_gives_back_the_holes_of_freed_activations():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    if r.stdout.startswith("SKIP"):
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr


# For the children below: a field of the mapping holding an address.
SMAPS = textwrap.dedent(
    """
    def smaps_field(ptr, field):
        # (the field's kB, the mapping's bytes) of the mapping holding ptr,
        # or (None, None) when no mapping holds it.
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    a, b = (int(x, 16) for x in head.split("-"))
                    inside = a <= ptr < b
                    size = b - a
                elif inside and head == field + ":":
                    return int(line.split()[1]), size
        return None, None
    """
)

HUGE_CHILD = SMAPS + textwrap.dedent(
    """
    import os
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # as aio-train sets it
    import torch
    from aio.zero.malloc import long_lived_zeros

    def huge_kib(t):
        # AnonHugePages of the mapping holding t's first byte.
        kib, _size = smaps_field(t.data_ptr(), "AnonHugePages")
        if kib is None:
            raise SystemExit("mapping not found")
        return kib

    n = 16 << 20  # 64 MiB
    plain, small = torch.zeros(n), long_lived_zeros(n)
    assert small.dtype == torch.float32 and small.shape == (n,) and not small.any()
    print(huge_kib(plain), huge_kib(small))
    """
)


def test_long_lived_zeros_stay_off_huge_pages():
    # Held gradients and in-memory master weights are allocated once, at
    # set-up: on small pages, as a VM host backs each fresh huge page anew
    # (1.3-3.5 s a GiB on the dev box against 0.25-0.8 s).
    out = subprocess.run([sys.executable, "-c", HUGE_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plain, small = (int(x) for x in out.stdout.split())
    if plain == 0:
        pytest.skip("torch's allocations get no huge pages here (THP off)")
    assert small == 0, (plain, small)


MAPPED_CHILD = SMAPS + textwrap.dedent(
    """
    import errno
    import gc
    import torch
    from aio.zero import malloc

    def mapping(ptr):
        # (Rss kB, the mapping's bytes) of the mapping holding ptr.
        return smaps_field(ptr, "Rss")

    n = 16 << 20  # 64 MiB
    t = malloc.long_lived_zeros(n)
    rss, size = mapping(t.data_ptr())
    assert t.dtype == torch.float32 and t.shape == (n,) and not t.any()
    assert size == 4 * n, size  # a mapping of its own
    assert rss >= 4 * n // 1024, rss  # faulted in at once, not by the first backward
    ptr = t.data_ptr()
    t += 1
    assert float(t.sum()) == n
    del t
    gc.collect()
    assert mapping(ptr)[1] != 4 * n  # unmapped with the tensor
    small = malloc.long_lived_zeros(1000)
    assert small.shape == (1000,) and not small.any() and malloc.long_lived_zeros(0).shape == (0,)
    malloc._madvise = lambda *a: errno.EINVAL  # a kernel without MADV_POPULATE_WRITE: zero_() touches
    t = malloc.long_lived_zeros(n)
    assert not t.any() and mapping(t.data_ptr())[0] >= 4 * n // 1024
    print("OK")
    """
)


def test_long_lived_zeros_are_a_mapping_of_their_own_faulted_in_at_once():
    # The kernel zeroes fresh anonymous memory: MADV_POPULATE_WRITE faults it
    # in from one thread, where zero_() wrote every byte again on every core.
    out = subprocess.run([sys.executable, "-c", MAPPED_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr


def _mapped(addr: int) -> bool:
    """Whether `addr` lies in one of this process's mappings."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.mark.parametrize("err", [errno.ENOMEM, errno.EFAULT], ids=["ENOMEM", "EFAULT"])
def test_long_lived_zeros_refused_by_the_kernel_raise_and_unmap(monkeypatch, err):
    """MADV_POPULATE_WRITE failing with ENOMEM (a memory cgroup at its limit)
    must be a MemoryError, the mapping given back; touching the pages with
    zero_() instead would fault them in past the limit and bring the OOM
    killer. Any errno but EINVAL (a kernel without the advice) is an error."""
    import ctypes

    from aio.zero import malloc

    asked = []

    def madvise(addr, length, advice):
        if advice != malloc._MADV_POPULATE_WRITE:
            return 0
        asked.append(addr)
        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(malloc, "_libc_madvise", madvise)
    with pytest.raises(MemoryError if err == errno.ENOMEM else OSError) as info:
        malloc.long_lived_zeros(4 << 20)
    assert asked and not _mapped(asked[0]), "the mapping was kept"
    if err != errno.ENOMEM:
        assert info.value.errno == err


def test_long_lived_zeros_without_the_advice_touch_the_pages(monkeypatch):
    """EINVAL: the kernel predates MADV_POPULATE_WRITE; zero_() faults the
    (already zero) pages in instead."""
    import ctypes

    from aio.zero import malloc

    def madvise(addr, length, advice):
        if advice != malloc._MADV_POPULATE_WRITE:
            return 0
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(malloc, "_libc_madvise", madvise)
    t = malloc.long_lived_zeros(4 << 20)
    assert t.shape == (4 << 20,) and not t.any()
