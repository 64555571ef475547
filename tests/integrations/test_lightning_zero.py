"""aio.integrations.lightning.AioZeroStrategy: a LightningModule (a tiny
Llama inside) trained on aio.zero, both offloads on the drive, against the
same Trainer in memory: every micro-batch's loss, the scheduled learning
rates and the validation losses bit for bit (configure_optimizers' AdamW and
LambdaLR, accumulate_grad_batches, gradient_clip_val, bf16-mixed autocast,
manual optimization); max_steps counted; ModelCheckpoint directories that a
new run resumes from bit for bit; the weights streamed out for
from_pretrained."""

import os
import re
import warnings

import pytest
import torch

import aio.zero

L = pytest.importorskip("lightning.pytorch", reason="lightning is in the test extras")
tf = pytest.importorskip("transformers", reason="transformers is in the test extras")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.utilities.warnings import PossibleUserWarning  # noqa: E402

from aio.integrations.lightning import AioZeroStrategy  # noqa: E402

V = 96


def _llama():
    cfg = tf.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=16,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg)


class Lit(L.LightningModule):
    def __init__(self, build=True):
        super().__init__()
        self.model = _llama() if build else None
        self.losses, self.lrs, self.vals = [], [], []

    def training_step(self, batch, i):
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def validation_step(self, batch, i):
        self.vals.append(self.model(**batch).loss.item())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return [opt], [{"scheduler": warmup, "interval": "step"}]


class Manual(Lit):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, i):
        opt = self.optimizers()
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        self.lr_schedulers().step()


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _loader(n):
    return torch.utils.data.DataLoader(_Tokens(n), batch_size=2)


def _fit(model, strategy=None, ckpt_path=None, **kw):
    """4 batches an epoch, 2 optimizer steps (accumulate_grad_batches=2)."""
    flags = dict(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    if strategy is not None:
        flags["strategy"] = strategy
    trainer = L.Trainer(**{**flags, **kw})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=PossibleUserWarning)  # advice about workers, logging
        trainer.fit(model, _loader(8), _loader(2), ckpt_path=ckpt_path)
    return trainer


def _config(drive):
    return {
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 20_000,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(drive),
                "buffer_count": 64,
                "buffer_size": 20_000,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": str(drive), "buffer_count": 11},
        },
    }


def _on_drive(config, cls=Lit):
    with aio.zero.Init(config):
        return cls()


@pytest.fixture
def config(tmp_path):
    (tmp_path / "drive").mkdir()
    return _config(tmp_path / "drive")


def test_fits_as_in_memory_checkpoints_resumes_and_saves(tmp_path, config):
    mem = Lit()
    _fit(mem)
    model, strategy = _on_drive(config), AioZeroStrategy(config)
    saves = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    trainer = _fit(model, strategy, enable_checkpointing=True, callbacks=[saves])
    assert (model.losses, model.lrs, model.vals) == (mem.losses, mem.lrs, mem.vals)
    assert len(model.losses) == 8 and trainer.global_step == 4 == strategy.engine.global_steps

    strategy.save_pretrained(str(tmp_path / "hf"))  # the Llama inside, streamed
    back = tf.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for k, v in mem.model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    trainer.save_checkpoint(tmp_path / "by_hand")  # a directory; the model is never gathered for it
    state = torch.load(tmp_path / "by_hand" / "global_step4.lightning.ckpt", weights_only=False)
    assert "state_dict" not in state and state["global_step"] == 4
    strategy.close()

    step2 = tmp_path / "ck" / "epoch=0-step=2.ckpt"
    assert sorted(os.listdir(step2)) == ["global_step2", "global_step2.lightning.ckpt", "latest"]
    resumed, again = _on_drive(config), AioZeroStrategy(config)
    with pytest.warns(UserWarning, match="middle of gradient accumulation"):
        # ModelCheckpoint saves the step resumed from again, mid-window: skipped
        trainer = _fit(
            resumed,
            again,
            ckpt_path=step2,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck2", every_n_train_steps=2)],
        )
    assert (resumed.losses, resumed.lrs, resumed.vals) == (mem.losses[4:], mem.lrs[4:], mem.vals[1:])
    assert trainer.global_step == 4 == again.engine.global_steps
    again.close()


def test_bf16_mixed_as_in_memory(config):
    mem = Lit()
    _fit(mem, precision="bf16-mixed", max_steps=2)
    model, strategy = _on_drive(config), AioZeroStrategy(config)
    _fit(model, strategy, precision="bf16-mixed", max_steps=2)
    assert (model.losses, model.vals) == (mem.losses, mem.vals)
    strategy.close()


def test_manual_optimization_counts_steps(config):
    mem = Manual()
    _fit(mem, max_steps=3, accumulate_grad_batches=1, gradient_clip_val=None)
    model, strategy = _on_drive(config, Manual), AioZeroStrategy(config)
    trainer = _fit(model, strategy, max_steps=3, accumulate_grad_batches=1, gradient_clip_val=None)
    assert trainer.global_step == 3 == strategy.engine.global_steps  # max_steps held
    assert model.losses == mem.losses
    strategy.close()


class Late(Lit):
    """Builds its model in configure_model: the strategy runs it under Init."""

    def __init__(self):
        super().__init__(build=False)

    def configure_model(self):
        if self.model is None:
            self.model = _llama()


def test_configure_model_builds_on_the_drive(config):
    mem = Late()
    _fit(mem, max_steps=1, accumulate_grad_batches=1)
    model, strategy = Late(), AioZeroStrategy(config)
    _fit(model, strategy, max_steps=1, accumulate_grad_batches=1)
    assert all(p.numel() == 0 and p.aio_shape for p in model.parameters())  # placeholders: stored
    assert model.losses == mem.losses
    strategy.close()


def test_misuse_is_refused_naming_the_fix(config):
    with pytest.raises(ValueError, match="'32-true' or 'bf16-mixed'"):
        _fit(Lit(), AioZeroStrategy(config), precision="bf16-true", max_steps=1)
    with pytest.raises(ValueError, match="gradient_clip_algorithm='norm'"):
        _fit(Lit(), AioZeroStrategy(config), gradient_clip_algorithm="value", max_steps=1)
    with pytest.raises(
        ValueError, match=re.escape("gradient_accumulation_steps=4 but accumulate_grad_batches=2")
    ):
        _fit(Lit(), AioZeroStrategy({**config, "gradient_accumulation_steps": 4}), max_steps=1)
    strategy = AioZeroStrategy(config)
    with pytest.raises(ValueError, match="not an AioZeroStrategy checkpoint"):
        strategy.load_checkpoint(config["zero_optimization"]["offload_param"]["nvme_path"])
