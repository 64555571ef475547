"""aio.integrations.transformers.AioZeroTrainer: the HF Trainer on aio.zero,
both offloads on the drive, from HF's DeepSpeed template with its "auto"
values, against the same Trainer in memory (tiny GPT-2, fp32): the logged
losses, gradient norms, learning rates and evaluation losses bit for bit
(the Trainer's optimizer and param groups, warm-up schedule, accumulation,
clipping, dropout); save_steps checkpoints that a new run resumes from bit
for bit; save_model's streamed weights loaded by from_pretrained."""

import os
import re

import pytest
import torch

import aio.zero

tf = pytest.importorskip("transformers", reason="transformers is in the test extras")
pytest.importorskip("accelerate", reason="accelerate is in the test extras")

from aio.integrations.transformers import AioZeroTrainer, resolve_config  # noqa: E402

V = 96


def _hf_config():
    cfg = tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    cfg._attn_implementation = "eager"
    return cfg


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _args(out, **kw):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-3,
        warmup_steps=2,
        weight_decay=0.01,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        # torch's AdamW, which aio's kernel reproduces (checked against torch
        # at first use); the default adamw_torch_fused is torch's fused class
        # stepping whole sub-groups instead of tensors
        optim="adamw_torch",
    )
    return tf.TrainingArguments(**{**base, **kw})


def _ds_config(drive):
    """HF's DeepSpeed template: the keys the Trainer fills are "auto"."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 20_000,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": 0,  # this toy model's tensors are all small
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(drive),
                "buffer_count": 64,
                "buffer_size": 20_000,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(drive),
                "buffer_count": 11,
                "pipeline_read": True,
                "pipeline_write": True,
            },
        },
    }


def _logs(trainer, after=0):
    keys = ("loss", "grad_norm", "learning_rate", "eval_loss", "step")
    return [
        {k: v for k, v in h.items() if k in keys}
        for h in trainer.state.log_history
        if h["step"] > after and ("loss" in h or "eval_loss" in h)
    ]


def _aio_trainer(tmp_path, args, config):
    with aio.zero.Init(resolve_config(config, args, _hf_config())):
        model = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "tiny")  # streamed to the drive
    return AioZeroTrainer(
        model=model, args=args, train_dataset=_Tokens(24), eval_dataset=_Tokens(4), aio_config=config
    )


@pytest.fixture
def tiny(tmp_path):
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(_hf_config()).save_pretrained(tmp_path / "tiny")
    (tmp_path / "drive").mkdir()
    return tmp_path


def test_trains_as_in_memory_checkpoints_resumes_and_saves(tiny):
    mem_model = tf.GPT2LMHeadModel.from_pretrained(tiny / "tiny")
    mem = tf.Trainer(
        model=mem_model, args=_args(tiny / "mem"), train_dataset=_Tokens(24), eval_dataset=_Tokens(4)
    )
    mem.train()
    want = _logs(mem)
    assert [h["step"] for h in want if "loss" in h] == [1, 2, 3, 4]

    config = _ds_config(tiny / "drive")
    # The template's optimizer block: its class, the Trainer's values and groups.
    config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    run = _aio_trainer(tiny, _args(tiny / "out", save_strategy="steps", save_steps=2), config)
    run.train()
    assert _logs(run) == want  # losses, grad norms, lrs, eval losses: the same bits
    groups = run.engine.optimizer.param_groups  # the Trainer's: no weight decay on biases and norms
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert {p.aio_name for p in groups[1]["params"]} >= {
        "transformer.ln_f.weight",
        "transformer.h.0.attn.c_attn.bias",
    }
    assert run.state.global_step == 4 and run.engine.global_steps == 4

    run.save_model(str(tiny / "final"))  # streamed, tensor by tensor
    trained = run.engine.state_dict()
    run.close()
    back = tf.GPT2LMHeadModel.from_pretrained(tiny / "final")
    assert back.state_dict().keys() == mem_model.state_dict().keys()
    for k, v in back.state_dict().items():
        assert torch.equal(v, trained[k]) and torch.equal(v, mem_model.state_dict()[k]), k

    ckpt = tiny / "out" / "checkpoint-2"
    assert {"global_step2", "latest", "model.safetensors", "scheduler.pt", "trainer_state.json"} <= set(
        os.listdir(ckpt)
    )
    # A new run resumed from the step-2 checkpoint continues bit for bit (it
    # saves step 4 again: the folder keeps one engine checkpoint).
    resumed = _aio_trainer(tiny, _args(tiny / "out", save_strategy="steps", save_steps=2), config)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert _logs(resumed, after=2) == [h for h in want if h["step"] > 2]
    tags = [n for n in os.listdir(tiny / "out" / "checkpoint-4") if n.startswith("global_step")]
    assert tags == [(tiny / "out" / "checkpoint-4" / "latest").read_text()]
    resumed.close()


def test_bf16_autocast_as_in_memory_and_bf16_parameters(tiny):
    """TrainingArguments(bf16=True) is autocast: around fp32 parameters
    (``bf16.enabled: false``) the same bits as the Trainer in memory, an
    evaluation before training included; with ``"auto"`` the parameters are
    bf16 on the drive, as DeepSpeed's would be."""
    args = dict(bf16=True, max_steps=2, eval_strategy="no")
    mem = tf.Trainer(
        model=tf.GPT2LMHeadModel.from_pretrained(tiny / "tiny"),
        args=_args(tiny / "mem", **args),
        train_dataset=_Tokens(24),
        eval_dataset=_Tokens(4),
    )
    first = mem.evaluate()["eval_loss"]
    mem.train()
    config = {**_ds_config(tiny / "drive"), "bf16": {"enabled": False}}
    run = _aio_trainer(tiny, _args(tiny / "out", **args), config)
    assert run.evaluate()["eval_loss"] == first  # builds the engine; training then uses it
    run.train()
    assert _logs(run) == _logs(mem)
    run.close()
    half = _aio_trainer(tiny, _args(tiny / "half", **{**args, "max_steps": 1}), _ds_config(tiny / "drive"))
    half.train()
    assert half.engine.cfg.dtype == "bf16" and all(
        torch.isfinite(torch.tensor(h["loss"])) for h in _logs(half)
    )
    half.close()


