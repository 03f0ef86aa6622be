#!/usr/bin/env bash
# Installs buf (its `buf curl` is the third-party gRPC reflection client that
# tests/reflection drives) from the npm package @bufbuild/buf, pinned, into a
# project-local gitignored folder, and prints the path of the buf executable.
#
#   scripts/install_buf.sh                    -> .tools/buf/node_modules/.bin/buf
#   MLAKV_TOOLS_DIR=/abs/dir scripts/install_buf.sh
#   BUF_VERSION=1.75.0 scripts/install_buf.sh
#
# Idempotent (an installed buf of the pinned version is reused; concurrent runs
# serialize on a lock). Needs node + npm (Debian: nodejs npm; scripts/install_deps.sh
# installs them) and the npm registry. When it cannot install it exits non-zero
# saying why, and the reflection test fails rather than passing silently.
set -euo pipefail
BUF_VERSION=${BUF_VERSION:-1.75.0}
root=$(cd "$(dirname "$0")/.." && pwd)
tools=${MLAKV_TOOLS_DIR:-$root/.tools}
prefix=$tools/buf
bin=$prefix/node_modules/.bin/buf

installed() { [ -x "$bin" ] && [ "$("$bin" --version 2>/dev/null)" = "$BUF_VERSION" ]; }

if ! installed; then
  for tool in node npm; do
    command -v "$tool" >/dev/null || { echo "install_buf: $tool not found (Debian: apt-get install nodejs npm)" >&2; exit 1; }
  done
  mkdir -p "$prefix"
  (
    flock 9
    if ! installed; then
      echo "install_buf: npm install @bufbuild/buf@$BUF_VERSION into $prefix" >&2
      if ! npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "@bufbuild/buf@$BUF_VERSION" >&2; then
        echo "install_buf: npm install @bufbuild/buf@$BUF_VERSION failed (is the npm registry reachable?)" >&2
        exit 1
      fi
    fi
  ) 9>"$prefix/.lock"
  installed || { echo "install_buf: $bin is not buf $BUF_VERSION after npm install" >&2; exit 1; }
fi
echo "$bin"
