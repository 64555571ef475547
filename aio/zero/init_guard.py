"""What keeps a model built under :class:`aio.zero.Init` equal to the same
model built in memory.

A module's parameters go to the store as soon as its ``__init__`` returns,
but libraries go on touching them: a parent's ``__init__`` initialises a
child's bias (``nn.MultiheadAttention``), transformers initialises every
weight after construction through its own recursion (``smart_apply``) and
loads checkpoints by replacing parameters (``setattr``), code reads
``weight.shape``. :class:`PlaceholderGuard` is a torch function mode active
for the whole ``Init`` block that catches every torch operation on a stored
parameter's placeholder:

- ``.shape``, ``.size()``, ``.dim()``, ``.numel()`` answer for the real
  parameter;
- any other operation runs on the real values, fetched for it, and whatever
  it wrote is stored again -- so ``normal_``, ``fill_``, ``copy_`` and reads
  happen in the same order, with the same random numbers, as in memory;
- ``.detach()`` outside a module's build (``state_dict()``) answers with a
  meta tensor of the parameter's shape and dtype, holding no buffer;
- ``.data``, and any operation whose result is a view of the parameter
  (``weight[padding_idx]``, ``.view``, ``.t()``...), fetches the parameter
  and leaves it fetched -- what is done through the view cannot be seen --
  until the outermost module being built ends (a view taken during a build),
  or the ``Init`` block ends; then it is stored. (Views held that way take parameter buffers: too many
  at once end in a PoolExhaustedError naming ``buffer_count``.)
- ``param.data = tensor`` (full size) stores the tensor as the new values.

Conversions of the placeholder itself (``.to``, ``.float()``...) pass
through: the store decides the parameter's dtype and device.
"""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .stored_param import PASS_NAMES as _PASS
from .stored_param import SHAPE_NAMES as _SHAPE
from .stored_param import shallow_args as _shallow
from .stored_param import torch_function_name as _name
from .stored_param import unique_tensors


class PlaceholderGuard(TorchFunctionMode):
    """The torch function mode of one ``Init`` block over `store` (see the
    module docstring); `opened` and `opened_in_build` hold the parameters left
    fetched because a view of them was handed out."""

    def __init__(self, store: Any) -> None:
        super().__init__()
        self.store = store
        self.opened: list[Any] = []  # views taken in the Init block itself
        self.opened_in_build: list[Any] = []  # views taken while a module was being built
        self.building = 0  # modules whose __init__ is running (Init's wrapper counts)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        stored = [t for t in flat if self.store.is_placeholder(t)]
        if not stored:
            return func(*args, **kwargs)
        name = _name(func)
        if name == "set:data":
            return self._set_data(args[0], args[1], func)
        if name in _PASS or name.startswith("set:"):
            return func(*args, **kwargs)
        if name in _SHAPE and args and args[0] is stored[0] and len(stored) == 1:
            return _shape_answer(name, stored[0], args[1:], kwargs)
        if name == "detach" and not self.building and args and args[0] is stored[0]:
            return _detached(stored[0])
        stored = unique_tensors(stored)
        self.store.acquire(stored)
        try:
            out = func(*args, **kwargs)
        except BaseException:
            self.store.put_back(stored)
            raise
        # A result sharing a parameter's memory (``.data``, a slice, ``.t()``)
        # keeps it fetched: what is done through it cannot be seen.
        views = _aliased(stored, out)
        self.store.put_back([p for p in stored if all(p is not v for v in views)])
        self._keep_open(views)
        return out

    def _set_data(self, p: Any, value: Any, func: Any) -> None:
        """``p.data = value``: a full-size value is stored as the parameter's new
        values (the placeholder stays); an empty one is the store's own
        placeholder swap and goes through."""
        if not self.store.is_placeholder(p) or value.numel() != p.aio_numel:
            return func(p, value)
        self.store.write(p, value.detach().reshape(-1).cpu(), async_op=False)
        return None

    def _keep_open(self, params: list[Any]) -> None:
        # No limit: releasing a parameter whose view is still out would let the
        # view write into a buffer reused for another parameter. Too many open
        # views run the pool out, and acquire() says so (PoolExhaustedError).
        # An open parameter is no placeholder, so it is never opened twice.
        (self.opened_in_build if self.building else self.opened).extend(params)

    def close_opened(self, build_only: bool = False) -> None:
        """Store the parameters left fetched (views handed out) and let them go:
        those opened while a module was being built (`build_only`: its build
        is over), or all (the Init block is over)."""
        done, self.opened_in_build = self.opened_in_build, []
        if not build_only:
            done, self.opened = done + self.opened, []
        if done:
            self.store.put_back(done)


class PlaceholderCheck(TorchFunctionMode):
    """Active during a trainer's forward: an operation that gets a stored
    parameter still showing its placeholder -- used by a module that does not
    own it, so nothing fetched it -- raises a ValueError naming the parameter
    and the remedy, instead of failing deep in torch on an empty tensor."""

    def __init__(self, store: Any) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in _shallow(args, kwargs):
            name = _name(func)
            if self.store.is_placeholder(t) and name not in _PASS and not name.startswith("set:"):
                raise ValueError(
                    f"parameter {t.aio_name!r} (shape {tuple(t.aio_shape)}) is used by "
                    f"{name!r} while it is not fetched: a module's forward uses a parameter "
                    "another module owns. Declare it for the module that uses it with "
                    "aio.zero.register_external_parameter(module, param)"
                )
        return func(*args, **kwargs)


def _detached(p: Any) -> Any:
    """``param.detach()`` of a stored parameter outside any module's build
    (``Module.state_dict()`` detaches every parameter): a meta tensor of its
    shape and dtype. Reading the shape, dtype or keys works; reading or
    writing values through it fails loudly (use ``param`` itself, which the
    guard fetches around each operation). Fetching instead would hold a swap
    buffer per parameter until the Init block ends: ``from_pretrained`` walks
    ``state_dict()`` and ran out of DeepSpeed's default 5 buffers."""
    import torch

    return torch.empty(p.aio_shape, dtype=p.dtype, device="meta")


def _aliased(params: list[Any], out: Any) -> list[Any]:
    """The parameters in `params` whose memory a tensor in `out` shares."""
    import torch

    flat, _ = tree_flatten(out)
    # An in-place op returns the parameter itself: nothing of it escapes.
    views = [t for t in flat if isinstance(t, torch.Tensor) and all(t is not p for p in params)]
    ptrs = {t.untyped_storage().data_ptr() for t in views}
    return [p for p in params if p.untyped_storage().data_ptr() in ptrs]


def _shape_answer(name: str, p: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    shape = torch.Size(p.aio_shape)
    if name in ("shape",):
        return shape
    if name == "size":
        dim = args[0] if args else kwargs.get("dim")
        return shape if dim is None else shape[dim]
    if name in ("dim", "ndim"):
        return len(shape)
    if name == "__len__":
        return shape[0]
    return p.aio_numel
