"""One rule for lists of drive directories, shared by the config validator
(aio.config) and the swappers (aio.swap.drives)."""

from __future__ import annotations

import os
from collections.abc import Iterable


def repeated_directory(paths: Iterable[str]) -> tuple[str, str] | None:
    """The first path naming the same directory as an earlier one, with that
    earlier one, or None. "d", "d/", "e/../d" and a symlink to d are one
    directory: two of them in one list would stripe a drive against itself."""
    seen: dict[str, str] = {}
    for p in paths:
        real = os.path.realpath(p)
        if real in seen:
            return p, seen[real]
        seen[real] = p
    return None
