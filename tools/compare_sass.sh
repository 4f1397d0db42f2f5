#!/usr/bin/env bash
# Whether two checkouts compile every kernel to the same machine code: for a change that only
# moves files or edits comments and include paths (a layout change), the SASS of every kernel
# must be identical; RENAMES (below) lets a rename of kernels or their parameter types pass too.
#
#   tools/compare_sass.sh BASE NEW [WORKDIR]
#
# Compiles every .cu under BASE/ffi/kernels and NEW/ffi/kernels for sm_90 alone with the flags
# CMake's Release build passes to the kernels library (-O3 -DNDEBUG -std=c++17
# -Xptxas=-warn-spills -Xcompiler=-fPIC, include dir ffi/kernels), one object at a time (JOBS=n
# for more), dumps each object's SASS with cuobjdump, and splits it into one entry per kernel.
# What differs between any two builds of the same code is masked: the anonymous namespace's
# per-file hash (_GLOBAL__N__<hash>, which nvcc derives from the file's path and which names
# the file, e.g. 27kernel11_rows_in_registers_cu_<hash>), and the file paths cuobjdump prints.
# The entries are sorted by kernel (so files may move or be renamed) and both lists written to
# WORKDIR/{base,new}.sass; the exit status is diff's, and the kernel counts are printed.
# NVCC, CUOBJDUMP and ARCH (default nvcc, cuobjdump, 90) may be set; cuobjdump needs nvdisasm
# on the PATH (without a toolkit: pip's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels,
# in nvidia/cu13/bin/). KEEP_BASE=1 reuses WORKDIR/base.sass from an earlier run. BASE_OBJS or
# NEW_OBJS, a folder, takes that side's objects from a build made with these flags instead of
# compiling them, e.g. CMake's BUILD/CMakeFiles/lnbwd_kernels.dir of a CUDAARCHS=90-real Release
# build (one object per .cu file, which is checked).
# RENAMES, a file of "OLD NEW" lines (C++ identifiers; blank lines and #-comments skipped), names
# what a change renamed: NEW is read as OLD on the new side before the diff, both as a whole word
# and as an Itanium-mangled name with its length prefix (13NormBwdParams as 18LayernormBwdParams),
# so that a rename of a kernel, or of a type in a kernel's signature, compares as no change.
set -euo pipefail

if [ $# -lt 2 ]; then
  sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
base=$(cd "$1" && pwd)
new=$(cd "$2" && pwd)
work=${3:-$(mktemp -d /tmp/compare_sass.XXXXXX)}
mkdir -p "$work"
NVCC=${NVCC:-nvcc}
ARCH=${ARCH:-90}
JOBS=${JOBS:-1}
CUOBJDUMP=${CUOBJDUMP:-cuobjdump}

# Per-kernel SASS of one checkout, masked and sorted, on stdout.
dump() {
  local root=$1 tag=$2 prebuilt=$3
  local objs="$work/$tag.obj"
  (cd "$root" && find ffi/kernels -name '*.cu' | sort) > "$work/$tag.files"
  if [ -n "$prebuilt" ]; then
    objs=$prebuilt
    echo "($tag: the objects in $objs)" >&2
  else
    rm -rf "$objs" && mkdir -p "$objs"
    # shellcheck disable=SC2016
    xargs -P "$JOBS" -I{} sh -c '
      o="$1/$(echo "$2" | tr / _).o"
      cd "$3" && $4 -O3 -DNDEBUG -std=c++17 -Xptxas=-warn-spills -Xcompiler=-fPIC \
        --generate-code=arch=compute_$5,code=sm_$5 -Iffi/kernels -c "$2" -o "$o" 2>"$o.log" \
        || { cat "$o.log" >&2; exit 255; }' _ "$objs" {} "$root" "$NVCC" "$ARCH" < "$work/$tag.files"
  fi
  local n_obj
  n_obj=$(find "$objs" -name '*.o' | wc -l)
  if [ "$n_obj" -ne "$(wc -l < "$work/$tag.files")" ]; then
    echo "compare_sass: $n_obj objects in $objs for $(wc -l < "$work/$tag.files") .cu files in $root" >&2
    exit 2
  fi
  local renames=""
  if [ "$tag" = new ]; then renames=${RENAMES:-}; fi
  find "$objs" -name '*.o' | sort | while read -r o; do "$CUOBJDUMP" -sass "$o"; done | python3 -c '
import re, sys
text = sys.stdin.read()
# The new side read with the old names (RENAMES): a mangled name first (its length prefix
# changes with it, and says where it ends), then the word.
if sys.argv[1]:
    for line in open(sys.argv[1]):
        line = line.split("#")[0].split()
        if not line:
            continue
        old, new = line
        text = re.sub(rf"(?<![0-9]){len(new)}{new}", f"{len(old)}{old}", text)
        text = re.sub(rf"(?<![0-9A-Za-z_]){new}(?![0-9A-Za-z_])", old, text)
# One entry per "Function : <name>" section (up to the next one, or the end of its ELF).
parts = re.split(r"^\s*Function : ", text, flags=re.M)[1:]
entries = []
for part in parts:
    body = re.split(r"^\s*\.{4,}|^Fatbin |^\s*-{8,}", part, flags=re.M)[0]
    body = re.sub(r"_GLOBAL__N__[0-9a-f]{8}_\d+_\w+?_cu_[0-9a-f]{8}", "_GLOBAL__N__H", body)
    body = re.sub(r"_GLOBAL__N__[0-9a-f]{8}", "_GLOBAL__N__H", body)
    body = re.sub(r"(?<=[A-Za-z_])\d+_GLOBAL__N__H", "N_GLOBAL__N__H", body)   # mangled length prefix
    body = re.sub(r"/\S+\.(cu|cuh|h)\b", "FILE", body)
    entries.append(body.rstrip() + "\n")
entries.sort()
sys.stdout.write("".join(entries))
print(f"{len(entries)} kernels", file=sys.stderr)
' "$renames"
}

echo "base: $base" >&2
if [ "${KEEP_BASE:-0}" = 1 ] && [ -s "$work/base.sass" ]; then
  echo "(reusing $work/base.sass)" >&2
else
  dump "$base" base "${BASE_OBJS:-}" > "$work/base.sass"
fi
echo "new:  $new" >&2
dump "$new" new "${NEW_OBJS:-}" > "$work/new.sass"
echo "$(wc -l < "$work/base.files") and $(wc -l < "$work/new.files") .cu files;" \
     "$(grep -c '^' "$work/base.sass") and $(grep -c '^' "$work/new.sass") SASS lines in $work/{base,new}.sass" >&2
if diff -q "$work/base.sass" "$work/new.sass" >/dev/null; then
  echo "compare_sass: identical SASS for every kernel" >&2
else
  diff "$work/base.sass" "$work/new.sass" | head -40
  echo "compare_sass: the SASS differs (full diff: diff $work/base.sass $work/new.sass)" >&2
  exit 1
fi
