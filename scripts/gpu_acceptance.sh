#!/usr/bin/env bash
# GPU acceptance: everything a lent GPU machine must run for aio, written to
# one markdown report ($GPU_REPORT, else $OUT/gpu_report.md when $OUT is set,
# else ./gpu_report.md; full logs beside it in gpu_logs/).
#
#   bash scripts/gpu_acceptance.sh [STEP ...]     STEP: tests sanitizer stress deepspeed bench all
#
# Steps, each part under its own `timeout` (GPU_ACC_LIMIT_<STEP>=seconds
# overrides a step's main part):
#   tests      aio-check --gpu (60 s), then pytest -k cuda (210 s): tests marked
#              `cuda` or named *cuda* (some CUDA tests are only skipif'ed)
#   sanitizer  the same under TORCH_CUDA_SANITIZER=1 (90 s + 240 s)
#   stress     scripts/gpu_stress.py: delayed copies, lagging compute, poisoned
#              recycled buffers; losses bit-identical (150 s)
#   deepspeed  DeepSpeed's handle cases on aio's op (and on DeepSpeed's own op
#              when libaio.h is there): the CUDA-tensor ones (120 s), then all
#              (60 s); then DeepSpeed's ZeRO-3 NVMe swappers under aio's
#              rules on CUDA (180 s); skipped without deepspeed
#   bench      bench/train_step.py --cuda, the 277M GPT of shared/GPU.md (420 s)
# `all` (the default) runs them in that order, at most 25.5 minutes; one device
# command may run 10 minutes, so there run them as four calls:
#   bash scripts/gpu_acceptance.sh tests stress          # <= 7 min
#   bash scripts/gpu_acceptance.sh sanitizer             # <= 5.5 min
#   bash scripts/gpu_acceptance.sh deepspeed             # <= 6 min
#   bash scripts/gpu_acceptance.sh bench                 # <= 7 min
# Each call writes its own report. Exit status: 0 every step passed or was
# skipped, 1 a step failed or ran out of time, 2 a bad argument, 77 no CUDA.
#
# Set-up (shared/GPU.md's recipe; docs/gpu.md explains it). Once, on a machine
# with internet, in the repo root:
#   printf '/.whl/\n/.deb/\n' >> .git/info/exclude; mkdir -p .whl .deb
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl pydantic==2.13.4 pydantic_core==2.46.4 \
#     annotated_types typing_inspection typing_extensions hjson
#   DS_BUILD_OPS=0 python3 -m pip wheel --no-deps -w .whl deepspeed==0.19.8   # optional, with:
#   python3 -m pip download (the same flags) -d .whl ninja py-cpuinfo msgpack einops nvidia-ml-py
#   (cd .deb && apt-get download libaio1 libaio-dev)    # optional; maybe libaio1t64
# On the GPU machine (carry .whl and .deb); this script does these itself when
# needed (GPU_ACC_SETUP=0: it does not):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   for f in .deb/*.deb; do dpkg -x $f /; done; ldconfig
#   python3 -m pip install -q --no-deps --no-build-isolation -e .
#   export TORCH_CUDA_ARCH_LIST=9.0   # DeepSpeed's JIT fails on '9.0a' otherwise
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
ALL_STEPS=(tests sanitizer stress deepspeed bench)

usage() {
  echo "gpu_acceptance: error: $1 (usage: scripts/gpu_acceptance.sh [tests|sanitizer|stress|deepspeed|bench|all] ...)" >&2
  exit 2
}

steps=()
for a in "$@"; do
  case "$a" in
    all) steps+=("${ALL_STEPS[@]}") ;;
    tests | sanitizer | stress | deepspeed | bench) steps+=("$a") ;;
    -h | --help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) usage "unknown step '$a'" ;;
  esac
