#!/usr/bin/env bash
# Installs aio and everything it needs into the current Python environment.
# torch is installed only when missing, pinned to the CPU build that is
# available locally here (any other spec would pull gigabytes of CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q torch==2.13.0
fi
extras="${AIO_EXTRAS:-test}"
"$PY" -m pip install -q -e ".[${extras}]"
