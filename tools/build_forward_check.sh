#!/usr/bin/env bash
# Builds the forward's standalone harness (tests/cuda/forward_check.cu) for sm_90; its list of
# sources is written here once, for gpu_check.sh's sweep and ncu stages and forward_ab.sh.
#   tools/build_forward_check.sh OUTPUT [ROOT] [NVCC FLAGS...]
# ROOT: the source tree to build from (default: this checkout), e.g. forward_ab.sh's copy of an
# earlier commit.
set -euo pipefail
out=$1
root=${2:-$(cd "$(dirname "$0")/.." && pwd)}
shift $(($# < 2 ? $# : 2))
exec nvcc -O3 -std=c++17 -arch=sm_90 "$@" -I"$root/ffi/kernels" "$root/tests/cuda/forward_check.cu" \
  "$root"/ffi/kernels/forward/*.cu "$root/ffi/kernels/common/occupancy.cu" "$root/ffi/kernels/common/device_limits.cu" \
  -o "$out"
