#!/usr/bin/env python3
"""Peak RSS of loading a Hugging Face checkpoint: ``from_pretrained`` in
memory against ``from_pretrained`` under ``aio.zero.Init`` with every tensor
on the drive at DeepSpeed's default ``buffer_count`` (5), each in a fresh
process, on one sharded safetensors checkpoint written first.

    PYTHONPATH=. python bench/hf_load_rss.py [--layers 12 --width 768 --vocab 50257] [--dir DIR] [--json FILE]

Prints the checkpoint's bytes and, for each variant, how far above the
process's memory after importing transformers (the baseline) its peak RSS
(VmHWM: this counts the checkpoint's memory-mapped file pages as they are
read, reclaimable page cache) and its peak anonymous memory (RssAnon,
sampled every 5 ms: the memory the load really holds) went; and the ratio
of the anonymous peaks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, threading, time
import torch, transformers as tf
from aio.train import peak_rss
import aio.zero

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

peak_anon = [anon()]
def sample():
    while True:
        peak_anon[0] = max(peak_anon[0], anon())
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
ckpt, how, drive = sys.argv[1], sys.argv[2], sys.argv[3]
base, base_anon = peak_rss(), anon()
if how == "memory":
    model = tf.AutoModelForCausalLM.from_pretrained(ckpt)
else:
    cfg = tf.AutoConfig.from_pretrained(ckpt)
    # the largest of the token and position embeddings and the MLP matrix
    largest = max(cfg.vocab_size, cfg.n_positions, 4 * cfg.hidden_size) * cfg.hidden_size
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
        "offload_param": {"device": "nvme", "nvme_path": drive, "buffer_count": 5,
                          "buffer_size": largest, "max_in_cpu": 0},
        "offload_optimizer": {"device": "cpu"}}}
    with aio.zero.Init(config):
        model = tf.AutoModelForCausalLM.from_pretrained(ckpt)
time.sleep(0.05)
print(json.dumps({"how": how, "base": base, "peak": peak_rss(), "anon": peak_anon[0] - base_anon}))
"""


def main() -> None:
    """Write the checkpoint, load it both ways, print the table."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--dir", default=None, help="where the checkpoint and the swap files go")
    ap.add_argument("--json", help="also write the measurements here (tests/zero/test_hf.py reads them)")
    args = ap.parse_args()
    import transformers as tf

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        ckpt = os.path.join(d, "ckpt")
        cfg = tf.GPT2Config(
            n_layer=args.layers,
            n_embd=args.width,
            n_head=max(1, args.width // 64),
            vocab_size=args.vocab,
            bos_token_id=args.vocab - 1,  # GPT-2's <|endoftext|> at the default vocabulary
            eos_token_id=args.vocab - 1,
        )
        model = tf.GPT2LMHeadModel(cfg)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(ckpt, max_shard_size="200MB")
        del model
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
        rows = []
        for how in ("memory", "init"):
            drive = os.path.join(d, f"drive-{how}")
            os.makedirs(drive)
            r = subprocess.run(
                [sys.executable, "-c", CHILD, ckpt, how, drive], capture_output=True, text=True, env=env
            )
            if r.returncode != 0:
                raise SystemExit(r.stderr[-3000:])
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"checkpoint: {nbytes / 2**20:.0f} MiB of parameters")
    for row in rows:
        grew = (row["peak"] - row["base"]) / 2**20
        print(
            f"{row['how']:>7}: peak RSS {grew:.0f} MiB above the baseline (file-backed pages of the "
            f"mapped checkpoint included), peak anonymous memory {row['anon'] / 2**20:.0f} MiB above it"
        )
    mem, init = (r["anon"] for r in rows)
    print(f"peak anonymous memory, under Init / in memory: {init / mem:.2f}")
    if args.json:
        largest = max(args.vocab, 1024, 4 * args.width) * args.width  # CHILD's buffer_size (n_positions 1024)
        out = {"param_bytes": nbytes, "buffer_count": 5, "buffer_bytes": 4 * largest, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
