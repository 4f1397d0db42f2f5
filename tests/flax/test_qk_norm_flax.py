"""jax_lnbwd.flax.QKNorm (linen) and jax_lnbwd.flax.nnx.QKNorm against the module public QK-norm
code writes: two Flax RMSNorms named q_norm and k_norm. The same parameter tree (a checkpoint of
that module loads as it is), the same values and gradients, dtypes and the offset field."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import assert_close
from jax_lnbwd.flax import QKNorm
from jax_lnbwd.flax import nnx as lnbwd_nnx

D = 32


def _qk(dtype="float32", seed=0):
    """q [B, T, 4, D] and k [B, T, 2, D] (grouped-query attention)."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((2, 5, 4, D)), dtype), jnp.asarray(rng.standard_normal((2, 5, 2, D)), dtype))


_RQ, _RK = (np.random.default_rng(9).standard_normal(s).astype(np.float32) for s in ((2, 5, 4, D), (2, 5, 2, D)))


def _loss(q, k):
    """A loss whose cotangents are fixed random arrays (nothing cancels in the backward)."""
    return jnp.sum(q.astype(jnp.float32) * _RQ) + jnp.sum(k.astype(jnp.float32) * _RK)


class FlaxQKNorm(nn.Module):
    """QK-norm as public linen code writes it (Qwen3, OLMo 2): two RMSNorms over head_dim."""
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.q_norm = nn.RMSNorm(epsilon=1e-6, dtype=self.dtype, param_dtype=self.param_dtype)
        self.k_norm = nn.RMSNorm(epsilon=1e-6, dtype=self.dtype, param_dtype=self.param_dtype)

    def __call__(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class FlaxQKNormNNX(nnx.Module):
    def __init__(self, num_features, *, dtype=None, param_dtype=jnp.float32, rngs):
        self.q_norm = nnx.RMSNorm(num_features, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.k_norm = nnx.RMSNorm(num_features, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, q, k):
        return self.q_norm(q), self.k_norm(k)


def _perturbed(tree, seed=1):
    """The parameters moved off their init (ones), each leaf differently."""
    leaves, treedef = jax.tree.flatten(tree)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [(a + 0.1 * rng.standard_normal(a.shape)).astype(a.dtype) for a in leaves])


DTYPES = [("float32", "float32", None), ("bfloat16", "float32", None), ("bfloat16", "float32", "bfloat16"),
          ("bfloat16", "bfloat16", None)]


@pytest.mark.parametrize("dtype,param_dtype,module_dtype", DTYPES)
def test_linen_loads_two_flax_rmsnorms(dtype, param_dtype, module_dtype):
    """Initialize Flax's two RMSNorms; apply QKNorm with their parameters: values and gradients."""
    q, k = _qk(dtype)
    fields = dict(dtype=module_dtype and jnp.dtype(module_dtype), param_dtype=jnp.dtype(param_dtype))
    theirs, ours = FlaxQKNorm(**fields), QKNorm(**fields)
    params = _perturbed(theirs.init(jax.random.key(0), q, k))
    assert jax.tree.map(jnp.shape, params) == {"params": {"q_norm": {"scale": (D,)}, "k_norm": {"scale": (D,)}}}
    assert jax.tree.structure(ours.init(jax.random.key(0), q, k)) == jax.tree.structure(params)
    tol_dtype = "bfloat16" if "bfloat16" in (dtype, param_dtype, module_dtype) else "float32"
    got, want = ours.apply(params, q, k), theirs.apply(params, q, k)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert_close("y", g, w, tol_dtype)
    g = jax.grad(lambda p: _loss(*ours.apply(p, q, k)))(params)
    g_ref = jax.grad(lambda p: _loss(*theirs.apply(p, q, k)))(params)
    for name in ("q_norm", "k_norm"):
        assert g["params"][name]["scale"].dtype == jnp.dtype(param_dtype)
        assert_close(f"d{name}", g["params"][name]["scale"], g_ref["params"][name]["scale"], tol_dtype)
    # dq and dk against Flax's module in float32 on the same (upcast) inputs: Flax's own 16-bit
    # backward rounds its intermediate cotangents, ours rounds once.
    dq, dk = jax.grad(lambda q, k: _loss(*ours.apply(params, q, k)), argnums=(0, 1))(q, k)
    f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)  # noqa: E731
    dq_ref, dk_ref = jax.grad(lambda q, k: _loss(*FlaxQKNorm().apply(f32(params), q, k)), argnums=(0, 1))(*f32((q, k)))
    assert dq.dtype == q.dtype and dk.dtype == k.dtype
    assert_close("dq", dq, dq_ref, tol_dtype)
    assert_close("dk", dk, dk_ref, tol_dtype)