def test_fp16_overflow_skips_the_step_and_the_schedule(tiny):
    """fp16 parameters with the engine's loss scaling (DeepSpeed's): a step
    skipped for overflow does not advance the Trainer's LR schedule."""
    config = {
        **_ds_config(tiny / "drive"),
        "fp16": {"enabled": "auto", "initial_scale_power": 40, "hysteresis": 1},
    }
    config["bf16"] = {"enabled": False}
    run = _aio_trainer(
        tiny, _args(tiny / "out", fp16=True, max_steps=3, eval_strategy="no", warmup_steps=0), config
    )
    run.train()
    assert run.engine.cfg.dtype == "fp16" and run.engine.skipped_steps == 3  # 2**40 overflows fp16
    assert run.lr_scheduler.last_epoch == 0
    assert [h["learning_rate"] for h in _logs(run)] == [1e-3] * 3
    run.close()


def test_misuse_is_refused_naming_the_fix(tiny):
    args = _args(tiny / "out", eval_strategy="no")
    config = _ds_config(tiny / "drive")
    with pytest.raises(ValueError, match=r"gradient_clipping=0\.5 but max_grad_norm=1\.0"):
        resolve_config({**config, "gradient_clipping": 0.5}, args, _hf_config())
    with pytest.raises(ValueError, match="scheduler"):
        resolve_config({**config, "scheduler": {"type": "WarmupLR"}}, args, _hf_config())
    with pytest.raises(ValueError, match="pass model="):
        resolve_config(config, args)
    model = tf.GPT2LMHeadModel.from_pretrained(tiny / "tiny")
    with pytest.raises(ValueError, match=re.escape('set "fp16": {"enabled": true}')):
        AioZeroTrainer(model=model, args=_args(tiny / "o", fp16=True, eval_strategy="no"), aio_config=config)
    ds_args = _args(tiny / "o", eval_strategy="no")
    ds_args.deepspeed = "ds_config.json"
    with pytest.raises(ValueError, match="aio_config="):
        AioZeroTrainer(model=model, args=ds_args, aio_config=config)
    run = AioZeroTrainer(model=model, args=args, train_dataset=_Tokens(8), aio_config=config)
    (tiny / "plain").mkdir()
    with pytest.raises(ValueError, match="no aio.zero checkpoint"):
        run.train(resume_from_checkpoint=str(tiny / "plain"))
    run.close()


def test_the_documented_template_resolves(tmp_path):
    """docs/huggingface.md's DeepSpeed template, as AioZeroTrainer reads it:
    every "auto" filled from the TrainingArguments and the model's config."""
    import json
    from pathlib import Path

    from aio.config import load_train_config

    page = (Path(__file__).resolve().parents[2] / "docs" / "huggingface.md").read_text()
    template = json.loads(
        next(b for b in re.findall(r"```json\n(.*?)```", page, re.S) if '"offload_param"' in b)
    )
    for block in ("offload_param", "offload_optimizer"):
        template["zero_optimization"][block]["nvme_path"] = str(tmp_path)
    args = _args(tmp_path / "out", bf16=True, max_grad_norm=0.5)
    got = resolve_config(template, args, _hf_config())
    assert got["gradient_clipping"] == 0.5 and got["gradient_accumulation_steps"] == 2
    assert got["bf16"] == {"enabled": True}
    want = {"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}  # absent ones too
    assert got["optimizer"]["params"] == want
    assert got["zero_optimization"]["stage3_param_persistence_threshold"] == 320  # 10 x hidden size
    cfg = load_train_config(got)
    assert cfg.dtype == "bf16" and cfg.aio_zero.adam_sqrt == "torch"
