#!/usr/bin/env bash
# Runs every kernel under compute-sanitizer's four tools, from the standalone check (tests/cuda/check.cu:
# exact-size cudaMalloc buffers, as XLA's pooled allocator hides out-of-bounds accesses from memcheck), and
# proves the tools would notice: scratch copies of kernel 11, each with one planted bug (an
# out-of-bounds write, a missing barrier, small rows' shuffles naming lanes that have left), must
# be reported. Needs a GPU (sm_90), nvcc and compute-sanitizer.
#   [CHECK=prebuilt] [JOBS=12] [KERNELS="11 12"] [LNBWD_SANITIZER_TIMEOUT=400] tests/cuda/run_sanitizers.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/sanitizers}
mkdir -p "$OUT/obj"
NVCC=(nvcc -O3 -lineinfo -std=c++17 -arch=sm_90 -Iffi/kernels -Iffi -Icuda_harness)

# Build the check (objects in parallel), with the kernel registry it reads.
build() {   # build OUT_BINARY KERNEL_SOURCES...
  local bin=$1 dir=$OUT/obj/$(basename "$1")
  shift
  mkdir -p "$dir"
  rm -f "$dir"/*.o   # the link takes every object here: none may be left from an earlier run
  local pids=() pid
  for f in tests/cuda/check.cu ffi/registry.cc "$@"; do "${NVCC[@]}" -c "$f" -o "$dir/$(basename "$f").o" & pids+=($!); done
  for pid in "${pids[@]}"; do wait "$pid" || return 1; done
  "${NVCC[@]}" "$dir"/*.o -o "$bin"
}
# CHECK=path reuses a check built from the same sources (with -lineinfo, for file:line reports).
if [ -n "${CHECK:-}" ]; then cp "$CHECK" "$OUT/check" || exit 2; else build "$OUT/check" $(find ffi/kernels -name "*.cu" | sort) || exit 2; fi

# Positive controls, in scratch copies that are deleted afterwards: each planted bug must make
# its tool fail. They run beside the main jobs.
controls() {
  ctl=$OUT/controls
  mkdir -p "$ctl"
  others=$(find ffi/kernels -name "*.cu" | sort | grep -v kernel11_rows_in_registers.cu)
  # The planted bugs are in kernel 11's row loop (kernel11_body.cuh): each control is a copy of
  # kernel11_rows_in_registers.cu that includes a planted copy of the body instead.
  body=ffi/kernels/backward/registers/kernel11_body.cuh
  # 1) One element past the end of dx: store the last row's vector at col + C (the next row, or
  #    past the buffer for the last row).
  sed 's|store_cs(reinterpret_cast<V\*>(dx + at() + col), dxv);|store_cs(reinterpret_cast<V*>(dx + at() + col + (row + 1 == rows ? C : 0)), dxv);|' \
    ffi/kernels/backward/registers/kernel11_body.cuh > "$ctl/kernel11_body_oob.cuh"
  # 2) No barrier between posting the warps' row sums and reading them.
  sed 's|      group_sync(1 + g, tpr);||' ffi/kernels/backward/registers/kernel11_body.cuh > "$ctl/kernel11_body_race.cuh"
  # 3) Small rows' shuffles naming the whole warp, while some of its groups have left the row loop.
  sed 's|const unsigned group_lanes = SMALL ? lanes_mask(tpr, lane) : 0xffffffffu;|const unsigned group_lanes = 0xffffffffu;|' \
    ffi/kernels/backward/registers/kernel11_body.cuh > "$ctl/kernel11_body_mask.cuh"
  for planted in oob race mask; do
    grep -q . "$ctl/kernel11_body_$planted.cuh" && ! cmp -s "$ctl/kernel11_body_$planted.cuh" "$body" \
      || { echo "control $planted: the planted change did not apply"; continue; }
    sed "s|#include \"backward/registers/kernel11_body.cuh\"|#include \"kernel11_body_$planted.cuh\"|" \
      ffi/kernels/backward/registers/kernel11_rows_in_registers.cu > "$ctl/kernel11_$planted.cu"
    build "$ctl/check_$planted" $others "$ctl/kernel11_$planted.cu" || { continue; }
    tool=$(case $planted in oob) echo memcheck ;; race) echo racecheck ;; *) echo synccheck ;; esac)
    if timeout "${LNBWD_SANITIZER_TIMEOUT:-400}" compute-sanitizer --tool "$tool" --error-exitcode 1 "$ctl/check_$planted" 11 > "$ctl/$planted.log" 2>&1; then
      echo "control $planted ($tool): NOT reported - the check would miss this bug"
    else
      echo "control $planted ($tool): reported: $(grep -Eo '(ERROR|RACECHECK) SUMMARY: .*' "$ctl/$planted.log" | tail -1)"
    fi
  done
  rm -f "$ctl"/*.cu "$ctl"/*.cuh
}

status=0
export LNBWD_QUICK=1   # the check's reduced shape set: the sanitizers are slow
# One (tool, kernel) pair per process, JOBS at a time: the GPU has room for all of them.
sanitize() {   # sanitize TOOL KERNEL: one line of result
  local tool=$1 kernel=$2 extra=() env=()
  [ "$tool" = memcheck ] && extra=(--leak-check full)
  # Kernel 12's mbarriers (groups x ring slots per block, up to 75 with split rows) outnumber
  # what synccheck tracks by default, and its grids are cooperative (every block resident at
  # once), so all blocks' barriers are alive together: raise synccheck's count.
  [ "$tool" = synccheck ] && extra=(--num-cuda-barriers "${NUM_CUDA_BARRIERS:-8192}")
  # racecheck is the slowest on kernels with many shared-memory accesses: smaller launches.
  [ "$tool" = racecheck ] && env=(LNBWD_QUICK_MAX_ELEMENTS=3500000)
  if env "${env[@]}" timeout "${LNBWD_SANITIZER_TIMEOUT:-400}" compute-sanitizer --tool "$tool" --error-exitcode 1 "${extra[@]}" \
      "$OUT/check" "$kernel" > "$OUT/$tool-k$kernel.log" 2>&1; then
    echo "$tool kernel $kernel: $(grep -Eo '(ERROR|RACECHECK) SUMMARY: .*' "$OUT/$tool-k$kernel.log" | tail -1)" \
         "($(grep -Eo 'check: [0-9]+ cases, [0-9]+ failures' "$OUT/$tool-k$kernel.log"))"
  else
    echo "$tool kernel $kernel: FAILED (exit $?, see $OUT/$tool-k$kernel.log)"
  fi
}
export -f sanitize
export OUT
controls > "$OUT/controls.txt" 2>&1 &
ctl_pid=$!
for tool in racecheck memcheck synccheck initcheck; do   # the slowest first
  for kernel in ${KERNELS:-1 2 3 4 5 6 7 8 9 10 11 12}; do echo "$tool $kernel"; done
done | xargs -P "${JOBS:-12}" -n 2 bash -c 'sanitize "$@"' _ | sort -k1,1 -k3,3n | tee "$OUT/summary.txt"
grep -q FAILED "$OUT/summary.txt" && status=1
wait $ctl_pid
cat "$OUT/controls.txt"
[ "$(grep -Ec '\): reported: (ERROR|RACECHECK) SUMMARY: [1-9]' "$OUT/controls.txt")" = 3 ] || status=1
exit $status
