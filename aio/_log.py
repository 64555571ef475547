"""The package's loggers and the once-per-process swap line.

aio logs to ``logging.getLogger("aio")`` and its children and adds no
handlers: the application decides where records go (``logging.basicConfig
(level=logging.INFO)`` shows them).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

logger = logging.getLogger("aio")

_lock = threading.Lock()
# pid of the process that logged its swap line; a forked child logs its own.
_swap_logged_pid: int | None = None


def swap_line_pending() -> bool:
    """True until this process has logged its first swap handle (a cheap check
    for hot paths before calling :func:`log_swap_handle`)."""
    return _swap_logged_pid != os.getpid()


def log_swap_handle(handle: Any, folder: str | None) -> None:
    """Log one INFO line describing the first swap handle of this process:
    engine, block size, queue depth, thread count and swap folder. Later
    calls in the same process do nothing."""
    global _swap_logged_pid
    with _lock:
        if not swap_line_pending():
            return
        _swap_logged_pid = os.getpid()
    logger.getChild("swap").info(
        "swap I/O: engine %s, block_size %d, queue_depth %d, thread_count %d, swap folder %s",
        handle.engine,
        handle.get_block_size(),
        handle.get_queue_depth(),
        handle.get_thread_count(),
        folder if folder is not None else "(unknown)",
    )


def _reset_for_tests() -> None:
    global _swap_logged_pid
    with _lock:
        _swap_logged_pid = None
