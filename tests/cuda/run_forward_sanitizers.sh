#!/usr/bin/env bash
# Runs the fused forward's standalone check (tests/cuda/forward_check.cu: exact-size cudaMalloc
# buffers, every path, plain and residual variant) plainly and under compute-sanitizer's four
# tools, and proves the tools would notice: scratch copies of forward_rows.cu with one planted
# out-of-bounds store (of y; of the residual variant's s) and one missing barrier must be
# reported. Everything is compiled at once, and the tools and controls run side by side.
# Needs a GPU (sm_90), nvcc and compute-sanitizer.
#   [LNBWD_SANITIZER_TIMEOUT=900] tests/cuda/run_forward_sanitizers.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/forward_sanitizers}
mkdir -p "$OUT"
NVCC=(nvcc -O3 -lineinfo -std=c++17 -arch=sm_90 -Iffi/kernels -Icuda_harness)
KERNELS=(ffi/kernels/forward/forward_launch.cu ffi/kernels/forward/forward_wide.cu ffi/kernels/common/occupancy.cu
         ffi/kernels/common/device_limits.cu)
TIMEOUT=${LNBWD_SANITIZER_TIMEOUT:-900}
source tests/cuda/control_report.sh
status=0

# The positive controls' sources: scratch copies of forward_rows.cu, each with one planted bug
# (deleted at the end): a store of y one row past the end, a missing barrier between the warps'
# row sums and their reads, a store of s one row past the end, and small rows' shuffles naming
# the whole warp while some of its groups have left the row loop (mask, for synccheck).
ctl=$OUT/controls
mkdir -p "$ctl" "$OUT/obj"
sed 's|if (in_row(j)) \*y = normalize|if (in_row(j)) y[row + 1 == a.rows ? C / VEC : 0] = normalize|' \
  ffi/kernels/forward/forward_rows.cu > "$ctl/forward_rows_oob.cu"
sed 's|auto sync = \[\] { __syncthreads(); };|auto sync = [] {};|' \
  ffi/kernels/forward/forward_rows.cu > "$ctl/forward_rows_race.cu"
sed 's|\*sp = xv\[j\];|sp[row + 1 == a.rows ? C / VEC : 0] = xv[j];|' \
  ffi/kernels/forward/forward_rows.cu > "$ctl/forward_rows_oob_s.cu"
sed 's|const unsigned group_lanes = SMALL ? lanes_mask(tpr, lane) : 0xffffffffu;|const unsigned group_lanes = 0xffffffffu;|' \
  ffi/kernels/forward/forward_rows.cu > "$ctl/forward_rows_mask.cu"
planted_all=()
for planted in oob race oob_s mask; do
  if cmp -s "$ctl/forward_rows_$planted.cu" ffi/kernels/forward/forward_rows.cu; then
    echo "control $planted: the planted change did not apply"; status=1
  else
    planted_all+=("$planted")
  fi
done

# Every object at once (forward_rows.cu and its planted copies are the slow ones), then the
# check and one binary per control, which differ only in their forward_rows object.
sources=(tests/cuda/forward_check.cu ffi/kernels/forward/forward_rows.cu "${KERNELS[@]}")
for planted in "${planted_all[@]}"; do sources+=("$ctl/forward_rows_$planted.cu"); done
# A compile that fails stops the script (no stale object of an earlier run may stand in for it).
rm -f "$OUT"/obj/*.o
pids=()
for f in "${sources[@]}"; do "${NVCC[@]}" -c "$f" -o "$OUT/obj/$(basename "$f" .cu).o" & pids+=($!); done
for pid in "${pids[@]}"; do wait "$pid" || exit 2; done
common=("$OUT/obj/forward_check.o")
for f in "${KERNELS[@]}"; do common+=("$OUT/obj/$(basename "$f" .cu).o"); done
"${NVCC[@]}" "${common[@]}" "$OUT/obj/forward_rows.o" -o "$OUT/forward_check" || exit 2
"$OUT/forward_check" check | tail -5 || exit 1

export LNBWD_QUICK=1   # the reduced shape set: the sanitizers are slow
sanitize() {   # sanitize TOOL: one line of result
  local tool=$1 extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check full)
  if timeout "$TIMEOUT" compute-sanitizer --tool "$tool" --error-exitcode 1 "${extra[@]}" "$OUT/forward_check" check \
      > "$OUT/$tool.log" 2>&1; then
    echo "$tool: $(grep -Eo '(ERROR|RACECHECK) SUMMARY: .*' "$OUT/$tool.log" | tail -1)" \
         "($(grep -Eo 'forward check: [0-9]+ cases, [0-9]+ failures' "$OUT/$tool.log"))"
  else
    echo "$tool: FAILED (exit $?, see $OUT/$tool.log)"
  fi
}
# Each planted bug must make its tool fail. The planted bug also makes values wrong (the check
# fails either way): what counts is that the tool itself reports errors.
control() {   # control PLANTED: one line of result
  local planted=$1 tool=memcheck
  [ "$planted" = race ] && tool=racecheck
  [ "$planted" = mask ] && tool=synccheck
  "${NVCC[@]}" "${common[@]}" "$OUT/obj/forward_rows_$planted.o" -o "$ctl/check_$planted" ||
    { echo "control $planted: FAILED to build"; return; }
  timeout "$TIMEOUT" compute-sanitizer --tool "$tool" "$ctl/check_$planted" check > "$ctl/$planted.log" 2>&1
  control_report "$planted" "$tool" "$ctl/$planted.log"
}
# The four tools and the controls side by side: the GPU has room for all of them.
for tool in memcheck racecheck synccheck initcheck; do sanitize "$tool" > "$OUT/$tool.result" & done
for planted in "${planted_all[@]}"; do control "$planted" > "$ctl/$planted.result" & done
wait
cat "$OUT"/{memcheck,racecheck,synccheck,initcheck}.result
grep -q FAILED "$OUT"/*.result && status=1
for planted in "${planted_all[@]}"; do
  cat "$ctl/$planted.result"
  grep -q ": reported: " "$ctl/$planted.result" || status=1
done
rm -f "$ctl"/*.cu
exit $status
