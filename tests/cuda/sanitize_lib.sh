# Sourced by the sanitizer scripts (run_sanitizers.sh, run_forward_sanitizers.sh,
# run_rms_sanitizers.sh, run_qk_sanitizers.sh): what they share.
#
# Two steps. Each script compiles a standalone check and its positive controls (scratch copies of
# a kernel with one planted bug), which needs nvcc but no GPU, then links them and runs them under
# compute-sanitizer, which needs the GPU. Compiling every kernel takes minutes; linking the
# objects takes seconds. So the objects can be compiled on a machine without a GPU and carried to
# one (tools/gpu/prebuild.sh, tools/gpu/gpu_check.sh). SAN_STEP says which steps run:
#   all    both (the default);
#   build  compile only: the objects go to OUT_DIR (OUT_DIR/obj, and the controls' in
#          OUT_DIR/controls), and nothing is linked or run;
#   run    link OUT_DIR's objects into its binaries and run them; compiles nothing.
# Every script takes OUT_DIR [LOG_DIR]: the tools' logs and result lines go to LOG_DIR (default
# OUT_DIR), so that a caller can keep them apart from the objects.
SAN_STEP=${SAN_STEP:-all}
case $SAN_STEP in
  all | build | run) ;;
  *) echo "SAN_STEP=$SAN_STEP: all, build or run" >&2; exit 2 ;;
esac
NVCC=(nvcc -O3 -std=c++17 -arch=sm_90)
TIMEOUT=${LNBWD_SANITIZER_TIMEOUT:-900}

# object DIR SOURCE: SOURCE's object in DIR (by the source's file name, which is unique among the
# kernels and checks).
object() { echo "$1/$(basename "$2").o"; }

# compile DIR KERNELS_DIR SOURCE...: each source into its object in DIR, one job per core, with
# KERNELS_DIR (ffi/kernels, or a control's planted copy) first in the include path, and with
# -lineinfo, so that the tools report file:line. Returns 1 if any source failed; the objects of an
# earlier run are deleted first, so that none can stand in for a failed compile.
# SAN_REUSE=DIR: objects another script compiled from this checkout with the same flags (its
# OUT_DIR/obj); a source whose object is there is hard-linked from it instead of compiled again.
# compile_control: the same without -lineinfo and without SAN_REUSE, for the positive controls:
# they are judged only by whether a tool reports, and line tables would double the objects that a
# GPU machine is sent.
compile() { _compile -lineinfo "${SAN_REUSE:-}" "$@"; }
compile_control() { _compile "" "" "$@"; }
_compile() {
  local lineinfo=$1 reuse=$2 dir=$3 kernels=$4 f
  shift 4
  mkdir -p "$dir"
  for f in "$@"; do rm -f "$(object "$dir" "$f")"; done
  for f in "$@"; do
    if [ -n "$reuse" ] && [ -s "$(object "$reuse" "$f")" ]; then
      ln -f "$(object "$reuse" "$f")" "$(object "$dir" "$f")" && continue
    fi
    while (($(jobs -rp | wc -l) >= $(nproc))); do wait -n || true; done
    "${NVCC[@]}" $lineinfo -I"$kernels" -Iffi -Icuda_harness -c "$f" -o "$(object "$dir" "$f")" &
  done
  wait
  for f in "$@"; do
    [ -s "$(object "$dir" "$f")" ] || { echo "compile: $f did not compile" >&2; return 1; }
  done
}

# link BINARY OBJECT...: one program from compiled objects.
link() {
  local bin=$1
  shift
  "${NVCC[@]}" "$@" -o "$bin" || { echo "link: $bin did not link" >&2; return 1; }
}

# link_control NAME BINARY PLANTED_OBJECT OBJECT...: positive control NAME's binary from the
# check's other objects and the planted one; where the planted change did not apply (no object)
# or the link fails, prints the control's line saying so and returns 1.
link_control() {
  local name=$1 bin=$2 planted=$3
  shift 3
  [ -f "$planted" ] || { echo "control $name: not built (its planted change did not apply)"; return 1; }
  link "$bin" "$@" "$planted" || { echo "control $name: FAILED to link"; return 1; }
}

