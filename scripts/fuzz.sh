#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, clang-14, ASan+UBSan) and runs
# each for a while over a copy of its seed corpus.
#
#   scripts/fuzz.sh [--seconds N] [TARGET...]    default: 60 s, every target
#   MLAKV_FUZZ_BUILD_DIR=dir                     default build-fuzz; CI passes
#                                                build-asan (the same configuration)
#
# The tree's corpus (tests/fuzz/corpus/<target>/) is only read: each run
# works in <build>/fuzz-runs/<target>/ (corpus copy, new inputs, crashes),
# emptied first. Each target runs with the -max_len and -rss_limit_mb that
# tests/fuzz/CMakeLists.txt gives it, and with tests/fuzz/<target>.dict as
# its dictionary when there is one. Targets run side by side, up to one
# per core. Exit status non-zero if any target crashed (or leaked, hit the
# memory limit, or an input took over 10 s); its reproducer's path is printed,
# with the command that replays it. A reproducer becomes a regression test in
# the normal suite and a file in the tree's corpus (tests/fuzz/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=scripts/clang_build.sh
source scripts/clang_build.sh

seconds=60
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=${2:?--seconds needs a number}; shift 2 ;;
    --seconds=*) seconds=${1#--seconds=}; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    -*) echo "fuzz: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[[ "$seconds" =~ ^[0-9]+$ ]] || { echo "fuzz: --seconds $seconds is not a number" >&2; exit 2; }

dir=${MLAKV_FUZZ_BUILD_DIR:-build-fuzz}
mlakv_clang_configure "$dir" address
list="$dir/tests/fuzz/fuzz_targets.txt"
known=$(awk '!/^#/ {print $1}' "$list")
[ ${#targets[@]} -gt 0 ] || read -r -a targets <<<"$(echo $known)"
for t in "${targets[@]}"; do
  grep -qx "$t" <<<"$known" || { echo "fuzz: no target $t (targets: $(echo $known))" >&2; exit 2; }
done
ninja -C "$dir" "${targets[@]}"

export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export LSAN_OPTIONS="suppressions=$root/tests/sanitize/lsan.supp:print_suppressions=0"

# One target: its own folder, its own log; libFuzzer's exit status in rc.
run_one() {
  local t=$1 max_len=$2 rss=$3
  local work="$dir/fuzz-runs/$t" rc=0 dict=()
  [ -f "$root/tests/fuzz/$t.dict" ] && dict=(-dict="$root/tests/fuzz/$t.dict")
  "$dir/tests/fuzz/$t" -max_total_time="$seconds" -max_len="$max_len" -rss_limit_mb="$rss" -timeout=10 \
    "${dict[@]}" -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" >"$work/log" 2>&1 || rc=$?
  echo "$rc" >"$work/rc"
}

for t in "${targets[@]}"; do
  work="$dir/fuzz-runs/$t"
  rm -rf "$work"
  mkdir -p "$work/corpus" "$work/artifacts"
  cp -R "$root/tests/fuzz/corpus/$t/." "$work/corpus/"
  read -r _ max_len rss < <(awk -v t="$t" '$1 == t' "$list")
  while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do wait -n || true; done
  echo "fuzz: $t for ${seconds} s (max_len $max_len, rss_limit_mb $rss)"
  run_one "$t" "$max_len" "$rss" &
done
wait

failed=0
for t in "${targets[@]}"; do
  work="$dir/fuzz-runs/$t"
  if [ "$(cat "$work/rc")" = 0 ]; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log")
    echo "fuzz: $t: no crash in ${runs:-?} runs ($(ls "$work/corpus" | wc -l) inputs in $work/corpus)"
  else
    failed=1
    echo "fuzz: $t FAILED; its log, $work/log, ends:" >&2
    tail -n 40 "$work/log" >&2
    for r in "$work"/artifacts/*; do
      [ -e "$r" ] || continue
      echo "fuzz: reproducer: $(cd "$(dirname "$r")" && pwd)/$(basename "$r")" >&2
      echo "fuzz:   replay:   $dir/tests/fuzz/$t $r" >&2
    done
  fi
done
exit $failed
