"""Turn user buffers into (pointer, byte count) for the core.

Accepted: contiguous torch tensors (CPU, or CUDA through a pinned bounce
buffer), numpy arrays, and any object exporting a C-contiguous buffer.
torch is imported only when a tensor is actually passed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class ResolvedBuffer:
    ptr: int
    nbytes: int
    keepalive: Any  # object that owns the memory; held until the I/O is done
    cuda_tensor: Any = None  # set when `keepalive` is a host bounce for this GPU tensor


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def tensor_nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def resolve(buffer: Any, *, writable: bool, argname: str = "buffer") -> ResolvedBuffer:
    """Validate `buffer` and return its address and size.

    writable=True is required for reads (the buffer receives data).
    Raises TypeError for unsupported objects and ValueError for unusable ones.
    """
    if _is_tensor(buffer):
        t = buffer
        if not t.is_contiguous():
            raise ValueError(f"{argname}: tensor must be contiguous (call .contiguous() first)")
        if getattr(t, "is_sparse", False):
            raise ValueError(f"{argname}: sparse tensors are not supported")
        if t.device.type == "cuda":
            import torch

            host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
            if not writable:
                host.copy_(t.reshape(-1))
            return ResolvedBuffer(host.data_ptr(), tensor_nbytes(t), host, cuda_tensor=t)
        if t.device.type != "cpu":
            raise ValueError(f"{argname}: tensors on device '{t.device}' are not supported")
        return ResolvedBuffer(t.data_ptr(), tensor_nbytes(t), t)
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError(f"{argname}: array must be C-contiguous (use np.ascontiguousarray)")
        if writable and not buffer.flags.writeable:
            raise ValueError(f"{argname}: array is read-only; a read needs a writable buffer")
        return ResolvedBuffer(int(buffer.__array_interface__["data"][0]), int(buffer.nbytes), buffer)
    if isinstance(buffer, (str, int, float)) or buffer is None:
        raise TypeError(
            f"{argname}: expected a tensor, numpy array or buffer object, got {type(buffer).__name__}"
        )
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise TypeError(
            f"{argname}: expected a tensor, numpy array or buffer object, got {type(buffer).__name__}"
        ) from None
    if not mv.c_contiguous:
        raise ValueError(f"{argname}: buffer must be C-contiguous")
    if writable and mv.readonly:
        raise ValueError(
            f"{argname}: buffer is read-only ({type(buffer).__name__}); "
            "a read needs a writable buffer such as bytearray"
        )
    flat = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
    if flat.nbytes == 0:
        return ResolvedBuffer(0, 0, buffer)
    arr = np.frombuffer(flat, dtype=np.uint8)
    return ResolvedBuffer(int(arr.__array_interface__["data"][0]), int(flat.nbytes), (buffer, arr))
