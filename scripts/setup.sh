#!/usr/bin/env bash
# Installs what the build needs (Debian 12 packages; nvcc is expected at
# /usr/local/cuda), configures and builds everything into build/.
# Idempotent: packages already present are not reinstalled.
#   scripts/setup.sh            install + configure + build
#   MLAKV_BUILD_DIR=dir ...     build somewhere else
set -euo pipefail
cd "$(dirname "$0")/.."

# The package list lives in scripts/install_deps.sh (also run by the
# Dockerfile's build stage): build packages plus the tools the tests use.
scripts/install_deps.sh
if [ ! -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  echo "setup: nvcc not found (expected /usr/local/cuda/bin/nvcc); the CUDA code cannot be compiled" >&2
  exit 1
fi

build=${MLAKV_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C "$build"
echo "setup: built into $build/"
