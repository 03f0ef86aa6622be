#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every test that this machine can run:
# all ctest tests; GPU tests (label gpu) skip themselves, saying so, when no
# GPU is visible. Exit status is ctest's.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${MLAKV_BUILD_DIR:-build}
cd "$build"
ctest --output-on-failure --timeout 900 -j2 "$@"
