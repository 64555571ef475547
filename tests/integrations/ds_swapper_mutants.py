"""Deliberately broken variants of aio's DeepSpeed swappers: the tests must
catch each one (a mutation test of test_ds_swappers.py's loss comparison)."""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

from aio.integrations.ds_swappers import param_swapper_class


class NaiveEvictionSwapper(param_swapper_class()):  # type: ignore[misc]
    """Evicts a gathered parameter by dropping its partition (DeepSpeed's
    plain release: NOT_AVAILABLE, buffer back) instead of keeping it in
    ordinary memory. The parameter still reads the buffer (one rank) and the
    NVMe prefetch reads the partition again while it is gathered."""

    def _evict_gathered(self, param: Any) -> None:
        AsyncPartitionedParameterSwapper.remove_partition_and_release_buffers(self, [param])
        self._forget(param.ds_id)
        self.counters["evicted"] += 1
