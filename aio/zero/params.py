"""Where the model's parameters live between uses, and how they come back.

A :class:`ParamStore` owns every parameter of a model as one *partition*
(one flat tensor in the training dtype), either on the drive through
:class:`aio.swap.ParamSwapper` (``offload_param.device: nvme``) or in CPU
memory (``cpu``/``none``). While a parameter is not in use its ``.data`` is
an empty placeholder; ``param.aio_shape`` / ``param.aio_numel`` keep its
real shape. :class:`Fetcher` installs the module hooks that bring a module's
parameters in right before its forward (and its backward) and let them go
right after, prefetching the next modules in the execution order recorded on
the first pass.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from ..swap import ParamSwapper, PoolExhaustedError, State, SwapStateError


def check_fits(cfg: Any, name: str, numel: int) -> None:
    """Raise a config error if a parameter of `numel` elements cannot be swapped."""
    from ..config import ConfigError

    p = cfg.offload.offload_param
    if cfg.param_device == "nvme" and numel > p.buffer_size:
        raise ConfigError(
            [
                (
                    "zero_optimization.offload_param.buffer_size",
                    f"{p.buffer_size} elements is smaller than parameter {name!r} "
                    f"({numel} elements); set it to at least {numel}",
                )
            ]
        )


_M_MMAP_THRESHOLD = -3
_malloc_bounded = False


def bound_malloc() -> None:
    """Make glibc return large freed blocks to the OS.

    glibc raises its mmap threshold each time a large mmapped block is freed
    (up to 32 MiB), after which parameter-sized tensors come from the heap and
    their memory stays in the process when freed: building or streaming a
    model through memory would then leave RSS growing with model size. A fixed
    1 MiB threshold keeps every tensor of 1 MiB or more in its own mapping,
    returned on free. Process-wide; a no-op where mallopt is unavailable.
    """
    global _malloc_bounded
    if _malloc_bounded:
        return
    _malloc_bounded = True
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):  # not glibc
        pass


def trim_malloc() -> None:
    """Give free heap memory back to the OS (after building a model)."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _placeholder(dtype: Any, device: Any) -> Any:
    import torch

    return torch.empty(0, dtype=dtype, device=device)


