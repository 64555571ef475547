#!/usr/bin/env bash
# The suite's torch-sensitive part on a second torch (issue 24: aio must not
# pin the user's torch, so CI runs beside the default one).
#
#   bash scripts/second_torch.sh install DIR   # unpack torch + its CUDA libs into DIR
#   bash scripts/second_torch.sh test DIR      # run TESTS with DIR's torch first on sys.path
#
# No venv: DIR is a `pip install --target` folder put in front of sys.path
# (PYTHONPATH), so every other package (and the aio extension, which does
# not link libtorch) is the environment's own. Only torch and the shared
# libraries its import loads are unpacked, --no-deps: the full resolution
# adds triton and the CUDA compiler wheels (5.5 GB, 4.5 min here) where
# this takes ~45 s. The CUDA build runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VERSION="${AIO_SECOND_TORCH:-2.14.1}"

# What torch 2.14.1+cu130's libraries link (ldd torch/lib/*.so), pinned to
# the versions its metadata admits that lie on this machine's local index.
CUDA_LIBS=(
  nvidia-cublas==13.1.1.3 nvidia-cuda-cupti==13.0.85 nvidia-cuda-nvrtc==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cudnn-cu13==9.24.0.43 nvidia-cufft==12.0.0.61
  nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35 nvidia-cusolver==12.0.4.66
  nvidia-cusparse==12.6.3.3 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7
  nvidia-nvjitlink==13.4.92 nvidia-nvshmem-cu13==3.4.5 nvidia-nvtx==13.0.85
)

# Where the torch APIs aio uses live (pyproject's lower bound names them):
# the CUDA simulator (dispatch modes, streams, events), optimizer param
# groups and LR schedulers, GradScaler and autocast, checkpoints
# (torch.load with safe_globals), module hooks and CUDA streams, FSDP2 /
# FSDP1 / DDP / DCP under aio.optim (tests/optim), a stored parameter's
# class and torch function dispatch (tests/zero/test_stored_param.py), and
# aio.fsdp's parameter tier, which reaches into FSDP2's groups and storage
# (its 2- and 3-rank cases and FSDP2's kept communication buffers:
# aio.fsdp.SUPPORTED names only the torch releases CI runs these on). The
# rest of the suite runs once, on the default torch (CI time: each file here
# costs a second worker's torch import and its tests again).
TESTS=(
  tests/zero/test_cuda_sim.py tests/zero/test_param_groups.py tests/zero/test_scaler.py
  tests/zero/test_checkpoint.py tests/zero/test_hooks.py tests/zero/test_streams.py
  tests/optim/test_distributed.py tests/optim/test_nvme_adamw.py
  tests/zero/test_stored_param.py tests/test_rss_estimate.py
  tests/fsdp/test_param_tier.py tests/fsdp/test_comm_buffers.py
)

install() {
  local dir="$1"
  rm -rf "$dir"
  # Compiled to bytecode as it is unpacked (~8 s of one core): else every
  # process of the tests compiles the torch modules it imports from source
  # (measured: import torch 3.0 -> 1.5 s of CPU, CUDA build).
  "$PY" -m pip install -q --no-deps --target "$dir" "torch==${VERSION}" "${CUDA_LIBS[@]}"
  echo "second torch: $(PYTHONPATH="$dir" "$PY" -c 'import torch; print(torch.__version__)') in $dir"
}

run_tests() {
  local dir="$1"
  shift
  # AIO_EXPECT_TORCH makes tests/conftest.py refuse to run on any other torch,
  # so a broken PYTHONPATH cannot pass as a second-torch run.
  PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" AIO_EXPECT_TORCH="$VERSION" \
    "$PY" -m pytest -q -n 2 -p no:cacheprovider "$@" "${TESTS[@]}"
}

case "${1:-}" in
  install) install "${2:?usage: $0 install DIR}" ;;
  test) run_tests "${2:?usage: $0 test DIR [pytest args]}" "${@:3}" ;;
  *)
    echo "usage: $0 install DIR | test DIR [pytest args]" >&2
    exit 2
    ;;
esac
