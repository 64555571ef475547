"""Streamed torch.distributed.checkpoint (DCP) saves and loads of
:class:`aio.optim.NVMeAdamW`'s moments: one parameter's moment in memory at
a time, never the whole state.

Inside ``with opt.streamed_state():`` the optimizer's ``state_dict()`` (and
so ``get_optimizer_state_dict``) gives each moment as a drive-backed
placeholder (:class:`aio.optim.drive_moments.DriveTensor`).
:class:`DriveSavePlanner` reads each from the drive when DCP writes it;
:class:`DriveLoadPlanner` gives DCP a buffer for each and writes it to the
drive once filled; ``set_optimizer_state_dict`` (the optimizer's
``load_state_dict``) of the same state dict then loads the steps and
hyper-parameters. Everything else in the state dict (the model, the steps)
is DCP's default handling. Memory bound: docs/fsdp.md.
"""

from __future__ import annotations

import collections
import io
import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem

from .drive_moments import DriveMoments, DriveSource, drive_source
from .dtensor import local_of

__all__ = ["DriveLoadPlanner", "DriveSavePlanner"]


def _distinct(sources: Iterable[DriveSource]) -> list[DriveMoments]:
    """The placeholders' drive accesses, each once."""
    return list({id(s.moments): s.moments for s in sources}.values())


class _Countdown:
    """The items of each placeholders' drive access (:class:`DriveMoments
    <aio.optim.drive_moments.DriveMoments>`) left in this rank's final
    plan: after the last, its swap buffers go back to the swapper (the
    optimizer's next step needs them)."""

    def __init__(self, sources: Iterable[DriveSource]) -> None:
        self.left = collections.Counter(id(s.moments) for s in sources)
        self.lock = threading.Lock()

    def done(self, src: DriveSource) -> None:
        """One item of `src`'s drive access written or loaded."""
        with self.lock:
            self.left[id(src.moments)] -= 1
            last = self.left[id(src.moments)] == 0
        if last:
            src.moments.release()


class DriveSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that a moment placeholder
    (:class:`aio.optim.drive_moments.DriveTensor`, from ``state_dict()`` inside
    :meth:`aio.optim.NVMeAdamW.streamed_state`) is read from the drive when
    DCP writes it: one moment in memory per write item. With torch's
    ``FileSystemWriter`` give ``single_file_per_rank=False``: the default
    writer keeps every tensor of a file alive until the file is closed (all
    of the rank's state)."""

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        """DefaultSavePlanner's, then the placeholders found by key and
        checked current (before the writer opens a file: a refused save
        leaves a checkpoint already at the path as it was)."""
        super().set_up_planner(state_dict, *args, **kwargs)
        self.drive = {k: s for k, v in self.state_dict.items() if (s := drive_source(v)) is not None}
        for moments in _distinct(self.drive.values()):
            moments.begin_save()

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """DefaultSavePlanner's, then the placeholders' items counted."""
        plan = super().finish_plan(new_plan)
        self.countdown = _Countdown(s for it in plan.items if (s := self.drive.get(it.index.fqn)) is not None)
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The moment read from the drive for a placeholder, else DCP's own."""
        src = self.drive.get(write_item.index.fqn)
        if src is None:
            return super().resolve_data(write_item)
        shape = tuple(local_of(self.state_dict[write_item.index.fqn]).shape)
        out = src.moments.read(src.index, src.name).view(shape)
        self.countdown.done(src)
        return out


class DriveLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a moment placeholder gets a
    buffer of its parameter's local moment, which goes to the drive as soon
    as DCP filled it (one or two moments in memory at a time when a
    parameter's pieces are read one after another, as from a checkpoint
    saved with one file per tensor or on the same layout). Then
    ``set_optimizer_state_dict`` (the optimizer's load_state_dict) with the
    same state dict loads the steps; from the load's first write to the
    drive until it does, the optimizer refuses to step (its moments are
    newer than its steps). A moment counts as loaded once on the drive; a
    failed load is retried with a new planner (each load starts afresh).
    After its last item each planner gives the swap buffers it leased back
    (after a failure, the optimizer's next step or the block's end does)."""

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        """DefaultLoadPlanner's (placeholders stay on the meta device), then
        the placeholders found by key and their load begun (what a failed
        load of them left is dropped: every moment is loaded again)."""
        super().set_up_planner(state_dict, *args, **kwargs)
        self.drive = {k: s for k, v in self.state_dict.items() if (s := drive_source(v)) is not None}
        for moments in _distinct(self.drive.values()):
            moments.begin_load()  # a retry after a failed load starts afresh

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        """DefaultLoadPlanner's, then the placeholders' items counted."""
        plan = super().finish_plan(new_plan)
        fqns = (it.dest_index.fqn for it in plan.items)
        self.countdown = _Countdown(s for fqn in fqns if (s := self.drive.get(fqn)) is not None)
        return plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """Where DCP copies a read item: a placeholder's assembly buffer, else DCP's own."""
        fqn = read_item.dest_index.fqn
        src = self.drive.get(fqn)
        if src is None:
            return super().resolve_tensor(read_item)
        shape = tuple(local_of(self.state_dict[fqn]).shape)
        return src.moments.target(src.index, src.name, shape, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """A placeholder's read item is in its buffer: counted, and the
        moment written to the drive once complete."""
        src = self.drive.get(read_item.dest_index.fqn)
        if src is None:
            super().commit_tensor(read_item, tensor)
            return
        src.moments.commit(src.index, src.name, tensor.numel())
        self.countdown.done(src)
