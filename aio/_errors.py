"""The one place where core errors become Python exceptions.

The C++ core raises a single error type carrying errno, operation, path and
byte range; the bindings call :func:`make_error` to turn it into the matching
built-in ``OSError`` subclass (``FileNotFoundError``, ``PermissionError``, ...)
with ``filename`` set and ``operation``/``offset``/``length`` attributes.
"""

from __future__ import annotations

import errno as _errno
import os as _os


class ReadPastEOFError(OSError, EOFError):
    """A read asked for bytes beyond the end of the file.

    Raised instead of returning stale or zero bytes. It is an ``OSError``
    (errno ``ENODATA``) and an ``EOFError``, so either ``except`` catches it.
    """


class HandleStateError(ValueError):
    """The handle cannot be used in this state (closed, or inherited through fork).

    A ValueError, like I/O on a closed Python file object.
    """


def readable_path(path: str) -> str:
    """``/proc/self/fd/N`` or ``/proc/self/fd/N/name`` (how the swappers
    reach files through a held, verified descriptor) as the real path (plus
    ``name``), so errors name a file a person can find. Anything else is
    returned as is."""
    return _resolve_held(path)[0]


_DELETED = " (deleted)"  # readlink of a descriptor whose file or folder was removed


def _resolve_held(path: str) -> tuple[str, bool]:
    """(:func:`readable_path` of `path`, whether the held file or folder it
    goes through was removed while in use: someone deleted the swap folder)."""
    prefix = "/proc/self/fd/"
    if not path.startswith(prefix):
        return path, False
    fd, sep, rest = path[len(prefix) :].partition("/")
    if not fd.isdigit():
        return path, False
    try:
        target = _os.readlink(prefix + fd)
    except OSError:
        return path, False
    # The kernel marks a removed file so: the path is still the one to name.
    removed = target.endswith(_DELETED)
    target = target.removesuffix(_DELETED)
    return (_os.path.join(target, rest) if sep else target), removed


def make_error(
    err: int,
    message: str,
    path: str,
    operation: str,
    offset: int,
    length: int,
    eof: bool,
) -> BaseException:
    """The Python exception for a core error: ReadPastEOFError for a read
    past the end, HandleStateError for misuse (errno 0), else the OSError
    subclass of `err`; with ``operation``/``offset``/``length`` attributes."""
    exc: BaseException
    path, removed = _resolve_held(path)
    if removed:
        message += "; it was deleted while in use (was the swap folder removed?)"
    if eof:
        exc = ReadPastEOFError(_errno.ENODATA, message, path or None)
    elif err == 0:
        exc = HandleStateError(message)
    else:
        # OSError(errno, ...) picks the subclass (ENOENT -> FileNotFoundError...).
        exc = OSError(err, message, path or None)
    # Context for callers and logs: which operation, which bytes.
    for name, value in (("operation", operation), ("offset", offset), ("length", length)):
        setattr(exc, name, value)
    return exc
