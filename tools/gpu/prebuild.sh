#!/usr/bin/env bash
# Compiles here, on a machine with nvcc but no GPU, what a GPU machine would otherwise spend its
# time compiling, packed small enough to bring along (the device tool's `carry`):
#   DIR/ext.so.xz, DIR/ext.name  the extension, built for the GPU machine's Python (PYTHON, default
#                                python3.12, with scikit-build-core and nanobind installed) and
#                                architectures (CUDAARCHS, default 90-real)
#   DIR/qk_san.tar.xz            tests/cuda/run_qk_sanitizers.sh's binaries (QK_STEP=build)
#   DIR/bins.tar.xz              tools/tune/build.sh's tune and check (the backward's sweeps and
#                                its standalone check)
#   tools/gpu/prebuild.sh [DIR]   (default build/prebuilt)
# On the GPU machine, in the checkout: tools/gpu/gpu_check.sh prebuilt STAGE... unpacks them (the
# extension into jax_lnbwd/, in place of the build stage; the binaries for the qk, check and small
# stages).
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
QK_STEP=build tests/cuda/run_qk_sanitizers.sh "$dir/qk_san"
tar cf - -C "$dir" qk_san | xz -T0 > "$dir/qk_san.tar.xz"
rm -rf "$dir/qk_san"
tools/tune/build.sh "$dir/bins" tune check
tar cf - -C "$dir/bins" tune check | xz -T0 > "$dir/bins.tar.xz"
rm -rf "$dir/bins"
ls -l "$dir"
