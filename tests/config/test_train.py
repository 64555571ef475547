"""aio.config.train: the training config aio.zero reads, validated by the
pydantic models of aio.config (one config layer)."""

import pytest

import aio.config
import aio.zero
from aio.config import ConfigError, TrainConfig, load_train_config


def test_one_config_layer():
    """aio.zero's training config is aio.config's model, not a second parser."""
    assert aio.zero.load_train_config is load_train_config
    assert aio.zero.TrainConfig is TrainConfig is aio.config.TrainConfig


def test_deepspeed_defaults():
    c = load_train_config({})
    assert (c.dtype, c.optimizer_type, c.gradient_accumulation_steps, c.gradient_clipping) == (
        "fp32",
        None,
        1,
        0.0,
    )
    assert (c.prefetch_bucket_size, c.persistence_threshold, c.sub_group_size) == (50_000_000, 100_000, 10**9)
    ls = c.loss_scale
    assert (
        ls.loss_scale,
        ls.initial_scale_power,
        ls.loss_scale_window,
        ls.hysteresis,
        ls.min_loss_scale,
    ) == (
        0.0,
        16,
        1000,
        2,
        1.0,
    )


def test_deepspeed_adam_means_adamw_with_weight_decay():
    c = load_train_config(
        {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1, "adam_w_mode": True}}}
    )
    assert c.optimizer_type == "AdamW" and c.optimizer_params == {"lr": 1e-3, "weight_decay": 0.1}
    c = load_train_config({"optimizer": {"type": "adam", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}}})
    assert c.optimizer_type == "Adam" and c.optimizer_params["betas"] == (0.8, 0.9)


def test_disabled_precision_block_is_not_read():
    c = load_train_config({"fp16": {"enabled": False, "loss_scale": "auto"}, "bf16": {"enabled": True}})
    assert c.dtype == "bf16"


@pytest.mark.parametrize(
    "cfg,path",
    [
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "nope": 1}}}, "optimizer.params.nope"),
        ({"optimizer": {"type": "SGD", "params": {"lr": -1}}}, "optimizer.params"),
        ({"optimizer": {"type": "Lion"}}, "optimizer.type"),
        ({"optimizer": "adam"}, "optimizer"),
        ({"fp16": {"enabled": "auto"}}, "fp16.enabled"),
        ({"fp16": 3}, "fp16"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "fp16.enabled"),
        ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
        ({"zero_optimization": True}, "zero_optimization"),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {
                        "device": "nvme",
                        "nvme_path": "/x",
                        "buffer_count": 1,
                        "pipeline_read": True,
                    },
                }
            },
            "zero_optimization.offload_optimizer.buffer_count",
        ),
    ],
)
def test_errors_name_the_key_path(cfg, path):
    with pytest.raises(ConfigError) as ei:
        load_train_config(cfg)
    assert path in [p for p, _ in ei.value.problems], ei.value.problems


@pytest.mark.parametrize("key", ["aio_zero.host_memory_budget", "gradient_clipping", "fp16.loss_scale"])
def test_an_integer_past_any_float_is_out_of_range_by_key(key):
    """A JSON integer too large for a float (400 digits) is a ConfigError
    naming the key, not a bare OverflowError."""
    top, _, leaf = key.rpartition(".")
    cfg = (
        {leaf: 10**400} if not top else {top: {leaf: 10**400, **({"enabled": True} if top == "fp16" else {})}}
    )
    with pytest.raises(ConfigError) as ei:
        load_train_config(cfg)
    assert [p for p, m in ei.value.problems if "out of range" in m] == [key], ei.value.problems


def test_ignored_keys_one_notice():
    with pytest.warns(UserWarning, match="ignores these config keys") as rec:
        c = load_train_config(
            {"scheduler": {}, "steps_per_print": 1, "zero_optimization": {"overlap_comm": True, "foo": 1}}
        )
    assert len(rec) == 1 and c.ignored == ("scheduler", "zero_optimization.foo")


def test_an_ignored_key_like_a_read_one_is_named_with_it():
    """A misspelt key a DeepSpeed config may carry is ignored with a notice,
    never silently: ``optimizer.parms`` used to train at the optimizer's
    default learning rate without a word, ``gradient_clippin`` without
    clipping. The notice names the key it looks like."""
    cfg = {
        "optimizer": {"type": "AdamW", "parms": {"lr": 1e-3}},
        "gradient_clippin": 1.0,
        "zero_optimization": {"offload_optimizr": {"device": "nvme"}},
        "scheduler": {},
        "fp16": {"enabled": True, "loss_scale_windw": 500},
    }
    with pytest.warns(UserWarning) as rec:
        c = load_train_config(cfg)
    assert len(rec) == 1
    assert c.ignored == (
        "fp16.loss_scale_windw",
        "gradient_clippin",
        "optimizer.parms",
        "scheduler",
        "zero_optimization.offload_optimizr",
    )
    msg = str(rec[0].message)
    assert "fp16.loss_scale_windw (did you mean fp16.loss_scale_window?)" in msg
    assert "gradient_clippin (did you mean gradient_clipping?)" in msg
    assert "optimizer.parms (did you mean optimizer.params?)" in msg
    assert "zero_optimization.offload_optimizr (did you mean zero_optimization.offload_optimizer?)" in msg
    assert "scheduler," in msg and "scheduler (" not in msg


