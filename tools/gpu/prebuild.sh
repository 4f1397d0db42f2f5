#!/usr/bin/env bash
# Compiles here, on a machine with nvcc but no GPU, what a GPU machine would otherwise spend its
# time compiling, packed small enough to bring along (the device tool's `carry`):
#   DIR/ext.so.xz, DIR/ext.name  the extension, built for the GPU machine's Python (PYTHON, default
#                                python3.12, with scikit-build-core and nanobind installed) and
#                                architectures (CUDAARCHS, default 90-real)
#   DIR/san.tar.xz               the four sanitizer scripts' objects (tests/cuda/run_*sanitizers.sh,
#                                SAN_STEP=build) in san/bwd, san/forward, san/rms and san/qk: the
#                                GPU machine links them in seconds instead of compiling for minutes.
#                                The kernels are compiled once (san/bwd) and hard-linked into the
#                                others (SAN_REUSE). They are also tune's and check's
#                                (tools/tune/build.sh with KERNEL_OBJECTS, on the GPU machine).
#   tools/gpu/prebuild.sh [DIR]   (default build/prebuilt)
# On the GPU machine, in the checkout: tools/gpu/gpu_check.sh prebuilt STAGE... unpacks them (the
# extension into jax_lnbwd/, in place of the build stage; the sanitizers' objects for the
# sanitize and qk stages, and tune and check linked from them for the check and small stages).
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-build/prebuilt}
mkdir -p "$dir"
wheels=$(mktemp -d)
CUDAARCHS=${CUDAARCHS:-90-real} JAX_LNBWD_CUDA=ON "${PYTHON:-python3.12}" -m pip wheel -q --no-build-isolation \
  --no-deps -w "$wheels" .
so=$(unzip -Z1 "$wheels"/*.whl | grep '^jax_lnbwd/_jax_lnbwd.*\.so$')
basename "$so" > "$dir/ext.name"
unzip -p "$wheels"/*.whl "$so" | xz -T0 > "$dir/ext.so.xz"
rm -rf "$wheels"
rm -rf "$dir/san"
SAN_STEP=build tests/cuda/run_sanitizers.sh "$dir/san/bwd"
for s in forward rms qk; do
  SAN_STEP=build SAN_REUSE="$dir/san/bwd/obj" "tests/cuda/run_${s}_sanitizers.sh" "$dir/san/$s"
done
tar cf - -C "$dir" san | xz -9 -T0 > "$dir/san.tar.xz"   # tar keeps the hard links
rm -rf "$dir/san" "$dir/bins.tar.xz"
ls -l "$dir"
