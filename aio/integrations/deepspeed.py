"""DeepSpeed runs its ZeRO-3 NVMe offload on aio.

After :func:`enable`, DeepSpeed's parameter swapper and both optimizer
swappers (partitioned and pipelined) get :class:`DeepSpeedAioHandle` wherever
they would have loaded DeepSpeed's JIT-built ``async_io`` op: no libaio-dev,
no op build, every completion checked, errors raised as Python exceptions
instead of return codes.

Three ways in:

- ``import aio.integrations.deepspeed as d; d.enable()`` before
  ``deepspeed.initialize`` (or before the HF Trainer / Lightning strategy
  builds the engine);
- no code change: run the script through ``python -m aio.run train.py ...``
  (also ``torchrun -m aio.run ...`` and ``deepspeed --module aio.run ...``);
- ``AIO_DEEPSPEED=1`` in the environment: any Python process of an
  environment where aio is installed, even one that never imports aio (the
  ``aio_deepspeed.pth`` startup hook, see ``_aio_startup.py``), and any
  process that imports ``aio``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import shutil
import sys
import threading
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from .._log import log_swap_handle, logger, swap_line_pending
from ..future import AioFuture
from ..handle import AsyncIOHandle
from ..pinned import free_locked_tensor, is_locked, new_locked_tensor
from . import ds_folder_lock

SUPPORTED = ((0, 19), (0, 20))  # [lowest, highest) major.minor
SUPPORTED_TEXT = "deepspeed>=0.19,<0.20"

_lock = threading.Lock()
_patched: list[tuple[Any, str, Any]] = []  # (owner, attribute, original)
# DeepSpeed's AsyncIOBuilder as deepspeed.ops.op_builder exports it, kept at
# the first enable(): modules imported while enabled bind aio's class from
# there, and disable() gives them this one back.
_ds_builder: Any = None


def _check_handle_types(ints: dict[str, Any], bools: dict[str, Any]) -> None:
    """TypeError naming ``aio.<key>`` for a setting of the wrong type:
    DeepSpeed passes its ``aio`` block's values through unchecked, and
    ``bool("false")`` is True (DeepSpeed's own op refuses them too)."""
    for name, v in ints.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"aio.{name} must be an integer, got {v!r} ({type(v).__name__})")
    for name, v in bools.items():
        if not isinstance(v, bool) and v not in (0, 1):
            raise TypeError(f"aio.{name} must be true or false, got {v!r} ({type(v).__name__})")


def check_aio_block(block: Any) -> None:
    """ConfigError naming ``aio.<key>`` when a DeepSpeed config's ``aio``
    block is one aio.config refuses (an unknown key such as ``blok_size``,
    a block size that is no multiple of 4096, a string for a number):
    DeepSpeed reads the keys it knows and ignores the rest in silence."""
    from ..config import AioConfig, ConfigError
    from ..config.load import validate

    if block is None:
        return
    if not isinstance(block, Mapping):
        raise ConfigError([("aio", f"must be a block of settings, got {type(block).__name__}")])
    try:
        validate(AioConfig, block)
    except ConfigError as e:
        raise ConfigError([(f"aio.{p}" if p else "aio", m) for p, m in e.problems], e.source) from None


def _file_or_fd(filename: Any, fd: Any) -> Any:
    """The target of an I/O call given as DeepSpeed's ``filename`` or ``fd``
    (exactly one of them)."""
    if (filename is None) == (fd is None):
        raise TypeError("pass exactly one of filename or fd")
    if fd is not None and (isinstance(fd, bool) or not isinstance(fd, int)):
        raise TypeError(f"fd must be an int descriptor, got {type(fd).__name__}")
    return filename if fd is None else fd


def _async_flag(async_op: bool, kwargs: dict[str, Any]) -> bool:
    """Merge DeepSpeed's ``async`` keyword (reserved in Python) into `async_op`."""
    if "async" in kwargs:
        if async_op:
            raise TypeError("pass async or async_op, not both")
        async_op = kwargs.pop("async")
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    return bool(async_op)


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; on Python 3.10 (no add_note) the same list,
    which tracebacks there do not print but callers can read."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


