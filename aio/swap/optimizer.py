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

Its parts: a sub-group and its extent's layout (:mod:`aio.swap.subgroup`),
the step's buffers and I/O -- reads ahead, write-backs, the sub-groups kept
in buffers between steps (:mod:`aio.swap.step_io`) -- the update of one
sub-group in its buffers by the torch optimizer (:mod:`aio.swap.update`)
and checkpoints (:mod:`aio.swap.optimizer_checkpoint`); this module
orchestrates them.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..config import discover_state_spec
from ..pinned import Lease, Register
from .copy import Chunk, copy_chunks, free_buffers, land_all
from .drives import IOFuture, SwapSpace
from .optimizer_checkpoint import CHECKPOINT_VERSION as CHECKPOINT_VERSION
from .optimizer_checkpoint import OptimizerCheckpointer
from .param import SwapStateError
from .param_groups import TorchGroups
from .pieces import Pieces, check_pieces, is_pieces
from .pool import BufferPool
from .step_io import BUFFER_COUNT_KEY, StepIO
from .subgroup import MAX_NUMEL, MasterSource, SubGroup, layout, slot_bytes
from .update import SubGroupUpdater


class OptimizerSwapper:
    """Swaps optimizer sub-groups to files under ``nvme_path``.

    ``optimizer_cls``/``hyper``: the torch optimizer applied per sub-group
    (e.g. ``torch.optim.Adam, {"lr": 1e-3}``). ``buffer_count`` pinned buffers
    each hold one tensor (gradient, master weights or one state) of the
    largest sub-group; at least ``2 + states`` are needed (Adam: 4).
    ``updater`` (:class:`~aio.swap.update.SubGroupUpdater`) applies the
    optimizer to one sub-group in its buffers and holds :attr:`optimizer`.
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
        self.groups: dict[int, SubGroup] = {}
        self.pool: BufferPool | None = None
        # The update of one sub-group in its buffers, and the torch optimizer it steps with.
        self.updater = SubGroupUpdater(optimizer_cls, self.hyper, self.spec, self.narrowed, self.torch_groups)
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
        self._checkpointer = OptimizerCheckpointer(self)
        # Buffers carried from one step to the next: sub-groups whose state is
        # still in a buffer after its write landed, and reads started ahead.
        self._carry: StepIO | None = None

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

    @property
    def optimizer(self) -> Any:
        """The torch optimizer over the sub-groups' proxies (None until the
        first step or :meth:`ensure_optimizer`): its ``param_groups`` hold
        the hyper-parameters the next step uses (an LR schedule changes
        them there). Kept by :attr:`updater`."""
        return self.updater.optimizer

    # -- layout --------------------------------------------------------------------
    def _layout(self, numel: int) -> tuple[dict[str, tuple[int, Any]], int]:
        import torch

        grad = [("grad", torch.float32)] if self.gradient_slot() else []
        master = [("param", torch.float32)] if self.master_slot() else []
        tensors = [*grad, *master, *self.spec]
        return layout(numel, [(n, torch.bfloat16 if n in self.narrowed else dt) for n, dt in tensors])

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
        if self.pool is not None and slot_bytes(numel, self.spec) > self.pool.slot_bytes:
            if self.optimizer is not None or self.pool.available() != self.pool.count:
                raise ValueError(
                    f"sub-group {index} ({numel} elements) is larger than the swap buffers, which "
                    "were sized at the first step; register every sub-group before stepping"
                )
            self.pool = None  # still setting up and idle: re-size on next use
        off = self.space.allocate(nbytes)
        g = SubGroup(index, numel, off, parts, nbytes)
        g.proxy = torch.nn.Parameter(torch.empty(0))
        self.groups[index] = g

    def _pool(self) -> BufferPool:
        if self.pool is None:
            if not self.groups:
                raise ValueError("no sub-groups registered")
            largest = max(slot_bytes(g.numel, self.spec) for g in self.groups.values())
            self.pool = BufferPool(
                self.buffer_count,
                largest,
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
        memory, and a checkpoint takes the states from zeros
        (:class:`~aio.swap.optimizer_checkpoint.OptimizerCheckpointer`).
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
        fills = list(fills)
        if not fills:  # e.g. a rank holding no element of any parameter: no sub-group, no pool
            return
        self.drop_cached()
        pool = self._pool()
        pending: collections.deque[tuple[SubGroup, Lease, IOFuture]] = collections.deque()
        try:
            for index, fill in fills:
                g = self.groups[index]
                if pending and pool.available() == 0:
                    _land_initial(pending.popleft())
                lease = pool.acquire()
                try:
                    fill(lease.tensor(torch.float32, g.numel))
                    g.scalars, g.valid = None, False
                    pending.append((g, lease, self.start_part_write(g, "param", lease)))
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

    def _master_pieces(self, g: SubGroup) -> Pieces:
        """Sub-group `g`'s in-place master weights, checked (see initialize_in_place)."""
        if g.master_pieces is None:
            raise SwapStateError(f"sub-group {g.index}'s master weights are not in place")
        return check_pieces(g.master_pieces(), g.numel, f"sub-group {g.index}'s master weights")

    def start_part_read(self, g: SubGroup, name: str, lease: Lease) -> list[IOFuture]:
        """Start reading one of sub-group `g`'s tensors into `lease`'s buffer
        (counted in the swap counters); returns the reads in flight: its
        master weights from their source while initialize_from() left one."""
        import torch

        if name == "param" and (g.master_source is not None or name not in g.parts):
            if g.master_source is None:
                raise SwapStateError(f"sub-group {g.index} has no master weights: initialize_from() it first")
            futs = list(g.master_source(lease.tensor(torch.float32, g.numel)))
            self.count_io("read", name, sum(int(f.nbytes) for f in futs))  # what it copied was no I/O
            return futs
        off, n = g.part_io(name)
        self.count_io("read", name, n)
        return [self.space.read(lease.buffer()[:n], off)]

    def count_io(self, direction: str, part: str, nbytes: int) -> None:
        """Count bytes moved ("read" or "written") for one tensor kind, in
        ``counters`` and in ``bytes_by_part``."""
        self.counters["bytes_" + direction] += nbytes
        self.bytes_by_part[direction][part] += nbytes

    def start_part_write(self, g: SubGroup, name: str, lease: Lease) -> IOFuture:
        """Start writing one of sub-group `g`'s tensors from `lease`'s buffer
        to its place in its extent (counted in the swap counters); once its
        master weights are written, the drive copy is theirs."""
        off, n = g.part_io(name)
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
            g.settle_grad()
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
        g.settle_grad()
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
            g.settle_grad()
            g.grad_mem = held
            return
        if grad.numel() != g.numel or grad.dtype != torch.float32 or grad.device.type != "cpu":
            raise ValueError(
                f"sub-group {index}: a held gradient must be {g.numel} fp32 elements on the CPU, "
                f"got {grad.numel()} of {grad.dtype} on {grad.device}"
            )
        if not grad.is_contiguous():
            raise ValueError(f"sub-group {index}: a held gradient must be contiguous")
        g.settle_grad()
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

    # -- the step ----------------------------------------------------------------------
    def ensure_optimizer(self) -> None:
        """Make the torch optimizer over the sub-groups' proxies at first
        need (:attr:`optimizer`), and clear any gradient a step cut short
        left on a proxy (:meth:`SubGroupUpdater.ensure_optimizer
        <aio.swap.update.SubGroupUpdater.ensure_optimizer>`)."""
        self.updater.ensure_optimizer(self.groups)

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
        (e.g. to copy the new weights into the model's low-precision params);
        `master_view` is to read only: its buffer may already be being
        written to the drive (change master weights with update_master()).
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
        if not self.groups:  # nothing on this rank (FSDP2 gave it no rows): a step all the same,
            self.steps += 1  # as torch's, not an error here alone (the other ranks would hang)
            return
        order = sorted(self.groups, reverse=self.steps % 2 == 1)
        # Gradients on the drive take buffers during backward: nothing is kept then.
        write_back = all(self.groups[i].grad_mem is not None for i in order)
        # A write-back cut short (Ctrl-C in drop_cached()) left writes in flight
        # from kept buffers: finished first, not stepped under.
        if not write_back or (self._carry is not None and self._carry.writes):
            self.drop_cached()
        in_place = self._check_ready(order)
        self.ensure_optimizer()
        io, self._carry = self._carry, None
        io = io or StepIO(self, self._pool())
        # Gradients in memory: free buffers read ahead whatever pipeline_read says,
        # partly if need be (2B bf16, 4 buffers: 1.5 s a step faster). On the drive:
        # a whole sub-group, only with pipeline_read (partly measured slower there).
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

    def _abandon_step(self, io: StepIO, e: BaseException) -> None:
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
        g: SubGroup,
        leases: dict[str, Lease],
        after: Callable[[int, Any], None] | None,
        grad_scale: Any,
        lowp: Any = None,
        in_place: Pieces | None = None,
    ) -> Any:
        """Step sub-group `g` from its buffers (`leases`) with the updater
        (:meth:`SubGroupUpdater.step <aio.swap.update.SubGroupUpdater.step>`:
        `in_place` and `after` as it takes them); around it, what the swapper
        keeps: master weights kept off the drive taken from their source
        first, a gradient held as pieces let go, the drive copy marked stale.
        Returns the new master weights (a view of their buffer) for `after`,
        which the caller runs once the write-back is under way; None when
        stepped in place."""
        if "param" not in g.parts and in_place is None:
            # Master weights kept off the drive (master_slot): taken from their
            # source now, not when read ahead or kept from the last step, so a
            # change made to them since (a model load) is what gets stepped.
            land_all(self.start_part_read(g, "param", leases["param"]))
        master = self.updater.step(g, leases, after, grad_scale, lowp, in_place)
        if is_pieces(g.grad_mem) and "grad" not in g.parts:
            g.grad_mem = None  # held for this step only (see hold_gradient)
        # The drive copy is stale from here until the write lands (and the
        # master weights' source is past: they are in the buffers now),
        # unless the source is where the master weights live (master_slot).
        g.valid = False
        if "param" in g.parts:
            g.master_source = None
        self.counters["subgroup_steps"] += 1
        return master

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
            land_all(self.start_part_read(g, "param", lease))
            edit(lease.tensor(torch.float32, g.numel))
            g.valid = False
            land_all([self.start_part_write(g, "param", lease)])
            g.valid = True

    def read_master(self, index: int) -> Any:
        """A CPU copy of a sub-group's fp32 master weights."""
        import torch

        g = self.groups[index]
        self.drop_cached()  # the drive copy must be current
        out = torch.empty(g.numel, dtype=torch.float32)
        if g.master_source is not None:
            land_all(g.master_source(out))
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
        return [n for n in self.saved_parts() if n != "param" or self.master_slot()]

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

    def saved_parts(self) -> list[str]:
        """The tensors a step writes back and a checkpoint holds: all but the
        gradient (``"param"``, then each optimizer state)."""
        return ["param", *(n for n, _ in self.spec)]

    def _state_part(self, index: int, name: str) -> SubGroup:
        g = self.groups.get(index)
        if g is None:
            raise ValueError(f"no sub-group {index} is registered")
        if name not in self.saved_parts():
            raise ValueError(f"sub-group {index} has no tensor {name!r}; it has {self.saved_parts()}")
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
            land_all(g.master_source(out))
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

    # -- checkpoint (aio.swap.optimizer_checkpoint) ------------------------------------
    def export_checkpoint(self, directory: str) -> None:
        """Write every sub-group's master weights and optimizer state, plus a
        manifest with checksums, to `directory` (created atomically: a crash
        leaves no half-written checkpoint under that name)."""
        self._check_usable()
        self._checkpointer.export(directory)

    def verify_checkpoint(self, directory: str) -> dict[str, Any]:
        """Check a checkpoint from export_checkpoint() completely -- completeness
        marker, manifest, layout, every sub-group's checksum, the scalar state --
        without changing anything. Returns what apply_checkpoint() needs. A
        malformed manifest or scalar state is a ValueError naming the folder."""
        self._check_open()
        return self._checkpointer.verify(directory)

    def apply_checkpoint(self, directory: str, verified: dict[str, Any]) -> None:
        """Load a checkpoint that verify_checkpoint() accepted into the swap
        files. Only an I/O error can still fail here; then the swapper refuses
        further use (and export) until a checkpoint is imported again."""
        self._check_open()
        self._checkpointer.apply(directory, verified)

    def import_checkpoint(self, directory: str) -> None:
        """Load a checkpoint from export_checkpoint() into the swap files.
        Everything is verified (marker, sizes, every checksum) before anything
        changes: a bad checkpoint leaves the current state intact."""
        self.apply_checkpoint(directory, self.verify_checkpoint(directory))

    def copy_through_buffers(self, chunks: list[Chunk]) -> dict[Any, int]:
        """copy_chunks() through two of the swapper's free buffers (kept
        sub-groups are written back first; one buffer: no overlap); returns
        each key's CRC32. ValueError when every buffer is in use. Not counted
        in the swap counters, which are the training's I/O."""
        self.drop_cached()
        pool = self._pool()
        with free_buffers(pool) as buffers:
            if not buffers:
                raise ValueError(
                    f"every optimizer swap buffer is in use ({BUFFER_COUNT_KEY}={pool.count}); "
                    "release the buffers taken with acquire_buffer() before a checkpoint"
                )
            return copy_chunks(chunks, buffers)

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


def _check_state_tensor(t: Any, g: SubGroup, what: str) -> None:
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


def _land_initial(entry: tuple[SubGroup, Lease, IOFuture]) -> None:
    """Wait for one of initialize_many()'s writes; its sub-group is valid once it landed."""
    g, lease, fut = entry
    try:
        fut.result()
        g.valid = True
    finally:
        lease.release()
