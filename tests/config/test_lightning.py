"""aio.config.lightning: the config Lightning's DeepSpeedStrategy builds, and
warnings for keyword combinations that do not offload where they seem to."""

import inspect
import json
import warnings

import pytest

from aio.config import ConfigError, from_lightning, load_config
from aio.config.lightning import _DEFAULTS, _IGNORED, ENV_VAR, builtin_config, lightning_config

NVME = {
    "stage": 3,
    "remote_device": "nvme",
    "offload_parameters": True,
    "offload_optimizer": True,
    "offload_params_device": "nvme",
    "offload_optimizer_device": "nvme",
    "nvme_path": "/mnt/nvme",
    "max_in_cpu": 0,
}

# Keyword sets whose config must equal Lightning's own, key for key.
PARITY = [
    {},
    {"stage": 3, "remote_device": "nvme", "offload_parameters": True, "offload_optimizer": True},
    NVME,
    {
        **NVME,
        "params_buffer_count": 6,
        "params_buffer_size": 2e8,
        "max_in_cpu": 5e8,
        "optimizer_buffer_count": 6,
        "block_size": 262144,
        "queue_depth": 16,
        "single_submit": True,
        "overlap_events": False,
        "thread_count": 2,
        "pin_memory": True,
        "sub_group_size": 1e9,
        "contiguous_gradients": False,
        "overlap_comm": False,
        "allgather_partitions": False,
        "reduce_scatter": False,
        "allgather_bucket_size": 5e8,
        "reduce_bucket_size": 5e8,
        "zero_allow_untested_optimizer": False,
        "logging_batch_size_per_gpu": 4,
        "partition_activations": True,
        "cpu_checkpointing": True,
    },
    {"stage": 2, "offload_optimizer": True, "offload_optimizer_device": "nvme", "nvme_path": "/n"},
    {"zero_optimization": False, "offload_optimizer": True},
]


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture(scope="module")
def strategy_cls():
    pytest.importorskip("deepspeed", reason="Lightning's DeepSpeedStrategy needs DeepSpeed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = pytest.importorskip("lightning.pytorch.strategies")
    return mod.DeepSpeedStrategy


def _quiet(fn, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(**kw)


@pytest.mark.parametrize("kw", PARITY, ids=range(len(PARITY)))
def test_config_is_lightnings_own(strategy_cls, no_env, kw):
    # DeepSpeedStrategy builds its config in __init__; setup (the part that needs CUDA) is not run.
    theirs = _quiet(strategy_cls, **kw).config
    ours = builtin_config(**kw)  # the fallback without Lightning
    assert lightning_config(**kw) == theirs
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert ours[key] == value, key
    assert _quiet(from_lightning, **kw) == load_config(theirs)


def test_registered_nvme_strategy(strategy_cls, no_env):
    from lightning.pytorch.strategies import StrategyRegistry

    kw = StrategyRegistry["deepspeed_stage_3_offload_nvme"]["init_params"]
    assert builtin_config(**kw) == _quiet(strategy_cls, **kw).config
    with pytest.warns(UserWarning) as rec:
        c = from_lightning(**kw)
    said = sorted(str(r.message).split(":")[1].split()[0] for r in rec)
    assert len(rec) == 2 and said == ["max_in_cpu=1000000000", "nvme_path"], said
    assert c.nvme_paths() == ["/local_nvme"]


def test_keywords_and_defaults_match_lightning(strategy_cls):
    params = inspect.signature(strategy_cls.__init__).parameters
    names = set(params) - {"self"}
    assert names == set(_DEFAULTS) | _IGNORED | {"config"}
    for k, v in _DEFAULTS.items():
        assert params[k].default == v, k


def test_config_from_environment_variable(tmp_path, monkeypatch):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": 8}))
    monkeypatch.setenv(ENV_VAR, str(p))
    assert lightning_config() == {"zero_optimization": {"stage": 3}, "train_batch_size": 8}
    with pytest.warns(UserWarning, match="ignores these keywords: offload_optimizer"):
        c = from_lightning(offload_optimizer=True)
    assert c.zero_optimization.stage == 3 and c.offload_optimizer is None


def _warnings(**kw):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        cfg = from_lightning(**kw)
    return cfg, [str(w.message) for w in rec if issubclass(w.category, UserWarning)]


def test_remote_nvme_with_cpu_offload_warns(no_env):
    kw = {"stage": 3, "remote_device": "nvme", "offload_parameters": True, "offload_optimizer": True}
    cfg, msgs = _warnings(**kw)
    assert cfg.offload_param.device == cfg.offload_optimizer.device == "cpu"  # what Lightning does
    assert len(msgs) == 1
    m = msgs[0]
    assert "remote_device='nvme') does not offload to NVMe" in m
    assert 'offload_params_device="nvme"' in m and 'offload_optimizer_device="nvme"' in m
    assert 'nvme_path="/local_nvme"' in m


def test_remote_nvme_names_only_the_device_that_is_wrong(no_env):
    kw = {**NVME, "offload_optimizer_device": "cpu"}
    _, msgs = _warnings(**kw)
    assert len(msgs) == 1
    assert 'offload_optimizer_device="nvme"' in msgs[0] and "offload_params_device=" not in msgs[0]
    assert 'nvme_path="/mnt/nvme"' in msgs[0]


def test_remote_nvme_without_param_offload_warns(no_env):
    _, msgs = _warnings(stage=3, remote_device="nvme")
    assert len(msgs) == 1 and "assertion" in msgs[0]
    assert 'offload_parameters=True, offload_params_device="nvme"' in msgs[0]


def test_remote_nvme_at_stage_2_warns_then_refuses_param_offload(no_env):
    with pytest.warns(UserWarning, match="stage=3") as rec:
        with pytest.raises(ConfigError) as ei:
            from_lightning(remote_device="nvme", offload_parameters=True, offload_optimizer=True)
    assert "at stage 2 Lightning does not run zero.Init" in str(rec[0].message)
    # The error names the keyword and the config key.
    assert [p for p, _ in ei.value.problems] == ["stage (zero_optimization.stage)"]


@pytest.mark.parametrize(
    "kw",
    [
        NVME,
        {k: v for k, v in NVME.items() if not k.startswith("offload_optimizer")},
        {"stage": 3, "remote_device": "cpu", "offload_parameters": True, "offload_optimizer": True},
        {"stage": 3, "offload_parameters": True, "offload_optimizer": True},
        {},
    ],
    ids=["all-nvme", "params-nvme-only", "remote-cpu", "cpu-offload", "defaults"],
)
def test_no_warning_when_nothing_is_a_trap(no_env, kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_lightning(**kw)


def test_device_without_its_offload_flag_warns(no_env):
    cfg, msgs = _warnings(stage=3, offload_params_device="nvme", nvme_path="/n")
    assert cfg.offload_param is None
    assert msgs == [
        "DeepSpeedStrategy: offload_params_device='nvme' does nothing without offload_parameters=True"
    ]


def test_zero_optimization_false_drops_offload(no_env):
    cfg, msgs = _warnings(zero_optimization=False, offload_optimizer=True)
    assert cfg.offload_optimizer is None and cfg.zero_optimization.stage == 0
    assert any("zero_optimization=False" in m for m in msgs)


def test_remote_nvme_with_a_config_names_config_keys(no_env):
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    _, msgs = _warnings(config=config, remote_device="nvme")
    assert len(msgs) == 1 and 'offload_param.device: "nvme"' in msgs[0]


def test_errors_name_the_keyword(no_env):
    with pytest.raises(ConfigError) as ei:
        from_lightning(stage=3, offload_parameters=True, params_buffer_count=0, queue_depth="8")
    paths = [p for p, _ in ei.value.problems]
    assert "params_buffer_count (zero_optimization.offload_param.buffer_count)" in paths
    assert "queue_depth (aio.queue_depth)" in paths


def test_default_max_in_cpu_with_nvme_params_warns(no_env):
    """Lightning's max_in_cpu default (DeepSpeed's 1e9) keeps a smaller
    model's parameters in memory although they read as offloaded to NVMe."""
    kw = {k: v for k, v in NVME.items() if k != "max_in_cpu"}
    with pytest.warns(UserWarning, match="max_in_cpu=1000000000 keeps"):
        from_lightning(**kw)
