#!/usr/bin/env bash
# Bundles what bench/run_aims.sh needs on a GPU machine that has the NVIDIA
# driver and nothing else of the stack (no gRPC, abseil, protobuf): the
# server, the CLI, the benchmarks and the GPU test programs from build/,
# every shared library they load (scripts/collect_runtime_libs.sh), the
# test vectors and the Python client's generated stubs, as one
# .devrt/bundle.tar.xz (git-ignored). Send .devrt with the working tree and
# run `bench/run_aims.sh` there; it unpacks the bundle.
#   scripts/device_bundle.sh                    from build/
#   MLAKV_BUILD_DIR=dir scripts/device_bundle.sh
#   MLAKV_PREV_SERVER=path scripts/device_bundle.sh   also an older server
#       build, as bin/mlakv-server-prev, for a same-run A/B (AB_SERVERS)
#   MLAKV_VECTORS_DIR=dir   where the kernel's test vectors are
#       (default ../shared/vectors, as tests/CMakeLists.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${MLAKV_BUILD_DIR:-build}
vectors=${MLAKV_VECTORS_DIR:-../shared/vectors}

programs=(
  server/mlakv-server
  client/mlakv
  bench/rpc_floor_bench
  bench/ipc_append_bench
  bench/quantize_append_bench
  bench/append_host_bench
  bench/backend_append_bench
  tests/quantize_append_cuda_test
  tests/quantize_cli_cuda_test
  tests/server/backend/cuda_backend_test
  tests/server/rpc/service_cuda_test
  tests/server/rpc/service_cuda_regions_test
  tests/server/rpc/cache_service_cuda_test
  tests/server/rpc/cuda_ipc_producer
  tests/server/rpc/gpu_device_test
  tests/server/rpc/multi_gpu_test
  tests/e2e/mlakv_e2e_test
)

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
for p in "${programs[@]}"; do
  [ -x "$build/$p" ] || { echo "device_bundle: $build/$p is not built (ninja -C $build)" >&2; exit 1; }
  cp -L "$build/$p" "$stage/bin/"
done
if [ -n "${MLAKV_PREV_SERVER:-}" ]; then
  cp -L "$MLAKV_PREV_SERVER" "$stage/bin/mlakv-server-prev"
fi
scripts/collect_runtime_libs.sh "$stage/lib" "$stage"/bin/* >/dev/null
[ -d "$vectors" ] || { echo "device_bundle: no test vectors at $vectors (MLAKV_VECTORS_DIR)" >&2; exit 1; }
cp -r "$vectors" "$stage/vectors"
[ -d "$build/client/python/gen" ] && cp -r "$build/client/python/gen" "$stage/gen"
cat > "$stage/env" <<'ENV'
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$here/bin:$PATH"
export MLAKV_VECTORS_DIR="$here/vectors"
export MLAKV_CUDA_IPC_PRODUCER="$here/bin/cuda_ipc_producer"
export MLAKV_PY_GEN="$here/gen"
export MLAKV_SERVER_BINARY="$here/bin/mlakv-server" MLAKV_CLI_BINARY="$here/bin/mlakv" MLAKV_CLI="$here/bin/mlakv"
ENV
git describe --always --dirty > "$stage/commit" 2>/dev/null || true
mkdir -p .devrt
tar cJf .devrt/bundle.tar.xz -C "$stage" .
echo "device_bundle: .devrt/bundle.tar.xz $(du -h .devrt/bundle.tar.xz | cut -f1) ($(cat "$stage/commit" 2>/dev/null))"
