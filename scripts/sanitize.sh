#!/usr/bin/env bash
# The C++ core and its unit tests under AddressSanitizer + UndefinedBehavior-
# Sanitizer (-fno-sanitize-recover=all, reports fatal). Exits non-zero on any
# failed test or any sanitizer report. Build output goes to build/sanitize.
set -euo pipefail
exec bash "$(dirname "$0")/cpp_tests.sh" --sanitize "$@"
