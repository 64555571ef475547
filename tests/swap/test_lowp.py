"""In-place bfloat16 <-> float32 of a swap buffer (bf16 optimizer states):
equal to torch's .to(torch.bfloat16) and back, at every size around the
C++ block, for ties, subnormals, infinities and NaN; bad buffers refused."""

import pytest

torch = pytest.importorskip("torch")

from aio.swap.lowp import narrow_bf16, widen_bf16, widen_bf16_threaded  # noqa: E402


def _values(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 20)
    edge = torch.tensor([0.0, -0.0, 1e-40, -1e-42, float("inf"), -float("inf"), 3.4e38, 1.00390625])
    edge = torch.cat([edge, torch.tensor([0x3F808000, 0x3F818000], dtype=torch.int32).view(torch.float32)])
    k = min(n, edge.numel())
    x[:k] = edge[:k]  # ties to even included (the last two)
    return x


@pytest.mark.parametrize("widen", [widen_bf16, widen_bf16_threaded])
@pytest.mark.parametrize("n", [1, 2, 3, 255, 256, 257, 513, 100_003])
def test_round_trip_equals_torch(n, widen):
    x = _values(n)
    raw = torch.full((4 * n + 16,), 0xAB, dtype=torch.uint8)
    raw[: 4 * n].view(torch.float32).copy_(x)
    narrow_bf16(raw, n)
    want = x.to(torch.bfloat16)
    assert torch.equal(raw[: 2 * n].view(torch.int16), want.view(torch.int16))
    widen(raw, n)
    assert torch.equal(raw[: 4 * n].view(torch.float32), want.float())
    assert (raw[4 * n :] == 0xAB).all(), "nothing past the values is touched"


@pytest.mark.parametrize("widen", [widen_bf16, widen_bf16_threaded])
def test_nan_stays_nan(widen):
    raw = torch.zeros(16, dtype=torch.uint8)
    raw[:8].view(torch.float32).copy_(torch.tensor([float("nan"), -float("nan")]))
    narrow_bf16(raw, 2)
    widen(raw, 2)
    assert raw[:8].view(torch.float32).isnan().all()


def test_threaded_widening_equals_the_kernel_bit_for_bit():
    """The same bits as the C++ pass, NaN payloads included, at an odd size."""
    n = 1_000_003
    bits = torch.randint(-(2**15), 2**15, (n,), generator=torch.Generator().manual_seed(1), dtype=torch.int16)
    a = torch.zeros(4 * n, dtype=torch.uint8)
    a[: 2 * n].view(torch.int16).copy_(bits)
    b = a.clone()
    widen_bf16(a, n)
    widen_bf16_threaded(b, n)
    assert torch.equal(a, b)


def test_bad_buffers_are_refused():
    with pytest.raises(ValueError, match="need 40 bytes"):
        widen_bf16(torch.zeros(39, dtype=torch.uint8), 10)
    with pytest.raises(ValueError, match="need 40 bytes"):
        widen_bf16_threaded(torch.zeros(39, dtype=torch.uint8), 10)
    with pytest.raises(TypeError):
        narrow_bf16(torch.zeros(10, dtype=torch.float32), 2)
    with pytest.raises(ValueError, match="contiguous"):
        narrow_bf16(torch.zeros(80, dtype=torch.uint8)[::2], 5)


class _Landed:
    """A read that has already landed."""

    nbytes = 0

    def exception(self, timeout=None):
        return None


@pytest.mark.parametrize("cut_at", [1, 3, 9])
def test_widened_reads_interrupted_mid_widening_fail_and_never_widen_twice(cut_at):
    """Ctrl-C between two chunks of widen_bf16_threaded (raised here through a
    trace function, where a signal handler's exception would surface) leaves
    the buffer half widened: every later wait must report that, not widen
    it again (reading floats as bfloat16) and call it success."""
    import linecache
    import sys

    from aio.swap.param import SwapStateError
    from aio.zero.placement import WidenedReads

    n = 1000
    want = torch.arange(n, dtype=torch.float32) + 0.5
    out = torch.zeros(n)
    out.view(torch.bfloat16)[:n].copy_(want.to(torch.bfloat16))
    fut = WidenedReads([_Landed()], out)
    copies = 0

    def trace(frame, event, arg):
        if frame.f_code is not widen_bf16_threaded.__code__:
            return None

        def line(frame, event, arg):
            nonlocal copies
            if event == "line" and ".copy_(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                copies += 1
                if copies == cut_at:
                    raise KeyboardInterrupt
            return line

        return line

    old = sys.gettrace()
    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            fut.exception()
    finally:
        sys.settrace(old)
    seen = out.clone()
    assert isinstance(fut.exception(), SwapStateError)
    with pytest.raises(SwapStateError, match="interrupted part-way"):
        fut.result()
    assert torch.equal(out.view(torch.int32), seen.view(torch.int32)), "widened a second time"
