#!/usr/bin/env bash
# A/B of forward kernel builds in one GPU run: the forward harness (tests/cuda/forward_check.cu
# sweep ... chain) built from several source trees, the auto pick's % of a same-bytes copy side by
# side, shape by shape, so that every build sees the same GPU, clocks and neighbours.
#   tools/forward_ab.sh prepare NAME REF   (here, with git) REF's ffi/kernels and tests/cuda into
#                                          .carry/ab/NAME; edit that tree for a variant by hand
#   tools/forward_ab.sh run                (on the GPU, with .carry in the call's carry list) builds
#                                          each .carry/ab/* tree and the working tree ("work") in
#                                          parallel, then REPS passes (default 2) over SHAPES
# SHAPES: forward_check sweep arguments, comma-separated (default: the issue shapes of both norms).
# Output under OUT (default $OUT or /tmp/forward_ab): ab.txt (the table), sweep_NAME.log (every row
# group of every shape), build_NAME.log.
set -uo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
case $cmd in
  prepare)
    [ $# -eq 3 ] || { echo "usage: $0 prepare NAME REF" >&2; exit 2; }
    dest=.carry/ab/$2
    rm -rf "$dest" && mkdir -p "$dest"
    git archive "$3" ffi/kernels tests/cuda | tar -x -C "$dest"
    echo "$dest: $3's ffi/kernels and tests/cuda"
    exit 0 ;;
  run) ;;
  *) echo "usage: $0 prepare NAME REF | run" >&2; exit 2 ;;
esac

OUT=${OUT:-/tmp/forward_ab}
BIN=${BIN:-/tmp/forward_ab_bin}
mkdir -p "$OUT" "$BIN"
SHAPES=${SHAPES:-16384 2048 bfloat16 rms,16384 4096 bfloat16 rms,8192 8192 bfloat16 rms,4096 16384 bfloat16 rms,16384 2048 float32 rms,8192 8192 float32 rms,16384 1600 bfloat16,16384 1600 float16,16384 2048 bfloat16,8192 8192 bfloat16,4096 16384 bfloat16,16384 2048 float32,16384 2048 bfloat16 residual,8192 768 bfloat16}
REPS=${REPS:-2}

names=() roots=()
for d in .carry/ab/*/; do
  [ -d "$d/ffi/kernels" ] && names+=("$(basename "$d")") && roots+=("${d%/}")
done
names+=(work) roots+=(.)

build() {   # build NAME ROOT: the harness from ROOT's sources
  tools/build_forward_check.sh "$BIN/$1" "$2" > "$OUT/build_$1.log" 2>&1
}
t0=$SECONDS
pids=()
for i in "${!names[@]}"; do
  build "${names[$i]}" "${roots[$i]}" &
  pids+=($!)
done
built=()
for i in "${!names[@]}"; do
  if wait "${pids[$i]}"; then built+=("${names[$i]}"); else echo "build ${names[$i]} failed: $OUT/build_${names[$i]}.log"; fi
done
echo "built ${built[*]} in $((SECONDS - t0)) s"
[ ${#built[@]} -gt 0 ] || exit 1

IFS=, read -ra shapes <<< "$SHAPES"
rm -f "$OUT"/sweep_*.log "$OUT/picks.tsv"
for ((rep = 1; rep <= REPS; rep++)); do
  for s in "${shapes[@]}"; do
    for name in "${built[@]}"; do   # the builds alternate shape by shape, so drift hits them alike
      # shellcheck disable=SC2086 (the arguments split on purpose)
      line=$("$BIN/$name" sweep $s chain 2>&1 | tee -a "$OUT/sweep_$name.log" | grep -E "^  auto ")
      # "  auto  tpr T nv N ... : US us GBS GB/s PCT% of copy"
      printf '%s\t%s\t%s\t%s\n' "$s" "$name" "$(awk '{print $3 "/" $5}' <<< "$line")" \
        "$(awk '{print $(NF-2)}' <<< "$line" | tr -d %)" >> "$OUT/picks.tsv"
    done
  done
done

# The table: per shape, each build's row group and mean % of copy over the passes.
python3 - "$OUT/picks.tsv" "${built[@]}" > "$OUT/ab.txt" <<'EOF'
import collections, sys
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    shape, name, group, pct = line.rstrip("\n").split("\t")
    cell = rows.setdefault(shape, {}).setdefault(name, [group, []])
    if pct:
        cell[1].append(float(pct))
names = sys.argv[2:]
print(f"{'shape (% of a copy, mean of passes; row group tpr/NV)':44s}" + "".join(f"{n:>16s}" for n in names))
for shape, by in rows.items():
    cells = []
    for n in names:
        group, pcts = by.get(n, ["-", []])
        cells.append(f"{sum(pcts) / len(pcts):6.1f}% ({group})" if pcts else "-")
    print(f"{shape:44s}" + "".join(f"{c:>16s}" for c in cells))
EOF
cat "$OUT/ab.txt"
echo "total $((SECONDS - t0)) s"
