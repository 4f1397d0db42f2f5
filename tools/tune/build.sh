#!/usr/bin/env bash
# Builds the configuration sweeps for sm_90: tune (the backward's: llm.c's block sizes, kernel 11's
# and 12's configurations) and forward_tune (the fused forward's paths and row groups). Their
# lists of sources are written here once.
#   tools/tune/build.sh OUT_DIR [tune] [forward_tune] [-- NVCC FLAGS...]   (default: both)
# e.g. `tools/tune/build.sh /tmp/tune forward_tune -- -lineinfo` for ncu's source view.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: tools/tune/build.sh OUT_DIR [tune] [forward_tune] [-- NVCC FLAGS...]}
shift
targets=()
while (($#)) && [[ $1 != -- ]]; do targets+=("$1"); shift; done
(($#)) && shift   # the --
((${#targets[@]})) || targets=(tune forward_tune)
mkdir -p "$out"
NVCC=(nvcc -O3 -std=c++17 -arch=sm_90 "$@" -Iffi/kernels -Icuda_harness)
for t in "${targets[@]}"; do
  case $t in
    tune)
      "${NVCC[@]}" -Iffi tools/tune/tune.cu ffi/registry.cc $(find ffi/kernels -name '*.cu' | sort) -o "$out/tune" ;;
    forward_tune)
      "${NVCC[@]}" tools/tune/forward_tune.cu ffi/kernels/forward/*.cu ffi/kernels/common/occupancy.cu \
        ffi/kernels/common/device_limits.cu -o "$out/forward_tune" ;;
    *) echo "build.sh: no program $t (tune, forward_tune)" >&2; exit 2 ;;
  esac
  echo "built $out/$t"
done
