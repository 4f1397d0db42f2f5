"""The rmsnorm ops of the kernel bench (ops.py): rmsnorm_bwd, rmsnorm_fwd and add_rmsnorm_fwd,
each its bytes, its Case (cases.py) and its entries: ours, the default, the jnp peers and Pallas."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_lnbwd import RMSNORM, autodiff, reference, rmsnorm_bwd
from jax_lnbwd import rmsnorm_fwd as rmsnorm_fwd_public
from jax_lnbwd.ops.forward import add_rmsnorm_fwd_op, rmsnorm_fwd_op

from .cases import (Case, Impl, add_forward_impls_of, default_impls, f64, forward_impls_of, inputs, pallas_impls,
                    params_dtype, stat_bytes)
from .timing import EPS


# ---------------------------------------------------------------------------------------------
# rmsnorm_bwd: dy, x, weight, rstd -> dx, dweight


def rms_backward_bytes(rows: int, C: int, dtype: str) -> int:
    """Read dy and x, write dx; read weight, write dweight; read rstd."""
    return (3 * rows * C + 2 * C) * jnp.dtype(dtype).itemsize + stat_bytes(rows, dtype, 1)


def prepare_rms_backward(rows, C, dtype, params, key) -> Case:
    x, dy, w, _ = inputs(key, rows, C, dtype, "same", 2)
    # rstd from the jnp forward: a case is made outside any entry's error handling, so it must
    # not need our FFI forward (and every entry gets the same rstd).
    acc = reference.acc_dtype(x.dtype)
    _, rstd = jax.jit(reference.rmsnorm_fwd, static_argnums=2)(x.astype(acc), w.astype(acc), EPS)
    ref = jax.jit(reference.rmsnorm_bwd)(dy.astype(acc), x.astype(acc), w.astype(acc), rstd)
    return Case(rms_backward_bytes(rows, C, dtype), dy, (x, w, rstd), f64(ref), dtype,
                torch_inputs=(x, w, dy))


def rms_backward_ours(kernel: int, block_size: int):
    def step(dy, x, w, rstd):
        return rmsnorm_bwd(dy, x, w, rstd, kernel=kernel, block_size=block_size)
    return step


def rms_backward_xla(dy, x, w, rstd):
    return reference.rmsnorm_bwd(dy, x, w, rstd)


def rms_backward_autodiff(dy, x, w, rstd):
    _, vjp = jax.vjp(lambda x, w: reference.rmsnorm(x, w, EPS), x, w)
    return vjp(dy)  # rstd is recomputed from x inside every step


def rms_backward_impls(case, args, combos):
    out = [Impl(f"k{kid}/bs{bs}", rms_backward_ours(kid, bs), False) for kid, bs in combos]
    steps = {"xla": rms_backward_xla, "autodiff": rms_backward_autodiff}
    return out + default_impls(rms_backward_default, args) + [Impl(p, steps[p], True) for p in steps if p in args.peers] \
        + pallas_impls("rmsnorm_bwd", args)


def rms_backward_default(dy, x, w, rstd):
    return rmsnorm_bwd(dy, x, w, rstd)



# ---------------------------------------------------------------------------------------------
# rmsnorm_fwd: x, weight -> y, rstd; add_rmsnorm_fwd: x, residual, weight -> y, s, rstd


def rms_forward_bytes(rows: int, C: int, dtype: str, params: str) -> int:
    """Read x, write y; read weight; write rstd."""
    return (2 * rows * C * jnp.dtype(dtype).itemsize + C * params_dtype(dtype, params).itemsize
            + stat_bytes(rows, dtype, 1))


def _rms_forward_ref(x, w):
    acc = reference.acc_dtype(x.dtype)
    return jax.jit(reference.rmsnorm_fwd, static_argnums=2)(x.astype(acc), w.astype(acc), EPS)


def prepare_rms_forward(rows, C, dtype, params, key) -> Case:
    x, w, _ = inputs(key, rows, C, dtype, params, 1)
    return Case(rms_forward_bytes(rows, C, dtype, params), x, (w,), f64(_rms_forward_ref(x, w)),
                str(w.dtype), torch_inputs=(x, w))


def rms_forward_ours(x, w):
    return rmsnorm_fwd_op(x, w, EPS)


def rms_forward_xla(x, w):
    return reference.rmsnorm_fwd(x, w, EPS)


def rms_forward_default(x, w):
    return rmsnorm_fwd_public(x, w, eps=EPS)


rms_forward_impls = forward_impls_of(rms_forward_ours, rms_forward_xla, rms_forward_default, "rmsnorm_fwd")


def prepare_add_rms_forward(rows, C, dtype, params, key) -> Case:
    x, r, w, _ = inputs(key, rows, C, dtype, params, 2)
    s = jax.jit(jnp.add)(x, r)  # jnp's add in x's dtype: s must equal it bit for bit
    y, rstd = _rms_forward_ref(s, w)
    nbytes = rms_forward_bytes(rows, C, dtype, params) + 2 * rows * C * jnp.dtype(dtype).itemsize
    return Case(nbytes, x, (r, w), f64((y, s, rstd)), str(w.dtype))


def add_rms_forward_ours(x, r, w):
    return add_rmsnorm_fwd_op(x, r, w, EPS)


def add_rms_forward_unfused(x, r, w):
    """jnp's add, then our fused forward of s."""
    s = x + r
    y, rstd = rmsnorm_fwd_op(s, w, EPS)
    return y, s, rstd


def add_rms_forward_xla(x, r, w):
    s = x + r
    y, rstd = reference.rmsnorm_fwd(s, w, EPS)
    return y, s, rstd


def add_rms_forward_default(x, r, w):
    return autodiff.add_forward(RMSNORM, x, r, w, None, EPS, None)


add_rms_forward_impls = add_forward_impls_of(add_rms_forward_ours, add_rms_forward_unfused, add_rms_forward_xla,
                                               add_rms_forward_default)

