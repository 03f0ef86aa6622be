#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every test that this machine can run.
# Without a visible GPU the tests labelled `gpu` are left out of the run (and
# said so), so that ctest's closing line counts only tests that really ran;
# run by hand, each of them skips itself with the reason. Exit status is ctest's.
#   scripts/test.sh [ctest args...]     e.g. -L e2e, -R Vector
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${MLAKV_BUILD_DIR:-build}
cd "$build"
args=(--output-on-failure --timeout 900 -j2)
if ! nvidia-smi -L >/dev/null 2>&1; then
  gpu_tests=$(ctest -N -L gpu | sed -n 's/^Total Tests: //p')
  echo "test: no GPU visible: the ${gpu_tests:-0} tests labelled gpu are not run here (run them on the GPU machine)"
  args+=(-LE gpu)
elif [ "$(nvidia-smi -L | grep -c '^GPU')" -lt 2 ]; then
  multi_tests=$(ctest -N -L multigpu | sed -n 's/^Total Tests: //p')
  echo "test: one GPU visible: the ${multi_tests:-0} tests labelled multigpu skip themselves (they need two)"
fi
ctest "${args[@]}" "$@"
