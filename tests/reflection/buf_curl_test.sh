#!/usr/bin/env bash
# A third-party reflection client (buf curl, npm @bufbuild/buf) against a real
# mlakv-server on a loopback port, without any .proto file: lists services and
# methods, describes a service and a message, calls GetPool with a JSON body,
# streams an Append (two JSON messages, rows as base64 bytes), reads the stored
# bytes back (server stream), checks an error status, Health/Check -> SERVING, and
# over TLS with a bearer token (accepted; a wrong one is UNAUTHENTICATED).
# Every step asserts on buf's output. buf is installed by scripts/install_buf.sh;
# if it cannot be installed the test FAILS.
#
#   tests/reflection/buf_curl_test.sh path/to/mlakv-server
set -euo pipefail

server_bin=${1:?usage: buf_curl_test.sh path/to/mlakv-server}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
py=/usr/bin/python3

fail() { echo "FAIL: $*" >&2; exit 1; }
[ -x "$server_bin" ] || fail "$server_bin is not an executable (build mlakv-server)"

buf=$("$root/scripts/install_buf.sh") || fail "scripts/install_buf.sh could not install buf"
echo "buf $("$buf" --version) at $buf"

work=$(mktemp -d)
pid=
stop_server() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { echo "server ignored SIGTERM for 10 s; killing" >&2; kill -KILL "$pid"; }
    wait "$pid" 2>/dev/null || true
  fi
  pid=
}
trap 'stop_server; rm -rf "$work"' EXIT

# start_server SCHEME [SERVER FLAGS...]: mlakv-server on port 0 (it binds a
# free port itself and logs it in its start-up line, "... ready: grpc
# 127.0.0.1:PORT ...", so no other process can take the port between a pick
# and the bind); returns once Health/Check, called with ${health_args[@]},
# says SERVING. Sets pid and url.
health_args=(--http2-prior-knowledge)
start_server() {
  local scheme=$1 port=
  shift
  "$server_bin" --listen 127.0.0.1:0 --device cpu "$@" >"$work/server.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do  # <= 30 s
    kill -0 "$pid" 2>/dev/null || { pid=; return 1; }
    if [ -z "$port" ]; then
      port=$(sed -n 's/.* ready: grpc 127\.0\.0\.1:\([0-9][0-9]*\) .*/\1/p' "$work/server.log")
      url="$scheme://127.0.0.1:$port"
    fi
    if [ -n "$port" ] && timeout 5 "$buf" curl --protocol grpc "${health_args[@]}" --connect-timeout 1 \
        "$url/grpc.health.v1.Health/Check" 2>/dev/null | grep -q SERVING; then
      return 0
    fi
    sleep 0.1
  done
  stop_server
  return 1
}
start_server http || { cat "$work/server.log" >&2; fail "mlakv-server did not become SERVING"; }
echo "server at $url (pid $pid)"

# show_cmd ARGS...: prints "$ buf curl ARGS" with shell quoting a person can paste.
show_cmd() {
  local a out='$ buf curl --protocol grpc --http2-prior-knowledge'
  for a in "$@"; do
    case $a in
      *[!A-Za-z0-9_@%+=:,./-]*) out+=" '${a//\'/\'\\\'\'}'" ;;
      *) out+=" $a" ;;
    esac
  done
  echo "$out" >&2
}
# bufc ARGS...: buf curl over gRPC (h2c), echoing the command and its output.
bufc() {
  show_cmd "$@"
  timeout 60 "$buf" curl --protocol grpc --http2-prior-knowledge "$@" | tee "$work/out" >&2
  return "${PIPESTATUS[0]}"
}
# expect_json PYTHON-EXPRESSION: asserts on the JSON in $work/out (bound to j).
expect_json() {
  "$py" - "$1" "$work/out" <<'EOF' || fail "assertion failed: $1"
import json, sys
expr, path = sys.argv[1], sys.argv[2]
j = json.load(open(path))
if not eval(expr, {"j": j}):
    sys.exit("false: %s on %s" % (expr, json.dumps(j)[:2000]))
EOF
}
expect_text() { grep -qF -- "$1" "$work/out" || fail "output lacks: $1"; }

