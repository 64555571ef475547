#!/usr/bin/env bash
# Builds the C++ unit tests (tests/cpp) against csrc/core -- no Python, no
# pybind11 -- and runs them. The test binary prints "N passed, M failed" and
# exits non-zero on any failure.
#
#   bash scripts/cpp_tests.sh [--sanitize] [--build-dir DIR]
#
# --sanitize builds with AddressSanitizer + UndefinedBehaviorSanitizer and makes
# every report fatal (scripts/sanitize.sh). CXX picks the compiler (g++),
# JOBS the parallel compiles (2).
set -euo pipefail
cd "$(dirname "$0")/.."

sanitize=0
build=""
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize) sanitize=1 ;;
    --build-dir) build="$2"; shift ;;
    *) echo "usage: $0 [--sanitize] [--build-dir DIR]" >&2; exit 2 ;;
  esac
  shift
done

CXX="${CXX:-g++}"
# Warnings are errors here (CI runs this): the core and its tests stay
# -Wall -Wextra clean. -ffp-contract=off as in setup.py: the CPU Adam kernel
# must round exactly as torch does (csrc/core/cpu_adam.h).
flags=(-std=c++17 -pthread -Wall -Wextra -Werror -ffp-contract=off -Icsrc/core -Itests/cpp)
if [ "$sanitize" = 1 ]; then
  build="${build:-build/sanitize}"
  flags+=(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all -g -O1)
else
  build="${build:-build/cpp-tests}"
  flags+=(-O1 -g)
fi
mkdir -p "$build/obj"

# Every core source (new files are picked up) and every test source.
mapfile -t sources < <(ls csrc/core/*.cpp tests/cpp/*.cpp)
objects=()
for src in "${sources[@]}"; do objects+=("$build/obj/$(echo "$src" | tr / _).o"); done

export CXX
# Compile in parallel; any failing compile fails the script.
printf '%s\n' "${sources[@]}" | paste -d' ' - <(printf '%s\n' "${objects[@]}") |
  FLAGS="${flags[*]}" xargs -P "${JOBS:-2}" -L 1 bash -c '"$CXX" $FLAGS -c "$0" -o "$1"'
"$CXX" "${flags[@]}" "${objects[@]}" -o "$build/test_core"

if [ "$sanitize" = 1 ]; then
  # Any report aborts the run with a non-zero status.
  export ASAN_OPTIONS="abort_on_error=1:halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1:${ASAN_OPTIONS:-}"
  export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1:${UBSAN_OPTIONS:-}"
fi
echo "running $build/test_core ($([ "$sanitize" = 1 ] && echo 'ASan+UBSan' || echo 'plain'))"
"$build/test_core"
