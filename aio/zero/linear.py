"""Keeping autograd away from recycled swap buffers.

A fetched parameter's ``.data`` is a view of a pooled swap buffer that holds
another parameter once this one is released. Autograd normally saves the
parameter itself (and so sees whatever ``.data`` is when backward fetches it
again), but some ops save a *view* made during forward: ``F.linear`` saves
``weight.t()``, which would still point at the recycled buffer in backward.

Two guards:
- ``F.linear`` on a parameter managed by aio.zero goes through
  :class:`_Linear`, which saves the parameter itself and computes exactly the
  gradients autograd's addmm/mm backward computes (same kernels, same operand
  order, so results are bit-identical to an in-memory run; under
  ``torch.autocast`` it casts as autocast does and converts each gradient
  back to its input's dtype, as autograd does in memory).
- :func:`saved_tensor_guard` (used around every trainer forward): any other
  saved tensor that lives in a swap buffer is copied when saved, trading
  memory for correctness.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_orig_linear: Any = None
_LinearFn: Any = None


def _autocast_state(input: Any) -> tuple[str, Any] | None:
    """(device type, dtype) of the autocast that F.linear on ``input`` runs
    under now, or None: autocast is per device type, and the input's device
    picks it (device-generic, unlike torch.amp.custom_fwd)."""
    import torch

    dev = input.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return dev, torch.get_autocast_dtype(dev)
    return None


def _autocast_cast(t: Any, dev: str, dtype: Any) -> Any:
    """What autocast's ``cached_cast`` does to one argument of a
    lower-precision op: a floating-point tensor on the autocast device, other
    than float64, goes to ``dtype`` (a plain ``to``, so the same bits)."""
    import torch

    if t is None or t.device.type != dev or not t.is_floating_point() or t.dtype in (torch.float64, dtype):
        return t
    return t.to(dtype)


def _weight_grad(g2: Any, x2: Any, param: Any, in_place: bool) -> Any:
    """``g2ᵀ·x2``, the weight's gradient. With `in_place`, when the weight's
    trainer offers its gradient buffer (``aio_grad_target``, see
    aio.zero.grads.GradientAccumulator.target), computed there by the same
    kernel and None returned: autograd then hands the gradient hook nothing
    more, and no weight-sized tensor is allocated and copied each step."""
    import torch

    ref = getattr(param, "aio_grad_target", None) if in_place else None
    fn = ref() if ref is not None and _accumulates(param, g2.device.type) else None
    dtype = torch.result_type(g2, x2)
    out = fn(param, dtype, g2.device) if fn is not None and x2.device == g2.device else None
    if out is None:
        return g2.t().mm(x2)
    torch.mm(g2.t(), x2, out=out.view(g2.shape[1], x2.shape[1]))
    return None


def _accumulates(param: Any, device_type: str) -> bool:
    """Whether the running backward accumulates `param`'s gradient from this
    one use, as autograd in memory would, with nothing else to see it on the
    way. Not under torch.autograd.grad() or backward(inputs=...) without it
    (their gradients must come back, not land in the buffers), nor with
    create_graph (a buffer is not differentiable), nor under an autocast
    active in backward (autograd's mm would run in its dtype), nor with a
    hook of the user's on it (``register_hook``, or a post-accumulate hook
    besides the trainer's), nor with the weight applied more than once since
    its last gradient (autograd sums the other uses' parts first: three
    parts would be added in another order), nor when more than two module
    calls used it (one linear use and one other add commutatively; a third,
    through F.embedding, say, would not)."""
    import torch

    if torch.is_grad_enabled() or torch.is_autocast_enabled(device_type) or param._backward_hooks:
        return False
    if len(param._post_accumulate_grad_hooks or ()) > 1 or getattr(param, "aio_uses", 0) > 1:
        return False
    if getattr(param, "aio_calls", 0) > 2:  # modules calling it (a T5 embedding twice, tied to the head)
        return False
    with torch.enable_grad():
        node = param.view_as(param).grad_fn.next_functions[0][0]  # its AccumulateGrad
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # a leaf asked about under torch.autograd.grad()
        return False


def _linear_grads(
    ctx: Any, grad: Any, input: Any, weight: Any, in_place: bool = False
) -> tuple[Any, Any, Any]:
    """The gradients autograd's addmm/mm backward computes for linear (same
    kernels, same operand order), in the dtype of ``grad`` and the operands;
    the weight's maybe in its buffer (`in_place`: see _weight_grad)."""
    g2 = grad.reshape(-1, grad.shape[-1])
    gi = gw = gb = None
    if ctx.needs_input_grad[0]:
        gi = g2.mm(weight).view(*grad.shape[:-1], weight.shape[1])
    if ctx.needs_input_grad[1]:
        gw = _weight_grad(g2, input.reshape(-1, input.shape[-1]), ctx.param, in_place)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        gb = g2.sum(0)
    return gi, gw, gb


