#!/usr/bin/env bash
# Runs every kernel under compute-sanitizer's four tools, from the standalone harness (exact-size
# cudaMalloc buffers: XLA's pooled allocator hides out-of-bounds accesses from memcheck), and
# proves the tools would notice: a scratch copy of kernel 11 with one planted out-of-bounds write
# and one with a missing barrier must be reported. Needs a GPU (sm_90), nvcc and compute-sanitizer.
#   tests/cuda/run_sanitizers.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/sanitizers}
mkdir -p "$OUT/obj"
NVCC=(nvcc -O3 -lineinfo -std=c++17 -arch=sm_90 -Iffi/kernels)

# Build the harness (objects in parallel).
build() {   # build OUT_BINARY KERNEL_SOURCES...
  local bin=$1 dir=$OUT/obj/$(basename "$1")
  shift
  mkdir -p "$dir"
  for f in tests/cuda/harness.cu "$@"; do "${NVCC[@]}" -c "$f" -o "$dir/$(basename "$f").o" & done
  wait
  "${NVCC[@]}" "$dir"/*.o -o "$bin"
}
build "$OUT/harness" ffi/kernels/*.cu || exit 2

status=0
export LNBWD_QUICK=1   # the harness's reduced shape set: the sanitizers are slow
for tool in memcheck racecheck synccheck initcheck; do
  extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check full)
  for kernel in 1 2 3 4 5 6 7 8 9 10 11 12; do
    if compute-sanitizer --tool "$tool" --error-exitcode 1 "${extra[@]}" "$OUT/harness" check "$kernel" \
        > "$OUT/$tool-k$kernel.log" 2>&1; then
      echo "$tool kernel $kernel: $(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?' "$OUT/$tool-k$kernel.log" | tail -1)"
    else
      echo "$tool kernel $kernel: FAILED (see $OUT/$tool-k$kernel.log)"; status=1
    fi
  done
done

# Positive controls, in scratch copies that are deleted afterwards.
ctl=$OUT/controls
mkdir -p "$ctl"
others=$(ls ffi/kernels/*.cu | grep -v kernel11_rows_in_registers.cu)
# 1) One element past the end of dx: store the last row's vector at col + C (the next row, or
#    past the buffer for the last row).
sed 's|store_cs(reinterpret_cast<V\*>(dx + row \* C + col), dxv);|store_cs(reinterpret_cast<V*>(dx + row * C + col + (row + 1 == rows ? C : 0)), dxv);|' \
  ffi/kernels/kernel11_rows_in_registers.cu > "$ctl/kernel11_oob.cu"
# 2) No barrier between posting the warps' row sums and reading them.
sed 's|      group_barrier(1 + g, tpr);||' ffi/kernels/kernel11_rows_in_registers.cu > "$ctl/kernel11_race.cu"
for planted in oob race; do
  grep -q . "$ctl/kernel11_$planted.cu" && ! cmp -s "$ctl/kernel11_$planted.cu" ffi/kernels/kernel11_rows_in_registers.cu \
    || { echo "control $planted: the planted change did not apply"; status=1; continue; }
  build "$ctl/harness_$planted" $others "$ctl/kernel11_$planted.cu" || { status=1; continue; }
  tool=$([ $planted = oob ] && echo memcheck || echo racecheck)
  if compute-sanitizer --tool "$tool" --error-exitcode 1 "$ctl/harness_$planted" check 11 > "$ctl/$planted.log" 2>&1; then
    echo "control $planted ($tool): NOT reported - the harness would miss this bug"; status=1
  else
    echo "control $planted ($tool): reported: $(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?' "$ctl/$planted.log" | tail -1)"
  fi
done
rm -f "$ctl"/*.cu
exit $status
