"""A sub-group's master weights and gradient given as pieces
(aio/swap/pieces.py): OptimizerSwapper.initialize_in_place() and
hold_gradient(list) step them where they are, bit-identical to packing them
into one buffer, copying nothing in or out; each in-place sub-group leases
one buffer less."""

import pytest

torch = pytest.importorskip("torch")

from aio.optim import CPUAdam  # noqa: E402
from aio.swap import OptimizerSwapper, SwapStateError  # noqa: E402
from aio.swap.pieces import check_pieces, segments  # noqa: E402

NUMELS = [3000, 1234]
# Per sub-group, where the master weights' pieces end and where the gradient's do:
# not the same cuts, and an empty piece among them.
MASTER_CUTS = [[7, 7, 1000, 2999, 3000], [1234]]
GRAD_CUTS = [[500, 1001, 3000], [1, 2, 1233, 1234]]


class _NoMasterSlot(OptimizerSwapper):
    """Master weights kept elsewhere (as NVMeAdamW's master="params")."""

    def master_slot(self):
        return False

    def gradient_slot(self):
        return False


def _split(t, cuts):
    out, at = [], 0
    for end in cuts:
        out.append(t[at:end])
        at = end
    return out


def test_segments_cut_at_every_piece_end():
    a, b = torch.arange(10.0), torch.arange(10.0) + 100
    whole = torch.arange(10.0) + 1000
    segs = segments(10, {"m": tuple(_split(a, [3, 3, 10])), "g": tuple(_split(b, [5, 10])), "s": whole})
    assert [len(s["m"]) for s in segs] == [3, 2, 5]
    for s in segs:  # views of the pieces, aligned element for element
        assert torch.equal(s["m"] + 100, s["g"]) and torch.equal(s["m"] + 1000, s["s"])
        assert s["m"].untyped_storage().data_ptr() == a.untyped_storage().data_ptr()


def test_pieces_are_checked():
    with pytest.raises(TypeError, match="list or tuple"):
        check_pieces(torch.zeros(4), 4, "x")
    with pytest.raises(TypeError, match="piece 1 must be a float32 CPU tensor"):
        check_pieces([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], 4, "x")
    with pytest.raises(ValueError, match="piece 0 must be a dense contiguous"):
        check_pieces([torch.zeros(2, 2).t()], 4, "x")
    with pytest.raises(ValueError, match="hold 3 elements, the sub-group 4"):
        check_pieces([torch.zeros(3)], 4, "x")


