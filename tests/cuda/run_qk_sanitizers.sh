#!/usr/bin/env bash
# Runs the QK-norm standalone check (tests/cuda/qk_check.cu: the one-launch forward and backward
# over two sets of head rows, both layouts, exact-size cudaMalloc buffers, poisoned outputs)
# plainly and under compute-sanitizer's four tools, and one positive control: a scratch copy of
# common/head_rows.h whose head_row_offset is one head on (it counts heads from 1, not 0), so that every row is read and
# written one head further on and the last token's last head past its buffer's end (the separate
# layout's buffers are exactly q's and k's rows), which memcheck must report. (A cursor that
# forgets its carry would not do: it lands on other rows inside the buffer, which the plain check
# sees and memcheck cannot.)
# Needs a GPU (sm_90), nvcc and compute-sanitizer; SAN_STEP=build compiles without a GPU, and
# SAN_STEP=run links and runs those objects (sanitize_lib.sh).
#   [SAN_STEP=all|build|run] [PLAIN_PARTS=3] [LNBWD_SANITIZER_TIMEOUT=900] tests/cuda/run_qk_sanitizers.sh [OUT_DIR [LOG_DIR]]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/qk_sanitizers}
LOGS=${2:-$OUT}
source tests/cuda/sanitize_lib.sh
ctl=$OUT/controls
kernels=(ffi/registry.cc $(find ffi/kernels -name "*.cu" | sort))
# Only the sets' kernels use head rows: the control compiles only their files again.
sets=(forward/forward_rows.cu backward/registers/kernel11_sets.cu)

if [ "$SAN_STEP" != run ]; then
  # The control's headers: a copy of ffi/kernels whose head rows are one head off.
  rm -rf "$ctl" && mkdir -p "$ctl/kernels"
  cp -r ffi/kernels/. "$ctl/kernels/"
  sed 's|return th.token \* h.token_stride + static_cast<int64_t>(th.head) \* C;|return th.token * h.token_stride + static_cast<int64_t>(th.head + 1) * C;|' \
    ffi/kernels/common/head_rows.h > "$ctl/kernels/common/head_rows.h"
  if cmp -s "$ctl/kernels/common/head_rows.h" ffi/kernels/common/head_rows.h; then
    echo "control head_off_by_one: the planted change did not apply"; exit 2
  fi
  # A compile that fails stops the script.
  compile "$OUT/obj" ffi/kernels tests/cuda/qk_check.cu "${kernels[@]}" || exit 2
  compile_control "$ctl" "$ctl/kernels" "${sets[@]/#/$ctl/kernels/}" || exit 2
  rm -rf "$ctl/kernels"
  [ "$SAN_STEP" = build ] && exit 0
fi

mkdir -p "$LOGS"
link "$OUT/qk_check" "$OUT"/obj/*.o || exit 2
others=()
for o in "$OUT"/obj/*.o; do
  case $o in */forward_rows.cu.o | */kernel11_sets.cu.o) ;; *) others+=("$o") ;; esac
done
link "$ctl/qk_check_head_off" "${others[@]}" "$ctl"/*.o || exit 2
# The plain check (every shape, within the tools' time limit) runs beside the tools (the reduced
# set): it is the slowest single step, and it needs the GPU far less than they need the host. One
# process a dtype and part (PLAIN_PARTS a dtype, LNBWD_SHARD: cuda_harness/shard.h), side by side:
# one process's float64 reference is what takes the time.
plain_dtypes=(float32 bfloat16 float16 float64)
parts=${PLAIN_PARTS:-3}
plain_log() { echo "$LOGS/plain_$1_part$2.log"; }   # plain_log DTYPE PART
for d in "${plain_dtypes[@]}"; do
  for ((k = 0; k < parts; ++k)); do
    log=$(plain_log "$d" "$k")
    (LNBWD_DTYPE=$d LNBWD_SHARD=$k/$parts timeout "$TIMEOUT" "$OUT/qk_check" > "$log" 2>&1
     echo "plain exit $?" >> "$log") &
  done
done

export LNBWD_QUICK=1   # the reduced shape set: the sanitizers are slow
four_tools 'qk check: [0-9]+ cases, [0-9]+ failures' "$OUT/qk_check"
# The planted walk past the buffer's end must be reported.
run_control head_off_by_one memcheck "$ctl/qk_check_head_off" > "$LOGS/head_off_by_one.result" &
wait
status=0
for d in "${plain_dtypes[@]}"; do
  for ((k = 0; k < parts; ++k)); do
    log=$(plain_log "$d" "$k")
    echo "plain $d (part $k/$parts): $(grep -E "^qk check" "$log") ($(tail -n 1 "$log"))"
    grep -q "^plain exit 0$" "$log" || status=1
  done
done
verdict head_off_by_one || status=1
exit $status
