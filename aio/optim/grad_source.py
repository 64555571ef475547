"""Gradients for :class:`aio.optim.NVMeAdam`'s step from elsewhere than ``p.grad``.

By default each step copies every parameter's local ``p.grad`` into its
sub-groups' gradient slots (held in memory, or written to the drive with
``gradients="nvme"``). A :class:`GradientSource` attached with
:meth:`aio.optim.NVMeAdam.attach_gradient_source` puts them there itself --
aio.fsdp's :class:`~aio.fsdp.GradientStream` writes each sub-group's slot
during backward, as the reduce-scatter produces its gradients -- and the
step asks it, at fixed points, instead of reading ``p.grad``:

1. :meth:`GradientSource.local_grads`, after the layout and the param
   groups' checks: which parameters it has gradients for (None: none, the
   step reads ``p.grad`` as without a source);
2. the step's other checks (nothing has changed yet), then the param
   groups' hyper-parameters are handed to the update;
3. :meth:`GradientSource.take_grads` (only when 1 gave gradients): every
   sub-group's gradient in its slot when it returns;
4. the swapped update, every gradient multiplied by
   :meth:`GradientSource.grad_scale` (a source attached, whoever gave the
   gradients);
5. :meth:`GradientSource.step_done`, after the update, also when it raised.

And the optimizer's ``zero_grad()`` calls :meth:`GradientSource.discard`:
the gradients the source holds are dropped with ``p.grad``.

A source works with the optimizer's :meth:`~aio.optim.NVMeAdam.layout`
(parameter indices, sub-groups) and its
:attr:`~aio.optim.NVMeAdam.swapper`'s public methods
(``write_gradient``, ``read_gradient``, ``hold_gradient``,
``discard_gradients``, ``try_acquire_buffer``); the optimizer refuses a new
layout while one is attached.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class GradientSource(Protocol):
    """What :meth:`aio.optim.NVMeAdam.step` asks an attached gradient source
    (see the module docstring for when)."""

    def local_grads(self) -> Collection[int] | None:
        """The indices (in :meth:`aio.optim.NVMeAdam.layout`'s ``params``)
        of the parameters this source has this step's gradients for, or None
        when it has none (the step then reads ``p.grad``). A ValueError,
        naming the parameter, when one that needs a gradient has none; it
        must change nothing (the step's other checks come after it)."""
        ...

    def take_grads(self) -> None:
        """Every sub-group's gradient in its slot in the optimizer's swapper
        when this returns (writes finished); an error changes nothing on
        the drive the update reads."""
        ...

    def grad_scale(self) -> Any:
        """The factor (a number or 0-dim tensor) the update multiplies every
        gradient by (a clip coefficient), or None for none."""
        ...

    def step_done(self) -> None:
        """The update ran (or raised part-way): forget this step's gradients."""
        ...

    def discard(self) -> None:
        """Drop the gradients held for the next step (``zero_grad()``)."""
        ...
