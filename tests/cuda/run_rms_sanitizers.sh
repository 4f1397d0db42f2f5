#!/usr/bin/env bash
# Runs the RMSNorm standalone check (tests/cuda/rms_check.cu: the forward and kernels 11 and 12's
# backward with NormKind::kRmsNorm, exact-size cudaMalloc buffers, poisoned outputs) plainly and
# under compute-sanitizer's four tools. One positive control is RMSNorm's own: a scratch copy of
# forward_rows.cu whose rows post their sums into one shared buffer instead of alternating two
# must be reported by racecheck (the grid-stride cases reach it). The other controls are in
# run_sanitizers.sh and run_forward_sanitizers.sh: the same kernels.
# Needs a GPU (sm_90), nvcc and compute-sanitizer.
#   [LNBWD_SANITIZER_TIMEOUT=900] tests/cuda/run_rms_sanitizers.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/rms_sanitizers}
mkdir -p "$OUT/obj"
NVCC=(nvcc -O3 -lineinfo -std=c++17 -arch=sm_90 -Iffi/kernels -Iffi -Icuda_harness)
TIMEOUT=${LNBWD_SANITIZER_TIMEOUT:-900}
source tests/cuda/control_report.sh

# The control's source: one buffer for every row's sum (exchange[1]) instead of two by parity.
ctl=$OUT/controls
mkdir -p "$ctl"
sed 's|exchange\[parity\] + (SMALL ? 0 : g \* warps)|exchange[1] + (SMALL ? 0 : g * warps)|' ffi/kernels/forward/forward_rows.cu \
  > "$ctl/forward_rows_one_buffer.cu"
if cmp -s "$ctl/forward_rows_one_buffer.cu" ffi/kernels/forward/forward_rows.cu; then
  echo "control one_buffer: the planted change did not apply"; exit 2
fi

# A compile that fails stops the script (no stale object of an earlier run may stand in for it).
rm -f "$OUT"/obj/*.o "$ctl"/*.o
pids=()
for f in tests/cuda/rms_check.cu ffi/registry.cc $(find ffi/kernels -name "*.cu" | sort); do
  "${NVCC[@]}" -c "$f" -o "$OUT/obj/$(basename "$f").o" &
  pids+=($!)
done
"${NVCC[@]}" -c "$ctl/forward_rows_one_buffer.cu" -o "$ctl/forward_rows_one_buffer.o" &
pids+=($!)
for pid in "${pids[@]}"; do wait "$pid" || exit 2; done
"${NVCC[@]}" "$OUT"/obj/*.o -o "$OUT/rms_check" || exit 2
"${NVCC[@]}" $(ls "$OUT"/obj/*.o | grep -v '/forward_rows.cu.o$') "$ctl/forward_rows_one_buffer.o" \
  -o "$ctl/rms_check_one_buffer" || exit 2
"$OUT/rms_check" | tail -5 || exit 1

status=0
export LNBWD_QUICK=1   # the reduced shape set: the sanitizers are slow
sanitize() {   # sanitize TOOL: one line of result (the four run side by side)
  local tool=$1 extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check full)
  [ "$tool" = synccheck ] && extra=(--num-cuda-barriers "${NUM_CUDA_BARRIERS:-8192}")   # kernel 12's mbarriers
  if timeout "$TIMEOUT" compute-sanitizer --tool "$tool" --error-exitcode 1 "${extra[@]}" "$OUT/rms_check" \
      > "$OUT/$tool.log" 2>&1; then
    echo "$tool: $(grep -Eo '(ERROR|RACECHECK) SUMMARY: .*' "$OUT/$tool.log" | tail -1)" \
         "($(grep -Eo 'rms check: [0-9]+ cases, [0-9]+ failures' "$OUT/$tool.log"))"
  else
    echo "$tool: FAILED (exit $?, see $OUT/$tool.log)"
  fi
}
control() {   # the planted race must be reported
  timeout "$TIMEOUT" compute-sanitizer --tool racecheck "$ctl/rms_check_one_buffer" > "$ctl/one_buffer.log" 2>&1
  control_report one_buffer racecheck "$ctl/one_buffer.log"
}
for tool in memcheck racecheck synccheck initcheck; do sanitize "$tool" > "$OUT/$tool.result" & done
control > "$ctl/one_buffer.result" &
wait
cat "$OUT"/{memcheck,racecheck,synccheck,initcheck}.result "$ctl/one_buffer.result"
grep -q FAILED "$OUT"/*.result && status=1
grep -q ": reported: " "$ctl/one_buffer.result" || status=1
rm -f "$ctl"/*.cu
exit $status
