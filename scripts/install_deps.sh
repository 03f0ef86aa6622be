#!/usr/bin/env bash
# The one list of packages that building and testing mlakv needs, installed
# with apt-get. Used by scripts/setup.sh (developers, CI) and by the Dockerfile's
# build stage, so that CI proves the image's install step. Works on Debian 12
# and Ubuntu 24.04 (the package names are the same on both). nvcc is not
# installed here: it comes from /usr/local/cuda (the CUDA devel image, or the
# machine).
#
#   scripts/install_deps.sh           build + test packages (what CI needs)
#   scripts/install_deps.sh --build   only what compiling mlakv needs (Dockerfile)
#
# Idempotent: packages already present are not reinstalled, and apt-get runs
# only when something is missing. The test group also installs the npm tool
# dockerfilelint into .tools/npm/ (gitignored) for tests/deploy.
set -euo pipefail
cd "$(dirname "$0")/.."

# prometheus-cpp-dev: the metric families and text format (core) and the
# /metrics Exposer (pull); libcivetweb-dev: the Exposer's HTTP server
# (prometheus-cpp-dev depends on it too, with zlib and libcurl for its CMake
# config). libgoogle-perftools-dev: tcmalloc_minimal, mlakv-server's allocator
# (cmake/allocator.cmake).
build_packages=(
  cmake ninja-build g++ pkg-config ccache
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libssl-dev
  libabsl-dev libspdlog-dev nlohmann-json3-dev
  prometheus-cpp-dev libcivetweb-dev
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libgoogle-perftools-dev
)
# Tools the tests run: the Python client's dependencies, promtool (package
# prometheus) for the metrics scrape check, openssl for test certificates,
# PyYAML for the rendered-manifest checks, pip, venv and setuptools for
# installing the Python package offline (tests/python_package_test.py), and clang 14 with its sanitizer and
# libFuzzer runtimes and llvm-symbolizer for the sanitizer builds and fuzz
# targets (scripts/sanitize.sh, scripts/fuzz.sh).
test_packages=(
  python3 python3-grpcio python3-numpy python3-protobuf python3-yaml python3-zmq python3-msgpack
  python3-pip python3-venv python3-setuptools
  prometheus openssl
  clang-14 libclang-rt-14-dev llvm-14
)
DOCKERFILELINT_VERSION=1.8.0

with_tests=1
case "${1:-}" in
  --build) with_tests=0 ;;
  "") ;;
  *) echo "usage: $0 [--build]" >&2; exit 2 ;;
esac

packages=("${build_packages[@]}")
[ "$with_tests" -eq 1 ] && packages+=("${test_packages[@]}")

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "$with_tests" -eq 1 ] && ! command -v npm >/dev/null; then
  missing+=(nodejs npm)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ "$with_tests" -eq 1 ]; then
  lint=.tools/npm/node_modules/.bin/dockerfilelint
  if [ ! -x "$lint" ]; then
    echo "install_deps: npm install dockerfilelint@$DOCKERFILELINT_VERSION into .tools/npm"
    mkdir -p .tools/npm
    npm install --no-audit --no-fund --silent --prefix .tools/npm "dockerfilelint@$DOCKERFILELINT_VERSION" >/dev/null
  fi
fi
