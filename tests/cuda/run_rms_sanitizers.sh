#!/usr/bin/env bash
# Runs the RMSNorm standalone check (tests/cuda/rms_check.cu: the forward and kernels 11 and 12's
# backward with NormKind::kRmsNorm, exact-size cudaMalloc buffers, poisoned outputs) plainly and
# under compute-sanitizer's four tools. (The positive controls that prove the tools notice a
# planted bug are in run_sanitizers.sh and run_forward_sanitizers.sh: the same kernels.)
# Needs a GPU (sm_90), nvcc and compute-sanitizer.
#   [LNBWD_SANITIZER_TIMEOUT=900] tests/cuda/run_rms_sanitizers.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/rms_sanitizers}
mkdir -p "$OUT/obj"
NVCC=(nvcc -O3 -lineinfo -std=c++17 -arch=sm_90 -Iffi/kernels -Iffi)
TIMEOUT=${LNBWD_SANITIZER_TIMEOUT:-900}

# A compile that fails stops the script (no stale object of an earlier run may stand in for it).
rm -f "$OUT"/obj/*.o
pids=()
for f in tests/cuda/rms_check.cu ffi/registry.cc $(find ffi/kernels -name "*.cu" | sort); do
  "${NVCC[@]}" -c "$f" -o "$OUT/obj/$(basename "$f").o" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || exit 2; done
"${NVCC[@]}" "$OUT"/obj/*.o -o "$OUT/rms_check" || exit 2
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
for tool in memcheck racecheck synccheck initcheck; do sanitize "$tool" > "$OUT/$tool.result" & done
wait
cat "$OUT"/{memcheck,racecheck,synccheck,initcheck}.result
grep -q FAILED "$OUT"/*.result && status=1
exit $status
