#!/bin/bash
# Manual check, not a ctest: the Dockerfile runtime stage's premise on a GPU
# machine without the build packages. DIR holds bin/mlakv-server, bin/mlakv
# (built here), lib/ (scripts/collect_runtime_libs.sh DIR/lib DIR/bin/*) and
# rows.safetensors (ckv [N,512], kpe [N,64], BF16). Starts the server on
# cuda:0 with only DIR/lib added to the library path, runs a CLI workload,
# writes the scrape and the log into $OUT (then: promtool check metrics).
#   tests/deploy/gpu_runtime_check.sh DIR
set -u
d=$(cd "${1:?usage: $0 DIR}" && pwd)
export LD_LIBRARY_PATH=$d/lib:${LD_LIBRARY_PATH:-}
nvidia-smi -L; cat /etc/os-release | head -2; ldd --version | head -1
echo "--- unresolved libraries (expect none):"; ldd $d/bin/mlakv-server $d/bin/mlakv | grep "not found"
$d/bin/mlakv-server --listen 127.0.0.1:50051 --device cuda:0 --metrics_listen 127.0.0.1:9090 > $OUT/server.log 2>&1 &
pid=$!
for i in $(seq 100); do grep -q "ready:" $OUT/server.log && break; sleep 0.2; done
cat $OUT/server.log
S="--server 127.0.0.1:50051"
for s in a b c; do
  for l in 0 1 2 3; do $d/bin/mlakv append $S --sequence $s --layer $l --input $d/rows.safetensors --ckv_scale 1 --kpe_scale 1 >/dev/null || echo "append $s $l failed"; done
done
$d/bin/mlakv append $S --sequence a --layer 0 --start 999 --input $d/rows.safetensors --ckv_scale 1 --kpe_scale 1; echo "hole rc=$?"
$d/bin/mlakv free $S b; $d/bin/mlakv pools $S
python3 -c "import urllib.request;open('$OUT/scrape.txt','wb').write(urllib.request.urlopen('http://127.0.0.1:9090/metrics').read())"
kill -TERM $pid; wait $pid; echo "server rc=$?"; tail -3 $OUT/server.log
grep -E "^mlakv_(rpcs_total|appended|kernel_(calls|seconds)|pool_)" $OUT/scrape.txt
