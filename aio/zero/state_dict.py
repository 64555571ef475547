"""``Module.state_dict()`` of a model whose parameters aio.zero keeps: the
real values, never the empty placeholders the parameters show between uses.

Every module of a model built under :class:`aio.zero.Init` or wrapped by
:func:`aio.zero.initialize` gets two state-dict hooks (:func:`watch`). The
post hook replaces each of the module's stored parameters that shows its
placeholder with a CPU copy of its values, read from where the store keeps
them, one parameter at a time; tied parameters (one parameter under two
keys) share one tensor, as they do in torch's own state dict. So
``model.state_dict()``, ``torch.save(model.state_dict(), f)`` and Hugging
Face's ``save_pretrained()`` (which calls ``state_dict()``) save the trained
weights. The dict holds the whole model in memory: the pre hook of the
module ``state_dict()`` is called on refuses up front (a MemoryError naming
the streamed ways: :meth:`OffloadTrainer.save_pretrained`, ``aio-export``)
when that would not fit in the memory available.

``load_state_dict()`` stores the values it is given for the parameters
(before a trainer steps them; then it is refused, naming the ways that
work). ``state_dict(keep_vars=True)`` holds the parameters themselves (as
``named_parameters()`` does): nothing is read for them. Inside an ``Init``
block nothing is read either: transformers' ``from_pretrained`` walks the
state dict of the model it fills, and the Init guard answers its
``detach()`` with meta tensors of the right shape.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from .stored_param import loaded_marker

# Refused when the values to read exceed this share of the memory available.
_MEMORY_SHARE = 0.9


def watch(store: Any, module: Any) -> None:
    """Install the state-dict hooks on `module` (once per module) so that its
    parameters owned by `store` appear in ``state_dict()`` with their values."""
    if module.__dict__.get("_aio_state_dict_store") is not None:
        return
    module.__dict__["_aio_state_dict_store"] = store
    reader = _Reader(store)
    # Plain functions: torch marks a public hook with an attribute, which a
    # bound method cannot take.
    module.register_state_dict_pre_hook(functools.partial(_Reader.before, reader))
    module.register_state_dict_post_hook(functools.partial(_Reader.after, reader))
    module.register_load_state_dict_pre_hook(functools.partial(_Reader.load, reader))


class _Reader:
    """The hooks of one module; tensors read in one ``state_dict()`` call are
    shared through the store's cache (see :func:`_cache_for`)."""

    def __init__(self, store: Any) -> None:
        self.store = weakref.ref(store)

    def before(self, module: Any, prefix: str, keep_vars: bool) -> None:
        """On the module ``state_dict()`` was called on (empty prefix): refuse
        before anything is read if the values cannot fit in memory."""
        store = self.store()
        if store is None or prefix or keep_vars or store.on_host:
            return
        need = sum(p.aio_numel * p.element_size() for p in _unique_params(module) if store.is_placeholder(p))
        if need:  # values kept in memory (a closed memory backend's) are still there
            _check_open(store)
            _check_memory(need)

    def after(self, module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        """Replace this module's placeholders in `state_dict` with their values."""
        store = self.store()
        if store is None or store.on_host:
            return
        for name, p in module._parameters.items():
            key = prefix + name
            if p is None or getattr(p, "_aio_store", None) is not store or key not in state_dict:
                continue
            if state_dict[key] is p or not _needs_copy(store, p):
                continue  # keep_vars=True, or torch took values the parameter keeps
            _check_open(store)
            state_dict[key] = _read(store, p, state_dict)
        if not prefix:  # the module state_dict() was called on: the call is over
            store.__dict__.pop("_state_dict_cache", None)

    def load(self, module: Any, state_dict: Any, prefix: str, local_metadata: Any, *rest: Any) -> None:
        """``load_state_dict()``: the values of this module's stored parameters
        go to the store (a placeholder cannot take them); torch then copies
        an empty tensor into the placeholder. Once a trainer steps the
        parameters, their master weights would overwrite such values:
        refused there, naming the ways that work."""
        store = self.store()
        if store is None or store.on_host:
            return
        if store.trained:
            _refuse_trained(store, module, state_dict, prefix, local_metadata)
        error_msgs = rest[-1]
        for name, p in module._parameters.items():
            key = prefix + name
            if p is None or key not in state_dict or not store.is_placeholder(p):
                continue
            _check_loadable(store, key, local_metadata)
            v = state_dict[key]
            if tuple(v.shape) != tuple(p.aio_shape):
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {tuple(v.shape)} from "
                    f"checkpoint, the shape in current model is {tuple(p.aio_shape)}."
                )
            else:
                store.write(p, v.detach().reshape(-1).cpu(), async_op=False)
            state_dict[key] = loaded_marker(p)  # torch's copy into the placeholder moves nothing


