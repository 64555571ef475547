"""OptimizerSwapper: optimizer sub-groups paged through pinned buffers.

The unit is a sub-group of ``sub_group_size`` elements. Its fp32 gradient,
fp32 master weights and every optimizer state tensor live back to back in one
aligned extent of the swap file::

    [ grad | master | state_0 | state_1 | ... ]

(without the gradient where :meth:`OptimizerSwapper.gradient_slot` says the
gradients are only ever held in memory, as aio.zero's trainer does with
``aio_zero.gradients: cpu``; without the master weights where
:meth:`OptimizerSwapper.master_slot` says they live elsewhere, as
NVMeAdamW's ``master="params"`` keeps them in the model's fp32 parameters).
Master weights kept elsewhere are copied into a buffer for the update and
out after it (:meth:`OptimizerSwapper.initialize_from`), or stepped where they
are, piece by piece, with no copy and no buffer
(:meth:`OptimizerSwapper.initialize_in_place`); a gradient held in memory may
be pieces too (:meth:`OptimizerSwapper.hold_gradient`; :mod:`aio.swap.pieces`).

The optimizer's state tensors are discovered by stepping the optimizer once
on a probe parameter, not hard-coded, so any elementwise torch optimizer
works (Adam's two moments, SGD's momentum, Adagrad's sum...). Scalar state
such as Adam's ``step`` stays in CPU memory.

Buffers (DeepSpeed's meaning of ``buffer_count``): the pool holds
``buffer_count`` pinned buffers of ONE tensor each, sized for the largest
sub-group (fp32, whole pages). Stepping a sub-group takes ``2 + states``
buffers (gradient, master weights, each state), each read with its own
asynchronous I/O; the gradient's buffer goes back right after the update and
the others once their write-back lands.

Pipelined (``pipeline_read``/``pipeline_write``): the reads of sub-group i+1
and the writes of sub-group i-1 run on separate handles while sub-group i is
stepped, so a step costs about max(I/O, compute), not their sum. Full overlap
needs ``2 x (2 + states) + (1 + states)`` buffers; with fewer, the step reads
ahead and writes behind only as far as free buffers allow (one warning).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._args import mismatched
from .._buffers import MAX_OFFSET
from ..config import discover_state_spec
from ..pinned import Lease, Register
from .copy import Chunk, copy_chunks, free_buffers
from .drives import IOFuture, SwapSpace
from .param import SwapStateError
from .param_groups import TorchGroups
from .pieces import Pieces, check_pieces, is_pieces, segments
from .pool import BufferPool
from .storage import (
    align_up,
    checkpoint_dir,
    load_plain,
    require_complete,
    save_plain,
    write_manifest,
)

# Elements of one sub-group, at most: all its tensors' bytes stay a valid file offset.
MAX_NUMEL = MAX_OFFSET // 64

CHECKPOINT_VERSION = 1

# ``source(out)`` starts reading a sub-group's fp32 master weights into `out`
# and returns the reads in flight (see OptimizerSwapper.initialize_from).
MasterSource = Callable[[Any], list[IOFuture]]


@dataclass
class _SubGroup:
    index: int
    numel: int
    offset: int  # of its extent in the swap file
    parts: dict[str, tuple[int, Any]]  # name -> (byte offset in the extent, dtype)
    nbytes: int  # of its extent
    scalars: dict[str, Any] | None = None  # None until its first step
    valid: bool = False  # drive copy holds a complete state
    grad_future: IOFuture | None = None
    # fp32 CPU tensor holding the gradient instead of the drive, or its pieces (a tuple: pieces.py)
    grad_mem: Any = None
    proxy: Any = None
    history: list[str] = field(default_factory=list)
    # Until its master weights are first written: reads them from elsewhere (initialize_from).
    master_source: MasterSource | None = None
    # Master weights stepped where they live (initialize_in_place): their pieces, asked at each use.
    master_pieces: Callable[[], Sequence[Any]] | None = None


BUFFER_COUNT_KEY = "zero_optimization.offload_optimizer.buffer_count"


class OptimizerSwapper:
    """Swaps optimizer sub-groups to files under ``nvme_path``.

    ``optimizer_cls``/``hyper``: the torch optimizer applied per sub-group
    (e.g. ``torch.optim.Adam, {"lr": 1e-3}``). ``buffer_count`` pinned buffers
    each hold one tensor (gradient, master weights or one state) of the
    largest sub-group; at least ``2 + states`` are needed (Adam: 4).
    """

    def __init__(
        self,
        nvme_path: str | Sequence[str],
        optimizer_cls: Any,
        hyper: dict[str, Any] | None = None,
        *,
        buffer_count: int = 4,
        pipeline_read: bool = False,
        pipeline_write: bool = False,
        pin_memory: bool = True,
        sub_group_size: int | None = None,
        aio: dict[str, Any] | None = None,
        job_id: str | None = None,
        rank: int | None = None,
        state_dtype: str = "fp32",
        register_host: Register | None = None,
        group_hyper: list[dict[str, Any]] | None = None,
    ) -> None:
        import torch

        if state_dtype not in ("fp32", "bf16"):
            raise ValueError(f"aio_zero.optimizer_states must be 'fp32' or 'bf16', got {state_dtype!r}")
        self.optimizer_cls = optimizer_cls
        self.hyper = dict(hyper or {})
        self.spec = discover_state_spec(optimizer_cls, **self.hyper)
        self.state_dtype = state_dtype
        # Page-locks the buffers instead of mlock (a GPU job's cudaHostRegister; see BufferPool).
        self.register_host = register_host
        self.torch_groups = TorchGroups(group_hyper)
        # float32 states kept as bfloat16 on the drive (widened in their buffer for the step)
        self.narrowed = [n for n, dt in self.spec if state_dtype == "bf16" and dt == torch.float32]
        _check_buffer_count(buffer_count, optimizer_cls, self.spec, pipeline_read, pipeline_write)
        self.buffer_count = buffer_count
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        self.pin_memory = pin_memory
        self.sub_group_size = sub_group_size
        self.space = SwapSpace(nvme_path, "optimizer", "optimizer.swp", aio, job_id, rank)
        self.groups: dict[int, _SubGroup] = {}
        self.pool: BufferPool | None = None
        self.optimizer: Any = None
        self.broken: str | None = None
        self.steps = 0
        self.counters = {
            "bytes_read": 0,
            "bytes_written": 0,
            "subgroup_steps": 0,
            "cached_subgroups": 0,
            "partial_reads": 0,  # reads ahead started with buffers for some tensors only
            "ahead_in_wait": 0,  # reads ahead started while waiting for a sub-group's reads
        }
        # The same bytes per tensor: "param" (fp32 master weights), "grad",
        # and each optimizer state by name (exp_avg, exp_avg_sq for Adam).
        self.bytes_by_part: dict[str, collections.Counter[str]] = {
            "read": collections.Counter(),
            "written": collections.Counter(),
        }
        self.closed = False
        self._zeros: Any = None  # _zero_bytes()'s zeros (a checkpoint before a sub-group's first step)
        # Buffers carried from one step to the next: sub-groups whose state is
        # still in a buffer after its write landed, and reads started ahead.
        self._carry: _StepIO | None = None

    @classmethod
    def from_config(
        cls, config: Any, optimizer_cls: Any, hyper: dict[str, Any] | None = None, **kw: Any
    ) -> OptimizerSwapper:
        """From a DeepSpeed-style config (anything aio.config.load_config takes);
        `kw` (job_id, rank) goes to the constructor. Needs offload_optimizer.device 'nvme'."""
        from ..config import load_config

        cfg = load_config(config)
        o = cfg.offload_optimizer
        if o is None or o.device != "nvme":
            raise ValueError(
                "zero_optimization.offload_optimizer.device must be 'nvme' for an OptimizerSwapper"
            )
        return cls(
            o.nvme_dirs(),
            optimizer_cls,
            hyper,
            buffer_count=o.buffer_count,
            pipeline_read=o.pipeline_read,
            pipeline_write=o.pipeline_write,
            pin_memory=o.pin_memory,
            sub_group_size=cfg.zero_optimization.sub_group_size,
            aio=cfg.aio.handle_kwargs(),
            **kw,
        )

    # -- layout --------------------------------------------------------------------
    def _layout(self, numel: int) -> tuple[dict[str, tuple[int, Any]], int]:
        import torch

        parts: dict[str, tuple[int, Any]] = {}
        off = 0
        grad = [("grad", torch.float32)] if self.gradient_slot() else []
        master = [("param", torch.float32)] if self.master_slot() else []
        for name, dtype in [*grad, *master, *self.spec]:
            if name in self.narrowed:
                dtype = torch.bfloat16
            parts[name] = (off, dtype)
            off += _part_bytes(numel, dtype)
        return parts, off

    def gradient_slot(self) -> bool:
        """Whether each sub-group's extent has room for its fp32 gradient
        (write_gradient()); a subclass that only ever holds gradients in
        memory (hold_gradient()) leaves it out: 4 bytes per element less drive."""
        return True

    def master_slot(self) -> bool:
        """Whether each sub-group's extent holds its fp32 master weights. A
        subclass whose masters live elsewhere (the model's fp32 parameters in
        CPU memory) leaves them out: every sub-group then takes them from its
        :meth:`initialize_from` source when it is stepped (so a change made to
        them between steps is stepped from, as torch's optimizers do) and the
        step's `after` callback is the only place the new values go: 4 bytes
        per element less drive and 8 less I/O per step. Such a swapper has no
        :meth:`master_extent`, and no :meth:`export_checkpoint` (the master
        weights would be missing from it)."""
        return True

    def _restore_hint(self) -> str:
        """How a broken swapper (see :attr:`broken`) gets a consistent state
        back: import_checkpoint() needs the master weights on the drive; a
        swapper without them is rewritten whole by its owner (NVMeAdamW:
        load_state_dict() writes every sub-group's state again)."""
        if self.master_slot():
            return "Restore it with import_checkpoint() (NVMeAdamW: load_state_dict())"
        return (
            "Restore it by writing every sub-group's state again (NVMeAdamW: load_state_dict()); "
            "import_checkpoint() cannot, the master weights not being on the drive (master_slot() is False)"
        )

    def _no_master_slot(self, index: int) -> ValueError:
        return ValueError(
            f"sub-group {index}'s master weights are not on the drive (master_slot() is False: "
            "they live in their initialize_from() source); change them there"
        )

    def _no_gradient_slot(self, index: int) -> ValueError:
        return ValueError(
            f"sub-group {index} has no gradient on the drive: this optimizer holds gradients in "
            "memory (aio_zero.gradients: cpu); hold_gradient() them"
        )

    def _slot_bytes(self, numel: int) -> int:
        """Bytes one buffer needs for any single tensor of a `numel`-element sub-group."""
        import torch

        return max(_part_bytes(numel, dt) for dt in [torch.float32, *(d for _, d in self.spec)])

    def register_subgroup(self, index: int, numel: int, group: int = 0) -> None:
        """Reserve the drive extent for sub-group `index` of `numel` elements,
        stepped with torch param group `group`'s hyper-parameters (``group_hyper``)."""
        self._check_usable()
        import torch

        if index in self.groups:
            raise ValueError(f"sub-group {index} is already registered")
        if isinstance(numel, bool) or not isinstance(numel, int) or not 0 < numel <= MAX_NUMEL:
            raise ValueError(f"sub-group {index}: numel must be an int in [1, {MAX_NUMEL}], got {numel!r}")
        self.torch_groups.add(index, group)
        if self.sub_group_size is not None and numel > self.sub_group_size:
            raise ValueError(
                f"sub-group {index} has {numel} elements, more than "
                f"zero_optimization.sub_group_size={self.sub_group_size}; raise sub_group_size "
                f"to at least {numel} or split the group"
            )
        parts, nbytes = self._layout(numel)
        if self.pool is not None and self._slot_bytes(numel) > self.pool.slot_bytes:
            if self.optimizer is not None or self.pool.available() != self.pool.count:
                raise ValueError(
                    f"sub-group {index} ({numel} elements) is larger than the swap buffers, which "
                    "were sized at the first step; register every sub-group before stepping"
                )
            self.pool = None  # still setting up and idle: re-size on next use
        off = self.space.allocate(nbytes)
        g = _SubGroup(index, numel, off, parts, nbytes)
        g.proxy = torch.nn.Parameter(torch.empty(0))
        self.groups[index] = g

    def _pool(self) -> BufferPool:
        if self.pool is None:
            if not self.groups:
                raise ValueError("no sub-groups registered")
            slot_bytes = max(self._slot_bytes(g.numel) for g in self.groups.values())
            self.pool = BufferPool(
                self.buffer_count,
                slot_bytes,
                self.pin_memory,
                BUFFER_COUNT_KEY,
                "zero_optimization.sub_group_size",
                register=self.register_host,
            )
        return self.pool

    def reserve_buffers(self) -> None:
        """Allocate (and lock) the swap buffers now rather than at their first
        use (fresh locked memory is slow on some VMs: see BufferPool.allocate)."""
        self._check_usable()
        if self.groups:
            self._pool().allocate()

    def acquire_buffer(self, timeout: float | None = None) -> Lease:
        """Lease one of the swapper's pinned buffers (one tensor of the largest
        sub-group, e.g. to gather a gradient in); give it back before step()."""
        self._check_usable()
        self.drop_cached()
        return self._pool().acquire(timeout)

    def try_acquire_buffer(self) -> Lease | None:
        """acquire_buffer() without waiting: None when all are in use."""
        self._check_usable()
        self.drop_cached()
        return self._pool().try_acquire()

    def _views(self, g: _SubGroup, leases: dict[str, Lease], widened: bool = True) -> dict[str, Any]:
        import torch

        def dtype(name: str) -> Any:  # a narrowed state is float32 in its buffer once widened
            if name not in g.parts:  # master weights kept off the drive (master_slot): float32
                return torch.float32
            return torch.float32 if widened and name in self.narrowed else g.parts[name][1]

        return {name: BufferPool.view(leases[name], dtype(name), g.numel) for name in leases}

    def _part_io(self, g: _SubGroup, name: str) -> tuple[int, int]:
        """(offset in the swap file, bytes) of one tensor of `g`, whole aligned blocks."""
        off, dt = g.parts[name]
        return g.offset + off, _part_bytes(g.numel, dt)

    def pinned_bytes(self) -> int:
        """Bytes of buffers this swapper has page-locked right now (0 before the
        first use and with ``pin_memory`` false)."""
        return self.pool.pinned_bytes if self.pool is not None else 0

    def planned_pinned_bytes(self) -> int:
        """Bytes of the buffers once allocated (page-locked when ``pin_memory``)."""
        return self._pool().planned_bytes if self.groups else 0

    # -- initial state and gradients -------------------------------------------------
    def initialize(self, index: int, master: Any) -> None:
        """Write a sub-group's fp32 master weights to the drive, its gradient
        and state starting at zero; returns once the write has landed.

        The zeros are never written: until the sub-group's first step
        (``scalars`` None) its first step zeroes the states in its buffers
        instead of reading them, a window's first gradient starts zeroed in
        memory, and a checkpoint takes the states from zeros (:meth:`_chunks`).
        Writing them was three quarters of set-up's optimizer bytes with AdamW."""
        src = master.detach().reshape(-1)
        g = self.groups.get(index)
        if g is not None and src.numel() != g.numel:
            raise ValueError(f"sub-group {index}: expected {g.numel} elements, got {src.numel()}")
        self.initialize_many([(index, lambda out: out.copy_(src))])

    def initialize_many(self, fills: Iterable[tuple[int, Callable[[Any], Any]]]) -> None:
        """initialize() for each (index, fill) pair, in order: ``fill(out)``
        writes the sub-group's fp32 master weights into `out` (a pinned
        buffer's float32 view of its size), e.g. reading the parameters
        straight into it. Each write is left in flight while the next
        sub-group is filled (as many as the buffers allow); returns once all
        landed, raising the first failure after every write has ended (a
        sub-group whose write failed stays invalid)."""
        import torch

        self._check_usable()
        if not self.master_slot():
            raise ValueError(
                "this swapper keeps no master weights on the drive (master_slot() is False): "
                "initialize_from() each sub-group with their source instead"
            )
        self.drop_cached()
        pool = self._pool()
        pending: collections.deque[tuple[_SubGroup, Lease, IOFuture]] = collections.deque()
        try:
            for index, fill in fills:
                g = self.groups[index]
                if pending and pool.available() == 0:
                    _land_initial(pending.popleft())
                lease = pool.acquire()
                try:
                    fill(lease.tensor(torch.float32, g.numel))
                    g.scalars, g.valid = None, False
                    pending.append((g, lease, self._start_part_write(g, "param", lease)))
                except BaseException:
                    lease.release()
                    raise
            while pending:
                _land_initial(pending.popleft())
        finally:
            for g, lease, fut in pending:  # after a failure: every write ends first
                g.valid = fut.exception() is None
                lease.release()

    def initialize_from(self, index: int, source: MasterSource) -> bool:
        """initialize() without writing anything now: until sub-group `index`'s
        master weights are first written (its first step, update_master(), a
        checkpoint saved or loaded), whoever needs them calls ``source(out)``,
        which starts reading them into `out` (float32, the sub-group's size)
        and returns the reads' futures (having copied at once what it need not
        read). The source must give the same values until then: e.g. the
        model's float32 parameters where their own swapper stored them, which
        set-up then neither reads nor writes again (it moved each of their
        bytes twice). Its gradient and states start at zero, as with
        initialize(). Returns True (it is always possible here)."""
        self._check_usable()
        self.drop_cached()
        g = self.groups[index]
        g.scalars, g.valid, g.master_source, g.master_pieces = None, True, source, None
        return True

    def initialize_in_place(self, index: int, pieces: Callable[[], Sequence[Any]]) -> None:
        """initialize_from() for master weights that the step updates where
        they live, never copied: ``pieces()`` returns the float32 CPU
        tensors, each contiguous, laid end to end (the sub-group's size in
        all) that hold sub-group `index`'s master weights -- NVMeAdamW's
        parameters with ``master="params"`` -- asked at every use (a tensor
        replaced between steps is the one stepped). The update runs on them
        piece by piece (:mod:`aio.swap.pieces`: the same bits, the update
        being elementwise), so a step copies nothing in or out for them and
        leases no buffer for them; `after` gets None for their master (they
        hold the new values already). Needs master_slot() False (ValueError
        otherwise). Its gradient and states start at zero."""
        self._check_usable()
        if self.master_slot():
            raise ValueError(
                f"sub-group {index}: initialize_in_place() is for a swapper whose master weights live "
                "elsewhere (master_slot() False); this one keeps them on the drive: initialize() it"
            )
        if not callable(pieces):
            raise TypeError(f"sub-group {index}: pieces must be a callable, got {type(pieces).__name__}")
        self.drop_cached()  # kept buffers were leased for the old mode (one for the master)
        g = self.groups[index]

        def source(out: Any) -> list[IOFuture]:  # read_master() and read_state("param")
            at = 0
            for t in self._master_pieces(g):
                out[at : at + t.numel()].copy_(t)
                at += t.numel()
            return []

        g.scalars, g.valid, g.master_source, g.master_pieces = None, True, source, pieces

    def _master_pieces(self, g: _SubGroup) -> Pieces:
        """Sub-group `g`'s in-place master weights, checked (see initialize_in_place)."""
        if g.master_pieces is None:
            raise SwapStateError(f"sub-group {g.index}'s master weights are not in place")
        return check_pieces(g.master_pieces(), g.numel, f"sub-group {g.index}'s master weights")

    def _start_part_read(self, g: _SubGroup, name: str, lease: Lease) -> list[IOFuture]:
        """Start reading one of sub-group `g`'s tensors into `lease`'s buffer:
        its master weights from their source while initialize_from() left one."""
        import torch

        if name == "param" and (g.master_source is not None or name not in g.parts):
            if g.master_source is None:
                raise SwapStateError(f"sub-group {g.index} has no master weights: initialize_from() it first")
            futs = list(g.master_source(lease.tensor(torch.float32, g.numel)))
            self.count_io("read", name, sum(int(f.nbytes) for f in futs))  # what it copied was no I/O
            return futs
        off, n = self._part_io(g, name)
        self.count_io("read", name, n)
        return [self.space.read(lease.buffer()[:n], off)]

    def count_io(self, direction: str, part: str, nbytes: int) -> None:
        """Count bytes moved ("read" or "written") for one tensor kind, in
        ``counters`` and in ``bytes_by_part``."""
        self.counters["bytes_" + direction] += nbytes
        self.bytes_by_part[direction][part] += nbytes

    def _start_part_write(self, g: _SubGroup, name: str, lease: Lease) -> IOFuture:
        off, n = self._part_io(g, name)
        if name == "param":
            g.master_source = None  # the drive copy is the master weights from here on
        self.count_io("written", name, n)
        return self.space.write(lease.buffer()[:n], off)

    def write_gradient(self, index: int, grad: Any, async_op: bool = True) -> IOFuture:
        """Write a sub-group's fp32 gradient (e.g. during backward). The
        future keeps `grad` alive; the next step waits for it."""
        import torch

        self._check_usable()
        g = self.groups[index]
        src = grad.detach().reshape(-1)
        if src.numel() != g.numel or src.dtype != torch.float32:
            raise ValueError(
                f"sub-group {index}: gradient must be {g.numel} fp32 elements, "
                f"got {src.numel()} of {src.dtype}"
            )
        if "grad" not in g.parts:
            raise self._no_gradient_slot(index)
        if g.grad_future is not None:
            g.grad_future.result()
        g.grad_mem = None  # the drive copy is the gradient from here on
        fut = self.space.write(src.contiguous(), g.offset + g.parts["grad"][0])
        self.count_io("written", "grad", g.numel * 4)
        g.grad_future = fut
        if not async_op:
            self._settle_grad(g)
        return fut

    def read_gradient(self, index: int, out: Any) -> None:
        """Read a sub-group's stored fp32 gradient into `out` (e.g. to add the
        next micro-batch's gradient to it); waits for its pending write first."""
        import torch

        self._check_usable()
        g = self.groups[index]
        if out.numel() != g.numel or out.dtype != torch.float32:
            raise ValueError(
                f"sub-group {index}: gradient buffer must be {g.numel} fp32 elements, "
                f"got {out.numel()} of {out.dtype}"
            )
        if "grad" not in g.parts:
            raise self._no_gradient_slot(index)
        self._settle_grad(g)
        self.space.sync_read(out, g.offset + g.parts["grad"][0])
        self.count_io("read", "grad", g.numel * 4)

    def discard_gradients(self) -> None:
        """Wait for every pending gradient write and forget it, failed or not
        (the caller is abandoning this step's gradients)."""
        for g in self.groups.values():
            fut, g.grad_future = g.grad_future, None
            if fut is not None:
                fut.exception()

    def hold_gradient(self, index: int, grad: Any) -> None:
        """Let the next step() take sub-group `index`'s gradient from `grad` (fp32,
        CPU, kept by reference: fill it before step()) instead of reading it from
        the drive: 8 bytes per element less I/O per step, for 4 bytes per element
        of memory. A later write_gradient() makes the drive copy current again.
        `grad` may also be a list of pieces (float32 CPU tensors, each
        contiguous, laid end to end: NVMeAdamW's parameters' gradients), which
        the step reads where they are (:mod:`aio.swap.pieces`): nothing packed.
        Pieces of a sub-group without a gradient slot are held for one step:
        let go once it is stepped, so the caller's tensors (``p.grad``, which
        ``zero_grad()`` drops) are not kept alive into the next backward;
        hold them again before the next step."""
        import torch

        self._check_usable()
        g = self.groups[index]
        if not isinstance(grad, torch.Tensor):
            held = check_pieces(grad, g.numel, f"sub-group {index}'s held gradient")
            self._settle_grad(g)
            g.grad_mem = held
            return
        if grad.numel() != g.numel or grad.dtype != torch.float32 or grad.device.type != "cpu":
            raise ValueError(
                f"sub-group {index}: a held gradient must be {g.numel} fp32 elements on the CPU, "
                f"got {grad.numel()} of {grad.dtype} on {grad.device}"
            )
        if not grad.is_contiguous():
            raise ValueError(f"sub-group {index}: a held gradient must be contiguous")
        self._settle_grad(g)
        g.grad_mem = grad.view(-1)

    def drop_cached(self, write_back: bool = True) -> None:
        """Give back the buffers a step left holding sub-group states (and the
        reads it started ahead for the next step), first writing the states not
        yet on the drive (unless not `write_back`: they are lost). Called before
        anything else needs the buffers or reads the drive copy. A failed write
        leaves the swapper refusing use until restored (import_checkpoint(),
        or without a master slot its owner writing every sub-group again).
        Ctrl-C loses nothing: during the write-back, the states stay in their
        buffers (the next call writes what is left); during the drain, the
        next call (or close()) finishes it."""
        io = self._carry
        if io is None:
            return
        if write_back:
            try:
                io.write_back()
            except KeyboardInterrupt:
                raise  # no write failed: the buffers still hold what did not land
            except BaseException as e:
                self.broken = (
                    f"writing kept optimizer state back failed ({type(e).__name__}: {e}); the swapped "
                    f"optimizer state is incomplete. {self._restore_hint()}"
                )
                self._drain_carry()
                raise
        self._drain_carry()

    def _drain_carry(self) -> None:
        """Wait for the kept buffers' I/O and give them back; forgotten only
        once done, so a Ctrl-C in the wait leaves the rest to the next call
        (their buffers are never leaked, nor handed out under I/O)."""
        io = self._carry
        if io is not None:
            io.abort()
            self._carry = None

    def flush(self) -> None:
        """Write the fp32 master weights of the stepped sub-groups the last
        step kept only in buffers (see step()); their states stay there, still
        to be written when the buffers are needed, and the next step starts
        from them without a read. Afterwards every :meth:`master_extent` range
        holds the current weights. A failed write leaves the swapper refusing
        use until restored, as a failed step does."""
        self._check_usable()
        if self._carry is None:
            return
        try:
            self._carry.write_masters()
        except BaseException as e:
            self.broken = (  # first: a Ctrl-C in the drain below must not leave it usable
                f"writing master weights failed ({type(e).__name__}: {e}); the swapped optimizer "
                f"state is incomplete. {self._restore_hint()}"
            )
            self._drain_carry()
            raise

    def _settle_grad(self, g: _SubGroup) -> None:
        fut, g.grad_future = g.grad_future, None
        if fut is not None:
            fut.result()

    # -- the step ----------------------------------------------------------------------
    def _ensure_optimizer(self) -> None:
        """The torch optimizer over the sub-groups' proxies (made at first
        need), none of them holding a gradient: a step cut short in _apply
        (Ctrl-C) left its proxy one, and the optimizer would step it again,
        into a buffer another sub-group holds by then."""
        if self.optimizer is None:
            proxies = {i: self.groups[i].proxy for i in self.groups}
            self.optimizer = self.optimizer_cls(self.torch_groups.build(proxies), **self.hyper)
        for g in self.groups.values():
            g.proxy.grad = None

    def _apply(self, g: _SubGroup, views: dict[str, Any], grad_scale: Any = None, lowp: Any = None) -> None:
        """Step sub-group `g` on `views` (name -> its tensor; the master
        weights and the gradient may be pieces: then stepped as segments,
        each a proxy of one optimizer step, :mod:`aio.swap.pieces`)."""
        import torch

        from ..optim import step_scaled

        if is_pieces(views["param"]) or is_pieces(views["grad"]):
            segs = segments(g.numel, {**views, "lowp": lowp})
            proxies = [torch.nn.Parameter(torch.empty(0)) for _ in segs]
            opt = self._segment_optimizer(g, proxies)
        else:
            segs, proxies, opt = [{**views, "lowp": lowp}], [g.proxy], self.optimizer
        for proxy, seg in zip(proxies, segs, strict=True):
            proxy.data = seg["param"]
            proxy.grad = seg["grad"]
            self._start_state(opt, g, proxy, seg)
        lows: dict[Any, Any] | None = None
        if lowp is not None:
            lows = {p: seg["lowp"] for p, seg in zip(proxies, segs, strict=True)}
        step_scaled(opt, [seg["grad"] for seg in segs], grad_scale, lows)
        scalars = [self._end_state(opt, g, proxy, seg) for proxy, seg in zip(proxies, segs, strict=True)]
        g.scalars = scalars[0]  # every segment counted from the same values, once

    def _segment_optimizer(self, g: _SubGroup, proxies: list[Any]) -> Any:
        """A torch optimizer over `proxies` (sub-group `g`'s segments) with
        the hyper-parameters of `g`'s param group now: one step() for all."""
        pg = self.optimizer.param_groups[self.torch_groups.torch_index[self.torch_groups.of.get(g.index, 0)]]
        return self.optimizer_cls(
            [{**{k: v for k, v in pg.items() if k != "params"}, "params": proxies}], **self.hyper
        )

    def _start_state(self, opt: Any, g: _SubGroup, proxy: Any, views: dict[str, Any]) -> None:
        """`proxy`'s state in `opt` before its update: `g`'s scalars and its
        state tensors' `views`, or the optimizer's first state."""
        import torch

        from ..optim import CPUAdam

        st = opt.state[proxy]
        st.clear()
        if g.scalars is not None:
            # A copy each: the update counts a proxy's step on in place.
            st.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.scalars.items()})
            for name, _ in self.spec:
                st[name] = views[name]
        elif isinstance(opt, CPUAdam):
            # Its first state is a zero step and zero moments, which the buffers
            # hold already (_read_parts zeroes them): stepped in place, not
            # made in fresh memory and copied over (16 GB at 2B in step 1:
            # seconds of page faults on the dev box's VM).
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            for name, _ in self.spec:
                st[name] = views[name]
        else:
            # First step of this sub-group: start from the state the optimizer
            # makes in its constructor, as it would in memory. Some optimizers
            # (Adagrad before torch 2.13) create state only there and fail on a
            # parameter without it; lazy ones create nothing here and make it
            # in step(). Either way it is copied into the buffer below.
            st.update(self.optimizer_cls([proxy], **self.hyper).state.get(proxy, {}))

    def _end_state(self, opt: Any, g: _SubGroup, proxy: Any, views: dict[str, Any]) -> dict[str, Any]:
        """After the update: `proxy`'s state tensors in their `views`, its
        state forgotten by `opt`; returns its scalars (copies)."""
        import torch

        st = opt.state[proxy]
        names = {n for n, _ in self.spec}
        for name in names:
            t = st.get(name)
            if t is None:
                raise SwapStateError(f"optimizer did not produce state '{name}' for sub-group {g.index}")
            if t.data_ptr() != views[name].data_ptr():
                views[name].copy_(t)
        scalars = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items() if k not in names}
        st.clear()
        proxy.grad = None
        proxy.data = torch.empty(0)
        return scalars

    def step(
        self,
        after: Callable[[int, Any], None] | None = None,
        grad_scale: Any = None,
        lowp: dict[int, Any] | None = None,
    ) -> None:
        """One optimizer step over every sub-group.

        Sub-groups go in index order on even steps and in reverse on odd ones.
        A stepped sub-group stays in its buffers until a read needs them, so the
        ones stepped last are stepped first next time without a read
        (``counters["cached_subgroups"]``); with every gradient held in memory
        (hold_gradient) they are also written only when their buffers are
        needed (write-back; drop_cached() writes the rest), and the buffers
        left free read ahead, whatever ``pipeline_read`` says: during each
        sub-group's update and, as this step ends, for the next step's first
        sub-groups (overlapping the next forward and backward).

        `after(index, master_view)` runs right after each sub-group's update
        (e.g. to copy the new weights into the model's low-precision params).
        `grad_scale` (a number or 0-dim tensor) multiplies every gradient
        first: gradient clipping and loss-scale removal. For each sub-group
        index in `lowp`, its bfloat16/float16 tensor (the sub-group's size)
        gets the updated master weights rounded to its dtype before `after`
        runs: in the update's own pass with aio's Adam, else by a copy.

        If anything fails, every I/O still in flight is drained, sub-groups
        whose write did not land are marked invalid, the swapper refuses
        further steps (the optimizer state is now partly stepped), and the
        error is raised; import_checkpoint() restores a consistent state
        (without a master slot, the owner writes every sub-group again:
        NVMeAdamW's load_state_dict()).
        Without a master slot `after` is required: it is the only place the
        updated master weights go.
        """
        self._check_usable()
        self._check_after(after)
        order = sorted(self.groups, reverse=self.steps % 2 == 1)
        # Gradients on the drive take buffers during backward: nothing is kept then.
        write_back = all(self.groups[i].grad_mem is not None for i in order)
        # A write-back cut short (Ctrl-C in drop_cached()) left writes in flight
        # from kept buffers: finished first, not stepped under.
        if not write_back or (self._carry is not None and self._carry.writes):
            self.drop_cached()
        in_place = self._check_ready(order)
        self._ensure_optimizer()
        io, self._carry = self._carry, None
        io = io or _StepIO(self, self._pool())
        # With every gradient in memory, buffers left free read ahead whatever
        # pipeline_read says, part of a sub-group if need be (measured: the
        # drive idled while each sub-group was computed; 2B bf16 at 4 buffers
        # stepped 1.5 s faster). With gradients on the drive only a whole
        # sub-group is read ahead, and only with pipeline_read (partly, it
        # measured slower there).
        ahead = self.pipeline_read or write_back
        try:
            for k, i in enumerate(order):
                nxt = order[k + 1] if ahead and k + 1 < len(order) else None
                leases = io.fetch(i, nxt, partly=write_back)
                master = self._step_subgroup(
                    self.groups[i], leases, after, grad_scale, (lowp or {}).get(i), in_place.get(i)
                )
                io.done_stepping(i, leases, write_back)
                if master is not None and after is not None:
                    if nxt is not None and write_back:
                        # The write-back the next read waits for starts before
                        # `after` copies the new weights out (measured: 1-2 ms
                        # of idle drive per sub-group with master="drive").
                        io.make_room(nxt)
                    after(i, master)
            io.carry_over(order[::-1], read_ahead=write_back)
            self.steps += 1
            self._carry = io
        except BaseException as e:
            self._abandon_step(io, e)
            raise

    def _check_ready(self, order: list[int]) -> dict[int, Pieces]:
        """Before a step changes anything: SwapStateError unless every
        sub-group has a valid state and a gradient; returns the master
        weights' pieces of those stepped in place (asked once a step)."""
        for i in order:
            if not self.groups[i].valid and (self._carry is None or i not in self._carry.reads):
                self._drop_held_pieces()
                raise SwapStateError(f"sub-group {i} has no valid state on the drive; initialize() it first")
            if "grad" not in self.groups[i].parts and self.groups[i].grad_mem is None:
                self._drop_held_pieces()
                raise SwapStateError(f"sub-group {i} has no gradient: hold_gradient() one before step()")
        return {i: self._master_pieces(g) for i, g in self.groups.items() if g.master_pieces is not None}

    def _abandon_step(self, io: _StepIO, e: BaseException) -> None:
        """After step() failed with `e`: refuse use, then drain `io`. Refusing
        first: a second Ctrl-C during the drain must not leave a half-updated
        state usable; the drain is then finished by drop_cached() or close()."""
        self.broken = (
            f"optimizer step {self.steps + 1} failed ({type(e).__name__}: {e}); the swapped "
            f"optimizer state is partly updated. {self._restore_hint()}"
        )
        self._drop_held_pieces()
        self._carry = io
        self._drain_carry()

    def _drop_held_pieces(self) -> None:
        """Forget gradients held as pieces (views of the owner's gradients,
        held for one step only) after a step that did not take them: they
        would keep a whole set of gradients alive into the next backward."""
        for g in self.groups.values():
            if is_pieces(g.grad_mem) and "grad" not in g.parts:
                g.grad_mem = None

    def _check_after(self, after: Callable[[int, Any], None] | None) -> None:
        in_place = all(g.master_pieces is not None for g in self.groups.values())
        if after is None and not self.master_slot() and not in_place:
            # The update would land in a buffer and be dropped: moments and step
            # count advanced, master weights not -- a silent divergence.
            raise ValueError(
                "step(after=None) on a swapper without a master slot (master_slot() is False): the "
                "updated master weights would be thrown away; pass after= to store them in their source"
            )

    def _step_subgroup(
        self,
        g: _SubGroup,
        leases: dict[str, Lease],
        after: Callable[[int, Any], None] | None,
        grad_scale: Any,
        lowp: Any = None,
        in_place: Pieces | None = None,
    ) -> Any:
        """Step sub-group `g` from its buffers (`leases`); `in_place`: its
        master weights' pieces, stepped where they are (initialize_in_place),
        `after` told before the update. Returns the new master weights (a
        view of their buffer) for `after`, which the caller runs once the
        write-back is under way; None when stepped in place."""
        import torch

        from ..optim import CPUAdam
        from .lowp import narrow_bf16, widen_bf16

        # aio's Adam kernel steps bfloat16 moments itself (widening and rounding
        # each block in its one pass); any other optimizer gets them widened to
        # float32 in their buffers, and rounded back after: the same bits.
        widen = bool(self.narrowed) and not isinstance(self.optimizer, CPUAdam)
        for name in self.narrowed if widen else []:
            widen_bf16(leases[name].tensor(torch.uint8), g.numel)
        if "param" not in g.parts and in_place is None:
            # Master weights kept off the drive (master_slot): taken from their
            # source now, not when read ahead or kept from the last step, so a
            # change made to them since (a model load) is what gets stepped.
            _wait_all(self._start_part_read(g, "param", leases["param"]))
        views = self._views(g, leases, widened=widen)
        if in_place is not None:
            views["param"] = in_place
        if "grad" not in views:
            views["grad"] = g.grad_mem
        if in_place is not None and after is not None:
            # Told before the update, which changes the parameters themselves: a
            # Ctrl-C right after the kernel returns must not leave them counted
            # unchanged (the owner's recovery advice depends on it).
            after(g.index, None)
        self._apply(g, views, grad_scale, lowp)
        if is_pieces(g.grad_mem) and "grad" not in g.parts:
            g.grad_mem = None  # held for this step only (see hold_gradient)
        for name in self.narrowed if widen else []:  # as the drive holds them
            raw = leases[name].tensor(torch.uint8)
            narrow_bf16(raw, g.numel)
            raw[2 * g.numel : self._part_io(g, name)[1]].zero_()  # padding: no float32 leftovers
        # The drive copy is stale from here until the write lands (and the
        # master weights' source is past: they are in the buffers now),
        # unless the source is where the master weights live (master_slot).
        g.valid = False
        if "param" in g.parts:
            g.master_source = None
        self.counters["subgroup_steps"] += 1
        return None if in_place is not None else views["param"]

    def master_extent(self, index: int) -> tuple[SwapSpace, int] | None:
        """Where sub-group `index`'s fp32 master weights live on the drive: the
        swap space and the logical offset of element 0 (element k is 4 k bytes
        further); None while they are read from initialize_from()'s source
        (not written yet). Between steps that copy is current once
        :meth:`flush` ran; a reader elsewhere (a parameter swapper reading
        float32 parameters from it) must not write it: the swapper owns it."""
        g = self.groups[index]
        if g.master_source is not None or "param" not in g.parts:
            return None
        return self.space, g.offset + g.parts["param"][0]

    def update_master(self, index: int, edit: Callable[[Any], Any]) -> None:
        """Change a sub-group's fp32 master weights between steps: ``edit(master)``
        changes the float32 tensor of its size in place, and it is written back
        before this returns (its optimizer state is untouched). A failed write
        leaves the sub-group invalid until initialize() or a checkpoint."""
        import torch

        self._check_usable()
        g = self.groups[index]
        if "param" not in g.parts:
            raise self._no_master_slot(index)
        self.drop_cached()  # nothing kept in a buffer may overwrite it later
        lease = self._pool().try_acquire()
        if lease is None:  # waiting could hang: nothing gives a buffer back meanwhile
            raise SwapStateError(
                f"changing sub-group {index}'s master weights needs a free optimizer swap buffer and "
                f"all {self._pool().count} are in use; finish the step (or give back the buffers "
                f"taken with acquire_buffer()) first, or raise {BUFFER_COUNT_KEY}"
            )
        with lease:
            _wait_all(self._start_part_read(g, "param", lease))
            edit(lease.tensor(torch.float32, g.numel))
            g.valid = False
            _wait_all([self._start_part_write(g, "param", lease)])
            g.valid = True

    def read_master(self, index: int) -> Any:
        """A CPU copy of a sub-group's fp32 master weights."""
        import torch

        g = self.groups[index]
        self.drop_cached()  # the drive copy must be current
        out = torch.empty(g.numel, dtype=torch.float32)
        if g.master_source is not None:
            _wait_all(g.master_source(out))
        elif "param" not in g.parts:
            raise SwapStateError(f"sub-group {index} has no master weights: initialize_from() it first")
        else:
            self.space.sync_read(out, g.offset + g.parts["param"][0])
        return out

    # -- one sub-group's state ----------------------------------------------------------
    def state_names(self) -> list[str]:
        """The tensors of a sub-group :meth:`read_state` and :meth:`write_state`
        take: ``"param"`` (the fp32 master weights; not listed without a
        master slot, where read_state() reads them from their source and
        write_state() refuses them), then each optimizer state (``exp_avg``,
        ``exp_avg_sq`` for Adam)."""
        return [n for n in self._saved_parts() if n != "param" or self.master_slot()]

    def scalars(self, index: int) -> dict[str, Any] | None:
        """Sub-group `index`'s scalar state (Adam's ``step``) as a new dict
        (tensors cloned: a later step does not change it), None before its
        first step or load."""
        import torch

        g = self.groups.get(index)
        if g is None:
            raise ValueError(f"no sub-group {index} is registered")
        if g.scalars is None:
            return None
        return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.scalars.items()}

    def _state_part(self, index: int, name: str) -> _SubGroup:
        g = self.groups.get(index)
        if g is None:
            raise ValueError(f"no sub-group {index} is registered")
        if name not in self._saved_parts():
            raise ValueError(f"sub-group {index} has no tensor {name!r}; it has {self._saved_parts()}")
        return g

    def read_state(self, index: int, name: str, out: Any = None) -> Any:
        """Sub-group `index`'s tensor `name` (see :meth:`state_names`) as
        float32 on the CPU, in `out` when given (contiguous, float32, the
        sub-group's size): the current values, written back first if a step
        left them in a buffer. A state stored as bfloat16 is widened; a
        state before the sub-group's first step is zeros. Not counted in the
        swap counters, which are the training's I/O."""
        import torch

        self._check_usable()
        g = self._state_part(index, name)
        out = torch.empty(g.numel, dtype=torch.float32) if out is None else out
        _check_state_tensor(out, g, f"read_state(out) for {name!r}")
        self.drop_cached()  # the drive copy must be current
        if name == "param" and g.master_source is not None:
            _wait_all(g.master_source(out))
        elif name not in g.parts:
            raise SwapStateError(f"sub-group {index} has no master weights: initialize_from() it first")
        elif name != "param" and g.scalars is None:
            out.zero_()  # set-up never writes the zeros (see initialize())
        elif name in self.narrowed:
            low = torch.empty(g.numel, dtype=torch.bfloat16)
            self.space.sync_read(low, g.offset + g.parts[name][0])
            out.copy_(low)
        else:
            self.space.sync_read(out, g.offset + g.parts[name][0])
        return out

    def write_state(self, index: int, values: dict[str, Any], scalars: dict[str, Any] | None = None) -> None:
        """Set tensors of sub-group `index` (name -> float32 CPU tensor of its
        size; names from :meth:`state_names`) and, with `scalars`, its scalar
        state (Adam's ``step``: a tensor or number per name). A sub-group
        not yet stepped has no state on the drive, so giving it states needs
        `scalars` and every state. Everything is checked before anything is
        written; returns once the writes landed. A failed write leaves the
        sub-group invalid until written again or a checkpoint is loaded."""
        import torch

        self._check_usable()
        for name, t in values.items():
            _check_state_tensor(t, self._state_part(index, name), f"write_state({name!r})")
        g = self.groups[index]
        if "param" in values and "param" not in g.parts:
            raise self._no_master_slot(index)
        states = {n for n, _ in self.spec}
        if g.scalars is None and (scalars is not None or states & set(values)):
            missing = sorted(states - set(values)) + ([] if scalars is not None else ["scalars"])
            if missing:
                raise ValueError(
                    f"sub-group {index} has not been stepped, so none of its state is on the drive: "
                    f"give its scalars and every state tensor together (missing: {missing})"
                )
        if scalars is not None and not (
            isinstance(scalars, dict)
            and all(isinstance(k, str) and k not in states | {"param"} for k in scalars)
            and all(torch.is_tensor(v) or isinstance(v, (int, float)) for v in scalars.values())
        ):
            raise ValueError(
                f"sub-group {index}: scalars must map names (not state tensors') to tensors or numbers"
            )
        self.drop_cached()  # nothing kept in a buffer may overwrite these later
        g.valid = False
        for name, t in values.items():
            src = t.detach().reshape(-1)
            if name in self.narrowed:
                src = src.to(torch.bfloat16)  # rounded to nearest even, as a step's narrowing does
            self.space.sync_write(src.contiguous(), g.offset + g.parts[name][0])
            if name == "param":
                g.master_source = None  # the drive copy is the master weights from here on
        if scalars is not None:
            g.scalars = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()}
        g.valid = True

    # -- checkpoint ----------------------------------------------------------------------
    def export_checkpoint(self, directory: str) -> None:
        """Write every sub-group's master weights and optimizer state, plus a
        manifest with checksums, to `directory` (created atomically: a crash
        leaves no half-written checkpoint under that name)."""

        self._check_usable()
        self._check_checkpointable()
        self.drop_cached()  # the drive copy must be current
        for i, g in sorted(self.groups.items()):
            if g.master_source is not None and g.valid:  # never stepped: store them first
                self.update_master(i, lambda master: None)
        torn = [i for i in sorted(self.groups) if not self.groups[i].valid]
        if torn:
            raise SwapStateError(
                f"sub-groups {torn} have no complete state on the drive (never initialized, or a "
                "write failed): refusing to save a checkpoint of them; load one first"
            )
        with checkpoint_dir(directory) as tmp:
            manifest: dict[str, Any] = {
                "version": CHECKPOINT_VERSION,
                "optimizer": f"{self.optimizer_cls.__module__}.{self.optimizer_cls.__qualname__}",
                "spec": [[n, str(d)] for n, d in self.spec],
                "state_dtype": self.state_dtype,
                "steps": self.steps,
                "groups": {},
            }
            scalars = {}
            chunks = []
            for i in sorted(self.groups):
                self._settle_grad(self.groups[i])
                path = os.path.join(tmp, f"subgroup_{i}.bin")
                chunks += self._chunks(self.groups[i], path, to_checkpoint=True)
            crcs = self._copy(chunks)
            for i in sorted(self.groups):
                g = self.groups[i]
                manifest["groups"][str(i)] = {
                    "numel": g.numel,
                    "bytes": g.nbytes - g.parts["param"][0],
                    "crc32": crcs[i],
                }
                scalars[i] = g.scalars
            save_plain(
                {"scalars": scalars, "param_groups": self._param_groups()},
                os.path.join(tmp, "scalars.pt"),
                "the optimizer's scalar state",
            )
            write_manifest(tmp, manifest)

    def _check_checkpointable(self) -> None:
        if not self.master_slot():
            raise ValueError(
                "this swapper keeps no master weights on the drive (master_slot() is False), so its "
                "checkpoint would not hold them: save the optimizer's state with the model's weights "
                "(NVMeAdamW: state_dict())"
            )

    def _saved_parts(self) -> list[str]:
        """The tensors a step writes back and a checkpoint holds: all but the gradient."""
        return ["param", *(n for n, _ in self.spec)]

    def _kept_parts(self, g: _SubGroup) -> list[str]:
        """The tensors a stepped sub-group keeps a buffer for: _saved_parts()
        but the master weights where they are stepped in place."""
        parts = self._saved_parts()
        return parts[1:] if g.master_pieces is not None else parts

    def _param_groups(self) -> list[dict[str, Any]]:
        if self.optimizer is None:
            return []
        return [{k: v for k, v in pg.items() if k != "params"} for pg in self.optimizer.param_groups]

    def verify_checkpoint(self, directory: str) -> dict[str, Any]:
        """Check a checkpoint from export_checkpoint() completely -- completeness
        marker, manifest, layout, every sub-group's checksum, the scalar state --
        without changing anything. Returns what apply_checkpoint() needs. A
        malformed manifest or scalar state is a ValueError naming the folder."""
        self._check_open()
        self._check_checkpointable()
        require_complete(directory)
        try:
            with open(os.path.join(directory, "manifest.json")) as f:
                manifest = json.load(f)
            self._check_manifest(manifest)
            extra = load_plain(os.path.join(directory, "scalars.pt"))
            self._check_extra(extra)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"{directory}: not a checkpoint of this optimizer: {e}") from None
        chunks = []
        for i in sorted(self.groups):
            chunks += self._chunks(
                self.groups[i], os.path.join(directory, f"subgroup_{i}.bin"), to_checkpoint=None
            )
        self._check_crcs(directory, manifest, self._copy(chunks))
        return {"manifest": manifest, "extra": extra}

    def _check_manifest(self, manifest: Any) -> None:
        """ValueError (or KeyError/TypeError on a malformed one) unless the
        manifest describes this swapper's state layout and sub-groups."""
        if not isinstance(manifest, dict):
            raise ValueError("manifest.json does not hold an object")
        if manifest.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"unsupported checkpoint version {manifest.get('version')!r}")
        spec = [[n, str(d)] for n, d in self.spec]
        if manifest["spec"] != spec:
            raise ValueError(
                f"checkpoint optimizer state {manifest['spec']} does not match this optimizer's {spec}"
            )
        if manifest.get("state_dtype", "fp32") != self.state_dtype:
            raise ValueError(
                f"checkpoint holds {manifest.get('state_dtype', 'fp32')} optimizer states, this swapper "
                f"stores {self.state_dtype} (aio_zero.optimizer_states); load it with the same setting"
            )
        groups = manifest["groups"]
        if sorted(int(i) for i in groups) != sorted(self.groups):
            raise ValueError("checkpoint sub-groups do not match the registered sub-groups")
        if not isinstance(manifest.get("steps"), int) or isinstance(manifest["steps"], bool):
            raise ValueError("the manifest's step count is not an integer")
        for i, g in self.groups.items():
            meta = groups[str(i)]
            if meta["numel"] != g.numel or meta["bytes"] != g.nbytes - g.parts["param"][0]:
                raise ValueError(f"checkpoint sub-group {i} has a different size")
            if not isinstance(meta["crc32"], int):
                raise ValueError(f"checkpoint sub-group {i} has no integer checksum")

    def _check_extra(self, extra: Any) -> None:
        """ValueError unless scalars.pt holds, for every sub-group, None (never
        stepped) or its optimizer's scalar entries (tensors or numbers, no state
        tensor's name), and one dict of hyper-parameters per param group, each
        of the kind the optimizer's own has (a number where it has a number)."""
        import torch

        if (
            not isinstance(extra, dict)
            or not isinstance(extra.get("scalars"), dict)
            or set(extra["scalars"]) != set(self.groups)
        ):
            raise ValueError("scalars.pt does not describe these sub-groups")
        states = {n for n, _ in self.spec} | {"param"}
        for i, sc in extra["scalars"].items():
            ok = sc is None or (
                isinstance(sc, dict)
                and all(isinstance(k, str) and k not in states for k in sc)
                and all(torch.is_tensor(v) or isinstance(v, (int, float)) for v in sc.values())
            )
            if not ok:
                raise ValueError(
                    f"scalars.pt: sub-group {i}'s scalar state is not tensors or numbers by name"
                )
        saved = extra.get("param_groups")
        if not isinstance(saved, list) or not all(isinstance(g, dict) and "params" not in g for g in saved):
            raise ValueError("scalars.pt: the param groups' hyper-parameters are not dicts of values")
        # The optimizer's groups, or (not made yet) the hyper-parameters it will be made with.
        current = self.optimizer.param_groups if self.optimizer is not None else [self.hyper] * len(saved)
        if saved and len(saved) != len(current):
            raise ValueError(
                f"scalars.pt has hyper-parameters for {len(saved)} param groups, not {len(current)}"
            )
        for k, (now, got) in enumerate(zip(current, saved, strict=False)):
            if bad := mismatched(now, got):
                key = bad[0]
                raise ValueError(
                    f"scalars.pt: param group {k}'s {key!r} is {got[key]!r}, not like {now[key]!r}"
                )

    def _chunks(self, g: _SubGroup, path: str, to_checkpoint: bool | None) -> list[Chunk]:
        """The copy of sub-group `g`'s saved tensors (master weights, then the
        states: the checkpoint file is its extent after the gradient) from
        the swap space to the checkpoint file `path` (to_checkpoint True),
        back (False), or only read from the file (None: a verify pass)."""
        base = g.offset + g.parts["param"][0]
        handle = self.space.handle
        out = []
        for name in self._saved_parts():
            off, n = self._part_io(g, name)
            at = off - base
            if to_checkpoint:
                if name != "param" and g.scalars is None:  # never stepped: zeros set-up did not write
                    c = Chunk(n, g.index, data=self._zero_bytes(n))
                else:
                    c = Chunk(n, g.index, read=functools.partial(self.space.read, offset=off))
                c.write = functools.partial(handle.async_pwrite, path=path, file_offset=at)
            else:
                c = Chunk(n, g.index, read=functools.partial(handle.async_pread, path=path, file_offset=at))
                if to_checkpoint is False:
                    c.write = functools.partial(self.space.write, offset=off)
            out.append(c)
        return out

    def _zero_bytes(self, n: int) -> Any:
        """A view of `n` zero bytes, shared by every chunk of a checkpoint."""
        import torch

        if self._zeros is None or self._zeros.numel() < n:
            self._zeros = torch.zeros(n, dtype=torch.uint8)
        return self._zeros[:n]

    def _copy(self, chunks: list[Chunk]) -> dict[Any, int]:
        """copy_chunks() through two of the swapper's free buffers (cached
        sub-groups are written back first; one buffer: no overlap). Not
        counted in the swap counters, which are the training's I/O."""
        self.drop_cached()
        pool = self._pool()
        with free_buffers(pool) as buffers:
            if not buffers:
                raise ValueError(
                    f"every optimizer swap buffer is in use ({BUFFER_COUNT_KEY}={pool.count}); "
                    "release the buffers taken with acquire_buffer() before a checkpoint"
                )
            return copy_chunks(chunks, buffers)

    def _check_crcs(self, directory: str, manifest: dict[str, Any], crcs: dict[Any, int]) -> None:
        for i in sorted(self.groups):
            if crcs[i] != manifest["groups"][str(i)]["crc32"]:
                raise OSError(5, f"checkpoint sub-group {i} fails its checksum", directory)

    def apply_checkpoint(self, directory: str, verified: dict[str, Any]) -> None:
        """Load a checkpoint that verify_checkpoint() accepted into the swap
        files. Only an I/O error can still fail here; then the swapper refuses
        further use (and export) until a checkpoint is imported again."""
        self._check_open()
        self._check_checkpointable()
        manifest, extra = verified["manifest"], verified["extra"]
        try:
            chunks = []
            for i in sorted(self.groups):
                self.groups[i].valid, self.groups[i].master_source = False, None
                path = os.path.join(directory, f"subgroup_{i}.bin")
                chunks += self._chunks(self.groups[i], path, to_checkpoint=False)
            # The file was verified; a checksum failing now means it changed since.
            self._check_crcs(directory, manifest, self._copy(chunks))
            for g in self.groups.values():
                g.valid = True
        except BaseException as e:
            self.broken = (
                f"importing checkpoint {directory} failed part-way ({type(e).__name__}: {e}); the "
                "swapped optimizer state is a mix. Import a checkpoint again"
            )
            raise
        for i, g in self.groups.items():
            g.scalars = extra["scalars"][i]
        self._ensure_optimizer()
        for pg, saved in zip(self.optimizer.param_groups, extra["param_groups"], strict=False):
            pg.update(saved)
        self.steps = manifest["steps"]
        self.broken = None

    def import_checkpoint(self, directory: str) -> None:
        """Load a checkpoint from export_checkpoint() into the swap files.
        Everything is verified (marker, sizes, every checksum) before anything
        changes: a bad checkpoint leaves the current state intact."""
        self.apply_checkpoint(directory, self.verify_checkpoint(directory))

    # -- lifecycle -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters (bytes read/written, sub-group steps), steps, state tensor names,
        pinned and drive bytes, why it is broken (or None), swap folder."""
        return {
            **self.counters,
            "bytes_by_part": {d: dict(c) for d, c in self.bytes_by_part.items()},
            "subgroups": len(self.groups),
            "steps": self.steps,
            "state_tensors": [n for n, _ in self.spec],
            "state_dtype": self.state_dtype,
            "master_on_drive": self.master_slot(),
            "pinned_buffer_bytes": self.pinned_bytes(),
            "drive_bytes": self.space.size,
            "broken": self.broken,
            "swap_dir": self.space.dirs[0],
            "drives": self.space.stats(),
        }

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("OptimizerSwapper is closed")

    def _check_usable(self) -> None:
        self._check_open()
        if self.broken:
            raise SwapStateError(self.broken)

    def close(self) -> None:
        """Finish I/O, free the buffers and remove the swap folder. Idempotent."""
        if self.closed:
            return
        self.drop_cached(write_back=False)  # the files go too
        self.closed = True
        for g in self.groups.values():
            if g.grad_future is not None:
                g.grad_future.exception()
        if self.pool is not None:
            self.pool.close()  # now, not when this swapper is collected
        self.space.close()

    def __enter__(self) -> OptimizerSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_state_tensor(t: Any, g: _SubGroup, what: str) -> None:
    """TypeError/ValueError unless `t` is a contiguous float32 CPU tensor of
    sub-group `g`'s size."""
    import torch

    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu":
        kind = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"sub-group {g.index}: {what} must be a float32 CPU tensor, got {kind}")
    if t.numel() != g.numel or not t.is_contiguous():
        raise ValueError(
            f"sub-group {g.index}: {what} must be contiguous with {g.numel} elements, got {t.numel()}"
        )


