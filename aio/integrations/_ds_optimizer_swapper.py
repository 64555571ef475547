"""BackpressurePipelinedOptimizerSwapper: DeepSpeed's pipelined ZeRO-3
optimizer swapper that never asserts for want of a buffer (see
ds_swappers.py for the why and the overridden methods).

Imports DeepSpeed: ds_swappers imports this module only when installing.

DeepSpeed's pipelined swapper (pipelined_optimizer_swapper.py, 0.19) holds
up to three sub-groups' buffers at once: the one being stepped
(SYNC_SWAP_IN, ``states + 1`` buffers with its gradient), the next one read
ahead (ASYNC_SWAP_IN) and the previous one's pending write (ASYNC_SWAP_OUT);
at the first step Adam's new state needs ``states`` more. It asks its
``SwapBufferManager`` and asserts when ``allocate`` returns None. Here a
buffer is found, in this order, by completing the pending write and by
dropping the read-ahead (its read is waited for, then its buffers freed; the
sub-group is read again when stepped); the read-ahead starts only into
buffers that are free, keeping room for the state a first step creates.
Which bytes are read, written and stepped on is DeepSpeed's: only when.

One thing it adds (DeepSpeed's upstream item 6 in docs/deepspeed.md): the
optimizer state that Adam creates at a sub-group's first step, in ordinary
memory, is copied into swap buffers for its first write, and DeepSpeed's
pipelined class never releases the originals (``release_memory()`` is not
called on this path; ``_complete_swap_out`` only rebinds a local), so they
stay until the sub-group's next swap-in: 8 bytes per parameter (Adam) after
step 1. Here they are released once that write has completed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper import (
    ASYNC_SWAP_IN,
    ASYNC_SWAP_OUT,
    PipelinedOptimizerSwapper,
)

from .ds_swappers import OPTIMIZER_COUNTERS, buffers_short, bump, note_buffer_count


class BackpressurePipelinedOptimizerSwapper(PipelinedOptimizerSwapper):
    """DeepSpeed's pipelined optimizer swapper with backpressure: reads
    ahead only into free buffers, completes writes early and drops the
    read-ahead when a buffer is needed, raises (a ValueError naming
    ``offload_optimizer.buffer_count``) only if one sub-group alone needs
    more buffers than there are; releases a sub-group's first-step state
    from ordinary memory once its write has completed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        swap_config = kwargs.get("swap_config", args[0] if args else None)
        count = getattr(swap_config, "buffer_count", 1)
        if isinstance(count, int) and count < 1:  # DeepSpeed's pool: an IndexError naming nothing
            raise buffers_short("offload_optimizer", count, 1, "stepping a sub-group")
        super().__init__(*args, **kwargs)
        self.counters: dict[str, int] = dict.fromkeys(OPTIMIZER_COUNTERS, 0)
        self._states_seen = 0  # most swapped state tensors a sub-group has had (Adam: 2)
        # Swap-out op -> the first-step state tensors its write carries (copies
        # of), with the memory each held then; weak: an op never completed
        # (engine dropped mid-step) keeps nothing alive.
        self._copied: weakref.WeakKeyDictionary[Any, list[tuple[Any, int]]] = weakref.WeakKeyDictionary()
        note_buffer_count("optimizer", self.swap_config.buffer_count)

    def _free(self) -> int:
        return len(self.swap_buffer_manager.free_buffer_index)

    def _needs(self, parameter: Any) -> int:
        """Buffers a swap-in of `parameter`'s sub-group takes (0: not swapped)."""
        info = self._get_param_swap_info(parameter)
        if info is None:
            return 0
        self._states_seen = max(self._states_seen, info.num_tensors() - 1)
        return info.num_tensors() + (1 if info.has_gradients() else 0)

    def _first_step_room(self, parameter: Any) -> int:
        """Buffers the swap-out of `parameter`'s sub-group will add for the
        state its optimizer creates at its first step (as seen on others)."""
        info = self._get_param_swap_info(parameter)
        return self._states_seen if info is not None and not info.has_state_tensors else 0

    def _drop_read_ahead(self) -> None:
        """Forget the sub-group read ahead: land its reads, free its buffers."""
        op = self.swap_ops[ASYNC_SWAP_IN]
        if op.wait_required:
            op.wait()
        master = op.param_info.tensors[0].compute_tensor
        master.grad = None  # a view of the buffers going back; set again when it is read
        op.param_info.release_memory()
        self.swap_buffer_manager.free(op.allocated_buffers)
        self.swap_ops[ASYNC_SWAP_IN] = None
        bump(self.counters, "read_ahead_dropped")

    def _make_room(self, need: int, what: str) -> None:
        """Complete the pending write, then drop the read-ahead, until `need`
        buffers are free; raise if even that is not enough."""
        if self._free() < need and self.swap_ops[ASYNC_SWAP_OUT] is not None:
            self._complete_swap_out(ASYNC_SWAP_OUT)
            bump(self.counters, "writes_completed_early")
        if self._free() < need and self.swap_ops[ASYNC_SWAP_IN] is not None:
            self._drop_read_ahead()
        if self._free() < need:
            held = self.swap_config.buffer_count - self._free()
            raise buffers_short("offload_optimizer", self.swap_config.buffer_count, need + held, what)

    def swap_in_optimizer_state(self, parameter: Any, async_parameter: Any) -> None:
        """DeepSpeed's swap-in of a sub-group, with room made for it first
        and the next one read ahead only into free buffers."""
        ahead = self.swap_ops[ASYNC_SWAP_IN]
        if ahead is not None and not ahead.is_parameter(parameter):
            self._drop_read_ahead()  # DeepSpeed asserts here
            ahead = None
        # The gradients' buffers come back first (DeepSpeed flushes them in the call).
        self._flush_gradient_swapper(self.gradient_swapper)
        need = 0 if ahead is not None else self._needs(parameter)
        self._make_room(need, "one optimizer sub-group (fp32 weights, state and gradients)")
        if async_parameter is not None and self.async_swap_in:
            room = self._free() - need - self._first_step_room(parameter)
            if self._needs(async_parameter) > room:
                async_parameter = None
                bump(self.counters, "read_ahead_skipped")
        super().swap_in_optimizer_state(parameter, async_parameter)

    def _swap_out_optimizer_state(self, aio_handle: Any, parameter: Any, swap_in_op: Any) -> Any:
        # Adam's first step made its state in ordinary memory: the write goes
        # through as many more buffers (DeepSpeed asserts when there are none).
        info = swap_in_op.param_info
        self._update_param_state_info(info, parameter)
        self._states_seen = max(self._states_seen, info.num_tensors() - 1)
        unpinned = len(info.get_unpinned_state_tensors())
        if unpinned:
            self._make_room(unpinned, "the first write of one sub-group's optimizer state")
        # DeepSpeed copies that state into the new buffers and writes those;
        # the originals go when the write has completed (_complete_swap_out),
        # when the drive has them. Not sooner, though the write reads the
        # copies: a failed write leaves them in memory, and it costs nothing
        # at HF's 4 buffers, where the pending write completes before the next
        # sub-group's swap-in, before its step makes more state.
        copied = self._first_step_state(info)
        op = super()._swap_out_optimizer_state(aio_handle, parameter, swap_in_op)
        if copied:
            self._copied[op] = copied
        return op

    def _first_step_state(self, info: Any) -> list[tuple[Any, int]]:
        """The state tensors of `info` that DeepSpeed's swap-out copies into
        new swap buffers (those not in pinned memory: Adam made them at this
        sub-group's first step), each with the address of its memory now.
        The fp32 weights (``tensors[0]``) are never among them."""
        pinned = self.aio_handle.is_pinned
        return [
            (t.compute_tensor, t.compute_tensor.data_ptr())
            for t in info.tensors[1:]
            if t.compute_tensor.numel() and not pinned(t.compute_tensor)
        ]

    def _complete_swap_out(self, swap_out_type: str) -> None:
        op = self.swap_ops[swap_out_type]
        copied = self._copied.pop(op, None) if op is not None else None
        # DeepSpeed's: waits for the write (a failed one raises here, and the
        # state stays in memory), then frees the swap buffers.
        super()._complete_swap_out(swap_out_type)
        if copied:
            self._release_copied(copied)

    def _release_copied(self, copied: list[tuple[Any, int]]) -> None:
        """Release first-step state tensors whose write has completed: the
        drive has them, and the sub-group's next swap-in reads them into
        buffers (``set_buffers`` rebinds these same tensor objects, which
        ``optimizer.state`` keeps), as after DeepSpeed's own
        ``release_memory()``."""
        for tensor, address in copied:
            if tensor.data_ptr() != address or self.aio_handle.is_pinned(tensor):
                continue  # rebound since (swapped in again): DeepSpeed's buffer now, not the copied memory
            nbytes = tensor.numel() * tensor.element_size()
            tensor.data = torch.Tensor()
            bump(self.counters, "state_released")
            bump(self.counters, "state_released_bytes", nbytes)
