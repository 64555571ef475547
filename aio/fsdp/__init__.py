"""aio as the parameter tier of FSDP2: each rank's sharded parameters on
its drive between uses (:func:`offload_params`), next to
:class:`aio.optim.NVMeAdamW` for the optimizer state. See docs/fsdp.md."""

from __future__ import annotations

from ._internals import SUPPORTED, TierError, UnsupportedTorchError
from .grads import GradientStream, stream_gradients
from .tier import DEFAULT_WINDOW, ParamTier, offload_params

__all__ = [
    "DEFAULT_WINDOW", "SUPPORTED", "GradientStream", "ParamTier", "TierError", "UnsupportedTorchError",
    "offload_params", "stream_gradients",
]  # fmt: skip
