"""Ctrl-C held off while aio finishes work that must not be cut part-way.

An optimizer step over every sub-group updates the state on the drive and
the model's parameters one sub-group at a time; cut part-way, some are
stepped and some are not, and only a checkpoint reload makes them agree
again. Inside :class:`interrupts_held` the first SIGINT (and SIGTERM, where
Python handles it) is remembered and logged, the work runs to its end, and
the signal is then raised again for the handler that was in place (Python's
default raises KeyboardInterrupt), so the caller sees a whole step and then
the interrupt. A repeat is handed on at once: the user insisted, and the
work's own failure path applies (NVMeAdamW then refuses to step until a
reload, and says what to load).

When the block runs inside an optimizer's step (a method of a
``torch.optim.Optimizer`` further up the stack: torch's hook wrapper around
NVMeAdamW.step, ZeroRedundancyOptimizer.step, a framework's optimizer
around aio.zero's engine), the signal waits until the outermost of those
returns or raises: handed on at the end of the inner step, it would skip
what the outer ones do after it (ZeRO's broadcast of each rank's new
parameters, step post-hooks, a framework's bookkeeping), leaving a whole
step looking cut. That wait uses ``sys.setprofile`` for its duration; with
a profiler already set, the signal goes at the end of the block.

Signals are only touched from the main thread (the only one Python runs
handlers in) and only where the handler in place is a Python callable: an
ignored signal stays ignored and a default action (SIGTERM's: exit) stays
the default.
"""

from __future__ import annotations

import dis
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from aio._log import logger

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A hold in force (its block running, or its signal waiting for an outer step):
# only the outermost holds; nested blocks run as they are.
_active = False


class interrupts_held:  # noqa: N801 -- used as a function: `with interrupts_held("...")`
    """Run the block whole under Ctrl-C: a first SIGINT/SIGTERM is raised
    again for its handler once the block (and any optimizer step around
    it) ends, also when it raised; a repeat goes at once. `what` names the
    work in the logged message ("NVMeAdamW.step()")."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.old: dict[int, Callable[[int, Any], Any]] = {}
        self.pending: list[int] = []  # held signals, to raise again at the end
        self.caller: FrameType | None = None
        self.owner = False

    def __enter__(self) -> interrupts_held:
        global _active
        if _active or threading.current_thread() is not threading.main_thread():
            return self
        self.owner, _active = True, True
        self.caller = sys._getframe(1)
        for sig in _SIGNALS:
            h = signal.getsignal(sig)
            if callable(h):
                self.old[sig] = h
                signal.signal(sig, self._handler)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.owner:
            return
        outer = _outermost_step(self.caller.f_back if self.caller is not None else None)
        self.caller = None
        if self.pending and outer is not None and sys.getprofile() is None:
            self._wait_for(outer)
            return
        self._finish()

    def _handler(self, signum: int, frame: Any) -> None:
        """First signal: held; a repeat of any: its old handler, now (a held
        one of another kind still goes at the end)."""
        if not self.pending:
            self.pending.append(signum)
            logger.warning(
                "%s: %s finishes first, so nothing is left half-done, then stops; press Ctrl-C again to "
                "stop at once (the work is then left part-way and refused until reloaded)",
                signal.Signals(signum).name,
                self.what,
            )
            return
        if signum in self.pending:
            self.pending.remove(signum)  # handed on now: not again at the end
        self.old[signum](signum, frame)

    def _wait_for(self, frame: FrameType) -> None:
        """Finish when `frame` (an outer optimizer step) returns: the held
        signal's KeyboardInterrupt comes out of its return, as a Ctrl-C
        there would. When it raises instead, at the next call or return
        after it (a profile function cannot raise past an error being
        unwound: raised at its return event, it would replace that error;
        at a call, in an ``except`` or ``finally`` block, it is chained to
        it)."""
        unwound = False

        def profile(f: FrameType, event: str, arg: Any) -> None:
            nonlocal unwound
            if not unwound:
                if event != "return" or f is not frame:
                    return
                unwound = not _returning(f)
                if unwound:
                    return
            elif event not in ("call", "c_call") and not (event == "return" and _returning(f)):
                return
            sys.setprofile(None)
            self._finish()

        sys.setprofile(profile)

    def _finish(self) -> None:
        """Put the old handlers back and raise the held signal again: its
        handler runs right away (Python's KeyboardInterrupt comes out of
        here)."""
        global _active
        for sig, h in self.old.items():
            if signal.getsignal(sig) == self._handler:  # not replaced by the block meanwhile
                signal.signal(sig, h)
        _active = False
        pending, self.pending = self.pending, []
        for signum in pending:
            signal.raise_signal(signum)


def _returning(frame: FrameType) -> bool:
    """Whether `frame`, at its return event, returns (not unwinds an error)."""
    op = frame.f_code.co_code[frame.f_lasti] if 0 <= frame.f_lasti < len(frame.f_code.co_code) else -1
    return dis.opname[op] in ("RETURN_VALUE", "RETURN_CONST") if 0 <= op < len(dis.opname) else False


def _outermost_step(frame: FrameType | None) -> FrameType | None:
    """The outermost frame from `frame` up that runs a method of a
    ``torch.optim.Optimizer`` (its ``self``), or None."""
    optimizer = getattr(sys.modules.get("torch.optim"), "Optimizer", None)
    found = None
    while frame is not None and optimizer is not None:
        if isinstance(frame.f_locals.get("self"), optimizer):
            found = frame
        frame = frame.f_back
    return found
