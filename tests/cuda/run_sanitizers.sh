#!/usr/bin/env bash
# Runs every kernel under compute-sanitizer's four tools, from the standalone check (tests/cuda/check.cu:
# exact-size cudaMalloc buffers, as XLA's pooled allocator hides out-of-bounds accesses from memcheck), and
# proves the checks would notice: scratch copies of kernel 11, each with one planted bug (an
# out-of-bounds write and a missing barrier, which memcheck and racecheck must report; small rows'
# shuffles naming lanes that have left, which hang the check itself: run_plain_control, stopped
# after LNBWD_HANG_LIMIT seconds). Needs a GPU (sm_90), nvcc and compute-sanitizer; SAN_STEP=build
# compiles without a GPU, and SAN_STEP=run links and runs those objects (sanitize_lib.sh).
#   [SAN_STEP=all|build|run] [JOBS=12] [KERNELS="11 12"] [RACECHECK_PARTS=4] [LNBWD_SANITIZER_TIMEOUT=400]
#     [LNBWD_HANG_LIMIT=60] tests/cuda/run_sanitizers.sh [OUT_DIR [LOG_DIR]]
# racecheck, the slowest tool, checks each kernel in RACECHECK_PARTS processes side by side, each
# on its part of the cases (LNBWD_SHARD, cuda_harness/shard.h): one result line a part.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/sanitizers}
LOGS=${2:-$OUT}
source tests/cuda/sanitize_lib.sh
TIMEOUT=${LNBWD_SANITIZER_TIMEOUT:-400}
ctl=$OUT/controls
PLANTED=(oob race mask)
# The planted bugs are in kernel 11's row loop (kernel11_body.cuh): each control is a copy of
# kernel11_rows_in_registers.cu that includes a planted copy of the body instead. oob12 plants
# kernel 11's out-of-bounds write in kernel 12's ring of row chunks (a copy of the block's walk,
# kernel12_chunk_rows.cuh, and of kernel12_row_chunks.cu that includes it), whose rows arrive by
# bulk copies rather than by the threads' loads.
body=ffi/kernels/backward/registers/kernel11_body.cuh
rows=ffi/kernels/backward/registers/kernel11_rows_in_registers.cu
chunks=ffi/kernels/backward/tma_ring/kernel12_row_chunks.cu
chunk_rows=ffi/kernels/backward/tma_ring/kernel12_chunk_rows.cuh

if [ "$SAN_STEP" != run ]; then
  # The positive controls' sources, in scratch copies (deleted once compiled):
  mkdir -p "$ctl"
  rm -f "$ctl"/kernel11_* "$ctl"/kernel12_*
  # 1) One element past the end of dx: store the last row's vector at col + C (the next row, or
  #    past the buffer for the last row).
  sed 's|store_cs(reinterpret_cast<V\*>(dx + at() + col), dxv);|store_cs(reinterpret_cast<V*>(dx + at() + col + (row + 1 == rows ? C : 0)), dxv);|' \
    ffi/kernels/backward/registers/kernel11_body.cuh > "$ctl/kernel11_body_oob.cuh"
  # 2) No barrier between posting the warps' row sums and reading them.
  sed 's|      group_sync(1 + g, tpr);||' ffi/kernels/backward/registers/kernel11_body.cuh > "$ctl/kernel11_body_race.cuh"
  # 3) Small rows' shuffles naming the whole warp, while some of its groups have left the row loop.
  sed 's|const unsigned group_lanes = SMALL ? lanes_mask(tpr, lane) : 0xffffffffu;|const unsigned group_lanes = 0xffffffffu;|' \
    ffi/kernels/backward/registers/kernel11_body.cuh > "$ctl/kernel11_body_mask.cuh"
  planted_sources=()
  for planted in "${PLANTED[@]}"; do
    if grep -q . "$ctl/kernel11_body_$planted.cuh" && ! cmp -s "$ctl/kernel11_body_$planted.cuh" "$body"; then
      sed "s|#include \"backward/registers/kernel11_body.cuh\"|#include \"kernel11_body_$planted.cuh\"|" "$rows" \
        > "$ctl/kernel11_$planted.cu"
      planted_sources+=("$ctl/kernel11_$planted.cu")
    else
      echo "control $planted: the planted change did not apply"
    fi
  done
  sed 's|store_cs(reinterpret_cast<V\*>(dx + row \* C + col), dxv);|store_cs(reinterpret_cast<V*>(dx + row * C + col + (row + 1 == rows ? C : 0)), dxv);|' \
    ffi/kernels/backward/tma_ring/kernel12_chunk_rows.cuh > "$ctl/kernel12_chunk_rows_oob12.cuh"
  if cmp -s "$ctl/kernel12_chunk_rows_oob12.cuh" "$chunk_rows"; then
    echo "control oob12: the planted change did not apply"
  else
    sed 's|#include "backward/tma_ring/kernel12_chunk_rows.cuh"|#include "kernel12_chunk_rows_oob12.cuh"|' "$chunks" \
      > "$ctl/kernel12_row_chunks_oob12.cu"
    planted_sources+=("$ctl/kernel12_row_chunks_oob12.cu")
  fi
  # The check with every kernel and the registry it reads, then the controls' copies of kernel
  # 11. A compile that fails stops the script.
  compile "$OUT/obj" ffi/kernels tests/cuda/check.cu ffi/registry.cc $(find ffi/kernels -name "*.cu" | sort) || exit 2
  compile_control "$ctl" ffi/kernels "${planted_sources[@]}" || exit 2
  rm -f "$ctl"/*.cu "$ctl"/*.cuh
  [ "$SAN_STEP" = build ] && exit 0
fi

mkdir -p "$LOGS"
link "$OUT/check" "$OUT"/obj/*.o || exit 2
others=() others12=()
for o in "$OUT"/obj/*.o; do [[ $o = */kernel11_rows_in_registers.cu.o ]] || others+=("$o"); done
for o in "$OUT"/obj/*.o; do [[ $o = */kernel12_row_chunks.cu.o ]] || others12+=("$o"); done

