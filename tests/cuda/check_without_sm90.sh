#!/usr/bin/env bash
# Builds jax_lnbwd for CUDA architecture 80 only (CUDAARCHS=80: sm_80 machine code and compute_80
# PTX, no sm_90 code) into a scratch folder, and checks on an sm_90 GPU that kernel 12 (the
# default) does not launch its body-less build: the driver JIT-compiles the compute_80 PTX, in
# which kernel 12's body (guarded by __CUDA_ARCH__ >= 900) is empty; the launcher sees that its
# code is not for sm_90 (kernel_code_arch, ffi/kernels/common/occupancy.h) and runs kernel 11,
# whose gradients must match the reference. Needs nvcc and a GPU of sm_90 or later.
# tests/install/test_arch_build.py runs it.
#   tests/cuda/check_without_sm90.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/jax_lnbwd_sm80}
rm -rf "$out"
mkdir -p "$out"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
CUDAARCHS=80 JAX_LNBWD_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps --target "$out/site" \
  --config-settings=build-dir="$out/build" --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=80 .
grep -Eq "^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=80$" "$out/build/CMakeCache.txt"
cd "$out"
PYTHONPATH="$out/site" XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda,cpu python3 - "$out/site" <<'PY'
import sys
# An editable install of the checkout (pip install -e .) puts an import hook ahead of PYTHONPATH;
# drop it so that the sm_80 build in the scratch folder is the jax_lnbwd imported here.
sys.meta_path = [f for f in sys.meta_path if "editable" not in (getattr(f, "__module__", "") or "")
                 and "editable" not in type(f).__module__]
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import numpy as np
import jax_lnbwd
from jax_lnbwd import _jax_lnbwd, kernels, layernorm, reference

assert jax_lnbwd.__file__.startswith(sys.argv[1]), f"imported {jax_lnbwd.__file__}, not the sm_80 build"
dev = kernels._cuda_device()
cc = _jax_lnbwd.device_limits(dev)["compute_capability"]
assert cc[0] >= 9, f"this check needs an sm_90 or later GPU, found sm_{cc[0]}{cc[1]}"
cpu = jax.devices("cpu")[0]
tol = {"float32": 1e-5, "bfloat16": 1e-2}
for dtype, shape in [("bfloat16", (4096, 1600)), ("float32", (512, 4096)), ("bfloat16", (256, 16384))]:
    plan = _jax_lnbwd.launch_plan(12, dtype, shape[0], shape[1], 1, dev)
    assert plan["kernel"] == 11, f"kernel 12 planned to run itself without sm_90 code: {plan}"
    rng = np.random.default_rng(0)
    x, r = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(shape[-1]), dtype)
    b = jnp.asarray(rng.standard_normal(shape[-1]), dtype)
    loss = lambda f: (lambda x, w, b: jnp.sum(f(x, w, b).astype(jnp.float64) * r.astype(jnp.float64)))
    got = jax.jit(jax.grad(loss(layernorm), argnums=(0, 1, 2)))(x, w, b)
    f64 = lambda a: jax.device_put(np.asarray(a, np.float64), cpu)
    want = jax.grad(loss(reference.layernorm), argnums=(0, 1, 2))(f64(x), f64(w), f64(b))
    for name, g, wt in zip(("dx", "dweight", "dbias"), got, want):
        g, wt = np.asarray(g, np.float64), np.asarray(wt)
        err = np.linalg.norm(g - wt) / np.linalg.norm(wt)
        assert err <= tol[dtype], f"{dtype} {shape} {name}: rel_err {err:.2e} (plan {plan})"
    print(f"sm_80-only build on sm_{cc[0]}{cc[1]}: {dtype} {shape} ran as kernel {plan['kernel']} ({plan['path']}), "
          "gradients match the reference")
print("OK")
PY
