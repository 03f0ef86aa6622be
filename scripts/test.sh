#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every test that this machine can run,
# then the reliability steps: the ASan+UBSan build and its tests
# (scripts/sanitize.sh asan), the fuzz smoke (scripts/fuzz.sh, every target
# 60 s, from that same build), and the TSan build and its tests
# (scripts/sanitize.sh tsan). Each step prints its time; the exit status is
# non-zero if any step failed (every step runs regardless).
# Without a visible GPU the tests labelled `gpu` are left out of the run (and
# said so), so that ctest's closing line counts only tests that really ran;
# run by hand, each of them skips itself with the reason.
#   scripts/test.sh [ctest args...]     e.g. -L e2e, -R Vector (the normal ctest only)
#   MLAKV_QUICK=1 scripts/test.sh       the normal build and tests only (developers; CI never sets it)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/clang_build.sh
source scripts/clang_build.sh
# ccache hits across the build folders of one checkout (paths relative to it).
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
total_start=$SECONDS
mlakv_timed "setup (install, configure, build)" scripts/setup.sh
build=${MLAKV_BUILD_DIR:-build}
args=(--output-on-failure --timeout 900 -j2)
if ! nvidia-smi -L >/dev/null 2>&1; then
  gpu_tests=$(cd "$build" && ctest -N -L gpu | sed -n 's/^Total Tests: //p')
  echo "test: no GPU visible: the ${gpu_tests:-0} tests labelled gpu are not run here (run them on the GPU machine)"
  args+=(-LE gpu)
elif [ "$(nvidia-smi -L | grep -c '^GPU')" -lt 2 ]; then
  multi_tests=$(cd "$build" && ctest -N -L multigpu | sed -n 's/^Total Tests: //p')
  echo "test: one GPU visible: the ${multi_tests:-0} tests labelled multigpu skip themselves (they need two)"
fi
failed=()
run_ctest() { (cd "$build" && ctest "$@"); }
mlakv_timed "ctest" run_ctest "${args[@]}" "$@" || failed+=(ctest)

if [ "${MLAKV_QUICK:-0}" = 1 ]; then
  echo "test: MLAKV_QUICK=1: the ASan, fuzz and TSan steps are skipped"
else
  asan_dir=${MLAKV_ASAN_BUILD_DIR:-build-asan}
  mlakv_timed "ASan+UBSan build and ctest" scripts/sanitize.sh asan || failed+=(asan)
  # The ASan folder is configured as the fuzz build (scripts/clang_build.sh):
  # the targets are already built there.
  mlakv_timed "fuzz smoke (60 s per target)" env MLAKV_FUZZ_BUILD_DIR="$asan_dir" scripts/fuzz.sh --seconds 60 ||
    failed+=(fuzz)
  mlakv_timed "TSan build and ctest -L tsan" scripts/sanitize.sh tsan || failed+=(tsan)
fi

echo "time: total: $((SECONDS - total_start)) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "test: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "test: every step passed"