# Each planted bug must make its tool fail. The controls run beside the main jobs.
controls() {
  local planted tool
  for planted in "${PLANTED[@]}"; do
    link_control "$planted" "$ctl/check_$planted" "$ctl/kernel11_$planted.cu.o" "${others[@]}" || continue
    tool=$(case $planted in oob) echo memcheck ;; race) echo racecheck ;; esac)
    # The mask bug is in small rows only (C up to 512), and no sanitizer reports it: the groups
    # still in the row loop wait at their shuffles for lanes that have left (run_plain_control), so
    # the plain check must hang or fail.
    if [ "$planted" = mask ]; then
      LNBWD_MAX_C=512 run_plain_control "$planted" "${LNBWD_HANG_LIMIT:-60}" "$ctl/check_$planted" 11
    else
      run_control "$planted" "$tool" "$ctl/check_$planted" 11
    fi
  done
  # Kernel 12's chunks at C <= 256 (where the ring of row chunks takes the rows).
  link_control oob12 "$ctl/check_oob12" "$ctl/kernel12_row_chunks_oob12.cu.o" "${others12[@]}" &&
    LNBWD_MAX_C=256 run_control oob12 memcheck "$ctl/check_oob12" 12
}

status=0
export LNBWD_QUICK=1   # the check's reduced shape set: the sanitizers are slow
# One (tool, kernel, part) per process, JOBS at a time: the GPU has room for all of them.
# racecheck is the slowest on kernels with many shared-memory accesses: smaller launches, and
# each kernel's cases in RACECHECK_PARTS parts.
sanitize_kernel() {   # sanitize_kernel TOOL KERNEL K/N: one line of result
  local tool=$1 kernel=$2 part=$3 label="$1 kernel $2" log=$LOGS/$1-k$2
  [ "$tool" = racecheck ] && export LNBWD_QUICK_MAX_ELEMENTS=3500000
  if [ "$part" != 0/1 ]; then
    label+=" (part $part)"
    log+="-part${part%/*}"
  fi
  LNBWD_SHARD=$part sanitize "$label" "$tool" "$log.log" 'check: [0-9]+ cases, [0-9]+ failures' \
    "$OUT/check" "$kernel"
}
export -f sanitize sanitize_kernel
export OUT LOGS TIMEOUT
controls > "$LOGS/controls.txt" 2>&1 &
ctl_pid=$!
parts=${RACECHECK_PARTS:-4}
for tool in racecheck memcheck synccheck initcheck; do   # the slowest first
  for kernel in ${KERNELS:-1 2 3 4 5 6 7 8 9 10 11 12}; do
    if [ "$tool" = racecheck ]; then
      for ((k = 0; k < parts; ++k)); do echo "$tool $kernel $k/$parts"; done
    else
      echo "$tool $kernel 0/1"
    fi
  done
done | xargs -P "${JOBS:-12}" -n 3 bash -c 'sanitize_kernel "$@"' _ | sort -k1,1 -k3,3n -k5,5 | tee "$LOGS/summary.txt"
grep -q FAILED "$LOGS/summary.txt" && status=1
wait $ctl_pid
cat "$LOGS/controls.txt"
[ "$(grep -Ec '\): reported: ' "$LOGS/controls.txt")" = "$((${#PLANTED[@]} + 1))" ] || status=1   # and oob12
exit $status
