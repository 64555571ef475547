"""``model.state_dict()`` of a model aio.zero keeps on the drive gives the
trained values (aio/zero/state_dict.py): compared bit for bit with the same
training in memory, through torch.save and Hugging Face's save_pretrained."""

import pytest
import torch

import aio.zero
from aio.optim import CPUAdamW

from .common import cfg_for, gpt, loss_of, train_in_memory

tf = pytest.importorskip("transformers", reason="transformers is in the test extras")

V = 96


def _hf_config(drive):
    return {
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 20_000,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(drive),
                "buffer_count": 8,
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


def _llama_config():
    cfg = tf.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=16,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "eager"
    return cfg


def _ids(step):
    return torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(step))


def _train_pair(tmp_path, steps=3):
    """A pretrained tiny Llama (tied head) loaded under Init and trained by
    aio.zero, and the same loaded and trained in memory. Returns (model,
    engine, reference); the engine is open."""
    torch.manual_seed(0)
    tf.LlamaForCausalLM(_llama_config()).save_pretrained(tmp_path / "pretrained")
    cfg = _hf_config(tmp_path / "drive")
    (tmp_path / "drive").mkdir()
    with aio.zero.Init(cfg):
        model = tf.LlamaForCausalLM.from_pretrained(tmp_path / "pretrained")
    ref = tf.LlamaForCausalLM.from_pretrained(tmp_path / "pretrained")
    opt = CPUAdamW(ref.parameters(), lr=1e-3)
    engine = aio.zero.initialize(model, cfg)
    for s in range(steps):
        loss = engine(input_ids=_ids(s), labels=_ids(s)).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(input_ids=_ids(s), labels=_ids(s)).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert loss.item() == ref_loss.item()
    return model, engine, ref


def _assert_same(got, want):
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), f"{k} differs from the training in memory"


def test_hf_model_state_dict_torch_save_and_save_pretrained_hold_the_trained_values(tmp_path):
    model, engine, ref = _train_pair(tmp_path)
    with engine:
        want = ref.state_dict()
        sd = model.state_dict()
        _assert_same(sd, want)
        assert "model.rotary_emb.inv_freq" not in sd  # non-persistent, as torch leaves it out
        assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]  # tied: one tensor, as in torch
        torch.save(model.state_dict(), tmp_path / "sd.pt")
        _assert_same(torch.load(tmp_path / "sd.pt", weights_only=True), want)
        model.save_pretrained(tmp_path / "saved")
        model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    for folder in ("saved", "sharded"):
        back = tf.LlamaForCausalLM.from_pretrained(tmp_path / folder)
        _assert_same(back.state_dict(), want)


def test_plain_model_state_dict_equals_memory_for_each_placement(tmp_path):
    for param in ("nvme", "cpu"):
        model = gpt()
        engine = aio.zero.initialize(model, cfg_for(tmp_path / param, param=param, gas=1, clip=0))
        ref = gpt()
        train_in_memory(2, gas=1, clip=0, model=ref)
        with engine:
            for step in range(2):
                engine.backward(loss_of(engine, step, 0))
                engine.step()
            _assert_same(model.state_dict(), ref.state_dict())


def test_values_are_copies_not_views_of_swap_buffers(tmp_path):
    model = gpt()
    with aio.zero.initialize(model, cfg_for(tmp_path, gas=1, clip=0)) as engine:
        with engine.gathered([model.head.weight]):  # in a swap buffer right now
            inside = model.state_dict()
            first = {k: v.clone() for k, v in inside.items()}
        engine.backward(loss_of(engine, 0, 0))
        engine.step()  # the buffers are reused and rewritten
        _assert_same(inside, first)
        after = model.state_dict()
        assert any(not torch.equal(after[k], first[k]) for k in first), "a step changed nothing?"


def test_keep_vars_gives_the_parameters_and_reads_nothing(tmp_path):
    model = gpt()
    with aio.zero.initialize(model, cfg_for(tmp_path, gas=1, clip=0)) as engine:
        reads = engine.store.stats()["bytes_read"]
        sd = model.state_dict(keep_vars=True)
        assert all(sd[n] is p for n, p in model.named_parameters())
        assert engine.store.stats()["bytes_read"] == reads


