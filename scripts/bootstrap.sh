#!/usr/bin/env bash
# Installs aio and everything it needs into the current Python environment.
# torch is installed only when missing, pinned to the CPU build that is
# available locally here (any other spec would pull gigabytes of CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: torch is missing: installing torch==2.13.0 (the CPU build available here)"
  "$PY" -m pip install -q torch==2.13.0
else
  echo "bootstrap: keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi
extras="${AIO_EXTRAS:-test}"
echo "bootstrap: pip install -e .[${extras}] (builds aio._C; adds numpy, psutil, pydantic and the ${extras} extra)"
"$PY" -m pip install -q -e ".[${extras}]"
echo "bootstrap: torch $("$PY" -c 'import torch; print(torch.__version__)') after the install"