def _part_bytes(numel: int, dtype: Any) -> int:
    """Bytes of one tensor of a sub-group in the swap file and its I/O: whole aligned blocks."""
    import torch

    return align_up(numel * torch.empty(0, dtype=dtype).element_size())


def _check_buffer_count(
    count: int, optimizer_cls: Any, spec: list[tuple[str, Any]], read_ahead: bool, write_behind: bool
) -> None:
    """Refuse a buffer count that cannot step even one sub-group; warn (once, here)
    when it is too small for the pipelining asked for, which then overlaps less."""
    from ..config import ConfigError

    per_step = 2 + len(spec)  # gradient, master weights, each state
    names = ", ".join(n for n, _ in spec) or "none"
    if count < per_step:
        raise ConfigError(
            [
                (
                    BUFFER_COUNT_KEY,
                    f"{count} is too small: stepping one sub-group with {optimizer_cls.__name__} takes "
                    f"{per_step} buffers (its gradient, master weights and {len(spec)} state "
                    f"tensors: {names}); set buffer_count to at least {per_step}",
                )
            ]
        )
    full = per_step + (per_step if read_ahead else 0) + ((per_step - 1) if write_behind else 0)
    if count < full:
        modes = " and ".join(
            m for m, on in (("pipeline_read", read_ahead), ("pipeline_write", write_behind)) if on
        )
        warnings.warn(
            f"{BUFFER_COUNT_KEY}={count} is too small for full {modes} overlap with "
            f"{optimizer_cls.__name__} ({full} buffers); the optimizer step reads ahead and "
            "writes behind only as far as free buffers allow",
            stacklevel=3,
        )


