"""aio: NVMe offload I/O for training models larger than GPU and CPU memory.

The core is a C++17 extension on Linux native AIO (kernel ABI, no libaio)
with a posix thread-pool fallback. Start with :class:`AsyncIOHandle`.
"""

from ._errors import HandleStateError, ReadPastEOFError
from .handle import AioFuture, AsyncIOHandle
from .pinned import (
    Lease,
    PinnedPool,
    free_locked_tensor,
    is_locked,
    locked_bytes,
    new_locked_tensor,
)

__version__ = "0.1.0"


def _honour_env() -> None:
    import os

    if os.environ.get("AIO_DEEPSPEED"):
        from .integrations.deepspeed import enable_from_env

        enable_from_env()


_honour_env()

__all__ = [
    "AioFuture",
    "AsyncIOHandle",
    "HandleStateError",
    "Lease",
    "PinnedPool",
    "ReadPastEOFError",
    "free_locked_tensor",
    "is_locked",
    "locked_bytes",
    "new_locked_tensor",
    "__version__",
]
