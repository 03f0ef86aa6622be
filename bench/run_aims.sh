#!/usr/bin/env bash
# Measures the aims of issues 16 and 18 (docs/performance.md "Where the open
# aims stand") on a GPU machine in one call, with the bundle that
# scripts/device_bundle.sh wrote to .devrt/bundle.tar.xz.
#
#   OUT=dir bench/run_aims.sh [PART...]
#
# PARTs (default: suites floor ipc bytes save kernel), each writing
# OUT/PART.txt; then OUT/summary.txt (also printed): the gpu part and each
# aim against the figures measured (bench/aims_summary.py), and the servers'
# logs as OUT/logs.tar.xz -- eight files at most, what the device tool
# brings back:
#   gpu     the card, driver, cores, bundle commit
#   suites  every test ctest labels gpu: the kernel vectors byte-exact, the
#           cuda backend, the service on cuda pools and CUDA IPC regions, the
#           CLI end to end on cuda:0, the Python client's CUDA regions
#   client  the Python client's CUDA tests alone (suites runs them too)
#   floor   rpc_floor_bench: GetPool against a minimal sync server
#   ipc     ipc_append_bench against a running server: the 262k-row IPC
#           append over the kernel alone, one row, the decode step by
#           reference (PACKED / COMPACT / BASIC views), ROUNDS rounds; with
#           AB_SERVERS="mlakv-server-prev mlakv-server" the servers take turns
#   phases  the ipc part's 262k append and decode step against a server at
#           debug level: the medians of its per-call phases (host staging,
#           enqueue, synchronize, the kernel on the GPU's clock)
#   bytes   mlakv bench: the compact bytes decode step; ingest on one and on
#           eight connections
#   save    client/python/tests/cuda_save_test.py (needs torch there):
#           layer-wise save overhead and last layer -> commit; then
#           save_layer_bench.py: s.layer's host time by piece; with
#           SAVE_PYS="DIR DIR...", ROUNDS rounds of those packages in turn
#   kernel  quantize_append_bench: every case against the same run's copy
#   sweep   quantize_append_bench --sweep at 16,384 and 32,768 rows
# Environment: ROUNDS (3), AB_SERVERS (mlakv-server), SAVE_TOKENS
# (1024,4096,16384), SAVE_RUNS (7), SAVE_PY (client/python: the folder of
# the mlakv package the save part imports; another to time another
# version; SAVE_PYS: several, in turn), SAVE_COMMIT (call,end),
# SAVE_GROUPS (8: layers_per_message, comma-separated to compare),
# SAVE_LAYER_BENCH (1; 0 skips save_layer_bench.py), KERNEL_RUNS (2), DEVICE (cuda:0; cpu tries the bytes part's
# plumbing on a machine without a GPU), NUM_PAGES (8192).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?OUT must name the folder for the results}"
mkdir -p "$OUT"
rt=$(mktemp -d)
tar xJf .devrt/bundle.tar.xz -C "$rt" || { echo "run_aims: no .devrt/bundle.tar.xz (scripts/device_bundle.sh)" >&2; exit 1; }
# shellcheck disable=SC1091
source "$rt/env"
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(suites floor ipc bytes save kernel)
rounds=${ROUNDS:-3}
ab_servers=${AB_SERVERS:-mlakv-server}
port=50611

# One pool large enough for a 262,144-row sequence (4,096 pages) and the
# benches' sequences beside it: 8,192 pages x 61 layers x 22.5 KB = 11.3 GB.
cfg="$rt/aims.cfg"
cat > "$cfg" <<CFG
pools { name: "default" device: "${DEVICE:-cuda:0}" num_layers: 61 page_size: 64 num_pages: ${NUM_PAGES:-8192} }
CFG

server_pid=
part=
start_server() {  # start_server BINARY [LOG_LEVEL]: serves $cfg on $port, waits until it answers
  "$1" --config "$cfg" --allow_ipc --listen "127.0.0.1:$port" --log_level "${2:-warn}" >>"$OUT/$part-$1.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 600); do
    mlakv pools --server "127.0.0.1:$port" --timeout_s 1 >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "run_aims: $1 did not answer on 127.0.0.1:$port" >&2
  return 1
}
stop_server() {
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  server_pid=
}
trap 'stop_server; rm -rf "$rt"' EXIT

part_gpu() {
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  echo "cores: $(nproc)  bundle: $(cat "$rt/commit" 2>/dev/null)"
}

# Every test ctest labels `gpu` (ctest cannot run here: no build tree):
# the C++ programs, the CLI end to end against a cuda:0 server, and the
# Python client's CUDA regions (the save's test is the save part).
part_suites() {
  for t in quantize_append_cuda_test quantize_cli_cuda_test cuda_backend_test service_cuda_test \
           service_cuda_regions_test cache_service_cuda_test gpu_device_test multi_gpu_test; do
    echo "== $t"
    "$t" --gtest_brief=1 2>&1 | tail -4
  done
  echo "== mlakv_e2e_test, its CUDA tests (cpu server)"
  mlakv_e2e_test --gtest_brief=1 --gtest_filter='*Cuda*' 2>&1 | tail -4
  echo "== mlakv_e2e_test on a cuda:0 server"
  MLAKV_E2E_DEVICE=cuda:0 mlakv_e2e_test --gtest_brief=1 --gtest_filter='-Device/*' 2>&1 | tail -4
  part_client
}