def _refuse_trained(store: Any, module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:
    """Refuse a load into parameters a trainer steps (resident ones included:
    torch would copy into them, and the next step would overwrite that),
    before torch copies anything: at the module load_state_dict() was called
    on (its hook runs first) for the whole tree, else for this module."""
    owned = module.named_parameters(prefix=prefix.rstrip("."), recurse=not prefix)
    for key, q in owned:
        if getattr(q, "_aio_store", None) is store and key in state_dict:
            _check_loadable(store, key, local_metadata)


def _check_loadable(store: Any, key: str, local_metadata: Any) -> None:
    _check_open(store)
    if store.trained:
        raise ValueError(
            f"load_state_dict() into {key!r}, a parameter an aio.zero trainer steps: its fp32 master "
            "weights would overwrite the values at the next step. Restore a checkpoint with "
            "engine.load_checkpoint(dir), or change values inside `with engine.gathered(params, "
            "modify=True):`, or load the weights before aio.zero.initialize()"
        )
    if local_metadata.get("assign_to_params_buffers"):
        raise ValueError(
            f"load_state_dict(assign=True) would replace {key!r}, a parameter aio.zero stores, "
            "with a tensor it does not own; load without assign=True"
        )


def _needs_copy(store: Any, p: Any) -> bool:
    """Whether `p`'s entry must be read from the store: a placeholder, or values
    in a swap buffer that will hold another parameter once `p` is let go."""
    return store.is_placeholder(p) or not store.keeps_values_of(p)


def _read(store: Any, p: Any, state_dict: Any) -> Any:
    made = _cache_for(store, state_dict)
    t = made.get(p.aio_id)
    if t is None:
        t = store.read(p).view(p.aio_shape)
        made[p.aio_id] = t
    return t


def _cache_for(store: Any, state_dict: Any) -> weakref.WeakValueDictionary:
    """Tensors read for `state_dict` so far, by part id: a tied parameter's
    second key gets the first one's tensor. Weak values: the cache never
    keeps a tensor alive; a new dict, or a write to the store since, starts
    a new cache, so nothing read before a change is handed out after it."""
    key = (id(state_dict), store.generation)
    cache = store.__dict__.get("_state_dict_cache")
    if cache is None or cache[0] != key or (cache[1] is not None and cache[1]() is not state_dict):
        try:
            ref: Any = weakref.ref(state_dict)
        except TypeError:  # a plain dict passed as destination=: compared by id, never held
            ref = None
        cache = (key, ref, weakref.WeakValueDictionary())
        store.__dict__["_state_dict_cache"] = cache
    return cache[2]


def _unique_params(module: Any) -> list[Any]:
    seen: dict[int, Any] = {}
    for p in module.parameters():
        seen.setdefault(id(p), p)
    return list(seen.values())


def _check_open(store: Any) -> None:
    if store.closed:
        raise ValueError(
            "the aio.zero trainer that kept these parameters is closed and their values are gone; "
            "save the model before closing the trainer: engine.save_pretrained(dir), "
            "engine.save_checkpoint(dir) (then aio-export), or model.state_dict()"
        )


def _check_memory(need: int) -> None:
    import psutil

    avail = psutil.virtual_memory().available
    if need > _MEMORY_SHARE * avail:
        raise MemoryError(
            f"state_dict() would hold {need / 2**30:.2f} GiB of parameter values in memory and "
            f"{avail / 2**30:.2f} GiB are available; write the weights streamed, one tensor at a time: "
            "engine.save_pretrained(dir) (safetensors shards), or engine.save_checkpoint(dir) and "
            "`aio-export CHECKPOINT_DIR OUT_DIR`"
        )
