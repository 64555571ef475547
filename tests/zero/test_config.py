"""aio.zero.config: the training config (aio.config.TrainConfig) as aio.zero reads it."""

import pytest

import aio.zero

from .common import cfg_for


def test_unknown_keys_are_ignored_with_one_notice(tmp_path):
    cfg = cfg_for(tmp_path, scheduler={"type": "WarmupLR"}, train_micro_batch_size_per_gpu=4)
    with pytest.warns(UserWarning, match="ignores these config keys: scheduler") as rec:
        cfg_obj = aio.zero.load_train_config(cfg)
    assert len(rec) == 1 and cfg_obj.ignored == ("scheduler",)
