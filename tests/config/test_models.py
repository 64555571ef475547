"""aio.config: defaults, loading, and malformed configs with key-path errors."""

import json
import warnings

import pytest

from aio.config import (
    ConfigError,
    OffloadConfig,
    from_lightning,
    load_config,
)

NVME_DS_CONFIG = {
    "train_batch_size": 16,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
        "overlap_comm": True,
        "sub_group_size": 1e9,
        "stage3_max_live_parameters": 1e9,
    },
    "aio": {
        "block_size": 262144,
        "queue_depth": 32,
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    },
}


def test_defaults_match_deepspeed():
    c = load_config({})
    assert c.aio.to_deepspeed() == {
        "block_size": 1048576,
        "queue_depth": 8,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": True,
        "use_gds": False,
    }
    z = load_config({"zero_optimization": {"stage": 3, "offload_param": {}, "offload_optimizer": {}}})
    p, o = z.offload_param, z.offload_optimizer
    assert (p.device, p.buffer_count, p.buffer_size, p.max_in_cpu, p.pin_memory) == (
        "none",
        5,
        100_000_000,
        1_000_000_000,
        True,
    )
    assert (o.device, o.buffer_count, o.pipeline_read, o.pipeline_write, o.fast_init, o.ratio) == (
        "none",
        4,
        False,
        False,
        False,
        1.0,
    )
    assert z.zero_optimization.sub_group_size == 1_000_000_000


def test_full_deepspeed_config_loads_and_ignores_the_rest(tmp_path):
    c = load_config(NVME_DS_CONFIG)
    assert c.offload_param.buffer_size == 100_000_000 and isinstance(c.offload_param.buffer_size, int)
    assert c.offload_param.max_in_cpu == 10**9
    assert c.aio.intra_op_parallelism == 1 and c.aio.block_size == 262144
    assert c.nvme_paths() == ["/local_nvme"]
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(NVME_DS_CONFIG))
    assert load_config(str(p)) == c
    assert load_config(p) == c
    assert load_config(json.dumps(NVME_DS_CONFIG)) == c
    assert load_config(c) is c


def test_handle_kwargs_build_a_handle():
    import aio

    c = load_config(NVME_DS_CONFIG)
    h = aio.AsyncIOHandle(**c.aio.handle_kwargs())
    assert h.get_block_size() == 262144 and h.get_queue_depth() == 32


BAD = [
    ({"aio": {"block_size": 0}}, "aio.block_size", "greater than 0"),
    ({"aio": {"block_size": 1000}}, "aio.block_size", "multiple of 4096"),
    # the I/O core's limit (1 TiB): validate passed it and aio-train refused it without a key
    ({"aio": {"block_size": 4096000000000000000}}, "aio.block_size", "less than or equal to 1099511627776"),
    ({"aio": {"block_size": (1 << 40) + 4096}}, "aio.block_size", "less than or equal to 1099511627776"),
    ({"aio": {"queue_depth": -2}}, "aio.queue_depth", "greater than 0"),
    ({"aio": {"queue_depth": "auto"}}, "aio.queue_depth", "'auto' is not filled in by anyone"),
    ({"aio": {"blocksize": 4096}}, "aio.blocksize", "did you mean 'block_size'"),
    ({"aio": {"single_submit": "yes"}}, "aio.single_submit", "boolean"),
    ({"aio": {"engine": "uring"}}, "aio.engine", "'io_uring'"),
    ({"aio": {"thread_count": 2, "intra_op_parallelism": 4}}, "aio.thread_count", "disagree"),
    ({"aio": {"block_size": 4096.5}}, "aio.block_size", "whole number"),
    ({"aio": 5}, "aio", "must be an object"),
    (
        {"zero_optimization": {"stage": 3, "aio": {"block_size": 4096}}},
        "zero_optimization.aio",
        "top level",
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/x"}}},
        "zero_optimization.stage",
        "needs stage 3",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        "zero_optimization.offload_param.nvme_path",
        "required",
    ),
    (
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": ""},
            }
        },
        "zero_optimization.offload_optimizer.nvme_path",
        "empty",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "ssd"}}},
        "zero_optimization.offload_optimizer.device",
        "'nvme'",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"pipline_read": True}}},
        "zero_optimization.offload_optimizer.pipline_read",
        "did you mean 'pipeline_read'",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"buffer_size": -1}}},
        "zero_optimization.offload_param.buffer_size",
        "greater than 0",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"buffer_count": "auto"}}},
        "zero_optimization.offload_param.buffer_count",
        "'auto'",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 1.5}}},
        "zero_optimization.offload_optimizer.ratio",
        "less than or equal",
    ),
    (
        {"zero_optimization": {"stage": 3, "sub_group_size": 0}},
        "zero_optimization.sub_group_size",
        "greater",
    ),
    (
        {"zero_optimization": {"stage": 3, "sub_group_size": "auto"}},
        "zero_optimization.sub_group_size",
        "not filled in by anyone",
    ),
    ({"zero_optimization": {"stage": 7}}, "zero_optimization.stage", "less than or equal to 3"),
    ({"zero_optimization": True}, "zero_optimization", "deprecated"),
]


