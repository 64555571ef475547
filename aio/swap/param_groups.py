"""Torch parameter groups over optimizer sub-groups: each sub-group is
stepped with the hyper-parameters of the one torch param group it belongs to
(sub-groups never mix groups), and those values can change between steps (an
LR schedule)."""

from __future__ import annotations

from typing import Any


class TorchGroups:
    """The torch parameter groups of a backend: group k's hyper-parameters
    (overrides of the constructor's) and which sub-groups belong to it. The
    backend's torch optimizer gets one param group per non-empty group, in
    order; :meth:`update` changes a group's values (an LR schedule) before
    the next step."""

    def __init__(self, group_hyper: list[dict[str, Any]] | None) -> None:
        self.hyper = [dict(h) for h in (group_hyper or [{}])]
        self.of: dict[int, int] = {}  # sub-group index -> group
        self.torch_index: dict[int, int] = {}  # group -> its index in the torch optimizer

    def add(self, index: int, group: int) -> None:
        """Sub-group `index` belongs to group `group`."""
        if not 0 <= group < len(self.hyper):
            raise ValueError(
                f"sub-group {index}: param group {group} does not exist ({len(self.hyper)} groups)"
            )
        self.of[index] = group

    def build(self, proxies: dict[int, Any]) -> list[dict[str, Any]]:
        """The param groups for the torch optimizer over `proxies` (sub-group -> proxy)."""
        out: list[dict[str, Any]] = []
        self.torch_index = {}
        for k, h in enumerate(self.hyper):
            ps = [proxies[i] for i in sorted(proxies) if self.of.get(i, 0) == k]
            if ps:
                self.torch_index[k] = len(out)
                out.append({"params": ps, **h})
        return out

    def update(self, optimizer: Any, values: list[dict[str, Any]]) -> None:
        """Group k takes `values[k]`'s entries for the keys it has (its
        hyper-parameters); in the torch optimizer too once it exists."""
        for k, v in enumerate(values):
            if k >= len(self.hyper):
                break
            mine = self.hyper[k]
            pg = optimizer.param_groups[self.torch_index[k]] if optimizer and k in self.torch_index else None
            for key in list(mine) if pg is None else [x for x in pg if x != "params"]:
                if key in v:
                    mine[key] = v[key]
                    if pg is not None:
                        pg[key] = v[key]