echo "== 1. list services (reflection)"
bufc --list-services "$url"
expect_text mlakv.v1.KvCache
expect_text grpc.health.v1.Health
reflection=$(grep -o 'grpc\.reflection\.v1[a-z]*\.ServerReflection' "$work/out" | sort | head -1) ||
  fail "no reflection service listed"

echo "== 2. list methods"
bufc --list-methods "$url"
for m in ListPools GetPool Append AppendBatch GetSequence ListSequences GetPage ReadSequence FreeSequence \
         TruncateSequence AcquireLease RenewLease ReleaseLease ListLeases ForkSequence MatchPrefix CommitAppend; do
  expect_text "mlakv.v1.KvCache/$m"
done

echo "== 3. describe (reflection file_containing_symbol, rendered like grpcurl describe)"
show_cmd -d '{"fileContainingSymbol": "mlakv.v1.KvCache"}' "$url/$reflection/ServerReflectionInfo"
timeout 60 "$buf" curl --protocol grpc --http2-prior-knowledge -d '{"fileContainingSymbol": "mlakv.v1.KvCache"}' \
  "$url/$reflection/ServerReflectionInfo" >"$work/out" || fail "reflection call failed"
echo "(a fileDescriptorResponse of $(wc -c <"$work/out") bytes of JSON; rendered:)" >&2
"$py" "$here/describe.py" mlakv.v1.KvCache <"$work/out" | tee "$work/describe" ||
  fail "describe of mlakv.v1.KvCache failed"
grep -qF "rpc Append ( stream .mlakv.v1.AppendRequest ) returns ( .mlakv.v1.AppendResponse );" "$work/describe" ||
  fail "describe lacks the client-streaming Append"
grep -qF "rpc ReadSequence ( .mlakv.v1.ReadSequenceRequest ) returns ( stream .mlakv.v1.ReadSequenceResponse );" \
  "$work/describe" || fail "describe lacks the server-streaming ReadSequence"
"$py" "$here/describe.py" mlakv.v1.LayerRows <"$work/out" | tee "$work/describe"
grep -qF "bytes ckv = 2;" "$work/describe" || fail "describe of LayerRows lacks bytes ckv = 2"
grep -qF "float ckv_scale = 4;" "$work/describe" || fail "describe of LayerRows lacks float ckv_scale = 4"

echo "== 4. GetPool with a JSON body"
bufc -d '{"pool": ""}' "$url/mlakv.v1.KvCache/GetPool"
expect_json 'j["name"] == "default" and j["device"] == "cpu" and j["numLayers"] == 61'
expect_json 'j["ckvDim"] == 512 and j["kpeDim"] == 64 and j["bytesPerTokenPerLayer"] == 352'
expect_json 'j["format"] == "CACHE_FORMAT_NVFP4_MLA" and j["pagesFree"] == j["pagesTotal"]'

echo "== 5. Append, client-streamed: two JSON messages of one bf16 row each (every element 1.0)"
# bf16 1.0 = 0x3F80, little-endian bytes 80 3F. With ckv_scale = kpe_scale = 1 (docs/format.md):
# block scale e4m3(1/6) = 0.171875 = 0x23; 1.0 * (1/0.171875) = 5.82 -> E2M1 code 7 (6.0),
# both nibbles: 0x77; kpe e4m3(1.0) = 0x38.
ckv=$("$py" -c 'import base64; print(base64.b64encode(b"\x80\x3f" * 512).decode())')
kpe=$("$py" -c 'import base64; print(base64.b64encode(b"\x80\x3f" * 64).decode())')
cat >"$work/append.json" <<EOF
{"sequence": "buf-curl", "start": 0, "rowCount": 1, "dtype": "ROW_DTYPE_BFLOAT16",
 "layers": [{"layer": 0, "ckv": "$ckv", "kpe": "$kpe", "ckvScale": 1.0, "kpeScale": 1.0}]}
{"sequence": "buf-curl", "start": 1, "rowCount": 1, "dtype": "ROW_DTYPE_BFLOAT16",
 "layers": [{"layer": 0, "ckv": "$ckv", "kpe": "$kpe", "ckvScale": 1.0, "kpeScale": 1.0}]}