@pytest.mark.parametrize("cfg,path,text", BAD, ids=[b[1] + ":" + b[2][:12] for b in BAD])
def test_malformed_configs_name_the_key(cfg, path, text):
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    e = ei.value
    assert isinstance(e, ValueError)
    paths = [p for p, _ in e.problems]
    assert path in paths, (paths, str(e))
    assert text in str(e), str(e)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as ei:
        load_config({"aio": {"block_size": 1, "queue_depth": 0, "bogus": 1}})
    assert len(ei.value.problems) == 3


def test_every_bad_aio_key_is_reported_with_the_thread_count_conflict():
    """thread_count and intra_op_parallelism disagreeing was checked by a
    validator of the whole block, which stopped pydantic before the block's
    other keys: only the conflict was reported. Every bad key comes at
    once, each with its key path and what is accepted."""
    cfg = {
        "aio": {
            "thread_count": 2,
            "intra_op_parallelism": 4,
            "queue_depth": 0,
            "block_size": 1000,
            "engine": "uring",
            "single_submit": "yes",
            "blocksize": 4096,
        },
        "zero_optimization": {"stage": 7},
    }
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    got = dict(ei.value.problems)
    assert sorted(got) == [
        "aio.block_size",
        "aio.blocksize",
        "aio.engine",
        "aio.queue_depth",
        "aio.single_submit",
        "aio.thread_count",
        "zero_optimization.stage",
    ], str(ei.value)
    assert "intra_op_parallelism" in got["aio.thread_count"] and "(2 vs 4)" in got["aio.thread_count"]
    assert "greater than 0" in got["aio.queue_depth"] and "multiple of 4096" in got["aio.block_size"]
    assert "'io_uring'" in got["aio.engine"] and "did you mean 'block_size'" in got["aio.blocksize"]
    # the same value under both names is one setting, as before
    assert load_config({"aio": {"thread_count": 3, "intra_op_parallelism": 3}}).aio.thread_count == 3
    assert load_config({"aio": {"thread_count": 3}}).aio.intra_op_parallelism == 3


def test_a_nested_aio_block_is_reported_with_the_other_zero_keys():
    """An aio block inside zero_optimization was refused by a validator of the
    whole block, which hid that block's other bad keys."""
    cfg = {"zero_optimization": {"stage": 7, "sub_group_size": 0, "aio": {"block_size": 4096}}}
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    got = dict(ei.value.problems)
    assert sorted(got) == [
        "zero_optimization.aio",
        "zero_optimization.stage",
        "zero_optimization.sub_group_size",
    ]
    assert "top level" in got["zero_optimization.aio"]
    extra = load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5}}).zero_optimization
    assert extra.model_extra == {"reduce_bucket_size": 5}  # other keys pass through as they are


