"""Argument checks shared by the handle: refuse what the core would misread."""

from __future__ import annotations

import os
from typing import Any, Union

from ._buffers import MAX_OFFSET

PathArg = Union[str, bytes, "os.PathLike[str]", int]
"""A file name (str, bytes, os.PathLike) or an open descriptor (int)."""


def check_int(name: str, v: Any, minimum: int = 1, maximum: int = MAX_OFFSET) -> int:
    """`v` if it is an int (not a bool) in [minimum, maximum]; TypeError,
    ValueError (too small) or OverflowError (too large) naming `name` otherwise."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    if v > maximum:
        raise OverflowError(f"{name} must be <= {maximum}, got {v}")
    return v


def check_path(path: Any) -> tuple[bytes, int]:
    """(encoded path, -1) or (b"", descriptor), refusing what the core would misread."""
    if isinstance(path, bool):
        raise TypeError("path must be a str, bytes, os.PathLike or an int descriptor, got bool")
    if isinstance(path, int):
        if path < 0:
            raise ValueError(f"file descriptor must be >= 0, got {path}")
        if path > 2**31 - 1:
            raise OverflowError(f"file descriptor must be < 2**31, got {path}")
        return b"", path
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(
            f"path must be a str, bytes, os.PathLike or an int descriptor, got {type(path).__name__}"
        )
    # bytes travel as they are (names need not be UTF-8).
    bpath = os.fsencode(path)
    if not bpath:
        raise ValueError("path must not be empty")
    if b"\0" in bpath:
        # The core takes a C string: a NUL would silently truncate the name.
        raise ValueError(f"path must not contain NUL bytes: {path!r}")
    return bpath, -1


def check_bool(name: str, v: Any) -> bool:
    """`v` if it is a bool; TypeError naming `name` otherwise (no truthiness)."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return v


def same_kind(have: Any, got: Any) -> bool:
    """Whether a loaded value `got` (a checkpoint's hyper-parameter, a
    scheduler's or a loss scaler's state) can stand where the live object has
    `have`: numbers for numbers (int, float or a one-element tensor; not bool),
    sequences of such of the same length, None or a bool where it has None or
    a bool, else the same type."""
    if have is None:  # flags such as foreach, fused: None or a bool
        return got is None or isinstance(got, bool)
    if got is None:
        return isinstance(have, bool)  # a flag saved unset
    if isinstance(have, bool) or isinstance(got, bool):
        return isinstance(have, bool) and isinstance(got, bool)
    if _number(have):
        return _number(got)  # a float lr where a tensor one was built, or back
    if isinstance(have, (tuple, list)):
        return (
            isinstance(got, (tuple, list))
            and len(got) == len(have)
            and all(same_kind(a, b) for a, b in zip(have, got, strict=True))
        )
    return type(have) is type(got)


def mismatched(have: Any, got: Any) -> list[str]:
    """The keys of mapping `got` (loaded) that `have` (live) also has, other
    than ``params``, whose values are not of the same kind (:func:`same_kind`)."""
    return [k for k, v in got.items() if k in have and k != "params" and not same_kind(have[k], v)]


def _number(v: Any) -> bool:
    """An int or float (not bool), or a tensor of one element (a tensor lr)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return True
    numel = getattr(v, "numel", None)
    return callable(numel) and hasattr(v, "dtype") and numel() == 1
