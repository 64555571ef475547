"""Run a training script with DeepSpeed's async I/O served by aio (no code change).

python -m aio.run train.py --deepspeed ds_config.json
torchrun --nproc-per-node 2 -m aio.run train.py ...
deepspeed --module aio.run train.py ...
python -m aio.run -m my_package.train ...      # a module instead of a file
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str] | None = None) -> int:
    """Enable the DeepSpeed integration, then run the script (or ``-m`` module) in `argv`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    from .integrations.deepspeed import enable

    enable()
    if args[0] == "-m":
        if len(args) < 2:
            print("aio.run: -m needs a module name", file=sys.stderr)
            return 2
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
