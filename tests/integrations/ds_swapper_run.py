"""Launch ds_swapper_train.py on 1-3 local gloo ranks (used by
test_ds_swappers.py; also by hand: ``python ds_swapper_run.py CASES.json
WORLD OUTDIR`` prints each case's losses, error and counters)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ds_swapper_train.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    workdir: Path, cases: list[dict[str, Any]], world: int, timeout: float = 600, env: dict | None = None
) -> list[dict[str, Any]]:
    """Run `cases` on `world` ranks; each rank's records (name -> record),
    with its stderr under "_stderr". Raises if a rank exits non-zero."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "cases.json"
    spec.write_text(json.dumps(cases))
    port = str(_port())
    procs = []
    for rank in range(world):
        rank_env = dict(
            os.environ,
            DS_ACCELERATOR="cpu",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
            **(env or {}),
        )
        out = workdir / f"rank{rank}.json"
        cmd = [sys.executable, SCRIPT, str(spec), str(out)]
        # Output to files, not pipes: a rank blocked on a full pipe (DeepSpeed
        # warns at every reduce-scatter) stalls the others in a collective.
        with open(workdir / f"rank{rank}.log", "w") as log:
            p = subprocess.Popen(
                cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        procs.append((p, out))
    try:
        for p, _ in procs:
            p.wait(timeout=timeout)
    finally:
        for p, _ in procs:  # a rank cut off must not go on in the background
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = [(workdir / f"rank{rank}.log").read_text(errors="replace") for rank in range(world)]
    failed = [(rank, p.returncode, logs[rank]) for rank, (p, _) in enumerate(procs) if p.returncode]
    if failed:
        raise AssertionError(
            "\n".join(f"rank {rank} exited {rc}:\n{stderr[-6000:]}" for rank, rc, stderr in failed)
        )
    return [dict(json.loads(out.read_text()), _stderr=log) for (_, out), log in zip(procs, logs, strict=True)]


def main() -> int:
    """Run CASES.json on WORLD ranks in OUTDIR; print one line per case and rank."""
    cases = json.loads(Path(sys.argv[1]).read_text())
    results = run_ranks(Path(sys.argv[3]), cases, int(sys.argv[2]))
    for rank, res in enumerate(results):
        for name, r in res.items():
            if name.startswith("_"):
                continue
            print(
                rank,
                name,
                r["losses"],
                r["error"] and r["error"][:200],
                r.get("where"),
                f"{r['seconds']:.1f}s",
            )
            print("   ", {k: v for k, v in {**r["param_counters"], **r["optimizer_counters"]}.items() if v})
    return 0


if __name__ == "__main__":
    sys.exit(main())