class DeepSpeedAioHandle:
    """DeepSpeed's ``aio_handle`` interface on aio's engine.

    Same constructor (``block_size, queue_depth, single_submit,
    overlap_events, intra_op_parallelism``, DeepSpeed's defaults) and the
    return codes DeepSpeed's swappers assert on: ``async_*`` return 0,
    synchronous calls and ``wait()`` return the number of completed
    operations. Unlike DeepSpeed's op, failures raise (``OSError`` with errno,
    path, offset and length) instead of returning -1 or being printed.
    """

    def __init__(
        self,
        block_size: int = 1024 * 1024,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
        **legacy: Any,
    ) -> None:
        # Older DeepSpeed spelled the thread count num_threads / thread_count.
        for name in ("num_threads", "thread_count"):
            if name in legacy:
                intra_op_parallelism = legacy.pop(name)
        if legacy:
            raise TypeError(f"aio_handle() got unexpected keyword arguments {sorted(legacy)}")
        threads = intra_op_parallelism
        _check_handle_types(
            {"block_size": block_size, "queue_depth": queue_depth, "intra_op_parallelism": threads},
            {"single_submit": single_submit, "overlap_events": overlap_events},
        )
        self._h = AsyncIOHandle(
            block_size=block_size,
            queue_depth=queue_depth,
            single_submit=bool(single_submit),
            overlap_events=bool(overlap_events),
            thread_count=threads,
        )
        # (future, buffer, filename, offset, what) of async requests made with validate=True.
        self._to_validate: list[tuple[AioFuture, Any, Any, int, str]] = []

    @property
    def handle(self) -> AsyncIOHandle:
        """The underlying :class:`aio.AsyncIOHandle` (futures, stats())."""
        return self._h

    # settings
    def get_block_size(self) -> int:
        """Bytes per submitted I/O."""
        return self._h.get_block_size()

    def get_queue_depth(self) -> int:
        """I/Os in flight per worker."""
        return self._h.get_queue_depth()

    def get_single_submit(self) -> bool:
        """Whether each I/O is submitted on its own."""
        return self._h.get_single_submit()

    def get_overlap_events(self) -> bool:
        """Whether the queue is kept full rather than drained per batch."""
        return self._h.get_overlap_events()

    def get_intra_op_parallelism(self) -> int:
        """Number of workers (also get_thread_count())."""
        return self._h.get_thread_count()

    get_thread_count = get_intra_op_parallelism

    def get_alignment(self) -> int:
        """Granularity of the zero-copy O_DIRECT path (see AsyncIOHandle.get_alignment)."""
        return self._h.get_alignment()

    # I/O: DeepSpeed's return conventions
    def _note_first_io(self, target: Any) -> None:
        # DeepSpeed names its swap folder only in the paths it passes, so the
        # process's swap line is logged at the first I/O, not at construction.
        if swap_line_pending():
            folder = None
            if not isinstance(target, int):
                folder = os.path.dirname(os.path.abspath(os.fsdecode(target)))
            log_swap_handle(self._h, folder)

    def _start(self, read: bool, buffer: Any, target: Any, offset: int) -> AioFuture:
        self._note_first_io(target)
        return (self._h.async_pread if read else self._h.async_pwrite)(buffer, target, int(offset))

    def async_pread(self, buffer: Any, filename: Any, file_offset: int = 0) -> int:
        """Start a read; returns 0 (DeepSpeed's convention). ``wait()`` collects it."""
        self._start(True, buffer, filename, file_offset)
        return 0

    def async_pwrite(self, buffer: Any, filename: Any = None, file_offset: int = 0, *, fd: Any = None) -> int:
        """Start a write to `filename` or to the caller's open descriptor `fd`; returns 0.

        DeepSpeed's op overloads this call on its second argument, so both
        ``async_pwrite(buf, path, off)`` and ``async_pwrite(buffer=buf, fd=fd,
        file_offset=off)`` (its fast checkpoint writer) work. The descriptor is
        not closed; writes through it are direct only if it was opened with
        ``O_DIRECT``.
        """
        self._start(False, buffer, _file_or_fd(filename, fd), file_offset)
        return 0

    def _sync(self, read: bool, buffer: Any, filename: Any, offset: int) -> int:
        # DeepSpeed's synchronous calls also complete (and count) whatever
        # async work was pending.
        self._note_first_io(filename)
        n = self.wait()
        (self._h.sync_pread if read else self._h.sync_pwrite)(buffer, filename, int(offset))
        return n + 1

    def sync_pread(self, buffer: Any, filename: Any, file_offset: int = 0) -> int:
        """Read now, after completing pending async work; returns the operations completed."""
        return self._sync(True, buffer, filename, file_offset)

    def sync_pwrite(self, buffer: Any, filename: Any, file_offset: int = 0) -> int:
        """Write now, after completing pending async work; returns the operations completed."""
        return self._sync(False, buffer, filename, file_offset)

    def _combined(
        self, read: bool, buffer: Any, filename: Any, validate: bool, async_op: bool, file_offset: int
    ) -> int:
        if async_op:
            fut = self._start(read, buffer, _file_or_fd(filename, None), file_offset)
            if validate:
                # DeepSpeed validates an async request when wait() completes it.
                self._to_validate.append(
                    (fut, buffer, filename, int(file_offset), "read" if read else "write")
                )
            return 0
        n = self._sync(read, buffer, filename, file_offset)
        if validate:
            self._h.verify(buffer, filename, int(file_offset), "read" if read else "write")
        return n

    def pread(
        self,
        buffer: Any,
        filename: Any,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
        **kwargs: Any,
    ) -> int:
        """Read: 0 when async, else the operations completed; `validate` re-checks the bytes.

        DeepSpeed names the flag ``async`` (a Python keyword, so it arrives as
        ``**{"async": True}`` or positionally); ``async_op`` is the same flag.
        """
        return self._combined(True, buffer, filename, validate, _async_flag(async_op, kwargs), file_offset)

    def pwrite(
        self,
        buffer: Any,
        filename: Any,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
        **kwargs: Any,
    ) -> int:
        """Write: 0 when async, else the operations completed; `validate` re-checks the bytes.

        The flag may be passed as ``async`` (DeepSpeed's name) or ``async_op``.
        """
        return self._combined(False, buffer, filename, validate, _async_flag(async_op, kwargs), file_offset)

    def read(self, buffer: Any, filename: Any, validate: bool = False, file_offset: int = 0) -> int:
        """Older DeepSpeed name: synchronous read; returns 0."""
        self.pread(buffer, filename, validate, False, file_offset)
        return 0

    def write(self, buffer: Any, filename: Any, validate: bool = False, file_offset: int = 0) -> int:
        """Older DeepSpeed name: synchronous write; returns 0."""
        self.pwrite(buffer, filename, validate, False, file_offset)
        return 0

    def wait(self) -> int:
        """Wait for every async request; returns how many completed (raises a failed one).

        Requests started with ``validate=True`` are checked here, once their
        I/O is done: every one whose I/O succeeded, also when another request
        of the batch failed. The first error (a failed request's, else the
        first failed check) is raised; what the other checks found is added to
        it as notes.
        """
        try:
            n = self._h.wait()
        except Exception as e:
            # The failed batch was collected and its error is raised. The
            # requests of it that succeeded are checked all the same: the
            # caller may handle this error and go on, and the checks would be
            # lost. A Ctrl-C (BaseException) collects nothing, so the checks
            # stay for the wait() that collects those requests.
            self._run_checks(e)
            raise
        self._run_checks(None)
        return n

    def _run_checks(self, failure: BaseException | None) -> None:
        """Check every collected validate=True request whose I/O succeeded;
        raise the first error found (unless `failure` is already being
        raised), the others added as notes to it or to `failure`."""
        checks, self._to_validate = self._to_validate, []
        errors: list[BaseException] = []
        for fut, buffer, filename, offset, what in checks:
            # Not done: submitted before a fork, it never finishes here.
            # Failed: its bytes were never moved; its error is wait()'s.
            if not fut.done() or fut.exception() is not None:
                continue
            try:
                self._h.verify(buffer, filename, offset, what)
            except Exception as e:  # noqa: BLE001 - every check runs; the errors are reported below
                errors.append(e)
        if failure is not None:
            errors.insert(0, failure)
        if not errors:
            return
        first, *others = errors
        for other in others:
            _add_note(first, f"also: {type(other).__name__}: {other}")
        if failure is None:
            raise first

    # pinned memory
    def new_cpu_locked_tensor(
        self, num_elem: int, example_tensor: Any = None, *, example_tenosr: Any = None
    ) -> Any:
        """A pinned 1-D CPU tensor of `num_elem` elements with example_tensor's dtype.

        ``example_tenosr`` is the keyword DeepSpeed's binding declares (spelled
        so there); either name is accepted.
        """
        if (example_tensor is None) == (example_tenosr is None):
            raise TypeError("new_cpu_locked_tensor() needs exactly one of example_tensor / example_tenosr")
        example = example_tensor if example_tensor is not None else example_tenosr
        return new_locked_tensor(int(num_elem), example.dtype)

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Release a tensor from new_cpu_locked_tensor (safe against stale views)."""
        return free_locked_tensor(tensor)

    def is_pinned(self, buffer: Any) -> bool:
        """True if the tensor's memory is pinned (by aio or by CUDA)."""
        return is_locked(buffer)

    # GPUDirect Storage entry points (gds_handle) are not offered.
    def pin_device_tensor(self, tensor: Any) -> bool:
        """GPUDirect Storage is not offered: always NotImplementedError."""
        raise NotImplementedError("aio has no GPUDirect Storage engine; set aio.use_gds to false")

    unpin_device_tensor = pin_device_tensor


