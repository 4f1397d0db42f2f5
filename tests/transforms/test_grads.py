"""Gradients of jax_lnbwd.layernorm, and the raw layernorm_bwd, against references.

(a) check_grads: the custom VJP agrees with finite differences (float64, small shapes).
(b) jax.grad of a random projection of layernorm, in every dtype, against jax.grad of the
    pure-jnp reference in float64 from the upcast inputs (for bf16/f16 a low-precision
    reference would be meaningless).
(c) the op composes with jit, value_and_grad and vmap.
(d) the raw layernorm_bwd against reference.layernorm_bwd, given the same mean/rstd.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from conftest import (DTYPES, PLATFORMS, RTOL, assert_close, device, f64, make_inputs, put,
                      reference_bwd, reference_stats, shape_id)
from jax_lnbwd import layernorm, layernorm_bwd, reference

ARGNUMS = (0, 1, 2)  # x, weight, bias


def _loss(fn, x, w, b, r):
    """A scalar whose gradient w.r.t. fn's output is r: sum(fn(x, w, b) * r)."""
    return jnp.sum(fn(x, w, b) * r)


grad_ours = jax.jit(jax.grad(functools.partial(_loss, layernorm), argnums=ARGNUMS))
grad_ref = jax.jit(jax.grad(functools.partial(_loss, reference.layernorm), argnums=ARGNUMS))


def reference_grads(x, w, b, r):
    """Gradients of the reference loss in float64 on the CPU from the upcast inputs."""
    args = [jax.device_put(f64(a), device("cpu")) for a in (x, w, b, r)]
    return tuple(np.asarray(g) for g in grad_ref(*args))


# --- (a) finite differences ---------------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", [(4, 3), (3, 17), (2, 3, 5)], ids=shape_id)
def test_check_grads_float64(platform, shape):
    x, _, w, b = make_inputs(shape, "float64", seed=1)
    f = jax.jit(lambda x, w, b: layernorm(x, w, b))
    # check_grads calls f on perturbed copies of the arguments; the default device keeps any
    # copy it makes uncommitted (and so every call of our FFI op) on the platform under test.
    with jax.default_device(device(platform)):
        check_grads(f, put(platform, x, w, b), order=1)  # default modes: forward and reverse


# --- (b) gradients against the float64 reference -------------------------------------------