# How often a wait for a sub-group's reads looks whether a write-back landed
# (its buffers then read ahead): ~4 MiB takes several ms on the drives measured.
_AHEAD_POLL_S = 0.0005

_Read = tuple[dict[str, Lease], list[IOFuture], bool]  # buffers, reads in flight, dirty
_Write = tuple[int, list[Lease], list[IOFuture]]


class _StepIO:
    """The buffers and I/Os of one OptimizerSwapper.step(): reads ahead,
    write-backs behind, and every lease held, so a failure can drain them all.
    A sub-group being read holds one buffer per tensor (gradient first).

    A stepped sub-group keeps its buffers (`kept`, oldest first) until a read
    needs them: clean once its write landed, or dirty (write-back: written
    only when its buffers are needed). Whatever is kept when the step ends
    becomes the next step's first reads, done already. A read that must
    wait for a write-back takes each buffer back as its own write lands
    (`split`: that sub-group is then not kept), not once all of them did.

    With every gradient held in memory, a read ahead with too few buffers
    free reads what they hold (`partial`: the tensors still to read): with 4
    buffers and 3 tensors a sub-group, the drive otherwise idles while each
    sub-group is computed. At most one
    read is partial, and none starts after it, so finish_read() can always
    complete it from the buffers of the sub-groups stepped before it."""

    def __init__(self, sw: OptimizerSwapper, pool: BufferPool) -> None:
        self.sw = sw
        self.pool = pool
        self.reads: dict[int, _Read] = {}
        self.writes: collections.deque[_Write] = collections.deque()
        self.kept: collections.OrderedDict[int, tuple[list[Lease], bool]] = collections.OrderedDict()
        self.held: list[Lease] = []
        self.partial: dict[int, list[str]] = {}  # sub-group -> tensors not yet being read
        self.carried: set[int] = set()  # reads done by carry_over(): the buffers kept by a step
        # id of a buffer's lease -> (the lease, the write-back from it in flight)
        self.written_from: dict[int, tuple[Lease, IOFuture]] = {}
        self.split: set[int] = set()  # write-backs that gave buffers back as their writes landed

    def _release(self, lease: Lease) -> None:
        lease.release()
        self.held.remove(lease)

    def _start_write(self, i: int, leases: list[Lease]) -> _Write:
        sw, g = self.sw, self.sw.groups[i]
        futs: list[IOFuture] = []
        try:
            for name, lease in zip(sw._kept_parts(g), leases, strict=True):
                if name not in g.parts:  # master weights kept off the drive (master_slot)
                    continue
                off, n = sw._part_io(g, name)
                futs.append(sw.space.write(lease.buffer()[:n], off))
                self.written_from[id(lease)] = (lease, futs[-1])
                sw.count_io("written", name, n)
        except BaseException:
            _settle_started(futs)  # no buffer goes back with a write still in it
            raise
        return (i, leases, futs)

    def _finish_write(self, entry: _Write) -> None:
        """Wait for a write-back; keep its buffers, clean (on failure they stay in
        `held`, which abort() gives back); those of one that gave some back
        early (_release_landed) go back too."""
        i, leases, futs = entry
        _wait_all(futs)
        self._forget_writes(leases)
        self.sw.groups[i].valid = True
        if i in self.split:
            self.split.discard(i)
            for lease in leases:
                self._release(lease)
            return
        self.kept[i] = (leases, False)

    def _release_landed(self) -> bool:
        """Give back the buffers of the oldest write-back whose own write landed,
        waiting for the first still in flight if none did: a read then reuses
        each buffer as its write lands, not once the whole sub-group's did
        (its sub-group is then not kept). False when none can come back so."""
        i, leases, futs = self.writes[0]
        mine = [self._write_from(lease) for lease in leases]
        if not any(f is not None and f.done() for f in mine):
            first = next((f for f in mine if f is not None), None)
            if first is None:
                return False
            first.wait()
        landed = [f is not None and f.done() for f in mine]
        _wait_all(
            [f for f, done in zip(mine, landed, strict=True) if done and f is not None]
        )  # a failure raises
        back = [lease for lease, done in zip(leases, landed, strict=True) if done]
        self._forget_writes(back)
        for lease in back:
            self._release(lease)
        self.writes[0] = (i, [lease for lease, done in zip(leases, landed, strict=True) if not done], futs)
        self.split.add(i)
        return True

    def _write_from(self, lease: Lease) -> IOFuture | None:
        """The write-back in flight from `lease`'s buffer, if any."""
        got = self.written_from.get(id(lease))
        return got[1] if got is not None and got[0] is lease else None

    def _forget_writes(self, leases: list[Lease]) -> None:
        for lease in leases:
            if self._write_from(lease) is not None:
                del self.written_from[id(lease)]

    def _free_one(self, wait: bool) -> bool:
        """One move towards free buffers: drop the oldest clean kept sub-group,
        else take a landed write-back (waiting for it if `wait`), else start
        writing the oldest dirty one; False when nothing can be done now."""
        for i, (leases, dirty) in self.kept.items():
            if not dirty:
                del self.kept[i]
                for lease in leases:
                    self._release(lease)
                return True
        if self.writes and all(f.done() for f in self.writes[0][2]):
            self._finish_write(self.writes.popleft())
            return True
        if self.writes and wait:
            if not self._release_landed():
                self._finish_write(self.writes.popleft())
            return True
        if self.kept and not self.writes:
            i, (leases, _) = self.kept.popitem(last=False)
            self.writes.append(self._start_write(i, leases))
            return True
        return False

    def _lease(self, count: int, must: bool) -> list[Lease] | None:
        """`count` free buffers, dropping kept sub-groups and finishing write-backs
        to free them (waiting only if `must`); None when they cannot be had and
        not `must`."""
        while self.pool.available() < count and self._free_one(wait=must):
            pass
        if self.pool.available() < count and not must:
            return None
        leases: list[Lease] = []
        for _ in range(count):
            lease = self.pool.try_acquire()
            if lease is None:
                for got in leases:
                    self._release(got)
                raise SwapStateError(
                    f"stepping a sub-group needs {count} free optimizer swap buffers; give back "
                    f"every buffer leased with acquire_buffer() before step(), or raise {BUFFER_COUNT_KEY}"
                )
            self.held.append(lease)
            leases.append(lease)
        return leases

    def _read_names(self, i: int) -> list[str]:
        """The tensors of sub-group i a read leases a buffer for, in order."""
        g = self.sw.groups[i]
        names = [n for n in g.parts if n != "grad" or g.grad_mem is None]
        if "param" not in g.parts and g.master_pieces is None:
            # Master weights kept off the drive take a buffer but no read:
            # leased last, so a partial read ahead spends its buffers on reads.
            # (Stepped in place, they take none.)
            names.append("param")
        return names

    def make_room(self, nxt: int) -> None:
        """Start now the write-back that reading sub-group `nxt` (or what a
        partial read left of it) will wait for: the oldest dirty kept
        sub-group's, when the free buffers fall short, no write-back is in
        flight and no clean kept sub-group could be dropped instead (what
        _lease() would do first). Never drops or reuses a buffer."""
        if nxt in self.reads and nxt not in self.partial:
            return
        need = len(self.partial[nxt]) if nxt in self.partial else len(self._read_names(nxt))
        if self.writes or not self.kept or self.pool.available() >= need:
            return
        if any(not dirty for _, dirty in self.kept.values()):
            return
        i, (leases, _) = self.kept.popitem(last=False)
        self.writes.append(self._start_write(i, leases))

    def start_read(self, i: int, must: bool, partly: bool = False) -> bool:
        """Lease a buffer per tensor of sub-group i (but a gradient held in
        memory) and start reading them all. Not `must`, with too few buffers
        free: with `partly`, start reading as many tensors as there are (none
        while another read is partial); False when nothing was started."""
        sw, g = self.sw, self.sw.groups[i]
        names = self._read_names(i)
        if self.partial and not must:
            return False
        leases = self._lease(len(names), must)
        if leases is None:
            if not partly:
                return False
            leases = self._lease(min(self.pool.available(), len(names)), must=True)
            if not leases:
                return False
            self.partial[i] = names[len(leases) :]
            sw.counters["partial_reads"] += 1
        self.reads[i] = ({}, [], False)
        self.carried.discard(i)
        sw._settle_grad(g)
        self._read_parts(i, names[: len(leases)], leases)
        return True

    def finish_read(self, i: int) -> None:
        """Start reading whatever a partial read of sub-group i left (waiting for
        buffers: the sub-groups stepped before it free theirs)."""
        # One buffer at a time: each read starts as a write-back's buffer comes back.
        for name in self.partial.pop(i, None) or []:
            self._read_parts(i, [name], self._lease(1, must=True) or [])

    def _read_parts(self, i: int, names: list[str], leases: list[Lease]) -> None:
        import torch

        sw, g = self.sw, self.sw.groups[i]
        have, futs, _ = self.reads[i]
        # Before its first step a sub-group's states are zeros set-up never wrote:
        # zeroed here instead of read (a fifth of step 1's reads with AdamW).
        fresh = {n for n, _ in sw.spec} if g.scalars is None else set()
        for name, lease in zip(names, leases, strict=True):
            have[name] = lease
            if name not in g.parts:
                continue  # master weights kept off the drive: taken from their source when stepped
            if name in fresh:
                lease.tensor(torch.uint8)[: sw._part_io(g, name)[1]].zero_()
                continue
            futs.extend(sw._start_part_read(g, name, lease))

    def fetch(self, i: int, nxt: int | None, partly: bool) -> dict[str, Lease]:
        """Sub-group i's buffers, its tensors read (started now if not ahead),
        while reading ahead sub-group `nxt` (None: none) into buffers that
        are free or come free meanwhile (`partly`: as start_read)."""
        if i not in self.reads:
            self.start_read(i, must=True)
        self.finish_read(i)  # before any read ahead takes the buffers it needs
        if nxt is not None and nxt not in self.reads:
            self.start_read(nxt, must=False, partly=partly)
        # While i's reads land, the write-back started beside them may land
        # first: its buffers then read ahead at once, not after i's reads and
        # update (measured: the drive ran one read at a time for ~6 ms of
        # each ~14 ms sub-group; counters["ahead_in_wait"] counts them).
        leases = self.take_read(i, nxt, partly=partly)
        if nxt is not None and nxt not in self.reads:
            # Again: the write-back started beside i's read may have landed
            # since, freeing buffers to read ahead into during i's update
            # (the drive idled through each update).
            self.start_read(nxt, must=False, partly=partly)
        return leases

    def take_read(self, i: int, ahead: int | None = None, partly: bool = False) -> dict[str, Lease]:
        """Wait for sub-group i's reads; return the buffers holding its tensors.
        With `ahead` (a sub-group not being read), start reading it (`partly`:
        as start_read) as soon as a write-back landing meanwhile frees buffers."""
        self.finish_read(i)
        if ahead is not None:
            self._read_ahead_while(self.reads[i][1], ahead, partly)
        leases, futs, _ = self.reads.pop(i)
        if i in self.carried:  # kept in its buffers by the step before: nothing read
            self.carried.discard(i)
            self.sw.counters["cached_subgroups"] += 1
        _wait_all(futs)
        return leases

    def _read_ahead_while(self, futs: list[IOFuture], ahead: int, partly: bool) -> None:
        """Until `futs` (reads) land: whenever the oldest write-back has landed,
        try to start reading sub-group `ahead`; stop once it started, or when no
        write-back is in flight (then nothing frees a buffer meanwhile)."""
        pending = [f for f in futs if not f.done()]
        while pending and ahead not in self.reads and self.writes:
            landed = self.writes[0]
            if all(f.done() for f in landed[2]):
                if self.start_read(ahead, must=False, partly=partly):
                    self.sw.counters["ahead_in_wait"] += 1
                    return
                if self.writes and self.writes[0] is landed:
                    return  # refused without taking it (a partial read is on): no use waiting
                continue  # taken, too few buffers still: wait for the next write-back, if any
            pending[0].wait(_AHEAD_POLL_S)
            pending = [f for f in pending if not f.done()]

    def done_stepping(self, i: int, leases: dict[str, Lease], write_back: bool) -> None:
        """Sub-group i is stepped: its gradient's buffer goes back; the rest are
        kept dirty (`write_back`), or written now, pipelined or waited for."""
        if "grad" in leases:
            self._release(leases["grad"])
        kept = [leases[name] for name in self.sw._kept_parts(self.sw.groups[i])]
        if write_back:
            self.kept[i] = (kept, True)
            return
        self.writes.append(self._start_write(i, kept))
        if not self.sw.pipeline_write:
            self._finish_write(self.writes.pop())
        while self.writes and all(f.done() for f in self.writes[0][2]):
            self._finish_write(self.writes.popleft())

    def carry_over(self, next_order: list[int], read_ahead: bool) -> None:
        """End of a step: wait for the write-backs in flight; every sub-group still
        in its buffers becomes one of the next step's reads, done already (the
        next step goes in `next_order`, the reverse of this one, so they come
        first). With `read_ahead` (only when every gradient is held in memory:
        a read started now must not fetch a gradient the next step will not
        use), start reading the sub-groups after them into the buffers still free."""
        while self.writes:
            self._finish_write(self.writes.popleft())
        for i, (leases, dirty) in self.kept.items():
            self.reads[i] = (
                dict(zip(self.sw._kept_parts(self.sw.groups[i]), leases, strict=True)),
                [],
                dirty,
            )
            self.carried.add(i)
        self.kept.clear()
        if read_ahead:
            for i in next_order:
                if i not in self.reads and not self.start_read(i, must=False, partly=True):
                    break

    def write_masters(self) -> None:
        """Write the master weights of every carried sub-group not yet on the
        drive, and wait; the sub-groups stay dirty (their states are not written)."""
        sw = self.sw
        futs: list[IOFuture] = []
        try:
            for i, (leases, _futs, dirty) in self.reads.items():
                if dirty and "param" in sw.groups[i].parts:
                    futs.append(sw._start_part_write(sw.groups[i], "param", leases["param"]))
        except BaseException:
            _settle_started(futs)
            raise
        _wait_all(futs)

    def write_back(self) -> None:
        """Write every carried sub-group not yet on the drive, and wait (the
        writes are tracked in `writes`, so abort() drains them after a failure;
        after a Ctrl-C, a second call waits for those already started)."""
        started = {entry[0] for entry in self.writes}
        for i, (leases, _futs, dirty) in list(self.reads.items()):
            if dirty and i not in started:
                parts = self.sw._kept_parts(self.sw.groups[i])
                self.writes.append(self._start_write(i, [leases[n] for n in parts]))
        while self.writes:
            i, written, futs = self.writes[0]
            _wait_all(futs)
            self._forget_writes(written)
            self.writes.popleft()
            self.sw.groups[i].valid = True
            leases, futs, _ = self.reads[i]
            self.reads[i] = (leases, futs, False)

    def abort(self) -> None:
        """After a failure (or to give everything back): drain so nothing still
        reads into or writes from a buffer, keep the sub-groups whose writes
        landed valid, release every lease. Dirty sub-groups are lost. Each
        entry is dropped only once settled: run again after a Ctrl-C, it
        goes on where it stopped."""
        for _leases, futs, _ in self.reads.values():
            for fut in futs:
                fut.exception()
        while self.writes:
            i, _kept, futs = self.writes[0]
            errors = [fut.exception() for fut in futs]  # every one waited for
            if all(e is None for e in errors):
                self.sw.groups[i].valid = True
            self.writes.popleft()
        while self.held:
            self.held[-1].release()  # waits for any I/O still on its buffer
            self.held.pop()
        self.reads.clear()
        self.carried.clear()
        self.kept.clear()
        self.partial.clear()
        self.written_from.clear()
        self.split.clear()


def _land_initial(entry: tuple[_SubGroup, Lease, IOFuture]) -> None:
    """Wait for one of initialize_many()'s writes; its sub-group is valid once it landed."""
    g, lease, fut = entry
    try:
        fut.result()
        g.valid = True
    finally:
        lease.release()


def _settle_started(futs: list[IOFuture]) -> None:
    """Starting a batch of I/O failed part-way: wait for those started (their
    outcome is not the error to report), so their buffers can go back."""
    for fut in futs:
        fut.exception()


def _wait_all(futs: list[IOFuture]) -> None:
    """Wait for every future, then raise the first failure (none left in flight)."""
    errors = [fut.exception() for fut in futs]
    for e in errors:
        if e is not None:
            raise e
