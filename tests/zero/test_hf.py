"""Hugging Face models under aio.zero: tiny configs built in code (no
downloads), built under ``Init`` and loaded with ``from_pretrained`` under
``Init``, equal to the same models in memory and training bit-identically
(fp32, both offloads on the drive)."""

import json
from pathlib import Path

import pytest
import torch

import aio.zero
from aio.optim import CPUAdamW

tf = pytest.importorskip("transformers", reason="transformers is in the test extras")

V = 96


def _configs():
    return {
        "gpt2": (
            tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=16),
            tf.GPT2LMHeadModel,
        ),
        "llama": (
            tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=V, max_position_embeddings=16),
            tf.LlamaForCausalLM,
        ),
        "bert": (
            tf.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          vocab_size=V, max_position_embeddings=16),
            tf.BertForMaskedLM,
        ),
        "t5": (
            tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, d_kv=8, num_heads=4,
                        vocab_size=V, decoder_start_token_id=0, pad_token_id=0),
            tf.T5ForConditionalGeneration,
        ),
    }  # fmt: skip


def _zero_config(drive):
    return {
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 20_000,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
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
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_clipping": 1.0,
    }


def _batch(name, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, V, (2, 8), generator=g)
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(0, V, (2, 6), generator=g)}
    return {"input_ids": ids, "labels": ids}


def _train(model, name, engine=None, steps=3):
    """Losses of `steps` steps: through `engine`, or in memory with the AdamW
    step aio.zero takes (aio.optim's kernel)."""
    opt = None if engine else CPUAdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)  # the same dropout masks in both runs
    losses = []
    for s in range(steps):
        if engine is not None:
            loss = engine(**_batch(name, s)).loss
            engine.backward(loss)
            engine.step()
        else:
            loss = model(**_batch(name, s)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def _build(name):
    cfg, cls = _configs()[name]
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg)


def _assert_equal_params(store, model, ref):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert tuple(p.aio_shape) == tuple(q.shape), name
        with store.gathered([p]):
            assert torch.equal(p.data, q.data), f"{name} differs from the model built in memory"


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_built_under_init_equals_memory_and_trains_identically(tmp_path, name):
    mem = _build(name)
    cfg = _zero_config(tmp_path)
    with aio.zero.Init(cfg) as init:
        model = _build(name)
    _assert_equal_params(init.store, model, mem)
    want = _train(mem, name)
    with aio.zero.initialize(model, cfg) as engine:
        assert _train(model, name, engine) == want


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_from_pretrained_under_init_streams_the_checkpoint(tmp_path, name):
    saved = _build(name)
    ckpt = tmp_path / "ckpt"
    saved.save_pretrained(ckpt, max_shard_size="20KB")  # several safetensors shards
    assert len(list(ckpt.glob("*.safetensors"))) > 1
    cfg = _zero_config(tmp_path / "drive")
    (tmp_path / "drive").mkdir()
    with aio.zero.Init(cfg) as init:
        model = tf.AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager")
    _assert_equal_params(init.store, model, saved)
    if name == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied weights stay tied
    ref = tf.AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager")
    want = _train(ref, name)
    with aio.zero.initialize(model, cfg) as engine:
        assert _train(model, name, engine) == want


def test_multihead_attention_built_under_init_equals_memory(tmp_path):
    """nn.MultiheadAttention initialises out_proj.bias after out_proj was stored."""
    torch.manual_seed(0)
    mem = torch.nn.MultiheadAttention(32, 4)
    with aio.zero.Init(_zero_config(tmp_path)) as init:
        torch.manual_seed(0)
        model = torch.nn.MultiheadAttention(32, 4)
    _assert_equal_params(init.store, model, mem)


_AUTO = {"gpt2": "AutoModelForCausalLM", "llama": "AutoModelForCausalLM", "bert": "AutoModelForMaskedLM",
         "t5": "AutoModelForSeq2SeqLM"}  # fmt: skip


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5"])
def test_from_pretrained_at_deepspeeds_default_buffer_count(tmp_path, name):
    """offload_param.buffer_count 5 (DeepSpeed's default) with every tensor on
    the drive: from_pretrained's state_dict() walk holds no swap buffer, the
    sharded checkpoint loads exactly, and training matches memory."""
    saved = _build(name)
    ckpt = tmp_path / "ckpt"
    saved.save_pretrained(ckpt, max_shard_size="20KB")
    cfg = _zero_config(tmp_path / "drive")
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = 5
    (tmp_path / "drive").mkdir()
    auto = getattr(tf, _AUTO[name])
    with aio.zero.Init(cfg) as init:
        model = auto.from_pretrained(ckpt, attn_implementation="eager")
        assert len(init.store.refs) <= 2  # at most the views a model keeps (BERT ties its decoder bias)
    _assert_equal_params(init.store, model, saved)
    ref = auto.from_pretrained(ckpt, attn_implementation="eager")
    want = _train(ref, name, steps=2)
    with aio.zero.initialize(model, cfg) as engine:
        assert _train(model, name, engine, steps=2) == want


def test_from_pretrained_under_init_holds_memory_tensor_by_tensor(tmp_path):
    """The load's peak anonymous memory under Init (every tensor on the drive,
    5 buffers) stays within the in-memory load's (transformers' own working
    memory) plus the swap buffers and two of the largest tensors, whatever the
    model's size; a load holding every parameter would exceed it here.
    bench/hf_load_rss.py, in fresh processes (this is also its smoke run)."""
    import subprocess
    import sys

    out = tmp_path / "rss.json"
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "bench" / "hf_load_rss.py"), "--layers", "8", "--width", "512"]
    cmd += ["--vocab", "2048", "--dir", str(tmp_path), "--json", str(out)]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    mem, init = (row["anon"] for row in got["rows"])
    held = (got["buffer_count"] + 2) * got["buffer_bytes"]
    assert got["param_bytes"] > 2 * held, got  # the bound can tell: a full copy would not fit
    assert init <= mem + held, (init / 2**20, (mem + held) / 2**20, r.stdout)


def enable_checkpointing(model, kwargs=None, offload=False):
    """HF's activation checkpointing as users turn it on (None: the library's
    default mode); transformers before 5.2x names it gradient_checkpointing_enable."""
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs=kwargs, offload=offload)
    else:
        if offload:
            pytest.skip("this transformers has no activation offloading")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


@pytest.mark.parametrize("reentrant", [None, True, False], ids=["default", "reentrant", "non-reentrant"])
def test_activation_checkpointing_trains_as_in_memory(tmp_path, reentrant):
    """The decoder layers run again in backward (in the non-reentrant mode,
    the library's default, holding their parameters until their gradients
    land); the same bits as the same model trained in memory without it."""
    want = _train(_build("llama"), "llama")
    model = enable_checkpointing(_build("llama"), None if reentrant is None else {"use_reentrant": reentrant})
    with aio.zero.initialize(model, _zero_config(tmp_path)) as engine:
        assert _train(model, "llama", engine) == want
        assert (engine.fetcher.counters.get("recompute_fetches", 0) > 0) is (reentrant is not True)
