"""weight and/or bias may be None (Flax's use_scale=False / use_bias=False).

An absent weight is a scale of ones, an absent bias a shift of zero; jax.grad returns None in
the place of an absent parameter. All four combinations against the pure-jnp reference (which
takes None the same way), forward and gradients, in each dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DTYPES, PLATFORMS, assert_close, device, f64, make_inputs, put
from jax_lnbwd import layernorm, layernorm_bwd, layernorm_fwd, reference

# id -> (weight given, bias given)
PARAMS = {"weight-bias": (True, True), "weight": (True, False), "bias": (False, True), "none": (False, False)}
ARGNUMS = (0, 1, 2)


def _params(params, w, b):
    use_w, use_b = PARAMS[params]
    return (w if use_w else None), (b if use_b else None)


def _loss(fn, x, w, b, r):
    return jnp.sum(fn(x, w, b) * r)


grad_ours = jax.jit(jax.grad(functools.partial(_loss, layernorm), argnums=ARGNUMS))
grad_ref = jax.jit(jax.grad(functools.partial(_loss, reference.layernorm), argnums=ARGNUMS))


def _on_cpu_f64(*arrays):
    return tuple(None if a is None else jax.device_put(f64(a), device("cpu")) for a in arrays)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_grads_match_reference(platform, params, dtype):
    x, r, w, b = make_inputs((2, 5, 48), dtype, seed=1)
    w, b = _params(params, w, b)
    dev_args = tuple(None if a is None else put(platform, a) for a in (x, w, b, r))

    y = jax.jit(layernorm)(*dev_args[:3])
    y2, mean, rstd = jax.jit(layernorm_fwd)(*dev_args[:3])
    y_ref, mean_ref, rstd_ref = reference.layernorm_fwd(*_on_cpu_f64(x, w, b))
    for name, got, want in (("y", y, y_ref), ("layernorm_fwd y", y2, y_ref), ("mean", mean, mean_ref),
                            ("rstd", rstd, rstd_ref)):
        assert_close(name, got, want, dtype)

    grads = grad_ours(*dev_args)
    want = grad_ref(*_on_cpu_f64(x, w, b, r))
    for name, given, got, ref in zip(("dx", "dweight", "dbias"), (x, w, b), grads, want):
        if given is None:
            assert got is None, f"{name}: a gradient for an absent parameter"
        else:
            assert got.dtype == jnp.dtype(dtype)
            assert_close(name, got, ref, dtype)


@pytest.mark.parametrize("params", list(PARAMS))
def test_vmap_of_grad_with_absent_params(params):
    # Per-example gradients of the parameters that are there; None for the others.
    parts = [make_inputs((3, 16), "float32", seed=10 + i) for i in range(4)]
    x, r, w, b = (np.stack(a) for a in zip(*parts))
    w, b = _params(params, w, b)
    grads = jax.jit(jax.vmap(grad_ours))(x, w, b, r)
    for i in range(4):
        want = grad_ref(*_on_cpu_f64(x[i], None if w is None else w[i], None if b is None else b[i], r[i]))
        for name, got, ref in zip(("dx", "dweight", "dbias"), grads, want):
            assert (got is None) == (ref is None), name
            if got is not None:
                assert_close(f"example {i} {name}", got[i], ref, "float32")


def test_layernorm_bwd_still_needs_weight():
    # The raw op has no "no scale" mode: pass ones. A clear TypeError, not an AttributeError.
    x = np.zeros((4, 8), np.float32)
    stats = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="'weight'"):
        layernorm_bwd(x, x, None, stats, stats)


@pytest.mark.parametrize("fn", [layernorm, layernorm_fwd], ids=["layernorm", "layernorm_fwd"])
def test_present_params_are_still_checked(fn):
    # None switches a parameter off; anything else must still be a (C,) array of x's dtype.
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="'bias'"):
        fn(x, None, np.zeros(7, np.float32))
    with pytest.raises(TypeError, match="'weight'"):
        fn(x, np.zeros(8, np.float16), None)