def test_keys_deepspeed_reads_get_no_guess():
    """No 'did you mean' for a key DeepSpeed reads and aio does not (listed
    as ignored, as it is), nor for one whose look-alike the config sets."""
    cfg = {
        "memory_breakdown": False,
        "timers": {},
        "optimizer": {"type": "AdamW", "params": {}, "legacy_fusion": False},
        "zero_optimization": {
            "stage": 3,
            "stage3_model_persistence_threshold": 1,
            "zero_quantized_weights": False,
            "offload_paramz": {},
            "offload_param": {"device": "cpu"},
        },
    }
    with pytest.warns(UserWarning) as rec:
        load_train_config(cfg)
    msg = str(rec[0].message)
    assert "memory_breakdown, " in msg and "optimizer.legacy_fusion, " in msg and "timers, " in msg
    assert "stage3_model_persistence_threshold, " in msg and msg.endswith("zero_quantized_weights")
    assert "offload_paramz, " in msg  # offload_param is given: no guess
    assert "did you mean" not in msg


def test_read_config_data_is_public(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"gradient_clipping": 1.0}')
    data, where = aio.config.read_config_data(str(f))
    assert data == {"gradient_clipping": 1.0} and where == str(f)
    with pytest.raises(ConfigError, match="JSON object"):
        aio.config.read_config_data(str(_write(tmp_path / "list.json", "[1]")))


def _write(path, text):
    path.write_text(text)
    return path


def test_auto_in_training_keys_names_the_hf_source():
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.99]}},
        "bf16": {"enabled": "auto"},
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
    }
    with pytest.raises(ConfigError) as ei:
        load_train_config(cfg)
    problems = dict(ei.value.problems)
    assert "HF Trainer fills this key (from learning_rate)" in problems["optimizer.params.lr"]
    assert "give true or false" in problems["bf16.enabled"]
    assert "from max_grad_norm" in problems["gradient_clipping"]
    assert "hidden_size" in problems["zero_optimization.stage3_prefetch_bucket_size"]


@pytest.mark.parametrize(
    "key,value,text",
    [
        ("betas", [0.9], "a list of 2 numbers"),  # IndexError deep in torch
        ("betas", [], "a list of 2 numbers"),
        ("betas", {"a": 1}, "a list of 2 numbers"),  # KeyError
        ("betas", [0.9, 0.99, 0.5], "a list of 2 numbers"),  # accepted, then unpacking failed in aio-train
        ("betas", [0.9, None], "item 1: expected a number, got null"),
        ("betas", [0.9, True], "item 1: expected a number, got the boolean true"),
        ("lr", True, "got the boolean true"),  # torch took it as 1.0
        ("lr", "1e-3", "got the string"),
        ("lr", None, "expected a number, got null"),
        ("maximize", 1, "expected true or false, got 1"),  # silently accepted
        ("amsgrad", "yes", 'expected true or false, got "yes"'),
        ("foreach", 5, "expected true, false or null"),
        ("adam_w_mode", 1, "expected true or false"),
        ("bias_correction", "no", "expected true or false"),
        ("torch_adam", 1, "expected true or false"),
    ],
)
def test_optimizer_params_types_name_the_key(key, value, text):
    params = {"lr": 1e-3, key: value}
    with pytest.raises(ConfigError) as ei:
        load_train_config({"optimizer": {"type": "AdamW", "params": params}})
    problems = dict(ei.value.problems)
    assert f"optimizer.params.{key}" in problems, ei.value.problems
    assert text in problems[f"optimizer.params.{key}"], ei.value.problems


def test_optimizer_params_of_the_right_types_load():
    params = {"lr": 1, "betas": [0.9, 0.95], "weight_decay": 0, "amsgrad": True, "foreach": None}
    c = load_train_config({"optimizer": {"type": "AdamW", "params": {**params, "adam_w_mode": False}}})
    assert c.optimizer_params == {**params, "betas": (0.9, 0.95)}
    c = load_train_config(
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}}
    )
    assert c.optimizer_params["nesterov"] is True


@pytest.mark.parametrize(
    "cfg,path,line",
    [
        (
            {"aio": {"blok_size": 4096}},
            "aio.blok_size",
            "unknown key; did you mean 'block_size'? Accepted: block_size, engine, ",  # docs/config.md's
        ),
        ({"aio": {"zzz": 1}}, "aio.zzz", "unknown key. Accepted: block_size, "),
        (
            {"aio_zero": {"modules_ahed": 1}},  # "Accepted:" was followed by nothing
            "aio_zero.modules_ahed",
            "unknown key; did you mean 'modules_ahead'? Accepted: adam_sqrt, gradients, ",
        ),
        ({"aio_zero": {"zzz": 1}}, "aio_zero.zzz", "unknown key. Accepted: adam_sqrt, gradients, "),
    ],
)
def test_unknown_key_lists_the_accepted_keys(cfg, path, line):
    with pytest.raises(ConfigError) as ei:
        load_train_config(cfg)
    problems = dict(ei.value.problems)
    assert problems[path].startswith(line), problems
    assert "?." not in str(ei.value)


@pytest.mark.parametrize(
    "value,text",
    [
        ("2", "got the string '2'"),  # a plain int field took "2" and true (as 1)
        (True, "got the boolean true"),
        (2.5, "whole number"),
        (0, "greater than or equal to 1"),
        (10**30, "out of range"),
        (65537, "less than or equal to 65536"),
    ],
)
def test_modules_ahead_is_a_strict_bounded_int(value, text):
    with pytest.raises(ConfigError) as ei:
        load_train_config({"aio_zero": {"modules_ahead": value}})
    problems = dict(ei.value.problems)
    assert text in problems["aio_zero.modules_ahead"], problems


def test_modules_ahead_takes_whole_numbers():
    assert load_train_config({"aio_zero": {"modules_ahead": 65536}}).aio_zero.modules_ahead == 65536
    got = load_train_config({"aio_zero": {"modules_ahead": 3.0}}).aio_zero.modules_ahead
    assert got == 3 and isinstance(got, int)