def test_linen_init_equals_flax_and_jits():
    q, k = _qk()
    p = QKNorm().init(jax.random.key(0), q, k)
    want = FlaxQKNorm().init(jax.random.key(0), q, k)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = jax.jit(QKNorm().apply)(p, q, k)
    assert_close("jit", got[0], FlaxQKNorm().apply(p, q, k)[0], "float32")


def test_linen_offset_and_no_scale():
    q, k = _qk()
    p = QKNorm(offset=1.0, scale_init=nn.initializers.zeros).init(jax.random.key(0), q, k)
    p = _perturbed(p)
    got = QKNorm(offset=1.0).apply(p, q, k)
    want = FlaxQKNorm().apply(jax.tree.map(lambda a: a + 1.0, p), q, k)
    for g, w in zip(got, want):
        assert_close("offset", g, w, "float32")
    m = QKNorm(use_scale=False)
    assert jax.tree.leaves(m.init(jax.random.key(0), q, k)) == []
    got = m.apply({}, q, k)
    want = FlaxQKNorm().apply(FlaxQKNorm().init(jax.random.key(0), q, k), q, k)   # scale ones
    for g, w in zip(got, want):
        assert_close("no scale", g, w, "float32")


@pytest.mark.parametrize("dtype,param_dtype,module_dtype", DTYPES)
def test_nnx_loads_two_flax_rmsnorms(dtype, param_dtype, module_dtype):
    """nnx: the state of Flax's two RMSNorms put into QKNorm; values and gradients."""
    q, k = _qk(dtype)
    fields = dict(dtype=module_dtype and jnp.dtype(module_dtype), param_dtype=jnp.dtype(param_dtype))
    theirs = FlaxQKNormNNX(D, **fields, rngs=nnx.Rngs(0))
    ours = lnbwd_nnx.QKNorm(D, **fields, rngs=nnx.Rngs(0))
    state = _perturbed(nnx.state(theirs, nnx.Param))
    assert jax.tree.structure(nnx.state(ours, nnx.Param)) == jax.tree.structure(state)
    nnx.update(theirs, state)
    nnx.update(ours, state)
    tol_dtype = "bfloat16" if "bfloat16" in (dtype, param_dtype, module_dtype) else "float32"
    for g, w in zip(ours(q, k), theirs(q, k)):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert_close("y", g, w, tol_dtype)
    grads = nnx.grad(lambda m: _loss(*m(q, k)))(ours)
    grads_ref = nnx.grad(lambda m: _loss(*m(q, k)))(theirs)
    for name in ("q_norm", "k_norm"):
        g, w = getattr(grads, name).scale[...], getattr(grads_ref, name).scale[...]
        assert g.dtype == jnp.dtype(param_dtype)
        assert_close(f"d{name}", g, w, tol_dtype)


def test_nnx_init_equals_flax_and_offset():
    ours, theirs = lnbwd_nnx.QKNorm(D, rngs=nnx.Rngs(0)), FlaxQKNormNNX(D, rngs=nnx.Rngs(0))
    for a, b in zip(jax.tree.leaves(nnx.state(ours)), jax.tree.leaves(nnx.state(theirs))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q, k = _qk()
    gemma = lnbwd_nnx.QKNorm(D, offset=1.0, scale_init=nnx.initializers.zeros_init(), rngs=nnx.Rngs(0))
    state = _perturbed(nnx.state(gemma, nnx.Param))
    nnx.update(gemma, state)
    nnx.update(theirs, jax.tree.map(lambda a: a + 1.0, state))
    for g, w in zip(gemma(q, k), theirs(q, k)):
        assert_close("offset", g, w, "float32")
    got = nnx.jit(lambda m, q, k: m(q, k))(gemma, q, k)
    assert_close("jit", got[1], theirs(q, k)[1], "float32")