def _one_shot(read: bool, buffer: Any, filename: Any, settings: tuple[Any, ...], validate: bool) -> int:
    block_size, queue_depth, single_submit, overlap_events = settings
    h = DeepSpeedAioHandle(block_size, queue_depth, single_submit, overlap_events)
    try:
        (h.read if read else h.write)(buffer, filename, validate)
    finally:
        h.handle.close()
    return 0


def aio_read(
    buffer: Any,
    filename: Any,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """The op's module-level read: whole `buffer` from offset 0 with a one-off handle; returns 0."""
    settings = (block_size, queue_depth, single_submit, overlap_events)
    return _one_shot(True, buffer, filename, settings, validate)


def aio_write(
    buffer: Any,
    filename: Any,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """The op's module-level write: `buffer` at offset 0 with a one-off handle; returns 0."""
    settings = (block_size, queue_depth, single_submit, overlap_events)
    return _one_shot(False, buffer, filename, settings, validate)


def deepspeed_memcpy(dest: Any, src: Any) -> int:
    """The op's tensor copy (``dest.copy_(src)``); returns 0."""
    dest.copy_(src)
    return 0


def _op_module() -> types.ModuleType:
    mod = types.ModuleType("aio_async_io_op")
    mod.aio_handle = DeepSpeedAioHandle  # type: ignore[attr-defined]
    mod.aio_read = aio_read  # type: ignore[attr-defined]
    mod.aio_write = aio_write  # type: ignore[attr-defined]
    mod.deepspeed_memcpy = deepspeed_memcpy  # type: ignore[attr-defined]
    mod.__doc__ = "DeepSpeed async_io op interface, served by aio"
    return mod


class AioAsyncIOBuilder:
    """Stands in for DeepSpeed's ``AsyncIOBuilder``: compatible everywhere,
    ``load()`` builds nothing and returns aio's handle class."""

    BUILD_VAR = "DS_BUILD_AIO"
    NAME = "async_io"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.name = self.NAME

    def absolute_name(self) -> str:
        """The op's import path, as DeepSpeed's builders report it."""
        return "aio.integrations.deepspeed.async_io"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Always True: nothing to compile."""
        return True

    def load(self, verbose: bool = True) -> types.ModuleType:
        """The op module whose ``aio_handle`` is DeepSpeedAioHandle."""
        return _op_module()

    def jit_load(self, verbose: bool = True) -> types.ModuleType:
        """Same as load(): nothing to compile."""
        return _op_module()

    def sources(self) -> list[str]:
        """No sources: nothing to compile."""
        return []


def _version_ok(version: str) -> bool:
    try:
        parts = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return SUPPORTED[0] <= parts < SUPPORTED[1]


def _is_ds_builder(obj: Any) -> bool:
    return (
        isinstance(obj, type)
        and obj is not AioAsyncIOBuilder
        and getattr(obj, "NAME", None) == "async_io"
        and obj.__module__.startswith("deepspeed")
    )


def enable() -> None:
    """Route DeepSpeed's async_io op to aio. Idempotent.

    Raises RuntimeError for DeepSpeed versions outside the supported range
    (rather than half-working with a swapper whose calls changed).
    """
    import deepspeed

    version = getattr(deepspeed, "__version__", "unknown")
    if not _version_ok(version):
        raise RuntimeError(
            f"aio's DeepSpeed integration supports {SUPPORTED_TEXT}; found deepspeed {version}. "
            f"Install a supported version (pip install '{SUPPORTED_TEXT}') or leave "
            "aio.integrations.deepspeed disabled to use DeepSpeed's own async_io op."
        )
    with _lock:
        was_enabled = bool(_patched)
        _patch_builders()
        _patch_accelerator()
        _patch_load_checkpoint()
        _patch_save_checkpoint()
        _patch_engine_start()
        _patch_engine_destroy()
        _patched.extend(ds_folder_lock.patch())  # one job per rank's swap folder
    from . import ds_swappers  # aio's buffer rules in DeepSpeed's swappers (AIO_DEEPSPEED_SWAPPERS=0: off)

    ds_swappers.install()
    if not was_enabled:
        _log_enabled(version)


def _log_enabled(version: str) -> None:
    """One INFO line saying what now serves DeepSpeed's async_io op."""
    import warnings

    # A throwaway handle tells which engine "auto" picks here; its fallback
    # warning would repeat when the swappers open theirs, so silence it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with AsyncIOHandle(queue_depth=1) as probe:
            engine, reason = probe.engine, probe.stats()["engine_reason"]
    logger.getChild("deepspeed").info(
        "DeepSpeed %s: async_io op served by aio (engine %s: %s) for the parameter swapper, "
        "both optimizer swappers and the checkpoint writer; DeepSpeed's own op is not built",
        version,
        engine,
        reason,
    )


_SWAPPER_MODULES = (
    "deepspeed.ops.op_builder",
    "deepspeed.ops.aio",
    "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
    "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper",
)


def _patch_builders() -> None:
    """Replace ``AsyncIOBuilder`` in every DeepSpeed module that imported it."""
    global _ds_builder
    for name in _SWAPPER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # pragma: no cover - layout differs; the scan below still runs
            pass
    exported = getattr(sys.modules.get("deepspeed.ops.op_builder"), "AsyncIOBuilder", None)
    if _ds_builder is None and _is_ds_builder(exported):
        _ds_builder = exported
    for name, mod in list(sys.modules.items()):
        if not name.startswith("deepspeed") or mod is None:
            continue
        cur = getattr(mod, "AsyncIOBuilder", None)
        if _is_ds_builder(cur):
            _patched.append((mod, "AsyncIOBuilder", cur))
            setattr(mod, "AsyncIOBuilder", AioAsyncIOBuilder)  # noqa: B010 - module attribute


def _patch_accelerator() -> None:
    """Code that asks the accelerator for the builder by name gets aio's."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    orig = acc.get_op_builder
    if getattr(orig, "_aio_wrapped", False):
        return

    def get_op_builder(class_name: str) -> Any:
        if class_name == "AsyncIOBuilder":
            return AioAsyncIOBuilder
        return orig(class_name)

    get_op_builder._aio_wrapped = True  # type: ignore[attr-defined]
    _patched.append((acc, "get_op_builder", orig))
    acc.get_op_builder = get_op_builder


def _patch_load_checkpoint() -> None:
    """DeepSpeed 0.19 leaves part of the optimizer state out when loading a
    checkpoint with NVMe optimizer offload (see ds_checkpoint.py): restore it."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    orig_load = DeepSpeedEngine.load_checkpoint
    if getattr(orig_load, "_aio_wrapped", False):
        return

    @functools.wraps(orig_load)
    def load_checkpoint(self: Any, load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = orig_load(self, load_dir, tag, *args, **kwargs)
        bound = inspect.signature(orig_load).bind(self, load_dir, tag, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if (
            result[0] is not None
            and a.get("load_optimizer_states", True)
            and not a.get("load_module_only", False)
            and self.zero_nvme_offload_optimizer()
        ):
            from .ds_checkpoint import restore

            restore(self, load_dir, tag)
        return result

    load_checkpoint._aio_wrapped = True  # type: ignore[attr-defined]
    _patched.append((DeepSpeedEngine, "load_checkpoint", orig_load))
    DeepSpeedEngine.load_checkpoint = load_checkpoint


def _patch_save_checkpoint() -> None:
    """A second ``save_checkpoint`` of the same tag at the same step (HF's
    Trainer saves the model, then the optimizer, into one folder) works with
    NVMe optimizer offload: DeepSpeed copies the swap folder into
    ``<tag>/offloaded_tensors/rank<r>`` refusing an existing one
    (FileExistsError), so the copy this engine made of this very step is
    removed first. Any other folder there is left, and refused as before."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    orig_save = DeepSpeedEngine.save_checkpoint
    if getattr(orig_save, "_aio_wrapped", False):
        return

    @functools.wraps(orig_save)
    def save_checkpoint(self: Any, save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        copy = _offloaded_copy(self, save_dir, tag)
        if copy is not None and getattr(self, "_aio_saved_copy", None) == copy and os.path.isdir(copy[0]):
            shutil.rmtree(copy[0])  # this engine's own copy of this step, from the save just before
        result = orig_save(self, save_dir, tag, *args, **kwargs)
        if copy is not None:
            self._aio_saved_copy = copy
        return result

    save_checkpoint._aio_wrapped = True  # type: ignore[attr-defined]
    _patched.append((DeepSpeedEngine, "save_checkpoint", orig_save))
    DeepSpeedEngine.save_checkpoint = save_checkpoint


def _offloaded_copy(engine: Any, save_dir: str, tag: Any) -> tuple[str, int] | None:
    """(the folder DeepSpeed 0.19's save copies the optimizer swap folder
    to, the step) for `engine`'s save into `save_dir` / `tag`; None without
    NVMe optimizer offload."""
    if not engine.zero_nvme_offload_optimizer():
        return None
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str

    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    folder = os.path.join(os.path.abspath(save_dir), tag, "offloaded_tensors", "rank" + dp_index_to_str(rank))
    return folder, int(engine.global_steps)


def _patch_engine_start() -> None:
    """Every DeepSpeed engine checks its ``aio`` block first
    (:func:`check_aio_block`) and, once built, says in one line when its NVMe
    parameter offload pages nothing (see :func:`warn_if_params_stay_in_cpu`)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    orig_init = DeepSpeedEngine.__init__
    if getattr(orig_init, "_aio_wrapped", False):
        return

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        # deepspeed.initialize passes the parsed config; the raw aio block is in it.
        check_aio_block((getattr(kwargs.get("config_class"), "_param_dict", None) or {}).get("aio"))
        try:
            orig_init(self, *args, **kwargs)
        except BaseException:
            _clean_failed_start(self)
            raise
        warn_if_params_stay_in_cpu(getattr(self, "optimizer", None))
        module = getattr(self, "module", None)
        if module is not None:
            from .ds_swappers import warn_if_built_before

            warn_if_built_before(module)
        _register_swap_cleanup(self)

    __init__._aio_wrapped = True  # type: ignore[attr-defined]
    _patched.append((DeepSpeedEngine, "__init__", orig_init))
    DeepSpeedEngine.__init__ = __init__


def _clean_failed_start(engine: Any) -> None:
    """An engine whose __init__ failed: remove the optimizer swap files it
    wrote already (a failed write's part too); never masks the failure."""
    try:
        _register_swap_cleanup(engine)
        cleanup = getattr(engine, "_aio_swap_cleanup", None)
        if cleanup is not None:
            cleanup()
    except Exception as e:  # noqa: BLE001 - the start's own error is the one raised
        logger.warning("DeepSpeed: could not remove the swap files of an engine that failed to start: %s", e)


def _patch_engine_destroy() -> None:
    """``engine.destroy()`` also removes the engine's optimizer swap files and
    lets their folder's lock go."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    orig_destroy = DeepSpeedEngine.destroy
    if getattr(orig_destroy, "_aio_wrapped", False):
        return

    @functools.wraps(orig_destroy)
    def destroy(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig_destroy(self, *args, **kwargs)
        cleanup = getattr(self, "_aio_swap_cleanup", None)
        if cleanup is not None:
            cleanup()  # a weakref.finalize: runs once, then never again at exit
        release = getattr(getattr(self, "optimizer", None), "_aio_folder_release", None)
        if release is not None:
            release()  # its swap folder is free for another job (ds_folder_lock)
        return result

    destroy._aio_wrapped = True  # type: ignore[attr-defined]
    _patched.append((DeepSpeedEngine, "destroy", orig_destroy))
    DeepSpeedEngine.destroy = destroy


_SWP = ".tensor.swp"


def _optimizer_swap_file(ids: frozenset[str], name: str) -> bool:
    """Whether `name` is a file DeepSpeed's optimizer swapper writes for one
    of the sub-groups `ids` (their fp32 partitions' ``ds_id``, e.g. ``7_10``):
    ``7_10.tensor.swp`` (fp32 weights), ``exp_avg-7_10.tensor.swp`` (state),
    ``7_10_gradient_0_262144.tensor.swp`` (gradients; optimizer_utils.py)."""
    if not name.endswith(_SWP):
        return False
    stem = name[: -len(_SWP)].split("_gradient_", 1)[0]
    return stem.rsplit("-", 1)[-1] in ids


def _param_swap_file(id_to_path: dict[Any, str], name: str) -> bool:
    """Whether `name` is a file DeepSpeed's parameter swapper wrote
    (``{ds_id}_param.tensor.swp``, recorded in its ``id_to_path``)."""
    head, sep, _ = name.partition("_param" + _SWP)
    if not sep or not head.isdigit():
        return False
    path = id_to_path.get(int(head))
    return path is not None and os.path.basename(path) == name


def remove_swap_files(folder: str, owned: Callable[[str], bool]) -> int:
    """Delete the regular files directly in `folder` whose names `owned`
    accepts, then `folder` if that left it empty; returns how many went.

    Follows no symbolic link: a folder that is a link, or a link inside it,
    is left alone. Runs at engine teardown and at exit, so a file it cannot
    remove is logged, not raised.
    """
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # gone already, or a link: not ours to touch
        return 0
    removed = 0
    try:
        with os.scandir(fd) as entries:
            names = [e.name for e in entries if e.is_file(follow_symlinks=False) and owned(e.name)]
        for name in names:
            try:
                os.unlink(name, dir_fd=fd)
                removed += 1
            except FileNotFoundError:
                continue
            except OSError as e:
                logger.getChild("deepspeed").warning("cannot remove swap file %s: %s", e.filename or name, e)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):  # not empty: another rank's or the user's files
        os.rmdir(folder)
    return removed


def _remove_if_registered_here(pid: int, folder: str, owned: Callable[[str], bool]) -> int:
    """:func:`remove_swap_files`, in the process whose pid is `pid` only; 0 elsewhere."""
    if os.getpid() != pid:
        # A forked child inherits the finalizers with the engine and runs them
        # when it drops its copy or exits, while the parent still swaps
        # through these very files: they are the parent's to remove.
        return 0
    return remove_swap_files(folder, owned)


def _finalize_in_this_process(swapper: Any, folder: str, owned: Callable[[str], bool]) -> weakref.finalize:
    """Remove `folder`'s files that `owned` accepts when `swapper` is
    collected, at exit, or when the returned finalizer is called; but only
    in the process calling this now, never in a child forked from it."""
    return weakref.finalize(swapper, _remove_if_registered_here, os.getpid(), folder, owned)


def _register_swap_cleanup(engine: Any) -> None:
    """Remove the engine's swap files when it is destroyed (optimizer) or its
    swappers are collected or the process exits (optimizer and parameters).

    DeepSpeed never removes its optimizer swap files (every swapped
    sub-group's fp32 weights, Adam moments and gradients), and its parameter
    swapper only clears its folder when the next one starts. Only files named
    after this engine's own tensors go: never another job's or rank's.
    """
    opt = getattr(engine, "optimizer", None)
    swapper = getattr(opt, "optimizer_swapper", None)
    folder = getattr(swapper, "swap_folder", None)
    if swapper is not None and isinstance(folder, str):
        groups = getattr(opt, "fp32_partitioned_groups_flat", None) or []
        ids = frozenset(str(g.ds_id) for g in groups if hasattr(g, "ds_id"))
        owned = functools.partial(_optimizer_swap_file, ids)
        engine._aio_swap_cleanup = _finalize_in_this_process(swapper, folder, owned)
    module = getattr(engine, "module", None)
    if module is not None:
        _register_param_swap_cleanup(module)


def _register_param_swap_cleanup(module: Any) -> None:
    """Once per parameter swapper: remove its files when it is collected or
    at exit. Not at destroy(): the module's parameters may still be read."""
    swapper = next(
        (p.nvme_swapper for p in module.parameters() if getattr(p, "nvme_swapper", None) is not None), None
    )
    register_param_swapper_cleanup(swapper)


def register_param_swapper_cleanup(swapper: Any) -> None:
    """Remove DeepSpeed parameter swapper `swapper`'s files (those named in
    its ``id_to_path``, read when it goes) when it is collected or at exit;
    once per swapper. aio's swapper registers itself when made, so the files
    zero.Init wrote go even when ``deepspeed.initialize`` then fails."""
    id_to_path = getattr(swapper, "id_to_path", None)
    folder = getattr(swapper, "swap_folder", None)
    if getattr(swapper, "_aio_cleanup", False):
        return
    if not isinstance(id_to_path, dict) or not isinstance(folder, str):
        return
    swapper._aio_cleanup = True
    owned = functools.partial(_param_swap_file, id_to_path)
    _finalize_in_this_process(swapper, folder, owned)


def warn_if_params_stay_in_cpu(optimizer: Any) -> bool:
    """Log one warning when DeepSpeed's ZeRO-3 optimizer has
    ``offload_param.device: nvme`` but keeps every parameter sub-group in CPU
    memory; returns whether it did. DeepSpeed copies sub-groups, in model
    order, into pinned CPU buffers for good until ``max_in_cpu`` elements are
    used (stage3.py, ``_create_param_groups_fp16_flat_cpu_memory``); only the
    rest is paged from the drive. Its default, 1e9, keeps every parameter of
    a model under a billion in CPU memory, and DeepSpeed says nothing."""
    flats = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    if not getattr(optimizer, "params_in_nvme_and_cpu", False) or not flats:
        return False
    if any(f is None for f in flats):  # a sub-group without a CPU buffer: on the drive
        return False
    numel = sum(getattr(optimizer, "fp16_partitioned_groups_flat_numel", []) or [f.numel() for f in flats])
    logger.getChild("deepspeed").warning(
        "DeepSpeed: offload_param.device is nvme but max_in_cpu=%d keeps all %d parameter elements "
        "of this model in pinned CPU memory: nothing is paged from the drive; set "
        "zero_optimization.offload_param.max_in_cpu lower (0: every parameter on the drive)",
        int(getattr(optimizer, "max_params_in_cpu", -1)),
        numel,
    )
    return True


def disable() -> None:
    """Undo :func:`enable` (DeepSpeed's own op is used again), also in
    DeepSpeed modules imported while it was enabled."""
    from . import ds_swappers

    ds_swappers.uninstall()
    with _lock:
        while _patched:
            owner, attr, orig = _patched.pop()
            if attr == "get_op_builder":
                try:
                    delattr(owner, attr)
                except AttributeError:
                    setattr(owner, attr, orig)
            else:
                setattr(owner, attr, orig)
        _unbind_late_imports()


def _unbind_late_imports() -> None:
    """A DeepSpeed module imported while enabled (``deepspeed.nvme``'s fast
    checkpoint engine, say) bound aio's builder from the patched op_builder
    and is in no record of enable(): give it DeepSpeed's class back."""
    if _ds_builder is None:
        return
    for name, mod in list(sys.modules.items()):
        if not name.startswith("deepspeed") or mod is None:
            continue
        for attr, value in list(getattr(mod, "__dict__", {}).items()):
            if value is AioAsyncIOBuilder:
                setattr(mod, attr, _ds_builder)


def is_enabled() -> bool:
    """Whether enable() is in effect (DeepSpeed's param swapper gets aio's builder)."""
    try:
        from deepspeed.runtime.swap_tensor import partitioned_param_swapper as pps
    except ImportError:
        return False
    return getattr(pps, "AsyncIOBuilder", None) is AioAsyncIOBuilder


def enable_from_env() -> bool:
    """Honour AIO_DEEPSPEED=1 (called at ``import aio``); returns whether enabled."""
    if os.environ.get("AIO_DEEPSPEED", "").strip().lower() not in ("1", "true", "yes", "on"):
        return False
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        import warnings

        warnings.warn("AIO_DEEPSPEED is set but deepspeed is not installed", RuntimeWarning, stacklevel=2)
        return False
    enable()
    return True