part_client() {
  echo "== cuda_bookkeeping_test.py"
  PYTHONPATH=client/python python3 client/python/tests/cuda_bookkeeping_test.py 2>&1 | tail -4
  echo "== cuda_region_test.py"
  MLAKV_SERVER="$rt/bin/mlakv-server" PYTHONPATH=client/python python3 client/python/tests/cuda_region_test.py 2>&1 |
    tail -4
}

part_floor() {
  rpc_floor_bench --rounds 2 --samples 2000 2>&1
}

part_ipc() {
  for r in $(seq 1 "$rounds"); do
    for s in $ab_servers; do
      echo "== round $r: $s"
      start_server "$s" || continue
      ipc_append_bench --server "127.0.0.1:$port" --decode_step --repeats 400 2>&1
      ipc_append_bench --server "127.0.0.1:$port" --rows 262144 --repeats 20 2>&1
      ipc_append_bench --server "127.0.0.1:$port" --rows 1 --repeats 200 2>&1
      stop_server
    done
  done
}

# The same benches against a server logging every call's phases (debug
# level: the logging and the backend's timing events cost a few us a call,
# so these calls are slower than part_ipc's): where the server's share of a
# 262k append and of a decode step goes on this host, and whether the
# kernel in the server takes what it takes alone in the bench's process.
part_phases() {
  start_server mlakv-server debug || return
  ipc_append_bench --server "127.0.0.1:$port" --rows 262144 --repeats 50 2>&1
  ipc_append_bench --server "127.0.0.1:$port" --decode_step --repeats 200 2>&1
  stop_server
  echo "== the server's phases (us), bench/phases_summary.py"
  python3 bench/phases_summary.py "$OUT/phases-mlakv-server.log"
}

part_bytes() {
  start_server mlakv-server || return
  echo "== compact bytes decode step (256 sequences x 61 layers)"
  mlakv bench --server "127.0.0.1:$port" --mode decode --compact --layers 61 --duration_s 4 2>&1 | tr '\r' '\n' | grep -v '^\['
  echo "== ingest, one connection"
  mlakv bench --server "127.0.0.1:$port" --concurrency 1 --duration_s 4 2>&1 | tr '\r' '\n' | grep -v '^\['
  echo "== ingest, eight connections"
  mlakv bench --server "127.0.0.1:$port" --concurrency 8 --duration_s 4 2>&1 | tr '\r' '\n' | grep -v '^\['
  stop_server
}

part_save() {
  if [ -z "${SAVE_PYS:-}" ]; then
    save_with "${SAVE_PY:-client/python}"
    return
  fi
  for r in $(seq 1 "$rounds"); do
    for py in $SAVE_PYS; do
      echo "== round $r: $py"
      save_with "$py"
    done
  done
}

save_with() {  # save_with PACKAGE_DIR
  MLAKV_SERVER="$rt/bin/mlakv-server" PYTHONPATH="$1" \
    python3 client/python/tests/cuda_save_test.py --runs "${SAVE_RUNS:-7}" \
    --tokens "${SAVE_TOKENS:-1024,4096,16384}" --commit "${SAVE_COMMIT:-call,end}" \
    --layers_per_message "${SAVE_GROUPS:-8}" 2>&1
  echo "exit $?"
  [ "${SAVE_LAYER_BENCH:-1}" = 0 ] && return
  MLAKV_SERVER="$rt/bin/mlakv-server" PYTHONPATH="$1" \
    python3 client/python/tests/save_layer_bench.py 2>&1
}

part_kernel() {
  for r in $(seq 1 "${KERNEL_RUNS:-2}"); do
    echo "== run $r"
    quantize_append_bench --repeats 200 2>&1
  done
}

part_sweep() {
  for c in prefill_4x4096 prefill_8x4096; do
    echo "== sweep $c"
    quantize_append_bench --sweep --only "$c" --repeats 200 2>&1
  done
}

for part in "${parts[@]}"; do
  if ! declare -f "part_$part" >/dev/null; then
    echo "run_aims: no part \"$part\"" >&2
    continue
  fi
  echo "run_aims: $part $(date -u +%T)" >&2
  "part_$part" >"$OUT/$part.txt" 2>&1
done
{ part_gpu; python3 bench/aims_summary.py "$OUT"; } >"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
logs=$(cd "$OUT" && ls -- *.log 2>/dev/null)
if [ -n "$logs" ]; then
  # shellcheck disable=SC2086
  (cd "$OUT" && tar cJf logs.tar.xz $logs && rm -f $logs)
fi
