"""Ctrl-C held off while aio finishes work that must not be cut part-way.

An optimizer step over every sub-group updates the state on the drive and
the model's parameters one sub-group at a time; cut part-way, some are
stepped and some are not, and only a checkpoint reload makes them agree
again. Inside :func:`interrupts_held` the first SIGINT (and SIGTERM, where
Python handles it) is remembered and logged, the work runs to its end, and
the signal is then handed to the handler that was in place (Python's
default raises KeyboardInterrupt), so the caller sees a whole step and then
the interrupt. A second signal is handed on at once: the user insisted, and
the work's own failure path applies (NVMeAdamW then refuses to step until a
reload, and says what to load).

Signals are only touched from the main thread (the only one Python runs
handlers in) and only where the handler in place is a Python callable: an
ignored signal stays ignored and a default action (SIGTERM's: exit) stays
the default.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from aio._log import logger

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Nesting (a load inside a step's recovery): only the outermost block holds.
_depth = 0


@contextlib.contextmanager
def interrupts_held(what: str) -> Iterator[None]:
    """Run the block whole under Ctrl-C: a first SIGINT/SIGTERM is delivered
    to its handler when the block ends (also when it raises), a second at
    once. `what` names the work in the logged message ("NVMeAdamW.step()")."""
    global _depth
    if _depth or threading.current_thread() is not threading.main_thread():
        yield
        return
    held = _Held(what)
    old = held.install()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for sig, h in old.items():
            if signal.getsignal(sig) == held.handler:  # not replaced by the block meanwhile
                signal.signal(sig, h)
        held.deliver()


class _Held:
    """The handler installed by one :func:`interrupts_held` block and the
    signal it holds."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.old: dict[int, Callable[[int, Any], Any]] = {}
        self.pending: tuple[int, Any] | None = None
        self.delivered = False

    def install(self) -> dict[int, Callable[[int, Any], Any]]:
        """Put :meth:`handler` in place of each Python-callable handler;
        returns the replaced ones."""
        for sig in _SIGNALS:
            h = signal.getsignal(sig)
            if callable(h):
                self.old[sig] = h
                signal.signal(sig, self.handler)
        return self.old

    def handler(self, signum: int, frame: Any) -> None:
        """First signal: remembered; the next: the old handler, now."""
        if self.pending is None:
            self.pending = (signum, frame)
            logger.warning(
                "%s: %s finishes first, so nothing is left half-done, then stops; "
                "press Ctrl-C again to stop at once (the work is then left part-way and refused "
                "until reloaded)",
                signal.Signals(signum).name,
                self.what,
            )
            return
        self.delivered = True
        self.old[signum](signum, frame)

    def deliver(self) -> None:
        """After the block: the held signal to its old handler (which may
        raise KeyboardInterrupt), unless a second one already went."""
        if self.pending is not None and not self.delivered:
            self.delivered = True
            signum, frame = self.pending
            self.old[signum](signum, frame)
