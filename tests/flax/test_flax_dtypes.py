"""The Flax modules follow linen's and nnx's dtype rules: for every (x dtype, dtype, param_dtype)
the output dtype is Flax's, the values and gradients are Flax's to the output's precision, the
parameter trees are identical, and float32 params are never rounded (the op gets them as
float32: target v2). AddLayerNorm against `s = x + residual; LayerNorm(s)` written with Flax."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from conftest import RTOL, rel_err  # noqa: E402
from jax_lnbwd import flax as lnbwd_flax  # noqa: E402
from jax_lnbwd import TARGET_V2  # noqa: E402
from jax_lnbwd.flax import nnx as lnbwd_nnx  # noqa: E402

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
COMBOS = list(itertools.product((F32, BF16, F16), (None, F32, BF16, F16), (F32, BF16)))
IDS = [f"x={jnp.dtype(x).name}-dtype={getattr(d, '__name__', d)}-param={jnp.dtype(p).name}" for x, d, p in COMBOS]
SHAPE = (2, 5, 32)


def _data(x_dtype, seed=0):
    rng = np.random.default_rng(seed)
    x, r, g = (jnp.asarray(rng.standard_normal(SHAPE), x_dtype) for _ in range(3))
    return x, r, g


def _tol(*dtypes):
    """The tolerance of the coarsest dtype involved (each rounding is within its RTOL)."""
    return max(RTOL[jnp.dtype(d).name] for d in dtypes if d is not None)


def _init_kw():
    # non-trivial params, so that rounding them would show
    return dict(scale_init=nn.initializers.normal(1.0), bias_init=nn.initializers.normal(1.0))


def _check(theirs_apply, ours_apply, v_theirs, v_ours, inputs, tol):
    out_t, out_o = theirs_apply(v_theirs, *inputs), ours_apply(v_ours, *inputs)
    out_t, out_o = jax.tree.leaves(out_t), jax.tree.leaves(out_o)
    for a, b in zip(out_t, out_o):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        assert rel_err(b, a) <= tol

    def grads(apply, v):
        g = _data(jnp.float32, seed=5)[2]
        return jax.grad(lambda v, *xs: sum(jnp.sum(o.astype(F32) * g) for o in jax.tree.leaves(apply(v, *xs))),
                        argnums=tuple(range(len(inputs) + 1)))(v, *inputs)

    for a, b in zip(jax.tree.leaves(grads(theirs_apply, v_theirs)), jax.tree.leaves(grads(ours_apply, v_ours))):
        assert a.dtype == b.dtype
        assert rel_err(b, a) <= tol


@pytest.mark.parametrize("x_dtype,dtype,param_dtype", COMBOS, ids=IDS)
def test_linen_dtypes(x_dtype, dtype, param_dtype):
    x, _, _ = _data(x_dtype)
    kw = dict(dtype=dtype, param_dtype=param_dtype, **_init_kw())
    theirs, ours = nn.LayerNorm(**kw), lnbwd_flax.LayerNorm(**kw)
    v_t, v_o = theirs.init(jax.random.key(1), x), ours.init(jax.random.key(1), x)
    assert jax.tree.structure(v_t) == jax.tree.structure(v_o)
    for a, b in zip(jax.tree.leaves(v_t), jax.tree.leaves(v_o)):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    _check(theirs.apply, ours.apply, v_t, v_o, (x,), _tol(x_dtype, dtype, param_dtype))


@pytest.mark.parametrize("x_dtype,dtype,param_dtype", COMBOS, ids=IDS)
def test_nnx_dtypes(x_dtype, dtype, param_dtype):
    x, _, _ = _data(x_dtype)
    kw = dict(dtype=dtype, param_dtype=param_dtype, scale_init=nnx.initializers.normal(1.0),
              bias_init=nnx.initializers.normal(1.0))
    theirs, ours = nnx.LayerNorm(32, rngs=nnx.Rngs(0), **kw), lnbwd_nnx.LayerNorm(32, rngs=nnx.Rngs(0), **kw)
    g_t, s_t = nnx.split(theirs)
    g_o, s_o = nnx.split(ours)
    for a, b in zip(jax.tree.leaves(s_t), jax.tree.leaves(s_o)):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    # nnx rounds float32 params to a 16-bit `dtype` before use; we do not: float32 params
    # differ from nnx by that rounding (within the 16-bit tolerance).
    _check(lambda s, x: nnx.merge(g_t, s)(x), lambda s, x: nnx.merge(g_o, s)(x), s_t, s_o, (x,),
           _tol(x_dtype, dtype, param_dtype))


@pytest.mark.parametrize("x_dtype,dtype,param_dtype", COMBOS, ids=IDS)
def test_linen_add_layernorm(x_dtype, dtype, param_dtype):
    x, r, _ = _data(x_dtype, seed=2)
    kw = dict(dtype=dtype, param_dtype=param_dtype, **_init_kw())

    class Theirs(nn.Module):
        @nn.compact
        def __call__(self, x, r):
            s = x + r
            return nn.LayerNorm(name="norm", **kw)(s), s

    class Ours(nn.Module):
        @nn.compact
        def __call__(self, x, r):
            return lnbwd_flax.AddLayerNorm(name="norm", **kw)(x, r)

    v_t, v_o = Theirs().init(jax.random.key(3), x, r), Ours().init(jax.random.key(3), x, r)
    assert jax.tree_util.tree_structure(v_t) == jax.tree_util.tree_structure(v_o)
    for a, b in zip(jax.tree.leaves(v_t), jax.tree.leaves(v_o)):
        np.testing.assert_array_equal(a, b)
    _check(Theirs().apply, Ours().apply, v_t, v_o, (x, r), _tol(x_dtype, dtype, param_dtype))


@pytest.mark.parametrize("x_dtype,dtype", [(F32, None), (BF16, BF16), (BF16, None)])
def test_nnx_add_layernorm(x_dtype, dtype):
    x, r, _ = _data(x_dtype, seed=4)
    theirs = nnx.LayerNorm(32, dtype=dtype, rngs=nnx.Rngs(0))
    ours = lnbwd_nnx.AddLayerNorm(32, dtype=dtype, rngs=nnx.Rngs(0))
    assert isinstance(ours, nnx.LayerNorm)
    g_t, s_t = nnx.split(theirs)
    g_o, s_o = nnx.split(ours)
    assert jax.tree.structure(s_t) == jax.tree.structure(s_o)

    def theirs_apply(s, x, r):
        h = x + r
        return nnx.merge(g_t, s)(h), h

    _check(theirs_apply, lambda s, x, r: nnx.merge(g_o, s)(x, r), s_t, s_o, (x, r), _tol(x_dtype, dtype))


def test_mixed_precision_params_never_rounded():
    """dtype=bfloat16, float32 params, bf16 x: the op gets float32 scale/bias (one v2 call, no
    convert of the params to bf16 before it), float32 gradients; AddLayerNorm too."""
    x, r, _ = _data(BF16, seed=6)
    for module, args in ((lnbwd_flax.LayerNorm(dtype=BF16), (x,)), (lnbwd_flax.AddLayerNorm(dtype=BF16), (x, r))):
        v = module.init(jax.random.key(0), *args)
        loss = lambda v: sum(jnp.sum(o.astype(F32)) for o in jax.tree.leaves(module.apply(v, *args)))  # noqa: E731
        text = jax.jit(jax.grad(loss)).lower(v).as_text()
        assert text.count(f"@{TARGET_V2}(") == 1
        assert "tensor<32xf32>) -> tensor<32xbf16>" not in text    # no rounding of a (32,) param
        assert all(g.dtype == F32 for g in jax.tree.leaves(jax.grad(loss)(v)))
