"""What the aio command-line tools share: one-line errors with exit status 2,
Ctrl-C (and SIGTERM) as exit 130, numbers checked as they are parsed, scratch
files no other user can redirect, and buffers that fall back to unlocked
memory when mlock is refused."""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import math
import os
import shutil
import signal
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from . import _C
from .pinned import new_locked_tensor


class CliError(Exception):
    """A problem the user can fix; the CLI prints one line and exits with status 2."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, raised by the CLI's signal handler.

    A subclass on purpose: CPython remembers a bare KeyboardInterrupt that
    leaves any ``exec``/``eval`` of a string (dataclasses and namedtuple build
    their methods that way) as "unhandled", and ``python -m`` then ends the
    process by SIGINT after our handled exit 130. It compares the exact type,
    so a subclass is never mistaken for one nobody caught."""


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that ends each option's text with its default, unless the text
    says it already (a default in words) or the option is a flag."""

    _FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if not action.option_strings or isinstance(action, self._FLAGS) or d in (None, argparse.SUPPRESS):
            return text
        if "default" in text:
            return text
        shown = ",".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)
        return f"{text} (default: {shown.replace('%', '%%')})"


class CliParser(argparse.ArgumentParser):
    """argparse with a one-line error (``prog: error: ...``) and exit status 2,
    and every option's default in its help (:class:`DefaultsFormatter`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message (see --help)`` and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def run_cli(prog: str, body: Callable[[], int], on_interrupt: str = "") -> int:
    """Run a CLI body: CliError and OSError become one line on stderr and exit
    status 2, Ctrl-C (and SIGTERM) exit 130; cleanup runs in the body's
    ``finally`` blocks before we get here. After an interrupt both signals
    stay ignored in this process: it is meant to exit 130 now."""
    with _sigterm_as_interrupt():
        try:
            return body()
        except KeyboardInterrupt:
            print(f"\n{prog}: interrupted{'; ' + on_interrupt if on_interrupt else ''}", file=sys.stderr)
            return 130
        except CliError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"{prog}: error: {_describe_os_error(e)}", file=sys.stderr)
            return 2
        except (ValueError, OverflowError) as e:  # a config, or settings the I/O core refuses
            text = e.one_line() if hasattr(e, "one_line") else " ".join(str(e).split())
            print(f"{prog}: error: {text}", file=sys.stderr)
            return 2
        except RuntimeError as e:
            if not _names_a_setting(e):
                raise  # a bug: its traceback is what a report needs
            print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2


def _names_a_setting(e: RuntimeError) -> bool:
    """Whether `e` is a swap pool too small for the run (PoolExhaustedError):
    its message names the config key to raise, which is all a user needs."""
    pool = sys.modules.get("aio.swap.pool")
    return pool is not None and isinstance(e, pool.PoolExhaustedError)


def _describe_os_error(e: OSError) -> str:
    # str(e) of our typed I/O errors already names file, offset and length.
    text = str(e) if e.strerror is None or e.filename is None else f"{e.filename}: {e.strerror}"
    return " ".join(text.split())


_deferred_interrupt = False
# After the one KeyboardInterrupt of a run every repeat is ignored, however
# long the unwinding takes: the CLI exits 130 next. (A time limit here failed
# under load: the main thread sat in a blocking call past it, and the queued
# repeat then raised from the handler's own teardown, outside run_cli's try.)
_interrupted = False
# Inside signals_deferred(): a signal is remembered, raised when it ends.
_defer_depth = 0


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt so cleanup runs (main thread
    only). After one was raised both signals are ignored from here on: the
    CLI exits 130 next, and a repeated Ctrl-C reaching the old handler (or the
    default action the interpreter restores while it shuts down) would make
    the process die of SIGINT instead."""
    global _deferred_interrupt, _interrupted
    _deferred_interrupt = _interrupted = False
    try:
        old = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, signal.SIG_IGN if _interrupted else h)


def _on_signal(signum: int, frame: Any) -> None:
    # An exception raised while a finalizer runs (a handle's __del__, a
    # weakref callback) is printed as "Exception ignored" and lost; remember
    # the signal instead, and check_interrupt() raises it at the next step.
    global _deferred_interrupt
    if _interrupted:
        return  # one KeyboardInterrupt per run: the CLI is already unwinding
    if _defer_depth:
        _deferred_interrupt = True
        return
    f = frame
    while f is not None:
        if f.f_code.co_name == "__del__" or f.f_code.co_filename == weakref.__file__:
            _deferred_interrupt = True
            return
        f = f.f_back
    _mark_interrupted()
    raise Interrupted


def _mark_interrupted() -> None:
    # A signal deferred before this one is the same Ctrl-C: raising it later
    # would cut the cleanup the first one started.
    global _interrupted, _deferred_interrupt
    _interrupted, _deferred_interrupt = True, False


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Ctrl-C (and SIGTERM) inside the block are raised only when it ends, so
    a step that creates something and hands it back (a scratch file: its
    descriptor and path assigned to the caller's names) is never cut between
    the two, which would leave the caller nothing to clean up."""
    global _defer_depth
    _defer_depth += 1
    try:
        yield
    finally:
        _defer_depth -= 1
    if _defer_depth == 0:
        check_interrupt()


