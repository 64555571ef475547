"""What a parameter aio.zero stores does when code uses it between uses.

Between a module's forward and backward a stored parameter's ``.data`` is
an empty placeholder (its real shape is ``param.aio_shape``). Code that
walks ``model.named_parameters()`` between steps -- logging a weight norm,
an EMA update, ``torch.save(param)``, ``print(param)`` -- used to read that
placeholder and get nothing, silently. :func:`mark` makes every parameter a
store adopts a :class:`StoredParameter` (the same object, its class
changed, as torch's own ``UninitializedParameter.materialize`` does), whose
``__torch_function__`` sees every torch operation on it:

- operations about the parameter rather than its values (``.dtype``,
  ``.shape``, ``.grad``, ``.requires_grad_()``, hooks...) and the engine's
  own ``param.data = ...`` go through unchanged;
- an operation that only reads the values (``p.norm()``, ``p.sum()``,
  ``p.clone()``, ``p.cpu()``, ``torch.save(p.clone())``, ``ema.lerp_(p, w)``)
  runs on the real values, fetched for it and let go after;
- an operation whose result would share the parameter's memory
  (``.data``, ``.detach()``, slices, ``.view``, ``.t()``) raises a
  ValueError naming ``engine.gathered([p])``: the memory it would point
  at is a swap buffer given to another parameter next;
- an in-place write (``p.mul_(x)``, ``p.copy_(x)``, ``p[0] = 1``,
  ``p.data = t``) stores the new values before a trainer steps the
  parameter, and raises a ValueError naming ``engine.gathered([p],
  modify=True)`` once one does: its master weights would silently undo the
  write at the next step;
- after the trainer is closed every read raises (the values are gone), and
  so does a read from another thread than the one that made the store
  (fetching is not locked against the training thread's).

Inside an ``Init`` block or a trainer's forward, the torch function modes
of :mod:`aio.zero.init_guard` see each operation first and keep their own
rules. Only parameters that show placeholders are marked (not those a CPU
model keeps in memory); every torch operation on one, fetched or not, goes
through this Python ``__torch_function__`` (~10 us, a few percent of a
small model's forward with its parameters on the drive).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Any

import torch

# Operations on a placeholder that are about the placeholder, not the values.
PASS_NAMES = {
    "to", "float", "half", "bfloat16", "double", "cpu", "cuda", "type", "requires_grad_",
    "dtype", "device", "requires_grad", "grad", "is_meta", "is_cuda", "layout", "names",
    "_is_view", "is_leaf", "grad_fn", "_backward_hooks", "_post_accumulate_grad_hooks",
    "__repr__", "__format__", "__hash__", "__reduce_ex__", "__deepcopy__",
    "data_ptr", "is_floating_point", "is_complex", "element_size",
}  # fmt: skip
# The same, for code outside an Init block. A conversion (``p.float()``) is
# about the placeholder only inside ``Module._apply`` (``model.to()``): the
# store decides where values live; elsewhere it reads the values.
_CONVERSIONS = {"to", "float", "half", "bfloat16", "double", "cpu", "cuda", "type"}
_METADATA = PASS_NAMES - _CONVERSIONS - {"__repr__", "__format__", "__reduce_ex__", "__deepcopy__"} | {
    "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "retains_grad",
    "is_sparse", "is_quantized", "is_nested", "is_mkldnn", "is_sparse_csr", "is_xpu", "is_mps",
    "itemsize", "nbytes", "stride", "is_contiguous", "storage_offset", "untyped_storage",
    "get_device", "is_inference", "_version", "_base", "_has_compatible_shallow_copy_type",
    "is_pinned", "share_memory_", "__setstate__", "__dir__", "_cdata", "output_nr",
}  # fmt: skip
SHAPE_NAMES = {"shape", "size", "dim", "ndim", "numel", "nelement", "__len__"}
# Files whose frames sit between a torch call and its __torch_function__.
_HANDLING = (
    "torch/overrides.py", "torch/utils/_device.py", "aio/zero/stored_param.py", "aio/zero/init_guard.py",
)  # fmt: skip
# Results that always share the parameter's memory: refused without a read.
_VIEWS = {"data", "detach", "view", "view_as", "__getitem__", "t", "T", "mT", "H", "expand", "as_strided"}
_INPLACE_DUNDERS = {
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__",
}  # fmt: skip


def torch_function_name(func: Any) -> str:
    """The name of a torch function: a property's getter and setter are
    `__get__`/`__set__` of a descriptor named for the property; the getter is
    named for the property, the setter ``set:<property>``."""
    name = getattr(func, "__name__", "")
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and owner is not None and hasattr(owner, "__name__"):
        return owner.__name__ if name == "__get__" else f"set:{owner.__name__}"
    return name


def shallow_args(args: tuple, kwargs: dict) -> list[Any]:
    """The arguments, and the items of list/tuple arguments (torch.cat's), one level deep."""
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def mark(param: Any) -> None:
    """Make `param` (just adopted by a store) a :class:`StoredParameter`. A
    parameter of another subclass keeps its class (and the old behaviour:
    reads between uses see the placeholder)."""
    if type(param) is torch.nn.Parameter:
        param.__class__ = StoredParameter


def loaded_marker(param: Any) -> Any:
    """An empty tensor that ``load_state_dict()`` copies into `param`'s
    placeholder once its values went to the store: the copy moves nothing
    and :class:`StoredParameter` lets it through."""
    t = torch.empty(0, dtype=param.dtype, device=param.device)
    t._aio_loaded = True  # type: ignore[attr-defined]
    return t


class StoredParameter(torch.nn.Parameter):
    """An ``nn.Parameter`` whose values an aio.zero store keeps: reads
    between uses get the values, views and late writes a ValueError (see
    the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        stored = [t for t in shallow_args(args, kwargs) if _is_placeholder(t)]
        if stored:
            name = torch_function_name(func)
            if not _passes(name, stored[0], args):
                return _between_uses(func, name, unique_tensors(stored), args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self) -> str:  # type: ignore[override]  # nn.Parameter's takes no arguments
        store: Any = getattr(self, "_aio_store", None)
        placeholder = _is_placeholder(self)
        if placeholder and (store.closed or threading.get_ident() != store.thread):
            # No fetch: a debugger's repr must not raise, nor fetch from
            # another thread than the training one (_check_use).
            p: Any = self
            why = "its trainer is closed" if store.closed else "values not read from this thread"
            return f"Parameter {p.aio_name!r} of shape {tuple(p.aio_shape)} ({why})"
        with store.gathered([self]) if placeholder else contextlib.nullcontext():
            with torch._C.DisableTorchFunctionSubclass():
                # As torch prints its own parameters, not as a subclass.
                return repr(torch.nn.Parameter(self.detach(), self.requires_grad))

    def __reduce_ex__(self, proto: Any) -> Any:
        # A plain Parameter with the values: the store, its hooks and names
        # are this process's, not the pickle's.
        if _is_placeholder(self):
            _refuse(self, "pickled (torch.save)", "torch.save(model.state_dict())")
        return (torch._utils._rebuild_parameter, (self.data, self.requires_grad, OrderedDict()))

    def __deepcopy__(self, memo: dict) -> Any:
        if id(self) in memo:
            return memo[id(self)]
        if _is_placeholder(self):
            remedy = "a new model built the same way, then new.load_state_dict(model.state_dict())"
            _refuse(self, "deep-copied", remedy)
        result = torch.nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = result
        return result


def _is_placeholder(t: Any) -> bool:
    store = getattr(t, "_aio_store", None) if isinstance(t, StoredParameter) else None
    return store is not None and bool(store.is_placeholder(t))


def _passes(name: str, p: Any, args: tuple) -> bool:
    """Whether an operation on placeholder `p` goes through unchanged."""
    if name in _METADATA or name in SHAPE_NAMES:
        return True
    if name.startswith("set:"):
        # The engine's own assignments are placeholders (its materialising
        # happens while the parameter is acquired, so not a placeholder);
        # a full-size value is the user's, and a write.
        value = args[1] if len(args) > 1 else None
        full = isinstance(value, torch.Tensor) and value.numel() == p.aio_numel > 0
        return not (name == "set:data" and full)
    if name in _CONVERSIONS:
        return _called_from(torch.nn.Module._apply.__code__, within=2)
    if name == "detach":
        # Module.state_dict(): its hooks put the values in (state_dict.py)
        return _called_from(torch.nn.Module._save_to_state_dict.__code__, within=1)
    # load_state_dict() copying the empty marker its hook left (state_dict.py)
    return name == "copy_" and len(args) > 1 and getattr(args[1], "_aio_loaded", False)


def _called_from(code: Any, within: int) -> bool:
    """Whether the torch operation being handled was called by `code` itself
    or from at most `within` - 1 frames below it (``Module._apply`` converts
    each parameter through a small closure). Frames of torch function
    handling in between (``__torch_function__`` of modes and subclasses,
    torch.overrides, a ``torch.device`` context) do not count. Exact and
    per call, unlike a flag an exception could leave set."""
    import sys

    frame: Any = sys._getframe(2)  # the caller of _passes' caller
    seen = 0
    while frame is not None and seen < within:
        if frame.f_code is code:
            return True
        if frame.f_code.co_name != "__torch_function__" and not frame.f_code.co_filename.endswith(_HANDLING):
            seen += 1
        frame = frame.f_back
    return False


def _written(name: str, args: tuple, kwargs: dict) -> list[Any]:
    """The tensors an operation writes in place: the first argument of an
    in-place method or operator (its items for ``_foreach_*_``), and ``out=``."""
    out = kwargs.get("out")
    written = list(out) if isinstance(out, (list, tuple)) else [out] if out is not None else []
    inplace = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))
    if inplace and args:
        written.extend(args[0] if isinstance(args[0], (list, tuple)) else [args[0]])
    return written


def _between_uses(func: Any, name: str, stored: list[Any], args: tuple, kwargs: dict) -> Any:
    """Run `func` on the real values of the placeholders in `stored` (see the
    module docstring for what is refused)."""
    store = _check_use(name, stored)
    if name == "set:data":
        return _assign(stored[0], args[1])
    if name in _VIEWS:
        _refuse(stored[0], f"viewed ({name!r})", _remedy(store))
    if len(stored) > 1 and name.startswith("_foreach_"):
        return _per_index(func, args, kwargs)
    if store.swapper is not None and len(stored) > store.swapper_buffer_count():
        raise ValueError(
            f"{name!r} reads {len(stored)} parameters at once between uses, more than the "
            f"{store.swapper_buffer_count()} parameter swap buffers: read them a few at a time "
            "(a loop, or with engine.gathered(params): ...), or all through model.state_dict()"
        )
    written = [p for p in stored if any(p is w for w in _written(name, args, kwargs))]
    if written and store.trained:
        _refuse(written[0], f"changed in place ({name!r})", _remedy(store, modify=True))
    store.acquire(stored)
    try:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if any(out is p for p in stored) and all(out is not p for p in written):
                # A conversion that changed nothing (p.float() of an fp32
                # parameter) returns the parameter: a placeholder again below.
                out = torch.Tensor.clone(out)
        if _shares_memory(stored, out):
            _refuse(stored[0], f"viewed ({name!r})", _remedy(store))
    except BaseException:
        store.drop(stored)
        raise
    try:
        store.put_back(written)
    finally:
        store.drop([p for p in stored if all(p is not w for w in written)])
    return out


def _check_use(name: str, stored: list[Any]) -> Any:
    """The store of `stored`, once it may be used here (its own thread, open)."""
    store = stored[0]._aio_store
    if any(p._aio_store is not store for p in stored):
        raise ValueError(f"{name!r} uses parameters of two aio.zero trainers at once")
    if threading.get_ident() != store.thread:
        # acquire/drop, the buffer pools and uploads belong to the training thread.
        raise ValueError(
            f"parameter {stored[0].aio_name!r} is read ({name!r}) between uses from another thread than "
            "the one that trains it; read it in the training thread (or from model.state_dict() there)"
        )
    if store.closed:
        _refuse(stored[0], f"read ({name!r})", "model.state_dict() or engine.save_pretrained() before close")
    return store


def _assign(p: Any, value: Any) -> None:
    """``p.data = value`` (full size) on a placeholder: the new values are
    stored (before a trainer steps `p`), else refused."""
    store = p._aio_store
    if store.trained:
        _refuse(p, "assigned (.data =)", _remedy(store, modify=True))
    store.write(p, value.detach().reshape(-1).cpu(), async_op=False)


def _remedy(store: Any, modify: bool = False) -> str:
    """The way that works for a view or a write, with or without a trainer."""
    if modify:
        return "with engine.gathered([p], modify=True): ... (the next step goes on from those values)"
    if store.trained:
        return "with engine.gathered([p]): ... around the use"
    return "model.state_dict(), or engine.gathered([p]) once aio.zero.initialize() made the trainer"


def _per_index(func: Any, args: tuple, kwargs: dict) -> Any:
    """A ``torch._foreach_*`` operation (an EMA's ``_foreach_lerp_``) over
    stored parameters, one index at a time: each parameter is fetched on
    its own, not all at once. Foreach operations are elementwise per list
    entry, so the results are the same bits."""
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))

    def pick(a: Any, i: int) -> Any:
        return [a[i]] if isinstance(a, (list, tuple)) and len(a) == n else a

    outs = [func(*(pick(a, i) for a in args), **{k: pick(v, i) for k, v in kwargs.items()}) for i in range(n)]
    return None if all(o is None for o in outs) else [o[0] for o in outs]


def _shares_memory(params: list[Any], out: Any) -> bool:
    """Whether a tensor in `out` (other than a parameter itself, which an
    in-place operation returns) shares the memory of one of `params`."""
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten(out)
    ptrs = {p.untyped_storage().data_ptr() for p in params}
    return any(
        isinstance(t, torch.Tensor)
        and t.layout == torch.strided  # a sparse result has no storage to share
        and all(t is not p for p in params)
        and t.untyped_storage().data_ptr() in ptrs
        for t in flat
    )


def unique_tensors(params: list[Any]) -> list[Any]:
    """`params` without repeats, by identity (tensors compare by value), in order."""
    out: list[Any] = []
    for p in params:
        if all(q is not p for q in out):
            out.append(p)
    return out


def _refuse(p: Any, what: str, remedy: str) -> None:
    raise ValueError(
        f"parameter {p.aio_name!r} (shape {tuple(p.aio_shape)}) is {what} between uses, while aio.zero "
        f"keeps its values on the {'drive' if p._aio_store.swapper is not None else 'host'}; use {remedy}. "
        "Reads that make new tensors (p.norm(), p.clone(), p.cpu()) work as they are"
    )
