"""Module hooks that fetch parameters just before use and release them right
after, with prefetch along the execution order recorded on the first pass.

Forward: a pre-hook materialises the module's own parameters, a post-hook
releases them and wraps the outputs in an identity autograd function whose
backward fetches them again. Backward: each parameter is released when its
gradient has been accumulated (``register_post_accumulate_grad_hook``, which
fires once per backward even for tied weights); frozen parameters (no
gradient, e.g. LoRA's base weights) when the gradient reaches the module's
inputs, wrapped in a second identity function; anything left over at the
end of backward is released then.
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Iterator
from typing import Any

from .linear import count_call
from .params import ParamStore, module_params


class Fetcher:
    """Forward hooks on every module with parameters of its own: fetch them from
    the :class:`ParamStore` right before the module's forward (and, through an
    identity autograd function, before its backward), release them right after.
    The module order of each pass is recorded on the first pass and used to
    prefetch up to `prefetch_bucket_size` elements of drive partitions ahead.
    On a GPU the host uploads at most ``aio_zero.modules_ahead`` modules
    ahead of the GPU (:meth:`ParamStore.pace`).
    :meth:`remove` takes the hooks off."""

    def __init__(self, store: ParamStore, modules: list[Any], prefetch_bucket_size: int) -> None:
        self.store = store
        self.mods = [m for m in modules if module_params(m)]
        self.index = {id(m): i for i, m in enumerate(self.mods)}
        self.mparams = [module_params(m) for m in self.mods]
        self.mdrive = [store.on_drive_part_ids(ps) for ps in self.mparams]
        self.numel = {p.aio_id: p.aio_numel for ps in self.mparams for p in ps}
        self.bucket = prefetch_bucket_size
        # Buffers kept free for the module being fetched (prefetch never takes them).
        self.reserve = max([len(d) for d in self.mdrive] + [1])
        self.traces: dict[str, list[int] | None] = {"fw": None, "bw": None}
        self._registration_order = list(range(len(self.mods)))
        self.recording: list[int] = []
        self.phase: str | None = None
        self.pos = 0
        self.on_trace = True
        self.soon: set[int] = set()
        self.bw_held: dict[int, Any] = {}
        self.counters = {
            "fetches": 0,
            "trace_misses": 0,
            "relearned": 0,
            "guess_misses": 0,
            "recompute_fetches": 0,
        }
        # Per module, a call's forward in progress: the exception being handled
        # when it began (see _post_forward).
        self._open: dict[int, list[BaseException | None]] = {}
        self.handles: list[Any] = []
        for m in self.mods:
            self.handles.append(m.register_forward_pre_hook(self._pre_forward))
            # always_call: also when the forward raises (a device out of memory
            # in a retry loop), so its parameters are not left acquired.
            self.handles.append(m.register_forward_hook(self._post_forward, always_call=True))

    # -- passes ----------------------------------------------------------------------------
    def _begin(self, phase: str) -> None:
        self._end_pass()
        self.phase = phase
        self.pos = 0
        self.recording = []
        self.on_trace = True

    def _end_pass(self) -> None:
        if self.phase is not None and self.recording:
            if self.traces[self.phase] is None or not self.on_trace:
                if self.traces[self.phase] is not None:
                    self.counters["relearned"] += 1
                self.traces[self.phase] = self.recording
        self.phase = None

    def begin_forward(self) -> None:
        """Start a forward pass. Parameters still held for a backward that never ran
        (a forward with grad, then none) are released first."""
        if self.bw_held:  # a forward with grad whose backward never ran
            self.end_backward()
        self._begin("fw")

    def end_backward(self) -> None:
        """End of backward: release every parameter backward still holds, and every
        other parameter still acquired in the store; a backward pass's module order
        becomes its trace if it was the first or left the previous one."""
        held = list(self.bw_held.values())
        self.bw_held.clear()
        self.store.drop(held)
        self.store.release_all()
        if self.phase == "bw":
            self._end_pass()

    # -- fetching ----------------------------------------------------------------------------
    def fetch(self, module: Any, phase: str) -> None:
        """Materialise `module`'s own parameters for `phase` (``"fw"`` or ``"bw"``; a
        change of phase starts a new pass), note the module in the pass's order and
        start prefetching what the trace says comes next. In backward the parameters
        stay held until release_after_backward() or end_backward()."""
        if phase != self.phase:
            self._begin(phase)
        i = self.index[id(module)]
        self.recording.append(i)
        trace = self._expected(phase)
        if self.on_trace:
            if self.pos < len(trace) and trace[self.pos] == i:
                self.pos += 1
            else:
                self.on_trace = False
                self.counters["trace_misses" if self.traces[phase] is not None else "guess_misses"] += 1
        params = self.mparams[i]
        if phase == "bw":
            params = [p for p in params if p.aio_id not in self.bw_held]
            for p in params:
                self.bw_held[p.aio_id] = p
        self.store.pace()
        self.store.acquire(params)
        self.counters["fetches"] += 1
        self._prefetch()

    def _expected(self, phase: str) -> list[int]:
        """The module order `phase` is expected to take: its recorded trace, else
        (the first pass) a guess, so the first step prefetches too (it ran
        about 2x slower than the next without): forward in the modules'
        registration order, backward in the reverse of the forward's trace.
        A guess that misses stops the pass's prefetching, as a trace does."""
        trace = self.traces[phase]
        if trace is not None:
            return trace
        if phase == "fw":
            return self._registration_order
        fw = self.traces["fw"]
        return fw[::-1] if fw is not None else []

    def _upcoming(self) -> Iterator[int]:
        """Module indices expected next: the rest of this pass, then the next
        pass (lazily: the caller stops after a bucket's worth)."""
        if not self.on_trace or self.phase is None:
            return iter(())
        trace = self._expected(self.phase)
        nxt = self.traces["bw" if self.phase == "fw" else "fw"] or []
        return itertools.chain((trace[i] for i in range(self.pos, len(trace))), nxt)

    def _prefetch(self) -> None:
        if self.bucket <= 0 or self.store.swapper is None:
            self.soon = set()
            return
        window: list[int] = []
        total = 0
        for i in self._upcoming():
            for part_id in self.mdrive[i]:
                if total >= self.bucket:
                    break
                if part_id not in window:
                    window.append(part_id)
                    total += self.numel[part_id]
            if total >= self.bucket:
                break
        self.soon = set(window)
        self.store.prefetch(window, limit=self.reserve)

    def _hold_for_recompute(self, module: Any) -> None:
        """Non-reentrant activation checkpointing runs `module`'s forward again
        inside backward, and the tensors it saves (a weight, views of it) are
        used by backward nodes still to run: its parameters are held like
        backward's own (released as their gradients land, frozen ones when the
        gradient reaches the module's inputs), not dropped after this forward.
        No pass bookkeeping: backward's trace and prefetch go on."""
        params = [p for p in self.mparams[self.index[id(module)]] if p.aio_id not in self.bw_held]
        for p in params:
            self.bw_held[p.aio_id] = p
        self.store.acquire(params)
        self.counters["recompute_fetches"] += 1

    def release_frozen(self, module: Any) -> None:
        """`module`'s backward is done: release its parameters that take no
        gradient (frozen ones get no gradient hook to release them)."""
        for p in self.mparams[self.index[id(module)]]:
            if not p.requires_grad and (q := self.bw_held.pop(p.aio_id, None)) is not None:
                self.store.drop([q], keep=self.soon)

    def release_after_backward(self, param: Any) -> None:
        """`param`'s gradient is accumulated: release it if backward holds it (its
        buffer is kept for now when it is about to be needed again)."""
        p = self.bw_held.pop(param.aio_id, None)
        if p is not None:
            self.store.drop([p], keep=self.soon)

    # -- hooks ------------------------------------------------------------------------------
    def _pre_forward(self, module: Any, args: Any) -> Any:
        import torch

        in_checkpoint = _in_non_reentrant_checkpoint()
        if self.phase == "bw" and in_checkpoint:
            self._hold_for_recompute(module)
            return None
        if self.phase != "fw":
            self._begin("fw")
        self.fetch(module, "fw")
        self._open.setdefault(id(module), []).append(sys.exc_info()[1])
        params = self.mparams[self.index[id(module)]]
        if torch.is_grad_enabled():
            count_call(params)
        if torch.is_grad_enabled() and not all(p.requires_grad for p in params):
            # Frozen parameters (LoRA's base weights): the inputs' gradient is
            # complete only after the module's backward, so its identity
            # function on them releases what no gradient hook will.
            new_args, wrapped = _wrap(args, _PostBackward, self, module)
            if wrapped:
                return new_args
        return None

    def _post_forward(self, module: Any, args: Any, output: Any) -> Any:
        import torch

        if self.phase == "bw" and _in_non_reentrant_checkpoint():
            return output  # its parameters stay held: see _hold_for_recompute
        params = self.mparams[self.index[id(module)]]
        calls = self._open.get(id(module))
        if not calls:
            return output  # its pre-forward hook did not acquire them
        # torch calls always_call hooks from the except clause around a forward
        # that raised: a different exception is being handled than when the
        # call began (user code may retry inside its own except clause).
        if calls.pop() is not sys.exc_info()[1]:
            self._forward_failed(params)
            return None
        new_output = output
        if torch.is_grad_enabled():
            # Also a module whose parameters are all frozen: a gradient passing
            # through it to the layers below needs its weights in backward.
            new_output, wrapped = _wrap(output, _PreBackward, self, module)
            if not wrapped and any(p.requires_grad for p in params):
                # No output tensor carries a gradient path we can hook: keep
                # the parameters until the end of backward instead.
                for p in params:
                    if p.aio_id not in self.bw_held:
                        self.bw_held[p.aio_id] = p
                        self.store.acquire([p])
        self.store.drop(params, keep=self.soon)
        return new_output

    def _forward_failed(self, params: list[Any]) -> None:
        """A module's forward raised: its parameters go back now, and its call
        is not counted (no backward will come through it). Left acquired, an
        out-of-memory retry loop kept them, and their buffers, until the next
        backward or for good under no_grad."""
        import torch

        if torch.is_grad_enabled():
            for p in params:
                p.aio_calls = max(0, getattr(p, "aio_calls", 0) - 1)
        self.store.drop(params, keep=self.soon)

    def remove(self) -> None:
        """Take every hook off the modules (idempotent); parameters still held are not released."""
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _in_non_reentrant_checkpoint() -> bool:
    """Whether a forward runs inside torch.utils.checkpoint's non-reentrant
    mode (its saved-tensor hooks are then the innermost): the checkpointed
    forward itself, or, in backward, its recomputation. Known through torch's
    hook stack where torch has it."""
    import torch

    top: Any = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks: Any = top(False) if top is not None else None
    return bool(hooks) and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"


