#!/usr/bin/env bash
# Copies the shared libraries that the given programs load (per ldd) into
# OUTDIR, except those every base image has (glibc, libstdc++, libgcc_s) and
# the NVIDIA driver's (libcuda, mounted into the container at run time). The
# Dockerfile's runtime stage takes OUTDIR and nothing else from the build
# stage's /usr, so the image carries exactly what mlakv-server and mlakv load.
#   scripts/collect_runtime_libs.sh OUTDIR PROGRAM...
# Fails if a library cannot be found (ldd "not found").
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 OUTDIR PROGRAM..." >&2; exit 2; }
out=$1; shift
mkdir -p "$out"
skip='^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libutil|libresolv|libstdc\+\+|libgcc_s|libcuda|libnvidia-)\.'
for prog in "$@"; do
  if ldd "$prog" | grep -q "not found"; then
    ldd "$prog" | grep "not found" >&2
    echo "collect_runtime_libs: $prog has unresolved libraries" >&2
    exit 1
  fi
  ldd "$prog" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    if [[ "$name" =~ $skip ]]; then continue; fi
    cp -L -n "$path" "$out/$name"
  done
done
echo "collect_runtime_libs: $(ls "$out" | wc -l) libraries in $out"
