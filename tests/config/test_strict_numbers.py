"""Numbers in a config are plain finite JSON numbers: NaN, inf, booleans and
quoted numbers are refused with a ConfigError naming the full key path, in
aio.config's models and in aio.zero's training config alike."""

import json
import math

import pytest

from aio.config import ConfigError, load_config
from aio.zero.config import load_train_config

BAD_VALUES = [math.nan, math.inf, -math.inf, "1e8", True]
BAD_IDS = ["nan", "inf", "-inf", "str1e8", "true"]

# Keys of the aio.config models (read by load_config and load_train_config).
MODEL_KEYS = [
    "aio.block_size",
    "aio.queue_depth",
    "aio.intra_op_parallelism",
    "zero_optimization.stage",
    "zero_optimization.sub_group_size",
    "zero_optimization.offload_param.buffer_count",
    "zero_optimization.offload_param.buffer_size",
    "zero_optimization.offload_param.max_in_cpu",
    "zero_optimization.offload_optimizer.buffer_count",
    "zero_optimization.offload_optimizer.ratio",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc",
]
# Keys only aio.zero's training config reads.
TRAIN_KEYS = [
    "gradient_clipping",
    "gradient_accumulation_steps",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "fp16.loss_scale",
    "fp16.initial_scale_power",
    "fp16.loss_scale_window",
    "fp16.hysteresis",
    "fp16.min_loss_scale",
]


def config_with(path, value):
    """A config that is valid except for `value` at the dotted `path`."""
    cfg = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if path.startswith("fp16."):
        cfg["fp16"] = {"enabled": True}
    node = cfg
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return cfg


def _assert_names(ei, path):
    paths = [p for p, _ in ei.value.problems]
    assert path in paths, (paths, str(ei.value))
    assert path in str(ei.value)


@pytest.mark.parametrize("value", BAD_VALUES, ids=BAD_IDS)
@pytest.mark.parametrize("path", MODEL_KEYS)
def test_model_keys_refuse(path, value):
    with pytest.raises(ConfigError) as ei:
        load_config(config_with(path, value))
    _assert_names(ei, path)


@pytest.mark.parametrize("value", BAD_VALUES, ids=BAD_IDS)
@pytest.mark.parametrize("path", MODEL_KEYS + TRAIN_KEYS)
def test_train_config_refuses(path, value):
    with pytest.raises(ConfigError) as ei:
        load_train_config(config_with(path, value))
    _assert_names(ei, path)


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", '"1.0"'])
def test_gradient_clipping_from_json_text(text):
    """JSON files reach us through json.loads, which reads NaN and Infinity."""
    with pytest.raises(ConfigError, match="gradient_clipping"):
        load_train_config(f'{{"gradient_clipping": {text}}}')


@pytest.mark.parametrize(
    "opt,key,value", [("SGD", "momentum", math.nan), ("AdamW", "betas", [0.9, math.inf])]
)
def test_optimizer_params_must_be_finite(opt, key, value):
    cfg = {"optimizer": {"type": opt, "params": {"lr": 0.1, key: value}}}
    with pytest.raises(ConfigError) as ei:
        load_train_config(cfg)
    _assert_names(ei, f"optimizer.params.{key}")


def test_whole_numbers_written_as_floats_still_load():
    cfg = config_with("zero_optimization.offload_param.buffer_size", 1e8)
    cfg["zero_optimization"]["sub_group_size"] = 1e9
    cfg["gradient_accumulation_steps"] = 2.0
    c = load_train_config(cfg)
    assert c.offload.offload_param.buffer_size == 100_000_000 and c.sub_group_size == 10**9
    assert c.gradient_accumulation_steps == 2 and isinstance(c.gradient_accumulation_steps, int)


@pytest.mark.parametrize("value", [2**64, -(2**70)], ids=["2**64", "-2**70"])
def test_out_of_range_integer(value):
    with pytest.raises(ConfigError) as ei:
        load_train_config(json.loads(json.dumps(config_with("gradient_accumulation_steps", value))))
    _assert_names(ei, "gradient_accumulation_steps")