def _run(tmp_path, opt_cls, hyper, in_place, steps=3, buffer_count=4, states="fp32", lowp=False, scale=None):
    """Step a master-elsewhere swapper: masters and gradients as pieces
    (`in_place`) or packed (a copy in, `after` copying out). Returns the
    masters, each sub-group's states, the lowp copies and the swapper."""
    gen = torch.Generator().manual_seed(3)
    masters = [torch.randn(n, generator=gen) for n in NUMELS]
    folder = tmp_path / ("in" if in_place else "packed")
    folder.mkdir(exist_ok=True)
    sw = _NoMasterSlot(
        str(folder), opt_cls, hyper, buffer_count=buffer_count,
        pipeline_read=True, pipeline_write=True, state_dtype=states,
    )  # fmt: skip
    for i, n in enumerate(NUMELS):
        sw.register_subgroup(i, n)
        if in_place:
            sw.initialize_in_place(i, lambda i=i: _split(masters[i], MASTER_CUTS[i]))
        else:
            sw.initialize_from(i, lambda out, i=i: [out.copy_(masters[i])][:0])
    low = {i: torch.empty(n, dtype=torch.bfloat16) for i, n in enumerate(NUMELS)} if lowp else None
    seen = []

    def after(i, new):
        seen.append(new is None)
        if new is not None:
            masters[i].copy_(new)

    for _ in range(steps):
        for i, n in enumerate(NUMELS):
            grad = torch.randn(n, generator=gen)
            sw.hold_gradient(i, _split(grad, GRAD_CUTS[i]) if in_place else grad)
        sw.step(after=after, grad_scale=scale, lowp=low)
    assert seen == [in_place] * (steps * len(NUMELS))
    states = [{n: sw.read_state(i, n) for n in sw.state_names()} for i in range(len(NUMELS))]
    return masters, states, low, sw


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
@pytest.mark.parametrize(
    "opt_cls,hyper,states,lowp,scale",
    [
        (CPUAdam, {"lr": 1e-2, "match_torch": True}, "fp32", False, None),
        (CPUAdam, {"lr": 1e-2, "weight_decay": 0.1}, "bf16", True, 0.5),
        (torch.optim.Adam, {"lr": 1e-2}, "fp32", False, None),
        (torch.optim.Adam, {"lr": 1e-2}, "bf16", True, 0.25),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "fp32", False, None),
    ],
    ids=["aio-adam", "aio-adam-bf16-lowp-scaled", "torch-adam", "torch-adam-bf16-lowp-scaled", "sgd"],
)
def test_pieces_step_bit_identical_to_packed(tmp_path, opt_cls, hyper, states, lowp, scale):
    want, want_states, want_low, a = _run(tmp_path, opt_cls, hyper, False, 3, 6, states, lowp, scale)
    got, got_states, got_low, b = _run(tmp_path, opt_cls, hyper, True, 3, 6, states, lowp, scale)
    assert all(map(torch.equal, want, got))
    for w, g in zip(want_states, got_states, strict=True):
        assert w.keys() == g.keys() and all(torch.equal(w[n], g[n]) for n in w)
    if lowp:
        assert all(torch.equal(want_low[i], got_low[i]) for i in want_low)
    assert [g.scalars for g in a.groups.values()] == [g.scalars for g in b.groups.values()]
    # read_master() reads the pieces where they are.
    assert all(torch.equal(b.read_master(i), got[i]) for i in range(len(NUMELS)))
    a.close()
    b.close()


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.buffer_count")
def test_in_place_sub_groups_lease_no_master_buffer(tmp_path):
    # Adam, gradients held: 3 buffers a sub-group with the master in one, 2
    # in place. Four buffers then keep both sub-groups from one step to the
    # next (the next step reads neither), where packed they keep one.
    hyper = {"lr": 1e-2}
    *_, packed = _run(tmp_path, CPUAdam, hyper, False, steps=3, buffer_count=4)
    *_, in_place = _run(tmp_path, CPUAdam, hyper, True, steps=3, buffer_count=4)
    assert in_place.counters["cached_subgroups"] == 2 * 2 > packed.counters["cached_subgroups"]
    assert in_place.counters["bytes_read"] < packed.counters["bytes_read"]
    packed.close()
    in_place.close()


def test_in_place_is_refused_with_a_master_slot_and_checked_before_a_step(tmp_path):
    sw = OptimizerSwapper(str(tmp_path), torch.optim.Adam, {"lr": 1e-2})
    sw.register_subgroup(0, 8)
    with pytest.raises(ValueError, match="initialize_in_place.*keeps them on the drive"):
        sw.initialize_in_place(0, lambda: [torch.zeros(8)])
    sw.close()
    sw = _NoMasterSlot(str(tmp_path), torch.optim.Adam, {"lr": 1e-2})
    sw.register_subgroup(0, 8)
    sw.register_subgroup(1, 8)
    m0, m1 = torch.ones(8), torch.ones(8)
    sw.initialize_in_place(0, lambda: [m0])
    sw.initialize_in_place(1, lambda: [m1[:7]])  # one element short: refused before any step
    for i in range(2):
        sw.hold_gradient(i, [torch.ones(8)])
    with pytest.raises(ValueError, match="sub-group 1's master weights: the pieces hold 7"):
        sw.step()
    assert sw.steps == 0 and not sw.broken and torch.equal(m0, torch.ones(8))
    sw.initialize_in_place(1, lambda: [m1[:3], m1[3:]])
    sw.step()  # no after= needed: every master is stepped in place
    assert not torch.equal(m0, torch.ones(8)) and torch.equal(m0, m1)
    # Pieces of a gradient are held for one step: the caller's tensors are let go.
    assert all(g.grad_mem is None for g in sw.groups.values())
    with pytest.raises(SwapStateError, match="has no gradient: hold_gradient"):
        sw.step()
    sw.close()