def test_bad_sources(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"aio": {"block_size": 4096,}}')
    with pytest.raises(ConfigError, match="line 1"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(str(_write(tmp_path, "[1, 2]")))
    with pytest.raises(TypeError):
        load_config(42)


def _write(tmp_path, text):
    p = tmp_path / "x.json"
    p.write_text(text)
    return p


def test_use_gds_warns():
    with pytest.warns(UserWarning, match="GPUDirect"):
        c = load_config({"aio": {"use_gds": True}})
    assert c.aio.use_gds is True


def test_thread_count_alias_and_case_insensitive_device():
    c = load_config(
        {
            "aio": {"thread_count": 3},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "NVMe", "nvme_path": "/n"},
            },
        }
    )
    assert c.aio.intra_op_parallelism == c.aio.thread_count == 3
    assert c.offload_param.device == "nvme"


def test_from_lightning_maps_keywords():
    c = from_lightning(
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
        offload_params_device="nvme",
        offload_optimizer_device="nvme",
        nvme_path="/mnt/nvme",
        params_buffer_count=6,
        params_buffer_size=2e8,
        max_in_cpu=5e8,
        optimizer_buffer_count=3,
        block_size=262144,
        queue_depth=16,
        single_submit=True,
        overlap_events=False,
        thread_count=2,
        pin_memory=True,
        sub_group_size=1e9,
        allgather_bucket_size=2e8,
    )
    p, o = c.offload_param, c.offload_optimizer
    assert (p.device, p.nvme_path, p.buffer_count, p.buffer_size, p.max_in_cpu, p.pin_memory) == (
        "nvme",
        "/mnt/nvme",
        6,
        200_000_000,
        500_000_000,
        True,
    )
    assert (o.device, o.buffer_count) == ("nvme", 3)
    assert c.aio.handle_kwargs() == {
        "block_size": 262144,
        "queue_depth": 16,
        "single_submit": True,
        "overlap_events": False,
        "thread_count": 2,
        "engine": "auto",
    }
    assert c.zero_optimization.sub_group_size == 10**9


def test_from_lightning_defaults_and_errors():
    c = from_lightning()
    assert c.zero_optimization.stage == 2 and c.offload_param is None and c.offload_optimizer is None
    with pytest.raises(ConfigError, match="did you mean 'queue_depth'"):
        from_lightning(queue_dept=4)
    with pytest.raises(ConfigError, match="needs stage 3"), pytest.warns(UserWarning, match="nvme_path"):
        from_lightning(offload_parameters=True, offload_params_device="nvme")  # Lightning default stage 2
    with pytest.warns(UserWarning, match="ignores these keywords: stage"):
        assert from_lightning(config=NVME_DS_CONFIG, stage=1).zero_optimization.stage == 3


