"""Stage-3 swappers: parameter partitions and optimizer sub-groups paged
between pinned CPU buffers and the drive (see docs/swap.md)."""

from .optimizer import OptimizerSwapper, discover_state_spec
from .param import ParamSwapper, State, SwapStateError
from .pool import BufferPool, PoolExhaustedError
from .storage import SwapStorage

__all__ = [
    "BufferPool",
    "OptimizerSwapper",
    "ParamSwapper",
    "PoolExhaustedError",
    "State",
    "SwapStateError",
    "SwapStorage",
    "discover_state_spec",
]
