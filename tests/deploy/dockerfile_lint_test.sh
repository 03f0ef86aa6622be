#!/usr/bin/env bash
# Lints the Dockerfile with dockerfilelint (npm, installed into .tools/npm by
# scripts/install_deps.sh) and checks what the image must be: CUDA 13.0 devel
# build stage on Ubuntu 24.04 using scripts/install_deps.sh, matching runtime
# stage, non-root user, the mlakv-server entrypoint on 0.0.0.0:50051, EXPOSEd
# gRPC and metrics ports. The linter is first shown a bad Dockerfile, which it
# must reject, so a linter that passes everything fails this test.
# Optional arguments: programs to run scripts/collect_runtime_libs.sh on (the
# Dockerfile's runtime-library step), which must collect gRPC, protobuf,
# abseil, prometheus-cpp (core, and pull for the /metrics Exposer) and civetweb.
#   tests/deploy/dockerfile_lint_test.sh [PROGRAM...]
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
lint=$root/.tools/npm/node_modules/.bin/dockerfilelint
df=$root/Dockerfile
fail=0
bad() { echo "FAIL: $*"; fail=1; }

if [ ! -x "$lint" ]; then
  echo "FAIL: dockerfilelint not installed at $lint (run scripts/install_deps.sh)"
  exit 1
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# 1. The linter must catch a bad Dockerfile.
printf 'FROM ubuntu\nRUN apt-get install curl\nEXPOSE 99999\n' >"$tmp/Dockerfile"
if "$lint" "$tmp/Dockerfile" >/dev/null 2>&1; then
  bad "dockerfilelint accepted a bad Dockerfile: the linter is not checking"
fi

# 2. Ours must lint clean.
if ! "$lint" "$df"; then bad "dockerfilelint found issues in Dockerfile"; fi

# 3. What the image must be.
need() { grep -Eq "$1" "$df" || bad "Dockerfile lacks: $2"; }
need '^ARG CUDA_VERSION=13\.0\.[0-9]+$' 'ARG CUDA_VERSION=13.0.x'
need '^ARG UBUNTU=ubuntu24\.04$' 'ARG UBUNTU=ubuntu24.04'
need '^FROM nvidia/cuda:\$\{CUDA_VERSION\}-devel-\$\{UBUNTU\} AS build$' 'devel build stage'
need '^FROM nvidia/cuda:\$\{CUDA_VERSION\}-runtime-\$\{UBUNTU\} AS runtime$' 'matching runtime stage'
need '^RUN scripts/install_deps\.sh --build' 'the build stage installs with scripts/install_deps.sh'
need 'scripts/collect_runtime_libs\.sh /opt/mlakv/lib' 'runtime libraries collected'
need '^COPY --from=build /opt/mlakv /opt/mlakv$' 'runtime stage copies only /opt/mlakv'
need '^USER [1-9][0-9]*(:[1-9][0-9]*)?$' 'numeric non-root USER'
need '^ENTRYPOINT \["mlakv-server", "--listen", "0\.0\.0\.0:50051"\]$' 'the mlakv-server entrypoint'
need '^EXPOSE 50051 9090$' 'EXPOSE 50051 9090'
[ "$(grep -c '^FROM ' "$df")" -eq 2 ] || bad "Dockerfile must have exactly two stages"
# The runtime stage is last and runs as the non-root user.
last_user=$(grep '^USER ' "$df" | tail -1)
[ "$last_user" != "USER root" ] && [ "$last_user" != "USER 0" ] || bad "last USER is root"
# Every file the build stage copies by name exists.
for f in scripts/install_deps.sh scripts/collect_runtime_libs.sh; do
  [ -x "$root/$f" ] || bad "$f missing or not executable"
done
# The targets the build stage names exist in the CMake build.
grep -rqE 'add_executable\(mlakv-server( |\)|$)' "$root/server" 2>/dev/null || bad "no add_executable(mlakv-server) under server/"
grep -rqE 'add_executable\(mlakv( |\)|$)' "$root/client" || bad "no add_executable(mlakv) under client/"
# .dockerignore keeps build trees and tool dirs out of the context.
for p in .git .tools build 'build-\*'; do
  grep -qx "$p" "$root/.dockerignore" || bad ".dockerignore lacks $p"
done

# 4. The runtime-library step on the real programs.
if [ $# -gt 0 ]; then
  if "$root/scripts/collect_runtime_libs.sh" "$tmp/lib" "$@"; then
    # prometheus-cpp (core: the families; pull: the /metrics Exposer) and
    # civetweb (the Exposer's HTTP server) are shared libraries too.
    for lib in 'libgrpc\+\+\.so' 'libprotobuf\.so' 'libabsl_' 'libprometheus-cpp-core\.so' \
               'libprometheus-cpp-pull\.so' 'libcivetweb\.so' 'libcivetweb-cpp\.so'; do
      ls "$tmp/lib" | grep -Eq "^$lib" || bad "collect_runtime_libs did not collect $lib for $*"
    done
    ls "$tmp/lib" | grep -Eq '^(libc|libstdc\+\+|libcuda)\.so' && bad "collect_runtime_libs copied a base-image or driver library"
  else
    bad "collect_runtime_libs.sh failed on $*"
  fi
fi

if [ "$fail" -ne 0 ]; then echo "dockerfile_lint_test: FAILED"; exit 1; fi
echo "dockerfile_lint_test: ok"