# sanitize LABEL TOOL LOG TALLY COMMAND...: COMMAND under compute-sanitizer's TOOL, its output in
# LOG; prints one line: LABEL, the tool's summary and the check's own count (TALLY: an extended
# regular expression for its "N cases, M failures" line), or FAILED with the exit status.
# memcheck also looks for leaks. synccheck tracks more barriers than its default: kernel 12's
# mbarriers (groups x ring slots per block) are all alive at once in its cooperative grids.
sanitize() {
  local label=$1 tool=$2 log=$3 tally=$4 extra=()
  shift 4
  [ "$tool" = memcheck ] && extra=(--leak-check full)
  [ "$tool" = synccheck ] && extra=(--num-cuda-barriers "${NUM_CUDA_BARRIERS:-8192}")
  if timeout "$TIMEOUT" compute-sanitizer --tool "$tool" --error-exitcode 1 "${extra[@]}" "$@" > "$log" 2>&1; then
    echo "$label: $(grep -Eo '(ERROR|RACECHECK) SUMMARY: .*' "$log" | tail -1) ($(grep -Eo "$tally" "$log" | tail -1))"
  else
    echo "$label: FAILED (exit $?, see $log)"
  fi
}

# four_tools TALLY COMMAND...: sanitize COMMAND under the four tools at once (the GPU has room for
# all of them), in the background, each line into LOGS/TOOL.result; the caller waits.
four_tools() {
  local tally=$1 tool
  shift
  for tool in memcheck racecheck synccheck initcheck; do
    sanitize "$tool" "$tool" "$LOGS/$tool.log" "$tally" "$@" > "$LOGS/$tool.result" &
  done
}

# run_control NAME TOOL COMMAND...: positive control NAME's binary under TOOL, which must report
# errors (the planted bug also makes values wrong, so the check fails either way: what counts is
# that the tool itself reports); prints control_report's line.
run_control() {
  local name=$1 tool=$2
  shift 2
  timeout "$TIMEOUT" compute-sanitizer --tool "$tool" "$@" > "$LOGS/$name.log" 2>&1
  control_report "$name" "$tool" "$LOGS/$name.log"
}

# run_plain_control NAME SECONDS COMMAND...: positive control NAME's binary run plainly, for a
# planted bug that no sanitizer reports: kernel 11's row group whose shuffles name lanes that have
# left the row loop (synccheck does not check a shuffle's mask: one that leaves out the calling
# lane went unreported), so that the group waits at its shuffle for lanes that never arrive, a
# hang which ends in no summary at all; or the forward's row sums taken across two groups, wrong
# values from well-formed shuffles. The check itself must notice, by failing or by not finishing
# within SECONDS. Prints one line, as control_report does.
run_plain_control() {
  local name=$1 limit=$2 rc tally
  shift 2
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  tally=$(grep -Eo '[0-9]+ cases, [0-9]+ failures' "$LOGS/$name.log" | tail -1)
  if [ "$rc" -eq 124 ]; then
    echo "control $name (plain run): reported: no result within $limit s (hung)"
  elif [ "$rc" -ne 0 ] || [[ "$tally" =~ \ [1-9][0-9]*\ failures ]]; then
    echo "control $name (plain run): reported: ${tally:-no tally} (exit $rc)"
  else
    echo "control $name (plain run): NOT reported ($tally) - the check would miss this bug"
  fi
}

# verdict CONTROL...: prints the four tools' lines and then the controls' (LOGS/CONTROL.result);
# returns 1 if a tool failed or a control's bug was not reported.
verdict() {
  local status=0 c
  cat "$LOGS"/{memcheck,racecheck,synccheck,initcheck}.result
  grep -q FAILED "$LOGS"/{memcheck,racecheck,synccheck,initcheck}.result && status=1
  for c in "$@"; do
    cat "$LOGS/$c.result"
    grep -q ": reported: " "$LOGS/$c.result" || status=1
  done
  return $status
}

# control_report NAME TOOL LOG: the one line that says whether TOOL reported the bug planted in
# positive control NAME (LOG: the tool's output on the control's binary).
control_report() {
  local summary
  summary=$(grep -Eo '(ERROR|RACECHECK) SUMMARY: .*' "$3" | tail -1)
  if [[ "$summary" =~ SUMMARY:\ [1-9] ]]; then
    echo "control $1 ($2): reported: $summary"
  else
    echo "control $1 ($2): NOT reported ($summary) - the check would miss this bug"
  fi
}