def test_output_block_loads_in_deepspeed_config_classes():
    """The block we emit is read unchanged by DeepSpeed's own parser."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install .[deepspeed])")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    c = load_config(NVME_DS_CONFIG)
    block = c.aio.to_deepspeed()
    assert get_aio_config({"aio": block}) == block
    z = DeepSpeedZeroConfig(**NVME_DS_CONFIG["zero_optimization"])
    assert z.offload_param.buffer_size == c.offload_param.buffer_size
    assert z.offload_optimizer.buffer_count == c.offload_optimizer.buffer_count


def test_model_is_frozen():
    c = load_config({})
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        c.aio.block_size = 4096  # type: ignore[misc]
    assert isinstance(c, OffloadConfig)


# "auto" is a placeholder for an integration to replace; the error says whether one
# would have (and from what), or that nobody fills the key and a value is needed.
AUTO_CASES = [
    # (config, key path, who fills it or None, what to give)
    (
        {"zero_optimization": {"stage": 3, "sub_group_size": "auto"}},
        "zero_optimization.sub_group_size",
        None,
        "a number",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"buffer_size": "auto"}}},
        "zero_optimization.offload_param.buffer_size",
        None,
        "a number",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"pin_memory": "auto"}}},
        "zero_optimization.offload_param.pin_memory",
        None,
        "true or false",
    ),
    ({"aio": {"block_size": "auto"}}, "aio.block_size", None, "a number"),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "auto"}}},
        "zero_optimization.offload_optimizer.device",
        "Accelerate",
        "a device",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "auto"}}},
        "zero_optimization.offload_param.nvme_path",
        "Accelerate",
        "a directory",
    ),
    ({"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage", "Accelerate", "a number"),
]


@pytest.mark.parametrize("cfg,path,who,want", AUTO_CASES)
def test_auto_says_who_fills_the_key(cfg, path, who, want):
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    msg = dict(ei.value.problems)[path]
    if who is None:
        assert "not filled in by anyone" in msg and "HF Trainer" in msg, msg
    else:
        assert f"'auto' was not resolved: {who}" in msg, msg
    assert f"give {want}" in msg, msg


def test_auto_message_names_what_hf_fills():
    from aio.config.models import AUTO_FILLED, auto_message

    for path in (
        "train_micro_batch_size_per_gpu",
        "train_batch_size",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_max_lr",
        "fp16.enabled",
        "bf16.enabled",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    ):
        assert AUTO_FILLED[path][0] == "the HF Trainer", path
        assert "the HF Trainer fills this key" in auto_message(path), path
    assert "hidden_size" in auto_message("zero_optimization.stage3_prefetch_bucket_size")
    for path in ("zero_optimization.sub_group_size", "zero_optimization.offload_param.buffer_size"):
        assert path not in AUTO_FILLED and "not filled in by anyone" in auto_message(path)


def test_nvme_path_takes_one_directory_or_a_list():
    import copy

    from aio.config import ConfigError

    cfg = copy.deepcopy(NVME_DS_CONFIG)
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = ["/a", "/b"]
    c = load_config(cfg)
    assert c.offload_param.nvme_dirs() == ["/a", "/b"]
    assert c.offload_optimizer.nvme_dirs() == ["/local_nvme"]
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = ["/a"]
    assert load_config(cfg).offload_param.nvme_path == "/a"  # a list of one is one directory
    bads = (
        ([], "empty list"),
        (["/a", "/a"], "same directory"),
        (["/a", "/a/"], "same directory"),  # R3-09: one folder spelled two ways
        (["/a", "/b/../a"], "same directory"),
        (["/a", ""], "item 1"),
    )
    for bad, why in bads:
        cfg["zero_optimization"]["offload_param"]["nvme_path"] = bad
        with pytest.raises(ConfigError, match=why) as ei:
            load_config(cfg)
        assert "zero_optimization.offload_param.nvme_path" in str(ei.value)


@pytest.mark.parametrize("kind", ["device", "fifo", "directory", "large"])
def test_config_file_must_be_a_small_regular_file(tmp_path, kind):
    """A device (/dev/zero read forever), a FIFO (open waited for a writer), a
    folder or a huge file is refused by name before it is read."""
    import os

    from aio.config.load import MAX_CONFIG_BYTES

    if kind == "device":
        path, text = "/dev/zero", "is a device"
    elif kind == "fifo":
        path, text = str(tmp_path / "c.json"), "is a FIFO"
        os.mkfifo(path)
    elif kind == "directory":
        path, text = str(tmp_path), "is a directory"
    else:
        path, text = str(tmp_path / "c.json"), f"larger than {MAX_CONFIG_BYTES >> 20} MiB"
        with open(path, "wb") as f:
            f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert text in str(ei.value) and path in str(ei.value), str(ei.value)


@pytest.mark.parametrize("where", ["file", "text"])
def test_a_key_given_twice_is_refused_naming_it(tmp_path, where):
    """JSON keeps the last of two equal keys silently (an edit that pastes an
    offload block again loses the first); DeepSpeed refuses it, so do we."""
    text = '{"aio": {"block_size": 1048576}, "zero_optimization": {"stage": 3, "stage": 0}}'
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="'stage' is given twice") as ei:
        load_config(str(path) if where == "file" else text)
    assert where == "text" or str(path) in str(ei.value)


def test_block_size_up_to_the_core_limit_builds_a_handle():
    """What validate accepts, the handle takes: 1 TiB is the largest block_size."""
    import aio

    c = load_config({"aio": {"block_size": 1 << 40}})
    assert aio.AsyncIOHandle(**c.aio.handle_kwargs()).get_block_size() == 1 << 40
