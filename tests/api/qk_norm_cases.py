"""Shared by tests/api's QK-norm test modules (not a test module itself): their inputs and their
loss. Imported as `from qk_norm_cases import inputs, loss` (pytest puts a test module's folder on
sys.path, as for tests/bench/e2e_shapes.py)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from conftest import np_dtype


def inputs(q_shape, k_shape, dtype="float32", weight_dtype=None, seed=0):
    """(q, k, q_weight, k_weight, rq, rk): host arrays; rq, rk are the cotangents (float32)."""
    rng = np.random.default_rng(seed)
    t, wt = np_dtype(dtype), np_dtype(weight_dtype or dtype)
    D = q_shape[-1]
    return (rng.standard_normal(q_shape).astype(t), rng.standard_normal(k_shape).astype(t),
            (1 + 0.1 * rng.standard_normal(D)).astype(wt), (1 + 0.1 * rng.standard_normal(D)).astype(wt),
            rng.standard_normal(q_shape).astype(np.float32), rng.standard_normal(k_shape).astype(np.float32))


def loss(fn, q, k, qw, kw, rq, rk, **kw_):
    """sum(q_out * rq) + sum(k_out * rk), in float32 (float64 for float64 outputs)."""
    qo, ko = fn(q, k, qw, kw, **kw_)
    acc = jnp.promote_types(qo.dtype, jnp.float32)
    return jnp.sum(qo.astype(acc) * rq) + jnp.sum(ko.astype(acc) * rk)
