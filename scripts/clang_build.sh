# Sourced by scripts/sanitize.sh and scripts/fuzz.sh: configures a clang-14
# sanitizer build folder, the same way for both, so that the fuzz build and
# the ASan build are one configuration (ccache shares their objects, and CI
# builds the ASan folder once and fuzzes from it).
#
#   mlakv_clang_configure DIR address   ASan+UBSan, with the fuzz targets
#   mlakv_clang_configure DIR thread    TSan
#
# -O1 with line tables (cmake/sanitizers.cmake adds -gline-tables-only): the
# usual sanitizer trade of speed against stacks a person can read. CUDA keeps
# Release's flags so that nvcc's objects are the normal build's (ccache hits).

mlakv_require_clang() {
  local missing=()
  for tool in clang-14 clang++-14; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  if [ ${#missing[@]} -eq 0 ]; then
    local rt
    rt=$(clang++-14 -print-runtime-dir)
    for lib in asan fuzzer tsan ubsan_standalone; do
      [ -e "$rt/libclang_rt.$lib-x86_64.a" ] || { missing+=(libclang-rt-14-dev); break; }
    done
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "${0##*/}: missing ${missing[*]} (scripts/install_deps.sh installs them)" >&2
    return 1
  fi
  # Reports with file:line need the symbolizer (package llvm-14, which clang-14 pulls in).
  if [ -z "${ASAN_SYMBOLIZER_PATH:-}" ] && [ -x /usr/lib/llvm-14/bin/llvm-symbolizer ]; then
    export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
  fi
}

mlakv_clang_configure() {
  local dir=$1 mode=$2
  mlakv_require_clang || return 1
  # ccache hits across folders and clones: paths relative to the checkout.
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
  local mode_args=()
  case "$mode" in
    address) mode_args=(-DMLAKV_SANITIZE=address -DMLAKV_FUZZ=ON) ;;
    thread) mode_args=(-DMLAKV_SANITIZE=thread -DMLAKV_FUZZ=OFF) ;;
    *) echo "mlakv_clang_configure: mode $mode: expected address or thread" >&2; return 2 ;;
  esac
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
    -DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 \
    "-DCMAKE_CUDA_FLAGS_RELWITHDEBINFO=-O3 -DNDEBUG" \
    "${mode_args[@]}" >/dev/null
}

# Runs "$@", then prints how long it took under the label $1 (shifted off).
mlakv_timed() {
  local label=$1; shift
  local start=$SECONDS rc=0
  "$@" || rc=$?
  echo "time: $label: $((SECONDS - start)) s (exit $rc)"
  return $rc
}