def test_refused_when_the_values_do_not_fit_in_memory(tmp_path, monkeypatch):
    import psutil

    model = gpt()
    with aio.zero.initialize(model, cfg_for(tmp_path, gas=1, clip=0)) as engine:
        total = sum(p.aio_numel * 4 for p in model.parameters())
        real = psutil.virtual_memory()
        monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=total // 2))
        reads = engine.store.stats()["bytes_read"]
        with pytest.raises(MemoryError, match="save_pretrained"):
            model.state_dict()
        assert engine.store.stats()["bytes_read"] == reads  # refused before reading anything
        monkeypatch.undo()
        assert model.state_dict()["head.weight"].numel() > 0


def test_after_close_state_dict_raises_instead_of_empty_tensors(tmp_path):
    model = gpt()
    aio.zero.initialize(model, cfg_for(tmp_path, gas=1, clip=0)).close()
    with pytest.raises(ValueError, match="closed"):
        model.state_dict()


def test_under_init_state_dict_reads_nothing(tmp_path):
    """from_pretrained walks the state dict of the model it fills: inside Init
    it must stay meta tensors of the right shapes (no read per parameter)."""
    cfg = _hf_config(tmp_path)
    with aio.zero.Init(cfg) as init:
        model = tf.LlamaForCausalLM(_llama_config())
        reads = init.store.stats()["bytes_read"]
        sd = model.state_dict()
        assert sd["lm_head.weight"].is_meta and tuple(sd["lm_head.weight"].shape) == (V, 32)
        assert init.store.stats()["bytes_read"] == reads
    assert model.state_dict()["lm_head.weight"].abs().sum() > 0  # after the block: the values
    init.store.close()


def test_load_state_dict_stores_values_before_training_and_is_refused_after(tmp_path):
    ref = gpt()
    want = {k: v + 1 for k, v in ref.state_dict().items()}
    cfg = cfg_for(tmp_path, gas=1, clip=0)
    with aio.zero.Init(cfg):
        model = gpt()
    with pytest.raises(RuntimeError, match=r"size mismatch for head.weight.*\(64, 64\)"):
        model.load_state_dict({**want, "head.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="assign=True"):
        model.load_state_dict(want, assign=True)
    model.load_state_dict(want)  # built under Init, before initialize(): stored
    with aio.zero.initialize(model, cfg) as engine:
        _assert_same(model.state_dict(), want)
        engine.backward(loss_of(engine, 0, 0))
        engine.step()
        with pytest.raises(ValueError, match="load_checkpoint"):
            model.load_state_dict(want)


def test_load_state_dict_after_training_is_refused_for_resident_parameters_too(tmp_path):
    """Parameters kept in CPU memory take torch's copy directly: refused all
    the same (the next step would start from the master weights), before
    anything is copied."""
    model = gpt()
    with aio.zero.initialize(model, cfg_for(tmp_path, param="cpu", gas=1, clip=0)) as engine:
        engine.backward(loss_of(engine, 0, 0))
        engine.step()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match="load_checkpoint"):
            model.load_state_dict({k: torch.zeros_like(v) for k, v in before.items()})
        _assert_same(model.state_dict(), before)


def test_a_plain_dict_destination_is_not_kept_and_values_survive_close_in_memory(tmp_path):
    model = gpt()
    engine = aio.zero.initialize(model, cfg_for(tmp_path, gas=1, clip=0))
    with engine:
        out = model.state_dict(destination={})
        assert out["head.weight"].numel() > 0
        assert "_state_dict_cache" not in engine.store.__dict__  # the call is over: nothing held
    mem = gpt()
    engine = aio.zero.initialize(mem, cfg_for(tmp_path / "m", param="cpu", opt="cpu", gas=1, clip=0))
    want = {k: v.clone() for k, v in mem.state_dict().items()}
    engine.close()
    _assert_same(mem.state_dict(), want)  # kept in memory: still there after close