EOF
bufc -d @"$work/append.json" "$url/mlakv.v1.KvCache/Append"
expect_json 'j["rowsWritten"] == "2" and j["pagesAllocated"] == 1'
expect_json 'j["sequence"]["id"] == "buf-curl" and j["sequence"]["layerLengths"][0] == 2'
expect_json 'len(j["sequence"]["kvIndices"]) == 1 and len(j["sequence"]["layerLengths"]) == 61'

echo "== 6. GetSequence and ReadSequence (server stream) of the stored bytes"
bufc -d '{"sequence": "buf-curl"}' "$url/mlakv.v1.KvCache/GetSequence"
expect_json 'j["id"] == "buf-curl" and j["layerLengths"][0] == 2 and j["pageSize"] > 0'
bufc -d '{"sequence": "buf-curl", "layers": [0], "format": "READ_FORMAT_RAW"}' "$url/mlakv.v1.KvCache/ReadSequence" ||
  fail "ReadSequence failed"
expect_json 'j["count"] == 2 and j["ckvScale"] == 1 and j["kpeScale"] == 1'
expect_json '__import__("base64").b64decode(j["ckvPacked"]) == b"\x77" * 512'
expect_json '__import__("base64").b64decode(j["ckvSf"]) == b"\x23" * 64'
expect_json '__import__("base64").b64decode(j["kpe"]) == b"\x38" * 128'
echo "stored bytes as computed from docs/format.md: ckv_packed 0x77.., ckv_sf 0x23.., kpe 0x38.."

echo "== 7. an error: GetSequence of an unknown id -> NOT_FOUND (buf exit status = code << 3 = 40)"
show_cmd -d '{"sequence": "no-such-sequence"}' "$url/mlakv.v1.KvCache/GetSequence"
set +e
timeout 60 "$buf" curl --protocol grpc --http2-prior-knowledge -d '{"sequence": "no-such-sequence"}' \
  "$url/mlakv.v1.KvCache/GetSequence" >"$work/out" 2>&1
status=$?
set -e
cat "$work/out" >&2
[ "$status" -eq 40 ] || fail "buf curl exit status $status, expected 40 (NOT_FOUND << 3)"
expect_text not_found
expect_text no-such-sequence

echo "== 8. FreeSequence"
bufc -d '{"sequence": "buf-curl"}' "$url/mlakv.v1.KvCache/FreeSequence"
expect_json 'j["pagesFreed"] == 1'

echo "== 8b. cache management: a lease with the page table, a fork, a deferred free, a read through the lease"
# Two rows in all 61 layers (a lease covers tokens written in every layer).
"$py" - "$work/lease.json" <<'EOF'
import base64, json, sys
row = lambda n: base64.b64encode(b"\x80\x3f" * n * 2).decode()
layers = [{"layer": l, "ckv": row(512), "kpe": row(64), "ckvScale": 1.0, "kpeScale": 1.0} for l in range(61)]
json.dump({"sequence": "buf-curl", "start": 0, "rowCount": 2, "dtype": "ROW_DTYPE_BFLOAT16", "layers": layers,
           "view": "SEQUENCE_VIEW_BASIC"}, open(sys.argv[1], "w"))
EOF
show_cmd -d @lease.json "$url/mlakv.v1.KvCache/Append"
timeout 60 "$buf" curl --protocol grpc --http2-prior-knowledge -d @"$work/lease.json" \
  "$url/mlakv.v1.KvCache/Append" >"$work/out" || fail "61-layer Append failed"
