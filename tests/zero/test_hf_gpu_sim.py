"""Hugging Face models on the simulated GPU (tests/zero/cuda_sim.py): built
under ``Init(device="cuda")``, trained through aio.zero with every tensor on
the drive, equal to the same model trained in memory. Dropout is off: a GPU
draws its masks from the device generator, so no CPU run could match them."""

import pytest
import torch

import aio.zero

from .cuda_sim import CudaSim
from .test_hf import _batch, _build, _train, _zero_config, enable_checkpointing

pytest.importorskip("transformers", reason="transformers is in the test extras")

_DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob",
             "attention_probs_dropout_prob", "dropout_rate", "attention_dropout")  # fmt: skip


def _build_no_dropout(name):
    model = _build(name)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in ("attention_dropout", "dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    return model


def _on_device(batch):
    return {k: v.to("cuda") for k, v in batch.items()}


def _train_on_device(engine, name, steps=3):
    out = []
    for s in range(steps):
        loss = engine(**_on_device(_batch(name, s))).loss
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize(
    "name,scheduler", [("llama", "lazy"), ("t5", "random")]
)  # a decoder and an encoder-decoder, each in one strict schedule (CI time); GPT-2 and BERT
# share their code paths (Init, tied weights, buffers), and the trainer's own tests run in all
def test_hf_model_on_the_simulated_gpu_equals_memory(tmp_path, name, scheduler):
    mem = _build_no_dropout(name)
    want = _train(mem, name)
    mem = _build_no_dropout(name)
    cfg = _zero_config(tmp_path)
    with CudaSim(scheduler=scheduler, seed=3):
        with aio.zero.Init(cfg, device="cuda") as init:
            model = _build_no_dropout(name)
        for (n, p), (_, q) in zip(model.named_parameters(), mem.named_parameters(), strict=True):
            assert torch.equal(init.store.read(p).view(q.shape), q.data), n
        with aio.zero.initialize(model, cfg, device="cuda") as engine:
            assert _train_on_device(engine, name) == want


def test_hf_activation_checkpointing_on_the_simulated_gpu_equals_memory(tmp_path):
    """Non-reentrant activation checkpointing (the library's default) on a
    GPU model: the recomputed layers' parameters held until their gradients
    land, in the strictest schedule. torch's recomputation check compares
    devices, which the simulator cannot fake for tensors made in backward:
    it is off here and on in the real-GPU test below."""
    want = _train(_build_no_dropout("llama"), "llama")
    kwargs = {"use_reentrant": False, "determinism_check": "none"}
    with CudaSim(scheduler="lazy"):
        model = enable_checkpointing(_build_no_dropout("llama"), kwargs)
        with aio.zero.initialize(model, _zero_config(tmp_path), device="cuda") as e:
            assert _train_on_device(e, "llama") == want
            assert e.fetcher.counters["recompute_fetches"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here or in CI)")
@pytest.mark.parametrize("offload", [False, True], ids=["in-device-memory", "offload"])
def test_hf_activation_checkpointing_on_a_gpu_equals_no_checkpointing(tmp_path, offload):
    """On a real GPU, HF's default activation checkpointing (and its
    activations kept in pinned host memory, offload=True) through aio.zero:
    the same losses, bit for bit, as the same training without it."""

    def losses(model, drive):
        drive.mkdir()
        with aio.zero.initialize(model.to("cuda"), _zero_config(drive)) as engine:
            return _train_on_device(engine, "llama", steps=4)

    want = losses(_build_no_dropout("llama"), tmp_path / "a")
    model = enable_checkpointing(_build_no_dropout("llama"), offload=offload)
    assert losses(model, tmp_path / "b") == want
