#!/usr/bin/env bash
# Builds the configuration sweeps and the backward's standalone check for sm_90:
#   tune          the backward's sweeps (llm.c's block sizes, kernel 11's and 12's configurations)
#   forward_tune  the fused forward's paths and row groups
#   check         tests/cuda/check.cu, every backward kernel against a reference
# Their lists of sources are written here once. tune and check share their kernels, which are
# compiled once (in parallel, one job per core) into OUT_DIR/obj and linked into both.
#   tools/tune/build.sh OUT_DIR [tune] [forward_tune] [check] [-- NVCC FLAGS...]   (default: tune, forward_tune)
# e.g. `tools/tune/build.sh /tmp/tune forward_tune -- -lineinfo` for ncu's source view.
# KERNEL_OBJECTS=DIR takes the kernels' and the registry's objects from DIR instead of compiling
# them (a sanitizer script's OUT_DIR/obj, whose *check.cu.o, the checks' mains, are left out):
# tools/gpu/gpu_check.sh links tune and check in seconds from the objects prebuild.sh compiled.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: tools/tune/build.sh OUT_DIR [tune] [forward_tune] [check] [-- NVCC FLAGS...]}
shift
targets=()
while (($#)) && [[ $1 != -- ]]; do targets+=("$1"); shift; done
(($#)) && shift   # the --
((${#targets[@]})) || targets=(tune forward_tune)
mkdir -p "$out"
NVCC=(nvcc -O3 -std=c++17 -arch=sm_90 "$@" -Iffi/kernels -Icuda_harness)
objs=()
kernel_objects() {   # the backward's kernels and the registry, once, into $out/obj
  ((${#objs[@]})) && return 0
  if [ -n "${KERNEL_OBJECTS:-}" ]; then
    local o
    for o in "$KERNEL_OBJECTS"/*.o; do [[ $o == *check.cu.o ]] || objs+=("$o"); done
    [ -s "${objs[0]}" ] || { echo "build.sh: no objects in $KERNEL_OBJECTS" >&2; return 1; }
    return 0
  fi
  mkdir -p "$out/obj"
  rm -f "$out"/obj/*.o   # a failed compile leaves no object: none of an earlier build may stand in
  local f o
  for f in ffi/registry.cc $(find ffi/kernels -name '*.cu' | sort); do
    o="$out/obj/$(echo "$f" | tr / _).o"
    objs+=("$o")
    while (($(jobs -rp | wc -l) >= $(nproc))); do wait -n || true; done
    "${NVCC[@]}" -Iffi -c "$f" -o "$o" &
  done
  wait || true
  for o in "${objs[@]}"; do [ -s "$o" ] || { echo "build.sh: $o did not compile" >&2; return 1; }; done
}
for t in "${targets[@]}"; do
  case $t in
    tune)
      kernel_objects
      "${NVCC[@]}" -Iffi tools/tune/tune.cu "${objs[@]}" -o "$out/tune" ;;
    check)
      kernel_objects
      "${NVCC[@]}" -Iffi tests/cuda/check.cu "${objs[@]}" -o "$out/check" ;;
    forward_tune)
      "${NVCC[@]}" tools/tune/forward_tune.cu ffi/kernels/forward/*.cu ffi/kernels/common/occupancy.cu \
        ffi/kernels/common/device_limits.cu -o "$out/forward_tune" ;;
    *) echo "build.sh: no program $t (tune, forward_tune, check)" >&2; exit 2 ;;
  esac
  echo "built $out/$t"
done
