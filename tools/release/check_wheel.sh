#!/usr/bin/env bash
# Checks a jax_lnbwd wheel as a user without a CUDA toolkit gets it: installs it into a fresh
# virtualenv with nvcc hidden and nothing fetched, then runs a gradient check through the FFI
# call and the tests from a copy outside the source tree (so the installed package is used).
#
#   tools/release/check_wheel.sh WHEEL [PYTEST_ARGS...]      (default PYTEST_ARGS: -m gpu tests)
#
# The venv sees this Python's packages (jax and its CUDA plugin, pytest, flax, ...): it is made
# with --system-site-packages and, where this Python is itself a venv, a .pth file adds that
# venv's site-packages. It must not hold jax_lnbwd itself (the wheel is checked to be used). nvcc is hidden: every PATH folder holding an nvcc, and every
# LD_LIBRARY_PATH folder holding a libcudart, is dropped, and CUDA_HOME/CUDA_PATH/CUDACXX are
# unset. On a GPU it requires jax_lnbwd.WITH_CUDA and a result from the GPU.
set -euo pipefail
wheel=$(readlink -f "$1"); shift
src=$(cd "$(dirname "$0")/../.." && pwd)
py=$(command -v "${PYTHON:-python3}")
(( $# )) || set -- -m gpu tests

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
parent_site=$("$py" -c 'import site; print(site.getsitepackages()[0])')
# CHECK_WHEEL_NO_SYSTEM_SITE=1 leaves out the base Python's packages (where an editable
# jax_lnbwd installed there would shadow the wheel; a .pth line adds paths, not import hooks).
system_site=--system-site-packages
[[ ${CHECK_WHEEL_NO_SYSTEM_SITE:-0} == 1 ]] && system_site=
"$py" -m venv --without-pip $system_site "$work/venv"   # this Python's pip installs into it
venv_site=$("$work/venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
echo "$parent_site" >"$venv_site/_parent_site.pth"
"$py" -m pip --python "$work/venv/bin/python" install -q --no-index --no-deps "$wheel"

keep() {  # $1: a ':' list, $2: a test a folder must fail to stay
  local out="" d
  IFS=: read -ra dirs <<<"$1"
  for d in "${dirs[@]}"; do eval "$2" || out+="${out:+:}$d"; done
  echo "$out"
}
export PATH=$(keep "$PATH" '[[ -x "$d/nvcc" ]]')
export LD_LIBRARY_PATH=$(keep "${LD_LIBRARY_PATH:-}" 'compgen -G "$d/libcudart.so*" >/dev/null')
unset CUDA_HOME CUDA_PATH CUDACXX CUDAToolkit_ROOT
if command -v nvcc; then echo "check_wheel: nvcc still found" >&2; exit 1; fi
echo "check_wheel: no nvcc on the PATH; LD_LIBRARY_PATH='$LD_LIBRARY_PATH'"

cp -r "$src/tests" "$src/benchmarks" "$src/examples" "$work/"   # the bench and example tests run these
cp "$src/README.md" "$work/"   # the README's Python blocks are run too
cp "$src/pyproject.toml" "$work/"   # pytest's settings (markers) only
cd "$work"
so=$(ls "$venv_site"/jax_lnbwd/_jax_lnbwd*.so)
echo "check_wheel: $so needs: $(readelf -d "$so" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
./venv/bin/python - <<'EOF'
import jax, jax.numpy as jnp, numpy as np
import jax_lnbwd
from jax_lnbwd import layernorm, reference
gpu = jax.default_backend() == "gpu"
print(f"check_wheel: jax {jax.__version__} on {jax.devices()}; jax_lnbwd {jax_lnbwd.__file__} "
      f"WITH_CUDA={jax_lnbwd.WITH_CUDA}")
assert "/venv/" in jax_lnbwd.__file__, "not the installed wheel"
assert jax_lnbwd.WITH_CUDA or not gpu, "the wheel has no CUDA handler"
k = jax.random.split(jax.random.key(0), 4)
x, dy = (jax.random.normal(kk, (4096, 1600), jnp.float32) for kk in k[:2])
w, b = 1 + 0.1 * jax.random.normal(k[2], (1600,)), jax.random.normal(k[3], (1600,))
loss = lambda f: lambda x, w, b, dy: jnp.sum(f(x, w, b) * dy)
grad = jax.jit(jax.grad(loss(layernorm), argnums=(0, 1, 2)))
assert jax_lnbwd.TARGET in grad.lower(x, w, b, dy).as_text(), "no FFI call in the program"
got = grad(x, w, b, dy)
cpu = jax.devices("cpu")[0]
with jax.enable_x64():
    args = [jax.device_put(np.asarray(a, np.float64), cpu) for a in (x, w, b, dy)]
    want = jax.jit(jax.grad(loss(reference.layernorm), argnums=(0, 1, 2)))(*args)
for name, g, r in zip(("dx", "dweight", "dbias"), got, want):
    g, r = np.asarray(g, np.float64), np.asarray(r)
    err = np.linalg.norm(g - r) / np.linalg.norm(r)
    print(f"check_wheel: {name} on {list(got[0].devices())[0]}: rel err {err:.2e} vs float64")
    assert err < 1e-5, name
EOF
./venv/bin/python -m pytest -p no:cacheprovider "$@"
