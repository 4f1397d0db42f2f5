"""A traced eps or offset is refused with a message that says how to pass it, and add_*norm
take residual=None as the Flax Add* modules do (s = x, plus x_bias rounded once)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lnbwd
from jax_lnbwd import reference

X = jax.random.normal(jax.random.key(0), (6, 40), jnp.float32)
W = 1.0 + 0.1 * jax.random.normal(jax.random.key(1), (40,), jnp.float32)
B = 0.1 * jax.random.normal(jax.random.key(2), (40,), jnp.float32)


@pytest.mark.parametrize("call, fn, name", [
    (lambda x, v: jax_lnbwd.layernorm(x, W, B, eps=v), "layernorm", "eps"),
    (lambda x, v: jax_lnbwd.rmsnorm(x, W, eps=v), "rmsnorm", "eps"),
    (lambda x, v: jax_lnbwd.rmsnorm(x, W, offset=v), "rmsnorm", "offset"),
    (lambda x, v: jax_lnbwd.add_rmsnorm(x, x, W, eps=v)[0], "add_rmsnorm", "eps"),
])
def test_traced_static_argument(call, fn, name):
    with pytest.raises(ValueError, match=rf"{fn}: {name} must be a static Python float.*static_argnames='{name}'"):
        jax.jit(call)(X, 1e-5)


def test_static_argnames_works():
    f = jax.jit(lambda x, eps: jax_lnbwd.rmsnorm(x, W, eps=eps), static_argnames="eps")
    np.testing.assert_allclose(f(X, eps=1e-3), reference.rmsnorm(X, W, 1e-3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x_bias", [None, B])
def test_add_rmsnorm_without_residual(x_bias):
    y, s = jax_lnbwd.add_rmsnorm(X, None, W, x_bias=x_bias)
    s_ref = X if x_bias is None else X + x_bias
    np.testing.assert_allclose(s, s_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, reference.rmsnorm(s_ref, W, 1e-6), rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda x, w: jax_lnbwd.add_rmsnorm(x, None, w, x_bias=x_bias)[0].sum(), argnums=(0, 1))(X, W)
    g_ref = jax.grad(lambda x, w: reference.rmsnorm(s_ref - X + x, w, 1e-6).sum(), argnums=(0, 1))(X, W)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_bias", [None, B])
def test_add_layernorm_without_residual(x_bias):
    y, s = jax_lnbwd.add_layernorm(X, None, W, B, x_bias=x_bias)
    s_ref = X if x_bias is None else X + x_bias
    np.testing.assert_allclose(s, s_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, reference.layernorm(s_ref, W, B, 1e-5), rtol=1e-5, atol=1e-5)


def test_add_rmsnorm_without_residual_checks_its_arguments():
    with pytest.raises(ValueError, match=r"add_rmsnorm: 'x_bias' has shape \(3,\)"):
        jax_lnbwd.add_rmsnorm(X, None, W, x_bias=jnp.ones(3))