def _make_fn() -> Any:
    import torch

    class _Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, input: Any, weight: Any, bias: Any) -> Any:
            ctx.has_bias = bias is not None
            # The parameter itself: backward's saved copy of it is a plain tensor
            # without its attributes (aio_grad_target, aio_id).
            ctx.param = weight
            ctx.amp = amp = _autocast_state(input)
            if amp is None:
                ctx.save_for_backward(input, weight)
                return _orig_linear(input, weight, bias)
            # Cast here rather than in autocast's linear kernel: its weight
            # cache would keep a low-precision copy of every offloaded weight
            # alive until the autocast region ends. The cast input is saved
            # (as autograd saves it in memory); the weight is cast again in
            # backward, after it is fetched again.
            x = _autocast_cast(input, *amp)
            ctx.dtypes = (input.dtype, weight.dtype, bias.dtype if bias is not None else None)
            ctx.save_for_backward(x, weight)
            return _orig_linear(x, _autocast_cast(weight, *amp), _autocast_cast(bias, *amp))

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            input, weight = ctx.saved_tensors
            if ctx.amp is None:
                return _linear_grads(ctx, grad, input, weight, in_place=True)
            # Autograd in memory: mm's on the cast tensors, then each cast's
            # backward converts the gradient to its input's dtype. Autocast
            # is off so that a backward() called inside the region does not
            # cast again.
            with torch.autocast(ctx.amp[0], enabled=False):
                grads = _linear_grads(ctx, grad, input, _autocast_cast(weight, *ctx.amp))
            return tuple(
                g if g is None or g.dtype == dt else g.to(dt) for g, dt in zip(grads, ctx.dtypes, strict=True)
            )

    return _Linear


def _linear(input: Any, weight: Any, bias: Any = None) -> Any:
    import torch

    if (
        hasattr(weight, "aio_id")
        and torch.is_grad_enabled()
        and input.dim() >= 2
        and (weight.requires_grad or input.requires_grad or (bias is not None and bias.requires_grad))
    ):
        weight.aio_uses = getattr(weight, "aio_uses", 0) + 1  # see _accumulates; reset_uses()
        return _LinearFn.apply(input, weight, bias)
    return _orig_linear(input, weight, bias)


def reset_uses(param: Any) -> None:
    """`param`'s gradient has arrived: count its uses through F.linear and the
    module calls that used it afresh (a forward without backward leaves them
    counted until then, which only keeps its next gradient off the in-place
    path)."""
    param.aio_uses = 0
    param.aio_calls = 0


def count_call(params: Any) -> None:
    """A module call (under grad) used these parameters: see _accumulates."""
    for p in params:
        p.aio_calls = getattr(p, "aio_calls", 0) + 1


def install_linear() -> None:
    """Route F.linear through _Linear for aio.zero parameters (idempotent;
    other tensors take the original path unchanged)."""
    global _orig_linear, _LinearFn
    import torch

    if _orig_linear is not None:
        return
    _orig_linear = torch.nn.functional.linear
    _LinearFn = _make_fn()
    torch.nn.functional.linear = _linear


@contextlib.contextmanager
def saved_tensor_guard(buffer_ptrs: set[int], counter: dict[str, int]) -> Iterator[None]:
    """Copy any saved-for-backward tensor whose storage is a swap buffer
    (other than a parameter itself, which is fetched again for backward).

    Everything else is saved as a detached alias, never as itself: a saved
    output returned as itself holds its own grad_fn, a cycle through C++ that
    Python's collector cannot see, so a graph never back-propagated (a loss
    thrown away) would live until the process ends. A parameter is kept as
    itself: it has no grad_fn, and backward needs the one whose data is
    fetched again."""
    import torch

    def pack(t: Any) -> Any:
        if isinstance(t, torch.nn.Parameter):
            return t
        if t.device.type != "cpu" or t.layout != torch.strided:
            return t.detach()
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            return t
        if ptr in buffer_ptrs:
            counter["saved_copies"] = counter.get("saved_copies", 0) + 1
            return t.clone()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