class ParamStore:
    """Owns parameter partitions (drive or CPU memory) and hands them out.

    ``acquire``/``drop`` are reference counted per parameter; a parameter is
    materialised (``.data`` set to its full tensor) while its count is > 0.
    """

    def __init__(self, cfg: Any, device: Any = None) -> None:
        import torch

        self.cfg = cfg
        self.dtype = cfg.torch_dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.on_drive = cfg.param_device == "nvme"
        self.swapper: ParamSwapper | None = None
        if self.on_drive:
            bound_malloc()
            p = cfg.offload.offload_param
            self.swapper = ParamSwapper(
                str(p.nvme_path),
                dtype=self.dtype,
                buffer_count=p.buffer_count,
                buffer_size=p.buffer_size,
                max_in_cpu=p.max_in_cpu,
                pin_memory=p.pin_memory,
                aio=cfg.offload.aio.handle_kwargs(),
                min_swap_bytes=cfg.persistence_threshold * torch.empty(0, dtype=self.dtype).element_size(),
            )
        self.resident: dict[int, Any] = {}  # part_id -> flat CPU tensor (memory backend)
        self.params: dict[int, Any] = {}  # part_id -> weakref to the Parameter
        self.refs: collections.Counter[int] = collections.Counter()
        self.speculative: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.next_part_id = 0
        self.buffer_ptrs: set[int] = set()  # storages of swap buffers (see linear.py)
        self.closed = False

    # -- adoption ------------------------------------------------------------------------
    def adopt(self, param: Any, name: str = "") -> None:
        """Take ownership of `param`: its current values become the stored
        copy (in the training dtype) and its ``.data`` becomes a placeholder
        (or, in CPU memory on a CPU model, the stored copy itself)."""
        import torch

        if getattr(param, "_aio_store", None) is not None:
            if param._aio_store is not self:
                raise ValueError(f"parameter {name!r} already belongs to another aio.zero trainer")
            return
        self._check_open()
        numel = param.numel()
        check_fits(self.cfg, name or f"#{self.next_part_id}", numel)
        part_id = self.next_part_id
        self.next_part_id += 1
        src = param.detach().reshape(-1).to(self.dtype)
        param.aio_shape = tuple(param.shape)
        param.aio_numel = numel
        param.aio_id = part_id
        param.aio_name = name
        if self.swapper is not None:
            self.swapper.register(part_id, numel)
            self.swapper.write(part_id, src.cpu())
        else:
            host = torch.empty(numel, dtype=self.dtype, pin_memory=self.device.type == "cuda")
            host.copy_(src)
            self.resident[part_id] = host
        del src
        param._aio_store = self
        self.params[part_id] = weakref.ref(param)
        if self._stays_materialised(part_id):
            param.data = self._host(part_id).view(param.aio_shape)
        else:
            param.data = _placeholder(self.dtype, self.device)

    def _host(self, part_id: int) -> Any:
        if self.swapper is None:
            return self.resident[part_id]
        return self.swapper.parts[part_id].tensor

    def _stays_materialised(self, part_id: int) -> bool:
        """A CPU model whose partition lives in CPU memory can keep pointing at it."""
        if self.device.type != "cpu":
            return False
        if self.swapper is None:
            return True
        return self.swapper.parts[part_id].state == State.RESIDENT

    def on_drive_part_ids(self, params: Iterable[Any]) -> list[int]:
        """The part ids of `params` that are swapped, i.e. not kept resident in CPU
        memory; always empty with the memory backend."""
        if self.swapper is None:
            return []
        return [p.aio_id for p in params if self.swapper.parts[p.aio_id].state != State.RESIDENT]

    # -- use ---------------------------------------------------------------------------
    def acquire(self, params: list[Any]) -> None:
        """Materialise `params` (reads them from the drive if needed)."""
        self._check_open()
        todo = []
        for p in params:
            part_id = p.aio_id
            self.refs[part_id] += 1
            if self.refs[part_id] == 1:
                self.speculative.pop(part_id, None)
                if not self._stays_materialised(part_id):
                    todo.append(p)
        if not todo:
            return
        if self.swapper is not None:
            part_ids = [p.aio_id for p in todo]
            parts = self.swapper.parts
            need = sum(
                1
                for part_id in part_ids
                if parts[part_id].lease is None and parts[part_id].state != State.RESIDENT
            )
            self._make_room(need)
            try:
                tensors = self.swapper.swap_in(part_ids)
            except BaseException:
                for p in params:
                    self.refs[p.aio_id] -= 1
                    if self.refs[p.aio_id] <= 0:
                        del self.refs[p.aio_id]
                raise
        else:
            tensors = [self.resident[p.aio_id] for p in todo]
        for p, t in zip(todo, tensors, strict=True):
            self._materialise(p, t)

    def _materialise(self, p: Any, host: Any) -> None:
        if self.device.type == "cpu":
            if self.swapper is not None:
                self.buffer_ptrs.add(host.untyped_storage().data_ptr())
            p.data = host.view(p.aio_shape)
        else:
            # The pinned host copy goes up on a side stream; the compute
            # stream waits for it, so the host buffer is free to reuse after.
            import torch

            stream = _side_stream(self.device)
            with torch.cuda.stream(stream):
                dev = host.view(p.aio_shape).to(self.device, non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            stream.synchronize()
            p.data = dev

    def drop(self, params: list[Any], keep: set[int] | None = None) -> None:
        """Undo acquire(); parameters no longer in use go back to placeholders.
        Those in `keep` (needed again soon) keep their buffer for now."""
        release = []
        for p in params:
            part_id = p.aio_id
            if self.refs[part_id] <= 0:
                continue
            self.refs[part_id] -= 1
            if self.refs[part_id] == 0:
                del self.refs[part_id]
                if self._stays_materialised(part_id):
                    continue
                p.data = _placeholder(self.dtype, self.device)
                if self.swapper is not None:
                    if keep is not None and part_id in keep:
                        self.speculative[part_id] = None
                    else:
                        release.append(part_id)
        if release and self.swapper is not None:
            self.swapper.release(release)

    def prefetch(self, part_ids: list[int], limit: int) -> None:
        """Start reading partitions needed soon, keeping `limit` buffers free."""
        if self.swapper is None or not part_ids:
            return
        room = self.swapper.pool.available() - limit
        want = [part_id for part_id in part_ids if self.swapper.parts[part_id].state == State.ON_DRIVE][
            : max(room, 0)
        ]
        if want:
            self.swapper.prefetch(want)
            for part_id in want:
                if self.swapper.parts[part_id].lease is not None and self.refs[part_id] == 0:
                    self.speculative[part_id] = None

    def _make_room(self, need: int) -> None:
        assert self.swapper is not None
        while self.swapper.pool.available() < need and self.speculative:
            part_id, _ = self.speculative.popitem(last=False)
            self.swapper.release([part_id])
        if self.swapper.pool.available() < need:
            in_use = sum(1 for part_id in self.refs if self.swapper.parts[part_id].lease is not None)
            raise PoolExhaustedError(
                f"{need} more parameter swap buffers needed but {in_use} of "
                f"{self.swapper.pool.count} hold parameters in use; raise "
                "zero_optimization.offload_param.buffer_count"
            )

    def release_all(self) -> None:
        """Drop every parameter still held (end of a backward pass)."""
        held = [p for part_id in list(self.refs) if (p := self.params[part_id]()) is not None]
        for p in held:
            self.refs[p.aio_id] = 1  # so that one drop() releases it
        self.drop(held)

    # -- values --------------------------------------------------------------------------
    def read(self, param: Any) -> Any:
        """A CPU copy of a parameter's stored values (flat, training dtype)."""
        import torch

        part_id = param.aio_id
        if self.swapper is None:
            return self.resident[part_id].clone()
        part = self.swapper.parts[part_id]
        self.swapper.wait([part_id])
        if part.state == State.INVALID:
            raise SwapStateError(
                f"parameter {param.aio_name!r}: its drive copy is invalid after a failed write"
            )
        if part.state == State.RESIDENT or part.lease is not None:
            return part.tensor.clone()
        out = torch.empty(part.numel, dtype=self.dtype)
        self.swapper.reader.sync_pread(out, self.swapper.file.path, part.offset)
        return out

    def write(self, param: Any, flat: Any, async_op: bool = True) -> None:
        """Store new values (flat, any float dtype; converted). The caller may
        reuse `flat` right away: an asynchronous write goes from a copy."""
        part_id = param.aio_id
        if self.swapper is None:
            self.resident[part_id].copy_(flat)
        else:
            # The write outlives this call when async: it must own its source.
            src = flat.to(self.dtype, copy=async_op)
            self.swapper.write(part_id, src, async_op=async_op)
        if self.refs.get(part_id, 0) > 0 and not self._stays_materialised(part_id):
            # In use right now (e.g. inside gathered()): refresh the live copy too.
            self._materialise(param, self._host(part_id))

    def settle(self, params: list[Any]) -> None:
        """Wait for these parameters' pending writes (raises a failed one)."""
        if self.swapper is not None:
            self.swapper.wait([p.aio_id for p in params])

    def synchronize(self) -> None:
        """Wait for every parameter read and write in flight; raises the first failure."""
        if self.swapper is not None:
            self.swapper.synchronize()

    @contextlib.contextmanager
    def gathered(self, params: list[Any], modify: bool = False) -> Iterator[None]:
        """Materialise `params` for use outside forward/backward; with
        `modify`, whatever the block writes into them is stored on exit."""
        params = [p for p in params if getattr(p, "_aio_store", None) is self]
        self.acquire(params)
        try:
            yield
            if modify:
                for p in params:
                    if not self._stays_materialised(p.aio_id):
                        self.write(p, p.data.detach().reshape(-1).cpu(), async_op=False)
        finally:
            self.drop(params)

    # -- checkpoint -------------------------------------------------------------------------
    def export_checkpoint(self, directory: str) -> None:
        """Write every partition's stored values to `directory` (the swapper's data
        file and manifest, or ``params.pt`` in memory), durably, with a
        ``complete`` marker; `directory` must not exist or be empty."""
        if self.swapper is not None:
            self.swapper.export_checkpoint(directory)
            return
        from ..swap.storage import checkpoint_dir, save_plain

        with checkpoint_dir(directory) as tmp:
            save_plain(dict(self.resident), f"{tmp}/params.pt", "the parameters")

    def verify_checkpoint(self, directory: str) -> Any:
        """Check a checkpoint completely without changing anything."""
        if self.swapper is not None:
            return self.swapper.verify_checkpoint(directory)
        from ..swap.storage import load_plain, require_complete

        require_complete(directory)
        saved = load_plain(f"{directory}/params.pt")
        if not isinstance(saved, dict) or set(saved) != set(self.resident):
            raise ValueError(f"{directory}: checkpoint parameters do not match this model")
        for part_id, t in saved.items():
            if not hasattr(t, "shape") or t.shape != self.resident[part_id].shape or t.dtype != self.dtype:
                raise ValueError(f"{directory}: parameter {part_id} has a different size or dtype")
        return saved

    def apply_checkpoint(self, directory: str, verified: Any) -> None:
        """Load a checkpoint verify_checkpoint() accepted."""
        if self.swapper is not None:
            self.swapper.apply_checkpoint(directory, verified)
        else:
            for part_id, t in verified.items():
                self.resident[part_id].copy_(t)
        for part_id in self.refs:
            p = self.params[part_id]()
            if p is not None and not self._stays_materialised(part_id):
                self._materialise(p, self._host(part_id))

    # -- accounting --------------------------------------------------------------------------
    def pinned_bytes(self) -> int:
        """Bytes page-locked for the parameters right now: the swapper's buffers
        and pinned CPU-resident partitions (nothing with ``pin_memory`` false), or
        with the memory backend the partitions torch pinned for a GPU model."""
        if self.swapper is not None:
            return self.swapper.pinned_bytes()
        return sum(t.nbytes for t in self.resident.values() if _is_pinned(t))

    def stats(self) -> dict[str, Any]:
        """The swapper's stats(), or in memory ``partitions`` and ``resident_bytes``."""
        if self.swapper is not None:
            return self.swapper.stats()
        return {
            "partitions": len(self.resident),
            "resident_bytes": sum(t.nbytes for t in self.resident.values()),
        }

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("the aio.zero parameter store is closed")

    def close(self) -> None:
        """Close the swapper (I/O finished, swap files removed); idempotent. Acquiring
        or adopting afterwards raises ValueError."""
        if self.closed:
            return
        self.closed = True
        if self.swapper is not None:
            self.swapper.close()


def _is_pinned(t: Any) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # CPU-only builds may refuse to answer
        return False


_streams: dict[Any, Any] = {}


def _side_stream(device: Any) -> Any:
    import torch

    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def module_params(module: Any) -> list[Any]:
    """The module's own parameters (not its children's), deduplicated."""
    seen: dict[int, Any] = {}
    for p in module.parameters(recurse=False):
        seen.setdefault(id(p), p)
    for p in getattr(module, "_aio_external_params", ()):
        seen.setdefault(id(p), p)
    return list(seen.values())
