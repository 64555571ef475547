"""``aio-export CHECKPOINT_DIR OUT_DIR``: the model weights of an aio.zero
checkpoint as safetensors shards, streamed one tensor at a time, without
building the model (see :mod:`aio.zero.export`)."""

from __future__ import annotations

import argparse
import sys
import time

from .._cli import CliParser, run_cli


def build_parser() -> argparse.ArgumentParser:
    """The ``aio-export`` argument parser."""
    p = CliParser(
        prog="aio-export",
        description=(
            "Write the model weights of a checkpoint saved by an aio.zero trainer "
            "(engine.save_checkpoint) as safetensors shards in Hugging Face's layout, one "
            "tensor at a time: from_pretrained(OUT_DIR) loads a transformers model, "
            "safetensors.torch.load_file any other."
        ),
    )
    p.add_argument(
        "checkpoint", metavar="CHECKPOINT_DIR", help="the save_checkpoint() folder, or one checkpoint in it"
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="where the shards go (created if missing)")
    p.add_argument("--tag", help="the checkpoint to export (default: the one 'latest' names)")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        help="floating-point tensors in this dtype (default: the training dtype)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MiB (default 5GB)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


class _Progress:
    """Progress lines on stderr at every tenth of the bytes, and a summary."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.start = time.monotonic()
        self.next = 0.1
        self.total = 0

    def __call__(self, done: int, total: int) -> None:
        self.total = total
        if self.quiet or total == 0 or done < self.next * total:
            return
        while self.next * total <= done:
            self.next += 0.1
        rate = done / max(time.monotonic() - self.start, 1e-9) / 1e9
        print(f"aio-export: {done / 2**30:.2f} of {total / 2**30:.2f} GiB ({rate:.2f} GB/s)", file=sys.stderr)


def _run(a: argparse.Namespace) -> int:
    from .export import export_checkpoint

    progress = _Progress(a.quiet)
    files = export_checkpoint(a.checkpoint, a.out_dir, a.tag, a.dtype, a.max_shard_size, progress)
    secs = time.monotonic() - progress.start
    print(
        f"aio-export: wrote {len(files)} file(s), {progress.total / 2**30:.2f} GiB of weights, "
        f"to {a.out_dir} in {secs:.1f} s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``aio-export`` on `argv` (default: ``sys.argv[1:]``); returns the exit
    status: 0 when written, 2 for a bad checkpoint or argument, 130 when
    interrupted (nothing of the export is left in OUT_DIR then)."""
    a = build_parser().parse_args(argv)
    return run_cli("aio-export", lambda: _run(a), on_interrupt="nothing was renamed into place")


if __name__ == "__main__":
    sys.exit(main())