GRAD_SHAPES = [(1, 1), (1, 3), (7, 3), (5, 1601), (64, 768), (2, 3, 4, 40), (33, 4100)]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grads_match_reference(platform, dtype, shape):
    x, r, w, b = make_inputs(shape, dtype, seed=2)
    dx, dw, db = grad_ours(*put(platform, x, w, b, r))
    assert (dx.dtype, dw.dtype, db.dtype) == (jnp.dtype(dtype),) * 3
    assert dx.shape == x.shape and dw.shape == db.shape == (shape[-1],)
    want = reference_grads(x, w, b, r)
    for name, got, ref in zip(("dx", "dweight", "dbias"), (dx, dw, db), want):
        assert_close(name, got, ref, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", [(1, 1), (5, 1), (2, 3, 1)], ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grads_single_column(platform, dtype, shape):
    # C = 1: x - mean = 0, so y = bias whatever x and weight are: dx = 0 and dweight = 0, and
    # dbias = Σ dy over all rows. The C++ reference gives exact zeros; the atol (O(1) inputs)
    # only admits a kernel whose x - mean leaves a rounding residue (an fma, say).
    x, r, w, b = make_inputs(shape, dtype, seed=3)
    dx, dw, db = grad_ours(*put(platform, x, w, b, r))
    assert dx.shape == shape and dw.shape == db.shape == (1,)
    np.testing.assert_allclose(f64(dx), np.zeros(shape), rtol=0, atol=RTOL[dtype])
    np.testing.assert_allclose(f64(dw), np.zeros(1), rtol=0, atol=RTOL[dtype])
    assert_close("dbias", db, [f64(r).sum()], dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("absent", ["weight", "bias", "both"])
def test_grads_without_weight_or_bias(platform, absent):
    # weight and/or bias may be None (no scale / no shift): the gradients of what is there
    # match the reference without them, and an absent parameter's gradient is None.
    x, r, w, b = make_inputs((7, 96), "float32", seed=8)
    w = None if absent in ("weight", "both") else w
    b = None if absent in ("bias", "both") else b

    def on(dev, a):
        return None if a is None else jax.device_put(a, dev)

    dx, dw, db = grad_ours(*(on(device(platform), a) for a in (x, w, b, r)))
    want = grad_ref(*(on(device("cpu"), None if a is None else f64(a)) for a in (x, w, b, r)))
    assert (dw is None) == (w is None) and (db is None) == (b is None)
    for name, got, ref in zip(("dx", "dweight", "dbias"), (dx, dw, db), want):
        if got is not None:
            assert_close(name, got, ref, "float32")


# --- (c) transformations --------------------------------------------------------------------

def _loss64(fn, x, w, b, r):
    """sum(fn(x, w, b) * r) summed in float64, so the value's error is the forward's alone
    (a sum in bf16 would round differently with every reduction order). The cotangent of
    fn's output is still exactly r, in fn's dtype."""
    return jnp.sum(fn(x, w, b).astype(jnp.float64) * r.astype(jnp.float64))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_value_and_grad_jit_and_eager(platform, dtype):
    x, r, w, b = make_inputs((6, 40), dtype, seed=4)
    args = put(platform, x, w, b, r)
    loss = functools.partial(_loss64, layernorm)
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=ARGNUMS))(*args)
    with jax.default_device(device(platform)):
        eager = jax.grad(loss, argnums=ARGNUMS)(*args)  # no jit: op-by-op dispatch

    # The value is that of the forward, whose outputs are rounded to dtype: each term of the
    # sum is off by about one rounding, so compare against the sum of the terms' sizes.
    cpu = device("cpu")
    y_ref = np.asarray(reference.layernorm(*(jax.device_put(f64(a), cpu) for a in (x, w, b))))
    scale = np.sum(np.abs(y_ref * f64(r)))
    assert abs(float(value) - np.sum(y_ref * f64(r))) <= RTOL[dtype] * scale
    want = reference_grads(x, w, b, r)
    for name, g_vg, g_eager, ref in zip(("dx", "dweight", "dbias"), grads, eager, want):
        assert_close(f"value_and_grad {name}", g_vg, ref, dtype)
        assert_close(f"eager grad {name}", g_eager, ref, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("params", ["batched", "shared"])
def test_vmap_of_grad(platform, params):
    # A batch of independent problems equals the problems one by one: dweight and dbias are
    # per example (summed over each example's rows only), whether each example has its own
    # weight and bias ("batched") or all share one ("shared", in_axes None).
    batch = [make_inputs((3, 24), "float32", seed=10 + i) for i in range(4)]
    x, r, w, b = (np.stack(a) for a in zip(*batch))
    in_axes = (0, 0, 0, 0) if params == "batched" else (0, None, None, 0)
    if params == "shared":
        w, b = w[0], b[0]
    grad = jax.grad(functools.partial(_loss, layernorm), argnums=ARGNUMS)
    dx, dw, db = jax.jit(jax.vmap(grad, in_axes=in_axes))(*put(platform, x, w, b, r))
    assert dx.shape == x.shape and dw.shape == db.shape == (4, 24)
    for i, (xi, ri, wi, bi) in enumerate(batch):
        if params == "shared":
            wi, bi = w, b
        want = reference_grads(xi, wi, bi, ri)
        for name, got, ref in zip(("dx", "dweight", "dbias"), (dx[i], dw[i], db[i]), want):
            assert_close(f"problem {i} {name}", got, ref, "float32")


# --- (d) the raw backward op -----------------------------------------------------------------

bwd_jit = jax.jit(layernorm_bwd)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (16, 1601), (3, 5, 40), (2, 2, 3, 130)], ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_bwd_matches_reference(platform, dtype, shape):
    x, dy, w, _ = make_inputs(shape, dtype, seed=5)
    mean, rstd = reference_stats(x)
    assert mean.shape == rstd.shape == shape[:-1]
    dx, dw, db = bwd_jit(*put(platform, dy, x, w, mean, rstd))
    assert dx.shape == shape and dw.shape == db.shape == (shape[-1],)
    assert (dx.dtype, dw.dtype, db.dtype) == (jnp.dtype(dtype),) * 3
    for name, got, ref in zip(("dx", "dweight", "dbias"), (dx, dw, db), reference_bwd(dy, x, w, mean, rstd)):
        assert_close(name, got, ref, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)], ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_bwd_zero_rows(platform, dtype, shape):
    # No rows: dx is empty and the sums over rows are exactly zero (nothing may be left
    # uninitialized in dweight/dbias).
    x, dy, w, _ = make_inputs(shape, dtype, seed=6)
    mean, rstd = reference_stats(x)
    dx, dw, db = bwd_jit(*put(platform, dy, x, w, mean, rstd))
    assert dx.shape == shape and dx.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(f64(dw), np.zeros(8))
    np.testing.assert_array_equal(f64(db), np.zeros(8))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_layernorm_bwd_uses_given_stats(platform):
    # The op must use the mean/rstd it is given, not recompute them from x: with stats of a
    # shifted and scaled x, the result follows the reference given those same stats.
    x, dy, w, _ = make_inputs((9, 64), "float32", seed=7)
    mean, rstd = reference_stats(x)
    mean, rstd = mean + np.float32(0.5), rstd * np.float32(2.0)
    dx, dw, db = bwd_jit(*put(platform, dy, x, w, mean, rstd))
    for name, got, ref in zip(("dx", "dweight", "dbias"), (dx, dw, db), reference_bwd(dy, x, w, mean, rstd)):
        assert_close(name, got, ref, "float32")
