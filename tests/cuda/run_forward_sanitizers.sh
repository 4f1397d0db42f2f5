#!/usr/bin/env bash
# Runs the fused forward's standalone check (tests/cuda/forward_check.cu: exact-size cudaMalloc
# buffers, every path, plain and residual variant) plainly and under compute-sanitizer's four
# tools, and proves the tools would notice: scratch copies of forward_rows.cu with one planted
# out-of-bounds store (of y; of the residual variant's s) and one missing barrier must be
# reported, and one planted sum across row groups must make the plain check fail. Everything is
# compiled at once, and the tools and controls run side by side.
# Needs a GPU (sm_90), nvcc and compute-sanitizer; SAN_STEP=build compiles without a GPU, and
# SAN_STEP=run links and runs those objects (sanitize_lib.sh).
#   [SAN_STEP=all|build|run] [LNBWD_SANITIZER_TIMEOUT=900] [LNBWD_HANG_LIMIT=120] tests/cuda/run_forward_sanitizers.sh [OUT_DIR [LOG_DIR]]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/forward_sanitizers}
LOGS=${2:-$OUT}
source tests/cuda/sanitize_lib.sh
KERNELS=(ffi/kernels/forward/forward_launch.cu ffi/kernels/forward/forward_wide.cu ffi/kernels/common/occupancy.cu
         ffi/kernels/common/device_limits.cu)
PLANTED=(oob race oob_s cross)
ctl=$OUT/controls
status=0

if [ "$SAN_STEP" != run ]; then
  # The positive controls' sources: scratch copies of forward_rows.cu, each with one planted bug
  # (deleted once compiled): a store of y one row past the end, a missing barrier between the
  # warps' row sums and their reads, a store of s one row past the end, and small rows' sums
  # taken one butterfly step too wide (cross: offsets from tpr down, over the whole warp), so that
  # each row's sum takes in the neighbouring group's row.
  # No sanitizer reports cross (its shuffles are well-formed; only their lanes are wrong): the
  # plain check must fail (run_plain_control). A shuffle mask naming the whole warp is no control
  # here: shfl.sync waits only for the named lanes that have not exited (sm_70 and later), and the
  # forward's groups past the last row exit, so the sums come out the same.
  mkdir -p "$ctl"
  rm -f "$ctl"/forward_rows_*
  sed 's|if (in_row(j)) \*y = normalize|if (in_row(j)) y[row + 1 == a.rows ? C / VEC : 0] = normalize|' \
    ffi/kernels/forward/forward_rows.cu > "$ctl/forward_rows_oob.cu"
  sed 's|auto sync = \[\] { __syncthreads(); };|auto sync = [] {};|' \
    ffi/kernels/forward/forward_rows.cu > "$ctl/forward_rows_race.cu"
  sed 's|\*sp = xv\[j\];|sp[row + 1 == a.rows ? C / VEC : 0] = xv[j];|' \
    ffi/kernels/forward/forward_rows.cu > "$ctl/forward_rows_oob_s.cu"
  sed 's|if constexpr (SMALL) return lanes_sum(v, tpr, group_lanes);|if constexpr (SMALL) return lanes_sum(v, 2 * tpr, 0xffffffffu);|' \
    ffi/kernels/forward/forward_rows.cu > "$ctl/forward_rows_cross.cu"
  planted_sources=()
  for planted in "${PLANTED[@]}"; do
    if cmp -s "$ctl/forward_rows_$planted.cu" ffi/kernels/forward/forward_rows.cu; then
      echo "control $planted: the planted change did not apply"; status=1
    else
      planted_sources+=("$ctl/forward_rows_$planted.cu")
    fi
  done
  # Every object at once (forward_rows.cu and its planted copies are the slow ones). A compile
  # that fails stops the script.
  compile "$OUT/obj" ffi/kernels tests/cuda/forward_check.cu ffi/kernels/forward/forward_rows.cu "${KERNELS[@]}" ||
    exit 2
  compile_control "$ctl" ffi/kernels "${planted_sources[@]}" || exit 2
  rm -f "$ctl"/*.cu
  [ "$SAN_STEP" = build ] && exit $status
fi

# The check, and one binary per control, which differ only in their forward_rows object.
mkdir -p "$LOGS"
common=("$(object "$OUT/obj" tests/cuda/forward_check.cu)")
for f in "${KERNELS[@]}"; do common+=("$(object "$OUT/obj" "$f")"); done
link "$OUT/forward_check" "${common[@]}" "$(object "$OUT/obj" forward_rows.cu)" || exit 2
"$OUT/forward_check" check | tail -5 || exit 1

export LNBWD_QUICK=1   # the reduced shape set: the sanitizers are slow
four_tools 'forward check: [0-9]+ cases, [0-9]+ failures' "$OUT/forward_check" check
control() {   # control PLANTED: each planted bug must make its tool report (cross: the plain check fail)
  local planted=$1 tool=memcheck
  [ "$planted" = race ] && tool=racecheck
  link_control "$planted" "$ctl/check_$planted" "$ctl/forward_rows_$planted.cu.o" "${common[@]}" || return
  if [ "$planted" = cross ]; then
    run_plain_control "$planted" "${LNBWD_HANG_LIMIT:-120}" "$ctl/check_$planted" check
  else
    run_control "$planted" "$tool" "$ctl/check_$planted" check
  fi
}
for planted in "${PLANTED[@]}"; do control "$planted" > "$LOGS/$planted.result" & done
wait
verdict "${PLANTED[@]}" || status=1
exit $status
