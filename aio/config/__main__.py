"""aio-config: validate a config, or estimate its memory before training.

aio-config validate ds_config.json
aio-config estimate ds_config.json --params 7e9 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import sys

from .load import ConfigError, load_config
from .memory import estimate_memory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="aio-config", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check a DeepSpeed-format config")
    v.add_argument("config")
    e = sub.add_parser("estimate", help="pinned memory and drive space for a model size")
    e.add_argument("config")
    e.add_argument("--params", required=True, type=float, help="parameters per process, e.g. 7e9")
    e.add_argument("--dtype", default="fp16")
    e.add_argument("--optimizer-states", type=int, default=2)
    e.add_argument("--json", action="store_true", help="print JSON")
    e.add_argument("--check", action="store_true", help="compare with this machine; exit 1 if short")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "validate":
            cfg = load_config(a.config)
            print(json.dumps(cfg.model_dump(mode="json", exclude_none=True), indent=2))
            print("config OK", file=sys.stderr)
            return 0
        est = estimate_memory(a.config, a.params, a.dtype, a.optimizer_states)
    except (ConfigError, ValueError, TypeError) as err:
        print(f"aio-config: {err}", file=sys.stderr)
        return 2
    print(json.dumps(est.as_dict(), indent=2) if a.json else est.format())
    if a.check:
        problems = est.check()
        for p in problems:
            print(f"WARNING: {p}", file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
