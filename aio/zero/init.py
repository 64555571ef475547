"""Building a model without ever holding all of it in memory.

Under ``with aio.zero.Init(config):`` every module's parameters go to the
parameter store (the drive, for ``offload_param.device: nvme``) as soon as
that module's own ``__init__`` returns, so peak memory during construction
is about one module, not the model. What construction code does to a
stored parameter afterwards still happens, on its real values
(:mod:`aio.zero.init_guard`): ``Module.apply`` (the usual
``self.apply(self._init_weights)``) fetches each module's parameters around
the function; any other torch operation on a stored parameter fetches it
around the operation; assigning a new parameter over a stored one (how
transformers' ``from_pretrained`` loads a checkpoint into a model built on
the meta device) stores the new values in its place, tensor by tensor.

A parameter's real shape is ``param.aio_shape`` (inside the block its
``.shape`` answers with it too; outside, ``.shape`` is the placeholder's).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from .config import check_drive_paths, load_train_config
from .init_guard import PlaceholderGuard
from .malloc import trim_malloc
from .params import ParamStore, module_params
from .state_dict import watch


def _subclasses(cls: type) -> list[type]:
    out: list[type] = []
    todo: list[type] = [cls]
    while todo:
        c = todo.pop()
        subs: list[type] = c.__subclasses__()
        out.extend(subs)
        todo.extend(subs)
    return out


# The Inits whose patches are in force (at most one: an Init entered inside
# another does nothing, see Init).
_ACTIVE: list[Init] = []


class Init:
    """Context manager; pass the same config to :func:`aio.zero.initialize`.

    ``device``: where the model computes (default CPU; a CUDA device keeps
    only placeholders there). Construction runs on the host either way:
    weight initialisation inside the block sees host tensors and draws from
    the host RNG, so a model built for a GPU has the values of the same
    model built in memory with the same seed. ``enabled=False`` makes it a no-op (handy for
    one code path with and without offload). So is an Init entered inside
    another, as DeepSpeed's ``zero.Init`` is: the modules built in it go to
    the outer one's store (a warning says so when its config differs), so
    one model never spans two stores.
    """

    def __init__(self, config: Any, device: Any = None, enabled: bool = True) -> None:
        self.cfg = load_train_config(config)  # config errors before anything is allocated
        check_drive_paths(self.cfg)
        self.device = device
        self.enabled = enabled
        self.store: ParamStore | None = None
        self._patched: list[tuple[type, Any]] = []
        self._orig_init_subclass: Any = None
        self._orig_apply: Any = None
        self._orig_register: Any = None
        self._guard: PlaceholderGuard | None = None
        self._nested = False  # entered inside another Init: a no-op

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        import torch

        if self._guard is not None or self._nested:
            # Its second entry would save its own patches as torch's originals.
            raise RuntimeError("this aio.zero.Init is already active: enter it once")
        if _ACTIVE:
            self._nested = True
            if _ACTIVE[-1].cfg != self.cfg:
                warnings.warn(
                    "aio.zero.Init inside another Init does nothing (as DeepSpeed's zero.Init): the "
                    "modules built in it are stored by the outer Init, under its config",
                    stacklevel=2,
                )
            return self
        if self.store is None:
            self.store = ParamStore(self.cfg, self.device)
        store = self.store
        # Construction code (weight init, checkpoint loading) works on host
        # values with the host RNG, as the same build in memory does; the
        # parameters go to the device only when training fetches them.
        store.on_host += 1
        guard = self._guard = PlaceholderGuard(store)

        def wrap(cls: type) -> None:
            orig = cls.__dict__.get("__init__")
            if orig is None or getattr(orig, "_aio_wrapped", False):
                return

            @functools.wraps(orig)
            def init(module: Any, *args: Any, **kwargs: Any) -> None:
                depth = module.__dict__.get("_aio_init_depth", 0)
                module.__dict__["_aio_init_depth"] = depth + 1
                guard.building += depth == 0
                try:
                    orig(module, *args, **kwargs)
                finally:
                    module.__dict__["_aio_init_depth"] = depth
                    guard.building -= depth == 0
                if depth == 0:
                    del module.__dict__["_aio_init_depth"]
                    for name, p in module.named_parameters(recurse=False):
                        store.adopt(p, f"{type(module).__name__}.{name}")
                    watch(store, module)  # state_dict() gives values, not placeholders
                    if guard.building == 0:  # the outermost module: no view of its build is still used
                        guard.close_opened(build_only=True)

            init._aio_wrapped = True  # type: ignore[attr-defined]
            cls.__init__ = init  # type: ignore[misc]
            self._patched.append((cls, orig))

        for cls in _subclasses(torch.nn.Module):
            wrap(cls)
        # Classes defined inside the context get wrapped as they are created.
        self._orig_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls: type, **kw: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kw)  # type: ignore[misc]
            wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]

        self._orig_apply = torch.nn.Module.apply

        def apply(module: Any, fn: Any) -> Any:
            for child in module.children():
                child.apply(fn)
            own = [p for p in module_params(module) if getattr(p, "_aio_store", None) is store]
            with store.gathered(own, modify=True):
                fn(module)
            return module

        torch.nn.Module.apply = apply  # type: ignore[method-assign,assignment]
        self._patch_register_parameter(store)
        guard.__enter__()
        _ACTIVE.append(self)
        return self

    def _patch_register_parameter(self, store: ParamStore) -> None:
        """A new parameter assigned over a stored one (``setattr(module, name,
        Parameter(values))``, as transformers loads checkpoints) has its values
        stored in the old one's place; the module keeps the stored parameter,
        so nothing of the new one stays in memory and ties made earlier hold."""
        import torch

        orig = self._orig_register = torch.nn.Module.register_parameter

        def register_parameter(module: Any, name: str, param: Any) -> None:
            old = module.__dict__.get("_parameters", {}).get(name)
            if (
                param is None
                or old is None
                or getattr(old, "_aio_store", None) is not store
                or getattr(param, "_aio_store", None) is not None
            ):
                return orig(module, name, param)
            if tuple(param.shape) != tuple(old.aio_shape):
                raise ValueError(
                    f"{type(module).__name__}.{name}: a tensor of shape {tuple(param.shape)} replaces "
                    f"a stored parameter of shape {tuple(old.aio_shape)}"
                )
            with torch.no_grad():
                store.write(old, param.detach().reshape(-1).cpu(), async_op=False)
            old.__dict__.update({k: v for k, v in param.__dict__.items() if not k.startswith("aio")})
            old.requires_grad_(param.requires_grad)
            return None

        torch.nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self._nested:
            self._nested = False
            return
        guard, self._guard = self._guard, None
        try:
            if guard is not None:
                guard.__exit__(None, None, None)
                guard.close_opened()
        finally:
            self._restore_torch()  # whatever closing the build raised
        trim_malloc()
        if self.store is not None and exc[0] is None:
            self.store.finish_adoption()  # a failed write raises here, not at first use

    def _restore_torch(self) -> None:
        """Undo __enter__'s patches of torch.nn.Module."""
        import torch

        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self.store is not None:
            self.store.on_host -= 1
        if self._orig_register is not None:
            torch.nn.Module.register_parameter = self._orig_register  # type: ignore[method-assign]
            self._orig_register = None
        for cls, orig in reversed(self._patched):
            cls.__init__ = orig
        self._patched.clear()
        if self._orig_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._orig_init_subclass  # type: ignore[method-assign]
        torch.nn.Module.apply = self._orig_apply  # type: ignore[method-assign]