expect_json 'j["sequence"]["length"] == 2'
bufc -d '{"sequence": "buf-curl", "lease": {"holder": "buf-curl-reader", "durationMs": 60000}}' \
  "$url/mlakv.v1.KvCache/GetSequence"
expect_json 'j["lease"]["tokens"] == 2 and j["lease"]["holder"] == "buf-curl-reader" and j["leases"] == 1'
expect_json 'int(j["generation"]) > 0 and j["lease"]["generation"] == j["generation"]'
lease=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["lease"]["leaseId"])' "$work/out")
bufc -d '{"source": "buf-curl", "target": "buf-fork", "length": 2}' "$url/mlakv.v1.KvCache/ForkSequence"
expect_json 'j["pagesCopied"] == 1 and j["sequence"]["length"] == 2 and j.get("pagesShared", 0) == 0'
bufc -d '{"sequence": "buf-curl"}' "$url/mlakv.v1.KvCache/FreeSequence"
expect_json 'j["leases"] == 1 and j["pagesRetained"] == 1 and j.get("pagesFreed", 0) == 0'
bufc -d "{\"leaseId\": \"$lease\", \"layers\": [0]}" "$url/mlakv.v1.KvCache/ReadSequence" ||
  fail "ReadSequence through the lease failed"
expect_json 'j["count"] == 2 and __import__("base64").b64decode(j["ckvPacked"]) == b"\x77" * 512'
bufc -d "{\"leaseId\": \"$lease\"}" "$url/mlakv.v1.KvCache/ReleaseLease"
expect_json 'j["pagesFreed"] == 1'
bufc -d '{"sequence": "buf-fork"}' "$url/mlakv.v1.KvCache/FreeSequence"
expect_json 'j["pagesFreed"] == 1'
bufc -d '{"pool": ""}' "$url/mlakv.v1.KvCache/GetPool"
expect_json 'j["pagesFree"] == j["pagesTotal"] and j.get("leases", 0) == 0'

echo "== 9. Health/Check"
bufc -d '{}' "$url/grpc.health.v1.Health/Check"
expect_json 'j["status"] == "SERVING"'

stop_server

echo "== 10. TLS + bearer token: the token must reach the reflection calls too (--reflect-header)"
if ! command -v openssl >/dev/null; then fail "openssl not found (Debian: openssl; scripts/install_deps.sh installs it)"; fi
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 -subj /CN=127.0.0.1 \
  -addext subjectAltName=IP:127.0.0.1 -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null ||
  fail "openssl could not make a test certificate"
echo "tok-$$" >"$work/token"
tls=(--cacert "$work/cert.pem")
health_args=("${tls[@]}" -H "authorization: Bearer tok-$$" --reflect-header '*')
start_server https --tls_cert "$work/cert.pem" --tls_key "$work/key.pem" --auth_token_file "$work/token" ||
  { cat "$work/server.log" >&2; fail "TLS server did not become SERVING"; }
bufc "${tls[@]}" -H "authorization: Bearer tok-$$" --reflect-header '*' --list-services "$url"
expect_text mlakv.v1.KvCache
show_cmd "${tls[@]}" -H 'authorization: Bearer wrong' --reflect-header "authorization: Bearer tok-$$" \
  "$url/mlakv.v1.KvCache/ListSequences"
set +e
timeout 60 "$buf" curl --protocol grpc "${tls[@]}" -H 'authorization: Bearer wrong' \
  --reflect-header "authorization: Bearer tok-$$" "$url/mlakv.v1.KvCache/ListSequences" >"$work/out" 2>&1
status=$?
set -e
cat "$work/out" >&2
[ "$status" -eq 128 ] || fail "buf curl exit status $status, expected 128 (UNAUTHENTICATED << 3)"
expect_text unauthenticated
stop_server

echo "PASS: buf curl listed, described and called mlakv.v1.KvCache and grpc.health.v1.Health via reflection"
