#!/usr/bin/env bash
# The checks and measurements of a GPU machine, in stages, each logging under OUT (default $OUT
# or /tmp/gpu_check). Run from a checkout on the GPU machine:
#   tools/gpu/gpu_check.sh STAGE...
# Stages:
#   build      pip install the package (no build isolation: the machine's jax and its CUDA plugin)
#   prebuilt   instead of build: what tools/gpu/prebuild.sh compiled elsewhere (PREBUILT, default
#              build/prebuilt): the extension into jax_lnbwd/, the checkout onto python3's
#              sys.path (a .pth file, as build's editable install); into BINS (default /tmp/lnbwd_bins),
#              the sanitizer scripts' objects (BINS/san) for the sanitize and qk stages, which then
#              only link and run them, and tune and check linked from them for the check and small
#              stages
#   tests      the GPU test suite (pytest -m gpu), the `slow` ones (a second build, 100,000
#              segments) included only with SLOW=1
#   check      tests/cuda/check.cu for every backward kernel (LNBWD_QUICK=1)
#   sanitize   the three below (about 10 minutes together)
#   sanitize_bwd  compute-sanitizer over kernels 11 and 12 (run_sanitizers.sh; about 5 minutes)
#   sanitize_fwd  the forward (run_forward_sanitizers.sh)
#   sanitize_rms  RMSNorm through both (run_rms_sanitizers.sh)
#   kernels    the kernel bench on the README's shapes (SHAPES), three dtypes
#   rms        the kernel bench's rmsnorm rows (forward, backward, add) with every peer
#   coop       the same bench with the cooperative in-grid finish (A/B of the launch path)
#   forward    the forward bench: layernorm and add_layernorm in bf16, fp16 and fp32
#   sweep      the forward's configuration sweep (tools/tune/forward_tune.cu: every row group, and
#              the pick) of SWEEP_SHAPES (forward_tune arguments, comma-separated), each in chain
#              mode: every launch reads the launch before's output, as in the kernel bench
#   l2         the L2-resident shapes (8192x768, 1024x768): every norm op against every peer
#   ncu        ncu's key lines (DRAM throughput, issue rate, stalls, occupancy, registers, waves) of
#              the forward on NCU_SHAPES (forward_tune arguments, comma-separated; the auto pick),
#              of kernel 12 at 16384x1600 bf16, and of our rmsnorm forward beside Liger's (the
#              bench's chain at 16384x2048 bf16)
#   kernel_time  the kernel bench with --kernel-time (each step's kernels alone beside the step)
#              for ours, Liger's and the copy, for each KERNEL_TIME "op:shape:dtype" (space-separated;
#              default: rmsnorm_fwd 16384x4096 and the forwards at 1024x768, bf16): what the
#              framework adds per call
#   crossover  the dispatch rule's crossovers: ours against XLA's fusion (and the default, the
#              rule's pick) for every norm op, forward and backward, bf16 and fp32, over C from 32
#              to 16384 at about 64 MB a tensor and at L2-sized shapes (CROSS_SHAPES, CROSS_OPS,
#              CROSS_PEERS override); jax_lnbwd/dispatch.py's table comes from it
#   small      the small rows (C 32-512; head_dim norms): kernel 11's configurations and the
#              forward's row groups (tools/tune), then the kernel bench's small-C rows of the
#              layernorm and rmsnorm ops, forward and backward, bf16 and fp32, with every peer
#   qk         QK-norm's one-launch kernels: the forward's one launch against two in the harness
#              (tools/tune/forward_tune.cu sets=32:8), tests/cuda/qk_check.cu plainly and under the four
#              sanitizers with its control (run_qk_sanitizers.sh), the QK-norm tests on the GPU,
#              and the kernel bench's qk_norm ops (separate and fused, forward and backward, bf16
#              and fp32) with every peer
#   e2e        the training-step bench
#   ab         a kernel change's before and after, in the same run on the same machine: the kernel
#              bench of AB_OPS (default layernorm_bwd,rmsnorm_bwd) on AB_SHAPES (default the small-C
#              rows; empty: the ops' own shapes) in AB_DTYPES (default bfloat16,float32) beside
#              AB_PEERS (default copy), first with the extension in jax_lnbwd/ (the change: OUT/ab_new),
#              then with another build's, AB_BASE (a tools/gpu/prebuild.sh folder, default
#              build/prebuilt_base: OUT/ab_base), from a copy of jax_lnbwd/ that holds it: the
#              checkout's extension is never replaced, so a stage cut short leaves it in place
# PEERS: the forward and l2 stages' --peers (by default every peer but Pallas, to keep the stages
# short: name it in PEERS to add it).
# The build stage first installs the wheels in PEER_WHEELS (default build/peer-wheels), when there
# are any: the bench peers a GPU machine without network lacks (tools/gpu/fetch_peer_wheels.sh
# downloads them on a machine with network).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_check}
PEER_WHEELS=${PEER_WHEELS:-build/peer-wheels}
BINS=${BINS:-/tmp/lnbwd_bins}   # tune, check and the sanitizers' objects (san/); outside OUT, which is for logs
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SHAPES=${SHAPES:-16384x1600,16384x2048,16384x4096,8192x8192,4096x16384,1024x768}
status=0
run() {   # run NAME COMMAND...: tee the output to OUT/NAME.log, remember a failure
  local name=$1
  shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log" | tail -n "${TAIL:-15}"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}
# sanitizer NAME STAGE SCRIPT: a sanitizer script (tests/cuda), its logs in OUT/STAGE. Its objects
# and binaries live in BINS/san/NAME: where the prebuilt stage unpacked objects there, it only
# links and runs them (SAN_STEP=run); else it compiles them there first.
sanitizer() {
  local dir=$BINS/san/$1 step=all
  [ -d "$dir/obj" ] && step=run
  SAN_STEP=$step run "$2" "tests/cuda/$3" "$dir" "$OUT/$2"
}
unpack_ext() {   # unpack_ext DIR [ROOT]: a tools/gpu/prebuild.sh folder's extension, into ROOT/jax_lnbwd/
  xz -dc "$1/ext.so.xz" > "${2:-.}/jax_lnbwd/$(cat "$1/ext.name")"
}
install_peer_wheels() {   # the bench peers from PEER_WHEELS, when there are any
  ls "$PEER_WHEELS"/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps "$PEER_WHEELS"/*.whl
}
for stage in "$@"; do
  case $stage in
    build)
      install_peer_wheels
      # Editable: `python -m pytest` puts the checkout first on sys.path, where an installed
      # (non-editable) package would be shadowed by the source folder, which has no extension.
      run build python3 -m pip install -q --no-build-isolation --no-deps -e . ;;
    prebuilt)
      dir=${PREBUILT:-build/prebuilt}
      install_peer_wheels
      unpack_ext "$dir" || status=1
      # What build's editable install gives every Python process: the checkout on sys.path, here
      # through a .pth file in python3's site-packages. `python -m pytest` finds the package
      # anyway (the checkout is its cwd); the tests' subprocesses (`python -c`, the e2e
      # bench's workers) start elsewhere and would not.
      echo "$PWD" > "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/jax_lnbwd_checkout.pth" ||
        status=1
      mkdir -p "$BINS"
      if [ -f "$dir/san.tar.xz" ]; then
        rm -rf "$BINS/san" && tar xJf "$dir/san.tar.xz" -C "$BINS" &&
          KERNEL_OBJECTS=$BINS/san/bwd/obj tools/tune/build.sh "$BINS" tune check > /dev/null || status=1
      fi ;;
    tests)
      marks="gpu and not slow"
      [ -z "${SLOW:-}" ] || marks=gpu
      run tests python3 -m pytest -q -m "$marks" -n "${JOBS:-4}" tests ;;
    check)
      [ -x "$BINS/check" ] || tools/tune/build.sh "$BINS" check || status=1
      LNBWD_QUICK=1 run check "$BINS/check" ;;
    sanitize | sanitize_bwd | sanitize_fwd | sanitize_rms)
      [[ $stage = sanitize || $stage = sanitize_bwd ]] && KERNELS="11 12" sanitizer bwd sanitize run_sanitizers.sh
      [[ $stage = sanitize || $stage = sanitize_fwd ]] && sanitizer forward sanitize_forward run_forward_sanitizers.sh
      [[ $stage = sanitize || $stage = sanitize_rms ]] && sanitizer rms sanitize_rms run_rms_sanitizers.sh
      true ;;
    kernels)
      run kernels python3 -m benchmarks.kernels --dtypes bfloat16,float32,float16 --shapes "$SHAPES" \
        --no-progress --out "$OUT/kernels" ;;
    coop)
      JAX_LNBWD_COOPERATIVE_FINISH=1 run coop python3 -m benchmarks.kernels --dtypes bfloat16,float32,float16 \
        --shapes "$SHAPES" --peers copy --no-progress --out "$OUT/coop" ;;
    rms)
      run rms python3 -m benchmarks.kernels --op rmsnorm_fwd,rmsnorm_bwd,add_rmsnorm_fwd --dtypes bfloat16,float32 \
        --no-progress --out "$OUT/rms" ;;
    l2)
      run l2 python3 -m benchmarks.kernels --op layernorm_fwd,layernorm_bwd,add_layernorm_fwd,rmsnorm_fwd,rmsnorm_bwd \
        --dtypes bfloat16,float32 --shapes 8192x768,1024x768 --peers "${PEERS:-xla,autodiff,copy,liger,torch,ours-unfus}" \
        --no-progress --out "$OUT/l2" ;;
    forward)
      run forward python3 -m benchmarks.kernels --op forward,add_forward --dtypes bfloat16,float16,float32 \
        --shapes 16384x1600,16384x2048,8192x8192,16384x1024,4096x16384,8192x768 \
        --peers "${PEERS:-xla,copy,liger,torch,ours-unfus}" --no-progress --out "$OUT/forward" ;;
    sweep)
      tools/tune/build.sh /tmp/lnbwd_tune forward_tune || status=1
      IFS=, read -ra sweep_shapes <<< "${SWEEP_SHAPES:-16384 1600 bfloat16,16384 2048 bfloat16,8192 8192 bfloat16,16384 4096 bfloat16 rms,4096 16384 bfloat16 rms,8192 8192 float32 rms}"
      for s in "${sweep_shapes[@]}"; do
        # shellcheck disable=SC2086 (the arguments split on purpose)
        /tmp/lnbwd_tune/forward_tune $s chain
      done > "$OUT/sweep.log" 2>&1
      grep -E "norm|auto" "$OUT/sweep.log" ;;
    ncu)
      tools/tune/build.sh /tmp/lnbwd_tune forward_tune -- -lineinfo || status=1
      keys='Duration|DRAM Throughput|Issued Warp Per Scheduler|No Eligible|Warp Cycles Per Issued|Registers Per|Waves Per SM'
      keys="$keys|Theoretical Occupancy|Achieved Occupancy|Block Limit Registers|Stall"
      sections=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats
                --section SchedulerStats)
      # NCU_SHAPES: comma-separated forward_tune arguments, "ROWS C DTYPE [f32params] [residual]
      # [rms] [tpr=N]" (tpr=N: that row group alone; 256 at C = 2048 bf16 is Liger's geometry, one
      # row per 256-thread block, one vector a thread)
      IFS=, read -ra ncu_shapes <<< "${NCU_SHAPES:-16384 1600 bfloat16,16384 2048 bfloat16,4096 16384 float32,16384 2048 bfloat16 rms,16384 2048 bfloat16 rms tpr=256}"
      for s in "${ncu_shapes[@]}"; do
        echo "### forward $s"
        # shellcheck disable=SC2086 (the arguments split on purpose)
        ncu "${sections[@]}" -k regex:forward --launch-count 1 /tmp/lnbwd_tune/forward_tune $s 2>&1 |
          grep -E "forward_|$keys"
      done > "$OUT/ncu.log" 2>&1
      echo "### kernel 12, 16384 x 1600 bfloat16" >> "$OUT/ncu.log"
      ncu "${sections[@]}" -k regex:kernel12 --launch-count 1 python3 -m benchmarks.kernels --op layernorm_bwd \
        --dtypes bfloat16 --shapes 16384x1600 --peers copy --reps 1 --no-progress 2>&1 | grep -E "kernel12|$keys" >> "$OUT/ncu.log"
      # Liger's Triton rmsnorm forward is the fastest peer of ours (one row per program): the same
      # sections for both, from the same bench chain, show what differs (occupancy, stalls, bytes).
      echo "### rmsnorm forward, 16384 x 2048 bfloat16: ours (forward_rows) and Liger's" >> "$OUT/ncu.log"
      for kernel in forward_rows rms_norm_forward; do
        ncu "${sections[@]}" -k regex:$kernel --launch-count 1 python3 -m benchmarks.kernels --op rmsnorm_fwd \
          --dtypes bfloat16 --shapes 16384x2048 --peers liger --reps 1 --no-progress 2>&1 | grep -E "$kernel|$keys"
      done >> "$OUT/ncu.log"
      tail -n 60 "$OUT/ncu.log" ;;
    kernel_time)
      for spec in ${KERNEL_TIME:-rmsnorm_fwd:16384x4096:bfloat16 layernorm_fwd:1024x768:bfloat16 rmsnorm_fwd:1024x768:bfloat16}; do
        IFS=: read -r op shape dtype <<< "$spec"
        python3 -m benchmarks.kernels --op "$op" --dtypes "$dtype" --shapes "$shape" --peers copy,liger \
          --kernel-time --reps 5 --no-progress
      done 2>&1 | tee "$OUT/kernel_time.log" ;;
    crossover)
      run crossover python3 -m benchmarks.kernels --op "${CROSS_OPS:-layernorm_fwd,layernorm_bwd,rmsnorm_fwd,rmsnorm_bwd,add_layernorm_fwd,add_rmsnorm_fwd}" \
        --dtypes bfloat16,float32 --kernels 12 --peers "${CROSS_PEERS:-default,xla,copy}" --reps 3 --chain 20 --min-run-ms 10 \
        --shapes "${CROSS_SHAPES:-1048576x32,524288x64,262144x128,131072x256,65536x512,32768x1024,16384x2048,8192x4096,2048x16384,8192x128,2048x512,1024x1024,256x4096}" \
        --no-progress --out "$OUT/crossover" ;;
    small)
      tools/tune/build.sh /tmp/lnbwd_tune forward_tune || status=1
      [ -x "$BINS/tune" ] || tools/tune/build.sh "$BINS" tune || status=1
      for s in "1048576 32" "524288 64" "262144 128" "131072 256" "65536 512"; do
        for d in bf16 f32; do "$BINS/tune" sweep $s $d; done
        for k in "" rms; do /tmp/lnbwd_tune/forward_tune $s bfloat16 $k chain; done
      done > "$OUT/small_sweep.log" 2>&1
      grep -E "default|auto|^[a-z]" "$OUT/small_sweep.log"
      run small python3 -m benchmarks.kernels --op layernorm_fwd,layernorm_bwd,rmsnorm_fwd,rmsnorm_bwd \
        --dtypes bfloat16,float32 --shapes 524288x64,262144x128,131072x256 --no-progress --out "$OUT/small" ;;
    qk)
      # The forward's one launch against two, in the harness (forward_tune sets=32:8: contiguous q
      # and k, 16384 tokens of 32 q and 8 kv heads), then the checks and the bench.
      [ -x /tmp/lnbwd_tune/forward_tune ] || tools/tune/build.sh /tmp/lnbwd_tune forward_tune || status=1
      for D in 64 128 256; do for d in bfloat16 float32; do
        /tmp/lnbwd_tune/forward_tune $((16384 * 40)) $D $d rms sets=32:8 chain
      done; done > "$OUT/qk_sets.log" 2>&1
      cat "$OUT/qk_sets.log"
      sanitizer qk qk_sanitize run_qk_sanitizers.sh
      run qk_tests python3 -m pytest -q -m gpu -n "${JOBS:-4}" -k "qk" tests
      run qk_bench python3 -m benchmarks.kernels --op qk_norm,qk_norm_fused --dtypes bfloat16,float32 \
        --reps 3 --min-run-ms 10 --no-progress --out "$OUT/qk" ;;
    e2e)
      TAIL=40 run e2e python3 -m benchmarks.e2e ${E2E_ARGS:-} --out "$OUT/e2e" ;;
    ab)
      base=${AB_BASE:-build/prebuilt_base}
      name=$(cat "$base/ext.name") || { status=1; continue; }
      ab_shapes=${AB_SHAPES-524288x64,262144x128,131072x256}
      ab_bench() {   # ab_bench TAG
        python3 -m benchmarks.kernels --op "${AB_OPS:-layernorm_bwd,rmsnorm_bwd}" --dtypes "${AB_DTYPES:-bfloat16,float32}" \
          ${ab_shapes:+--shapes "$ab_shapes"} --peers "${AB_PEERS:-copy}" --no-progress --out "$OUT/ab_$1"
      }
      run ab_new ab_bench new
      # The base: a copy of the package with the base's extension in place of ours, in a folder
      # that is the bench's working directory (python -m puts it first on sys.path; the checkout
      # follows on PYTHONPATH, for benchmarks/). A timeout that stops the stage here leaves the
      # checkout's extension as it was.
      tree=$(mktemp -d)
      if cp -r jax_lnbwd "$tree/" && rm -f "$tree"/jax_lnbwd/_jax_lnbwd*.so && unpack_ext "$base" "$tree"; then
        (OUT=$(cd "$OUT" && pwd) && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" && export PYTHONPATH &&
          cd "$tree" && run ab_base ab_bench base && exit "$status") || status=1
      else
        status=1
      fi
      rm -rf "$tree" ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
