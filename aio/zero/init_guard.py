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
- ``.data``, and any operation whose result is a view of the parameter
  (``weight[padding_idx]``, ``.view``, ``.t()``...), fetches the parameter
  and leaves it fetched -- what is done through the view cannot be seen --
  until the module being built ends, the ``Init`` block ends, or more than
  half the parameter buffers are held that way (the oldest first); then it
  is stored.

Conversions of the placeholder itself (``.to``, ``.float()``...) pass
through: the store decides the parameter's dtype and device.
"""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# Operations on a placeholder that are about the placeholder, not the values.
_PASS = {
    "to", "float", "half", "bfloat16", "double", "cpu", "cuda", "type", "requires_grad_",
    "dtype", "device", "requires_grad", "grad", "is_meta", "is_cuda", "layout", "names",
    "_is_view", "is_leaf", "grad_fn", "_backward_hooks", "_post_accumulate_grad_hooks",
    "__set__", "__repr__", "__format__", "__hash__", "__eq__", "__reduce_ex__", "__deepcopy__",
    "data_ptr", "is_floating_point", "is_complex", "element_size",
}  # fmt: skip
_SHAPE = {"shape", "size", "dim", "ndim", "numel", "nelement", "__len__"}


def _name(func: Any) -> tuple[str, bool]:
    """(name, is a property get) of a torch function: a property's getter and
    setter are `__get__`/`__set__` of a descriptor named for the property."""
    name = getattr(func, "__name__", "")
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and owner is not None and hasattr(owner, "__name__"):
        return (owner.__name__ if name == "__get__" else "__set__"), name == "__get__"
    return name, False


class PlaceholderGuard(TorchFunctionMode):
    """The torch function mode of one ``Init`` block over `store` (see the
    module docstring). `opened` holds the parameters fetched through ``.data``."""

    def __init__(self, store: Any) -> None:
        super().__init__()
        self.store = store
        self.opened: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        stored = [t for t in flat if self.store.is_placeholder(t)]
        if not stored:
            return func(*args, **kwargs)
        name, getter = _name(func)
        if name in _PASS:
            return func(*args, **kwargs)
        if name in _SHAPE and args and args[0] is stored[0] and len(stored) == 1:
            return _shape_answer(name, stored[0], args[1:], kwargs)
        stored = _unique(stored)
        self.store.acquire(stored)
        try:
            out = func(*args, **kwargs)
        except BaseException:
            self.store.put_back(stored)
            raise
        if name == "data" and getter:
            self._keep_open(stored)
        else:
            views = _aliased(stored, out)
            self.store.put_back([p for p in stored if all(p is not v for v in views)])
            self._keep_open(views)
        return out

    def _keep_open(self, params: list[Any]) -> None:
        self.opened.extend(params)
        limit = max(1, self.store.param_buffer_count() // 2)
        while len(_unique(self.opened)) > limit:
            self._close(self.opened[0])

    def _close(self, p: Any) -> None:
        """Store `p` and undo every acquire() it had from here."""
        times = sum(1 for q in self.opened if q is p)
        self.opened = [q for q in self.opened if q is not p]
        self.store.put_back([p])
        self.store.drop([p] * (times - 1))

    def close_opened(self) -> None:
        """Store every parameter left fetched (views handed out) and let it go."""
        while self.opened:
            self._close(self.opened[0])


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
            if self.store.is_placeholder(t) and _name(func)[0] not in _PASS:
                raise ValueError(
                    f"parameter {t.aio_name!r} (shape {tuple(t.aio_shape)}) is used by "
                    f"{_name(func)[0]!r} while it is not fetched: a module's forward uses a parameter "
                    "another module owns. Declare it for the module that uses it with "
                    "aio.zero.register_external_parameter(module, param)"
                )
        return func(*args, **kwargs)


def _shallow(args: tuple, kwargs: dict) -> list[Any]:
    """The arguments, and the items of list/tuple arguments (torch.cat's), one level deep."""
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _aliased(params: list[Any], out: Any) -> list[Any]:
    """The parameters in `params` whose memory a tensor in `out` shares."""
    import torch

    flat, _ = tree_flatten(out)
    ptrs = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
    return [p for p in params if p.untyped_storage().data_ptr() in ptrs]


def _unique(params: list[Any]) -> list[Any]:
    out: list[Any] = []
    for p in params:
        if all(q is not p for q in out):
            out.append(p)
    return out


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
