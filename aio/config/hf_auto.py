"""``"auto"`` values the HF Trainer and Accelerate fill, stood in for when a
config is checked before training (``aio-config validate``).

aio.zero and the swappers read a config as written, so an ``"auto"`` there
is an error naming who would have filled it (:func:`aio.config.models.auto_message`).
A config meant for the HF Trainer is *supposed* to hold them: validate then
replaces each one it knows (:data:`aio.config.models.AUTO_FILLED`) by a
typical value of the right type, checks everything else, and says which keys
the run will fill.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from .models import AUTO_FILLED

# A value of the right type for each key an integration fills (what HF's
# defaults would give; only the types matter to validation).
STAND_INS: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "train_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer.params.lr": 5e-5,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_max_lr": 5e-5,
    "scheduler.params.warmup_num_steps": 0,
    "scheduler.params.total_num_steps": 1,
    "fp16.enabled": False,
    "bf16.enabled": False,
    "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.stage": 3,
    "zero_optimization.offload_param.device": "none",
    "zero_optimization.offload_optimizer.device": "none",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
}


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.strip().lower() == "auto"


def stand_in_autos(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A copy of `data` with every ``"auto"`` an integration fills replaced by
    a stand-in, and the dotted paths replaced (in key order). ``"auto"`` at
    any other key stays, for validation to refuse."""
    out = copy.deepcopy(dict(data))
    done: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, dict):
            return
        for k, v in node.items():
            path = f"{prefix}{k}"
            if _is_auto(v) and path in STAND_INS:
                node[k] = copy.deepcopy(STAND_INS[path])
                done.append(path)
            else:
                walk(v, path + ".")

    walk(out, "")
    return out, done


def filled_note(paths: list[str]) -> str:
    """One line: which keys are 'auto' and who fills each."""
    by: dict[str, list[str]] = {}
    for p in paths:
        by.setdefault(AUTO_FILLED[p][0], []).append(p)
    parts = [f"{who} fills {', '.join(keys)}" for who, keys in by.items()]
    return "'auto' values checked with stand-ins: " + "; ".join(parts) + " when training starts"
