"""Writes the fixtures of tests/api/test_exported_compat.py: a fixed set of programs exported for
cpu and cuda (NAME.bin), each with its inputs and its CPU results (NAME.npz: the inputs, then the
outputs, as float32 arrays).

An exported program names the FFI targets it calls, so a program exported by one jax_lnbwd must
load and run on every later one. A fixture pins what the jax_lnbwd that wrote it exported: a file
that exists is never rewritten, only programs without a file are exported.

    python tests/api/export_compat.py tests/api/data/exported [NAME ...]   (default: every program)

Every call runs on our targets (JAX_LNBWD_FORWARD=ffi JAX_LNBWD_BACKWARD=ffi, set here); the
test checks which targets each fixture calls.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ["JAX_LNBWD_FORWARD"] = "ffi"
os.environ["JAX_LNBWD_BACKWARD"] = "ffi"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import export  # noqa: E402

import jax_lnbwd  # noqa: E402
from jax_lnbwd import add_layernorm, add_rmsnorm, layernorm, rmsnorm  # noqa: E402


def grad(loss, n):
    """The gradient of loss with respect to its first n arguments."""
    return jax.grad(loss, argnums=tuple(range(n)))


def programs():
    """name -> (function, inputs)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
    b = jnp.asarray(rng.standard_normal(64), jnp.float32)
    xb16 = x.astype(jnp.bfloat16)

    def sq(y):
        return jnp.sum(y.astype(jnp.float32) ** 2)

    def add_ln_loss(x, r, w, b):
        y, s = add_layernorm(x, r, w, b, x_bias=b)
        return sq(y) + jnp.sum(s * r)

    def add_rms_loss(x, r, w, xbias):
        y, s = add_rmsnorm(x, r, w, x_bias=xbias)
        return sq(y) + jnp.sum(s * r)

    return {
        # layernorm: the backward v1, v2 (16-bit x, float32 parameters), add_layernorm with x_bias,
        # the fused forward
        "layernorm_grad_v1": (grad(lambda x, w, b: sq(layernorm(x, w, b)), 3), (x, w, b)),
        "layernorm_grad_mixed_v2": (grad(lambda x, w, b: sq(layernorm(x, w, b)), 3), (xb16, w, b)),
        "add_layernorm_x_bias_grad": (grad(add_ln_loss, 4), (x, r, w, b)),
        "layernorm_fused_forward": (lambda x, w, b: jax_lnbwd.layernorm_fwd(x, w, b), (x, w, b)),
        # rmsnorm: float32; bfloat16 x with a float32 weight and offset 1 (Gemma's scale);
        # add_rmsnorm with x_bias
        "rmsnorm_grad_f32": (grad(lambda x, w: sq(rmsnorm(x, w)), 2), (x, w)),
        "rmsnorm_grad_bf16_offset": (grad(lambda x, w: sq(rmsnorm(x, w, offset=1.0)), 2), (xb16, w)),
        "add_rmsnorm_x_bias_grad": (grad(add_rms_loss, 4), (x, r, w, b)),
    }


def export_one(name, f, args):
    """The program exported for cpu and cuda; stops if it calls none of our targets."""
    exp = export.export(jax.jit(f), platforms=["cpu", "cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(t) for t in jax_lnbwd.TARGETS])(*args)
    if not any(t in exp.mlir_module() for t in jax_lnbwd.TARGETS):
        raise SystemExit(f"export_compat: {name} calls none of jax_lnbwd's targets")
    return exp


def main(argv):
    if not argv:
        print(__doc__.split("\n\n")[-2], file=sys.stderr)
        return 2
    out, names = argv[0], argv[1:]
    progs = programs()
    unknown = sorted(set(names) - set(progs))
    if unknown:
        print(f"export_compat: no program {unknown}; programs: {sorted(progs)}", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    for name in names or progs:
        f, args = progs[name]
        paths = [os.path.join(out, f"{name}.{ext}") for ext in ("bin", "npz")]
        if any(os.path.exists(p) for p in paths):
            print(f"{name}: kept (a fixture is never rewritten)")
            continue
        exp = export_one(name, f, args)
        res = exp.call(*args)
        with open(paths[0], "wb") as fh:
            fh.write(exp.serialize())
        np.savez(paths[1], *[np.asarray(a.astype(jnp.float32)) for a in args],
                 *[np.asarray(jnp.asarray(o).astype(jnp.float32)) for o in jax.tree.leaves(res)])
        print(name, [t for t in jax_lnbwd.TARGETS if t in exp.mlir_module()])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