def check_interrupt() -> None:
    """Raise the KeyboardInterrupt a signal during a finalizer had to defer."""
    global _deferred_interrupt
    if _deferred_interrupt:
        _deferred_interrupt = False
        _mark_interrupted()
        raise Interrupted


def parse_size(text: str) -> int:
    """'256M', '1G', '4096', '1.5G' -> bytes (binary units); positive and finite."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    bad = argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 256K, 1M, 2G)")
    try:
        if t and t[-1] in mult:
            x = float(t[:-1])
            if not math.isfinite(x):
                raise bad
            n = int(x * mult[t[-1]])
        else:
            n = int(t)
    except ValueError:
        raise bad from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in lo..hi."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is outside {lo}..{hi}")
        return v

    return parse


def check_directory(d: str, need_bytes: int, flag: str) -> None:
    """Raise CliError unless `d` is an existing, writable directory with room
    for `need_bytes` plus 64 MiB headroom."""
    if not os.path.exists(d):
        raise CliError(f"{d}: no such directory")
    if not os.path.isdir(d):
        raise CliError(f"{d}: not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise CliError(f"{d}: not writable by this user")
    free = shutil.disk_usage(d).free
    if free < need_bytes + (64 << 20):
        raise CliError(
            f"{d}: {free / 2**30:.2f} GiB free, this needs {need_bytes / 2**30:.2f} GiB "
            f"plus 64 MiB headroom; lower {flag}"
        )


def check_memory(nbytes: int, flag: str) -> None:
    """Refuse a buffer larger than the memory available now (it would swap or be OOM-killed)."""
    import psutil

    avail = psutil.virtual_memory().available
    if nbytes > avail:
        raise CliError(
            f"{flag} {nbytes / 2**30:.2f} GiB needs that much memory for its buffer; "
            f"{avail / 2**30:.2f} GiB is available; lower {flag}"
        )


def open_scratch(directory: str, prefix: str, direct: bool = True) -> tuple[int, str, bool]:
    """Create a fresh scratch file: (fd, path, is O_DIRECT).

    mkstemp picks an unpredictable name and opens it O_CREAT|O_EXCL|O_NOFOLLOW
    with mode 0600, so a file or symlink planted by another user is never
    opened; all I/O then goes through the returned descriptor, never the path.
    O_DIRECT is switched on with F_SETFL (EINVAL: the filesystem cannot).
    """
    try:
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=".bin", dir=directory)
    except OSError as e:
        raise CliError(f"{directory}: cannot create a file: {e.strerror}") from None
    if not direct:
        return fd, path, False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            remove_scratch(fd, path)
            raise CliError(f"{directory}: cannot use a file: {e.strerror}") from None
        return fd, path, False
    return fd, path, True


def remove_scratch(fd: int, path: str) -> None:
    """Close and unlink a scratch file (unlink removes the name, never a link target)."""
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def scratch_buffer(nbytes: int, log: Callable[[str], None]) -> tuple[Any, bool]:
    """A uint8 tensor of `nbytes` in locked memory, or, when the lock is refused
    (RLIMIT_MEMLOCK as a normal user), in unlocked page-aligned memory with a
    one-line notice: (tensor, locked). Direct I/O works on either; only the
    measured rates may be a little lower unlocked."""
    import torch

    try:
        return new_locked_tensor(nbytes, torch.uint8), True
    except (OSError, MemoryError, RuntimeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        log(
            f"note: could not lock {nbytes / 2**20:.0f} MiB ({reason}; see ulimit -l); "
            "using unlocked page-aligned memory"
        )
    buf = _C.PinnedBuffer(nbytes, False)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes), False
