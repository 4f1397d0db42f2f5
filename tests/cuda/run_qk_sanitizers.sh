#!/usr/bin/env bash
# Runs the QK-norm standalone check (tests/cuda/qk_check.cu: the one-launch forward and backward
# over two sets of head rows, both layouts, exact-size cudaMalloc buffers, poisoned outputs)
# plainly and under compute-sanitizer's four tools, and one positive control: a scratch copy of
# common/head_rows.h whose head_row_offset is one head on (it counts heads from 1, not 0), so that every row is read and
# written one head further on and the last token's last head past its buffer's end (the separate
# layout's buffers are exactly q's and k's rows), which memcheck must report. (A cursor that
# forgets its carry would not do: it lands on other rows inside the buffer, which the plain check
# sees and memcheck cannot.)
# Needs a GPU (sm_90), nvcc and compute-sanitizer.
#   [LNBWD_SANITIZER_TIMEOUT=900] tests/cuda/run_qk_sanitizers.sh [OUT_DIR]
# The two binaries can be compiled on a machine without a GPU and run on one:
#   QK_STEP=build tests/cuda/run_qk_sanitizers.sh DIR   (nvcc only; writes DIR's binaries)
#   QK_STEP=run tests/cuda/run_qk_sanitizers.sh DIR     (runs DIR's binaries, compiles nothing)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/qk_sanitizers}
STEP=${QK_STEP:-all}
mkdir -p "$OUT/obj"
NVCC=(nvcc -O3 -lineinfo -std=c++17 -arch=sm_90 -Iffi/kernels -Iffi -Icuda_harness)
TIMEOUT=${LNBWD_SANITIZER_TIMEOUT:-900}
source tests/cuda/control_report.sh

ctl=$OUT/controls
if [ "$STEP" != run ]; then
# The control's headers: a copy of ffi/kernels whose head rows are one head off. Only the sets'
# kernels use head rows, so only their files are compiled again.
rm -rf "$ctl" && mkdir -p "$ctl/kernels"
cp -r ffi/kernels/. "$ctl/kernels/"
sed 's|return th.token \* h.token_stride + static_cast<int64_t>(th.head) \* C;|return th.token * h.token_stride + static_cast<int64_t>(th.head + 1) * C;|' \
  ffi/kernels/common/head_rows.h > "$ctl/kernels/common/head_rows.h"
if cmp -s "$ctl/kernels/common/head_rows.h" ffi/kernels/common/head_rows.h; then
  echo "control head_off_by_one: the planted change did not apply"; exit 2
fi
sets=(forward/forward_rows.cu backward/registers/kernel11_sets.cu)

# A compile that fails stops the script (no stale object of an earlier run may stand in for it).
rm -f "$OUT"/obj/*.o "$ctl"/*.o
pids=()
for f in tests/cuda/qk_check.cu ffi/registry.cc $(find ffi/kernels -name "*.cu" | sort); do
  "${NVCC[@]}" -c "$f" -o "$OUT/obj/$(basename "$f").o" &
  pids+=($!)
done
for f in "${sets[@]}"; do
  nvcc -O3 -lineinfo -std=c++17 -arch=sm_90 -I"$ctl/kernels" -Iffi -Icuda_harness -c "$ctl/kernels/$f" \
    -o "$ctl/$(basename "$f").o" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || exit 2; done
"${NVCC[@]}" "$OUT"/obj/*.o -o "$OUT/qk_check" || exit 2
"${NVCC[@]}" $(ls "$OUT"/obj/*.o | grep -v -e '/forward_rows.cu.o$' -e '/kernel11_sets.cu.o$') "$ctl"/*.o \
  -o "$ctl/qk_check_head_off" || exit 2
rm -rf "$ctl/kernels" "$OUT/obj" "$ctl"/*.o
[ "$STEP" = build ] && exit 0
fi
"$OUT/qk_check" | tail -5 || exit 1

status=0
export LNBWD_QUICK=1   # the reduced shape set: the sanitizers are slow
sanitize() {   # sanitize TOOL: one line of result (the four run side by side)
  local tool=$1 extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check full)
  if timeout "$TIMEOUT" compute-sanitizer --tool "$tool" --error-exitcode 1 "${extra[@]}" "$OUT/qk_check" \
      > "$OUT/$tool.log" 2>&1; then
    echo "$tool: $(grep -Eo '(ERROR|RACECHECK) SUMMARY: .*' "$OUT/$tool.log" | tail -1)" \
         "($(grep -Eo 'qk check: [0-9]+ cases, [0-9]+ failures' "$OUT/$tool.log"))"
  else
    echo "$tool: FAILED (exit $?, see $OUT/$tool.log)"
  fi
}
control() {   # the planted walk past the buffer's end must be reported
  timeout "$TIMEOUT" compute-sanitizer --tool memcheck "$ctl/qk_check_head_off" > "$ctl/head_off.log" 2>&1
  control_report head_off_by_one memcheck "$ctl/head_off.log"
}
for tool in memcheck racecheck synccheck initcheck; do sanitize "$tool" > "$OUT/$tool.result" & done
control > "$ctl/head_off.result" &
wait
cat "$OUT"/{memcheck,racecheck,synccheck,initcheck}.result "$ctl/head_off.result"
grep -q FAILED "$OUT"/*.result && status=1
grep -q ": reported: " "$ctl/head_off.result" || status=1
exit $status