done
[ ${#steps[@]} -gt 0 ] || steps=("${ALL_STEPS[@]}")

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  echo "gpu_acceptance: no CUDA device (torch missing or torch.cuda.is_available() is False); nothing to run"
  exit 77
fi

REPORT="${GPU_REPORT:-${OUT:+$OUT/}gpu_report.md}"
LOGS="$(dirname "$REPORT")/gpu_logs"
mkdir -p "$LOGS"
SCRATCH="$(mktemp -d "${GPU_ACC_DIR:-${TMPDIR:-/tmp}}/aio-gpu-acc-XXXXXX")"
SECTIONS="$(mktemp)"
SUMMARY="$(mktemp)"
trap 'rm -rf "$SCRATCH" "$SECTIONS" "$SUMMARY"' EXIT
failed=0

# -- set-up -------------------------------------------------------------------------------------
setup_log="$LOGS/setup.log"
: >"$setup_log"
say() { echo "$*" | tee -a "$setup_log"; }
prepare() {
  [ "${GPU_ACC_SETUP:-1}" = 0 ] && { say "# set-up skipped (GPU_ACC_SETUP=0)"; return 0; }
  [ -d /tmp/site ] && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c 'import pydantic' 2>/dev/null; then
    say "# $PY -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >>"$setup_log" 2>&1 || say "# (pip install of .whl failed, see gpu_logs/setup.log)"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if compgen -G ".deb/*.deb" >/dev/null && [ ! -e /usr/include/libaio.h ] && [ "$(id -u)" = 0 ]; then
    say "# for f in .deb/*.deb; do dpkg -x \$f /; done; ldconfig"
    for f in .deb/*.deb; do dpkg -x "$f" / >>"$setup_log" 2>&1; done
    ldconfig >>"$setup_log" 2>&1
  fi
  if ! "$PY" -c 'import aio._C' 2>/dev/null; then
    say "# $PY -m pip install --no-deps --no-build-isolation -e .   (builds aio's extension)"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$setup_log" 2>&1 ||
      say "# (pip install -e . failed, see gpu_logs/setup.log)"
  fi
  if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
    export TORCH_CUDA_ARCH_LIST
  fi
  say "# PYTHONPATH=${PYTHONPATH:-} TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
}

# -- running and recording a step --------------------------------------------------------------
# run_part STEP LABEL LIMIT CMD...: run CMD under `timeout`, log it, add a report section.
run_part() {
  local step="$1" label="$2" limit="$3"
  shift 3
  local name="$step-$label" t0 rc status cmd
  local log="$LOGS/${name//[^A-Za-z0-9._-]/_}.log"
  cmd="$(printf '%q ' "$@")"
  cmd="${cmd% }"
  echo "== $step: $label (limit ${limit}s): $cmd"
  t0=$(date +%s)
  timeout --kill-after=30 "$limit" "$@" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status=PASS ;;
    124 | 137) status="TIMEOUT (${limit} s)" ;;
    *) status="FAIL (exit $rc)" ;;
  esac
  [ $rc -eq 0 ] || failed=1
  local dt=$(($(date +%s) - t0))
  tail -n 5 "$log"
  echo "== $step: $label: $status in ${dt}s"
  echo "| $step | $label | $status | $dt |" >>"$SUMMARY"
  {
    echo "### $step: $label"
    echo
    echo "\`$cmd\` -- **$status**, ${dt} s (limit ${limit} s), log \`gpu_logs/$(basename "$log")\`"
    echo
    echo '```text'
    tail -n "${GPU_ACC_TAIL:-120}" "$log"
    echo '```'
    echo
  } >>"$SECTIONS"
}

note() { # note STEP LABEL TEXT: a skipped part, with the reason
  echo "== $1: $2: $3"
  echo "| $1 | $2 | SKIP: $3 | 0 |" >>"$SUMMARY"
  printf '### %s: %s\n\nSkipped: %s\n\n' "$1" "$2" "$3" >>"$SECTIONS"
}

limit() { local v="GPU_ACC_LIMIT_${1^^}"; echo "${!v:-$2}"; }

step_tests() {
  # AIO_GPU_FIGURES: tests that measure (tests/fsdp/test_cuda_rank.py) leave their figures there.
  local env=(env AIO_GPU_FIGURES="$LOGS") step=tests
  if [ "${1:-}" = sanitizer ]; then env+=(TORCH_CUDA_SANITIZER=1); step=sanitizer; fi
  local lim
  lim=$(limit "$step" "$([ $step = tests ] && echo 210 || echo 240)")
  run_part "$step" "aio-check --gpu" "$([ $step = tests ] && echo 60 || echo 90)" "${env[@]}" "$PY" -m aio.quickcheck --gpu --dir "$SCRATCH"
  # DeepSpeed's swappers on CUDA start DeepSpeed six times: the deepspeed step runs them.
  run_part "$step" "pytest -k cuda" "$lim" "${env[@]}" "$PY" -m pytest -q -rs -p no:cacheprovider -k cuda tests \
    --deselect tests/integrations/test_ds_swappers_cuda.py
}

step_stress() {
  run_part stress "gpu_stress.py" "$(limit stress 150)" "$PY" scripts/gpu_stress.py --dir "$SCRATCH"
}

step_deepspeed() {
  if ! "$PY" -c 'import deepspeed' >/dev/null 2>&1; then
    note deepspeed "DeepSpeed handle cases" "deepspeed is not importable (carry its wheel in .whl/, docs/gpu.md)"
    return
  fi
  local env=(env) which="aio's op"
  if [ -e /usr/include/libaio.h ]; then
    env=(env AIO_TEST_DS_OP=1)
    which="aio's op and DeepSpeed's own (JIT-built)"
  else
    echo "== deepspeed: no libaio.h: DeepSpeed's own op not compared (carry libaio-dev in .deb/)"
  fi
  run_part deepspeed "CUDA-tensor cases, $which" "$(limit deepspeed 120)" "${env[@]}" "$PY" -m pytest -v -rs -p no:cacheprovider \
    tests/integrations/test_deepspeed_op_parity.py -k "cuda or device"
  run_part deepspeed "all handle cases, $which" 60 "${env[@]}" "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/integrations/test_deepspeed_op_parity.py tests/integrations/test_deepspeed_handle.py
  # Issue 43 item 6: aio's buffer rules in DeepSpeed's ZeRO-3 NVMe swappers, on CUDA.
  run_part deepspeed "ZeRO-3 NVMe swappers on CUDA (1 rank)" "$(limit ds_swappers 180)" \
    env AIO_GPU_FIGURES="$LOGS" "$PY" -m pytest -q -rs -p no:cacheprovider tests/integrations/test_ds_swappers_cuda.py
}

step_bench() {
  local flags=(--cuda --model gpt --width 1536 --layers 8 --vocab 32000 --seq 1024 --batch 8 --bf16)
  local missing=() f
  local help
  help="$("$PY" bench/train_step.py --help 2>&1)"
  for f in "${flags[@]}" --rounds --steps --warmup --dir --json; do
    [[ $f == --* ]] || continue
    grep -q -- "$f\b" <<<"$help" || missing+=("$f")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    note bench "277M GPT (shared/GPU.md table)" "bench/train_step.py lacks ${missing[*]}"
    return
  fi
  run_part bench "277M GPT (shared/GPU.md table)" "$(limit bench 420)" "$PY" bench/train_step.py "${flags[@]}" \
    --rounds "${GPU_ACC_BENCH_ROUNDS:-1}" --steps "${GPU_ACC_BENCH_STEPS:-3}" --warmup 1 \
    --dir "$SCRATCH" --json "$LOGS/bench_277m.json"
}

# -- main ---------------------------------------------------------------------------------------
sed -n '/^# Set-up/,/^# *export TORCH_CUDA_ARCH_LIST/p' "$0" | tee -a "$setup_log" # the recipe, as a comment header
prepare
for s in "${steps[@]}"; do
  case "$s" in
    tests) step_tests ;;
    sanitizer) step_tests sanitizer ;;
    stress) step_stress ;;
    deepspeed) step_deepspeed ;;
    bench) step_bench ;;
  esac
done

{
  echo "# aio GPU acceptance report"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); host: $(hostname)"
  echo "- GPU: $(nvidia-smi -L 2>/dev/null | head -n 1 || echo '?')"
  echo "- $("$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")' 2>&1)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$([ -n "$(git status --porcelain 2>/dev/null)" ] && echo ' (+ uncommitted changes)')"
  echo "- steps: ${steps[*]}; result: $([ $failed = 0 ] && echo PASS || echo FAIL)"
  echo
  echo "## Set-up"
  echo
  echo '```text'
  cat "$setup_log"
  echo '```'
  echo
  echo "## Summary"
  echo
  echo "| step | part | status | seconds |"
  echo "|---|---|---|---|"
  cat "$SUMMARY"
  echo
  echo "## Steps"
  echo
  cat "$SECTIONS"
} >"$REPORT"
echo "gpu_acceptance: $([ $failed = 0 ] && echo PASS || echo FAIL); report: $REPORT"
exit $failed
