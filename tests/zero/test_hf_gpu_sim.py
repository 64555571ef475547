"""Hugging Face models on the simulated GPU (tests/zero/cuda_sim.py): built
under ``Init(device="cuda")``, trained through aio.zero with every tensor on
the drive, equal to the same model trained in memory. Dropout is off: a GPU
draws its masks from the device generator, so no CPU run could match them."""

import pytest
import torch

import aio.zero

from .cuda_sim import CudaSim
from .test_hf import _batch, _build, _train, _zero_config

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
