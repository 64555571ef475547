"""Startup hook behind ``AIO_DEEPSPEED=1`` for processes that never import aio.

aio installs ``aio_deepspeed.pth`` into site-packages. Python runs its one
line at every start; the line only reads the environment, and imports this
module only when ``AIO_DEEPSPEED`` is set, so an unset variable costs nothing.
:func:`install` then puts a finder on ``sys.meta_path`` that waits for
``import deepspeed``: once DeepSpeed has finished importing, aio's integration
is enabled (DeepSpeed's async_io op is served by aio). Neither torch nor
DeepSpeed nor aio is imported early; a process that never imports DeepSpeed
never imports aio. This module is top-level, not ``aio._startup``, because
importing anything under ``aio`` would load the extension at startup.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_TRUE = ("1", "true", "yes", "on")


def _wanted() -> bool:
    return os.environ.get("AIO_DEEPSPEED", "").strip().lower() in _TRUE


def _enable() -> None:
    from aio.integrations.deepspeed import enable_from_env

    enable_from_env()


class _LoaderThenEnable:
    """Wraps DeepSpeed's own loader: runs it, then enables aio. The finder
    leaves ``sys.meta_path`` only here, when DeepSpeed really executes: a
    mere ``importlib.util.find_spec("deepspeed")`` (transformers' and
    accelerate's ``is_deepspeed_available``) gets a spec and changes nothing."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # The module keeps DeepSpeed's real loader: nothing later sees ours.
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        _remove()
        self._inner.exec_module(module)
        _enable()


class _DeepSpeedFinder:
    """A meta path finder that finds nothing itself: for ``deepspeed`` it asks
    the rest of ``sys.meta_path`` and wraps the loader it gets. It stays on
    the path until that loader runs (any number of find_spec calls before)."""

    def __init__(self) -> None:
        import threading

        self._searching = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "deepspeed" or getattr(self._searching, "on", False):
            return None
        import importlib.util

        # The search below walks sys.meta_path again: this finder steps aside then.
        self._searching.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching.on = False
        if spec is not None and spec.loader is not None:
            # Duck-typed (create_module/exec_module): importlib.abc stays unimported.
            spec.loader = _LoaderThenEnable(spec.loader)  # type: ignore[assignment]
        return spec


_finder = _DeepSpeedFinder()


def _remove() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def install() -> None:
    """Arrange for aio to serve DeepSpeed's async_io op in this process if
    ``AIO_DEEPSPEED`` is true (1, true, yes, on): now if DeepSpeed is already
    imported, else right after its import. Idempotent."""
    if not _wanted():
        return
    if "deepspeed" in sys.modules:
        _enable()
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
