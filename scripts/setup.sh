#!/usr/bin/env bash
# Installs what the build needs (Debian 12 packages; nvcc is expected at
# /usr/local/cuda), configures and builds everything into build/.
# Idempotent: packages already present are not reinstalled.
#   scripts/setup.sh            install + configure + build
#   MLAKV_BUILD_DIR=dir ...     build somewhere else
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  cmake ninja-build g++ pkg-config ccache
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev libspdlog-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-grpcio python3-numpy python3-protobuf
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ ! -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  echo "setup: nvcc not found (expected /usr/local/cuda/bin/nvcc); the CUDA code cannot be compiled" >&2
  exit 1
fi

build=${MLAKV_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C "$build"
echo "setup: built into $build/"
