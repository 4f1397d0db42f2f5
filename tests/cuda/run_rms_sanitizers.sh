#!/usr/bin/env bash
# Runs the RMSNorm standalone check (tests/cuda/rms_check.cu: the forward and kernels 11 and 12's
# backward with NormKind::kRmsNorm, exact-size cudaMalloc buffers, poisoned outputs) plainly and
# under compute-sanitizer's four tools. One positive control is RMSNorm's own: a scratch copy of
# forward_rows.cu whose rows post their sums into one shared buffer instead of alternating two
# must be reported by racecheck (the grid-stride cases reach it). The other controls are in
# run_sanitizers.sh and run_forward_sanitizers.sh: the same kernels.
# Needs a GPU (sm_90), nvcc and compute-sanitizer; SAN_STEP=build compiles without a GPU, and
# SAN_STEP=run links and runs those objects (sanitize_lib.sh).
#   [SAN_STEP=all|build|run] [LNBWD_SANITIZER_TIMEOUT=900] tests/cuda/run_rms_sanitizers.sh [OUT_DIR [LOG_DIR]]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/rms_sanitizers}
LOGS=${2:-$OUT}
source tests/cuda/sanitize_lib.sh
ctl=$OUT/controls

if [ "$SAN_STEP" != run ]; then
  # The control's source: one buffer for every row's sum (exchange[1]) instead of two by parity.
  mkdir -p "$ctl"
  sed 's|exchange\[parity\] + (SMALL ? 0 : g \* warps)|exchange[1] + (SMALL ? 0 : g * warps)|' ffi/kernels/forward/forward_rows.cu \
    > "$ctl/forward_rows_one_buffer.cu"
  if cmp -s "$ctl/forward_rows_one_buffer.cu" ffi/kernels/forward/forward_rows.cu; then
    echo "control one_buffer: the planted change did not apply"; exit 2
  fi
  # A compile that fails stops the script.
  compile "$OUT/obj" ffi/kernels tests/cuda/rms_check.cu ffi/registry.cc $(find ffi/kernels -name "*.cu" | sort) || exit 2
  compile_control "$ctl" ffi/kernels "$ctl/forward_rows_one_buffer.cu" || exit 2
  rm -f "$ctl"/*.cu
  [ "$SAN_STEP" = build ] && exit 0
fi

mkdir -p "$LOGS"
link "$OUT/rms_check" "$OUT"/obj/*.o || exit 2
others=()
for o in "$OUT"/obj/*.o; do [[ $o = */forward_rows.cu.o ]] || others+=("$o"); done
link "$ctl/rms_check_one_buffer" "${others[@]}" "$ctl/forward_rows_one_buffer.cu.o" || exit 2
"$OUT/rms_check" | tail -5 || exit 1

export LNBWD_QUICK=1   # the reduced shape set: the sanitizers are slow
four_tools 'rms check: [0-9]+ cases, [0-9]+ failures' "$OUT/rms_check"
# The planted race must be reported.
run_control one_buffer racecheck "$ctl/rms_check_one_buffer" > "$LOGS/one_buffer.result" &
wait
verdict one_buffer