def _wrap(output: Any, fn: Any, fetcher: Fetcher, module: Any) -> tuple[Any, bool]:
    """Route `output`'s tensors that require grad through the identity
    function `fn` (_PreBackward, _PostBackward); whether any did."""
    import torch

    leaves: list[Any] = []

    def collect(o: Any) -> None:
        if torch.is_tensor(o):
            if o.requires_grad:
                leaves.append(o)
        elif isinstance(o, (tuple, list)):
            for x in o:
                collect(x)
        elif isinstance(o, dict):
            for x in o.values():
                collect(x)

    collect(output)
    if not leaves:
        return output, False
    new = fn.apply(fetcher, module, *leaves)
    mapping = {id(t): n for t, n in zip(leaves, new, strict=True)}

    def rebuild(o: Any) -> Any:
        if torch.is_tensor(o):
            return mapping.get(id(o), o)
        if isinstance(o, tuple):
            items = [rebuild(x) for x in o]
            return type(o)(*items) if hasattr(o, "_fields") else type(o)(items)
        if isinstance(o, list):
            return [rebuild(x) for x in o]
        if isinstance(o, dict):
            d = copy.copy(o)
            for k, v in o.items():
                d[k] = rebuild(v)
            return d
        return o

    return rebuild(output), True


def _make_identity(name: str, on_backward: Any) -> Any:
    import torch

    class Identity(torch.autograd.Function):
        """Identity in forward; ``on_backward(fetcher, module)`` when the
        gradient reaches it in backward."""

        @staticmethod
        def forward(ctx: Any, fetcher: Fetcher, module: Any, *tensors: Any) -> Any:
            ctx.fetcher = fetcher
            ctx.module = module
            return tuple(t.detach() for t in tensors)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            on_backward(ctx.fetcher, ctx.module)
            return (None, None, *grads)

    Identity.__name__ = Identity.__qualname__ = name
    return Identity


class _Lazy:
    """An identity autograd function made at first use (torch imported late)."""

    def __init__(self, name: str, on_backward: Any) -> None:
        self.name = name
        self.on_backward = on_backward
        self.fn: Any = None

    def apply(self, *args: Any) -> Any:
        if self.fn is None:
            self.fn = _make_identity(self.name, self.on_backward)
        return self.fn.apply(*args)


# On a module's outputs: fetches its parameters before the module's own backward.
_PreBackward = _Lazy("PreBackward", lambda fetcher, module: fetcher.fetch(module, "bw"))
# On a module's inputs (when it has frozen parameters): its backward is done.
_PostBackward = _Lazy("PostBackward", lambda fetcher, module: fetcher.release_frozen(module))
