"""The layernorm ops of the kernel bench (ops.py): layernorm_bwd, layernorm_fwd and
add_layernorm_fwd, each its bytes, its Case (cases.py) and its entries: ours, the default, the
jnp peers and Pallas."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_lnbwd import KERNELS, LAYERNORM, autodiff, layernorm_bwd, layernorm_fwd, reference
from jax_lnbwd.ops.forward import add_layernorm_fwd_op, layernorm_fwd_op

from .cases import (Case, Impl, add_forward_impls_of, default_impls, f64, forward_impls_of, inputs, pallas_impls,
                    params_dtype, stat_bytes)
from .timing import EPS


# ---------------------------------------------------------------------------------------------
# layernorm_bwd: dy, x, weight, mean, rstd -> dx, dweight, dbias


def backward_bytes(rows: int, C: int, dtype: str) -> int:
    """Read dy and x, write dx; read weight, write dweight and dbias; read mean and rstd."""
    return (3 * rows * C + 3 * C) * jnp.dtype(dtype).itemsize + stat_bytes(rows, dtype)


def prepare_backward(rows, C, dtype, params, key) -> Case:
    kx, kdy, kw, kb = jax.random.split(key, 4)
    x = jax.random.normal(kx, (rows, C), dtype)
    dy = jax.random.normal(kdy, (rows, C), dtype)
    w = (1 + 0.1 * jax.random.normal(kw, (C,), jnp.float32)).astype(dtype)
    b = jax.random.normal(kb, (C,), dtype)
    _, mean, rstd = jax.jit(lambda x, w, b: layernorm_fwd(x, w, b, eps=EPS))(x, w, b)
    acc = reference.acc_dtype(x.dtype)
    ref = jax.jit(reference.layernorm_bwd)(dy.astype(acc), x.astype(acc), w.astype(acc), mean, rstd)
    return Case(backward_bytes(rows, C, dtype), dy, (x, w, b, mean, rstd), f64(ref), dtype,
                torch_inputs=(x, w, b, dy))


def backward_ours(kernel: int, block_size: int):
    def step(dy, x, w, b, mean, rstd):
        return layernorm_bwd(dy, x, w, mean, rstd, kernel=kernel, block_size=block_size)
    return step


def backward_xla(dy, x, w, b, mean, rstd):
    return reference.layernorm_bwd(dy, x, w, mean, rstd)


def backward_autodiff(dy, x, w, b, mean, rstd):
    _, vjp = jax.vjp(lambda x, w, b: reference.layernorm(x, w, b, EPS), x, w, b)
    return vjp(dy)  # the statistics are recomputed from x inside every step


def backward_impls(case, args, combos):
    loose = {"dweight": 10, "dbias": 10}  # kernels with precise=False
    out = [Impl(f"k{kid}/bs{bs}", backward_ours(kid, bs), False, {} if KERNELS[kid].precise else loose)
           for kid, bs in combos]
    return out + default_impls(backward_default, args) + [
        Impl(p, {"xla": backward_xla, "autodiff": backward_autodiff}[p], True)
        for p in ("xla", "autodiff") if p in args.peers] + pallas_impls("layernorm_bwd", args)


def backward_default(dy, x, w, b, mean, rstd):
    return layernorm_bwd(dy, x, w, mean, rstd)



# ---------------------------------------------------------------------------------------------
# layernorm_fwd: x, weight, bias -> y, mean, rstd


def forward_bytes(rows: int, C: int, dtype: str, params: str) -> int:
    """Read x, write y; read weight and bias; write mean and rstd."""
    return (2 * rows * C * jnp.dtype(dtype).itemsize + 2 * C * params_dtype(dtype, params).itemsize
            + stat_bytes(rows, dtype))


def _forward_ref(x, w, b):
    acc = reference.acc_dtype(x.dtype)
    return jax.jit(reference.layernorm_fwd)(x.astype(acc), w.astype(acc), b.astype(acc), EPS)


def prepare_forward(rows, C, dtype, params, key) -> Case:
    x, w, b = inputs(key, rows, C, dtype, params, 1)
    return Case(forward_bytes(rows, C, dtype, params), x, (w, b), f64(_forward_ref(x, w, b)),
                str(w.dtype), torch_inputs=(x, w, b))


def forward_ours(x, w, b):
    return layernorm_fwd_op(x, w, b, EPS)


def forward_xla(x, w, b):
    return reference.layernorm_fwd(x, w, b, EPS)


def forward_default(x, w, b):
    return layernorm_fwd(x, w, b, eps=EPS)


forward_impls = forward_impls_of(forward_ours, forward_xla, forward_default, "layernorm_fwd")



# ---------------------------------------------------------------------------------------------
# add_layernorm_fwd: x, residual, weight, bias -> y, s, mean, rstd


def add_forward_bytes(rows: int, C: int, dtype: str, params: str) -> int:
    """Read x and residual, write y and s; read weight and bias; write mean and rstd."""
    return forward_bytes(rows, C, dtype, params) + 2 * rows * C * jnp.dtype(dtype).itemsize


def prepare_add_forward(rows, C, dtype, params, key) -> Case:
    x, r, w, b = inputs(key, rows, C, dtype, params, 2)
    s = jax.jit(jnp.add)(x, r)  # jnp's add in x's dtype: s must equal it bit for bit
    y, mean, rstd = _forward_ref(s, w, b)
    return Case(add_forward_bytes(rows, C, dtype, params), x, (r, w, b), f64((y, s, mean, rstd)),
                str(w.dtype))


def add_forward_ours(x, r, w, b):
    return add_layernorm_fwd_op(x, r, w, b, EPS)


def add_forward_unfused(x, r, w, b):
    """jnp's add (XLA's fusion: read 2 tensors, write 1), then our fused forward of s."""
    s = x + r
    y, mean, rstd = layernorm_fwd_op(s, w, b, EPS)
    return y, s, mean, rstd


def add_forward_xla(x, r, w, b):
    s = x + r
    y, mean, rstd = reference.layernorm_fwd(s, w, b, EPS)
    return y, s, mean, rstd


def add_forward_default(x, r, w, b):
    return autodiff.add_forward(LAYERNORM, x, r, w, b, EPS, None)


add_forward_impls = add_forward_impls_of(add_forward_ours, add_forward_unfused, add_forward_xla,
                                           add_forward_default)

