"""The Flax RMSNorm drop-ins: jax_lnbwd.flax.RMSNorm / AddRMSNorm (linen) and jax_lnbwd.flax.nnx's,
against flax.linen.RMSNorm and flax.nnx.RMSNorm: the same parameters (names, shapes, init,
auto-names), the same values and gradients, and the offset field (Gemma)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_lnbwd
import jax_lnbwd.flax as lnflax
from conftest import RTOL, assert_close
from jax_lnbwd.flax import nnx as lnbwd_nnx


def _x(dtype="float32", shape=(2, 8, 64), seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize("dtype,param_dtype", [("float32", "float32"), ("bfloat16", "float32"),
                                               ("bfloat16", "bfloat16")])
def test_linen_drop_in(dtype, param_dtype):
    class Block(nn.Module):
        norm: type

        @nn.compact
        def __call__(self, x):
            return self.norm(dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(param_dtype))(x) * 2

    x = _x(dtype)
    ours, theirs = Block(lnflax.RMSNorm), Block(nn.RMSNorm)
    p = theirs.init(jax.random.key(0), x)
    assert jax.tree.structure(ours.init(jax.random.key(0), x)) == jax.tree.structure(p)
    assert "RMSNorm_0" in p["params"]
    scale = jax.tree.map(lambda a: a * 1.5, p)
    assert_close("y", ours.apply(scale, x), theirs.apply(scale, x), dtype)
    g = jax.grad(lambda p: jnp.sum(ours.apply(p, x).astype(jnp.float32) ** 2))(scale)
    g_ref = jax.grad(lambda p: jnp.sum(theirs.apply(p, x).astype(jnp.float32) ** 2))(scale)
    assert_close("dscale", g["params"]["RMSNorm_0"]["scale"], g_ref["params"]["RMSNorm_0"]["scale"], dtype)


def test_linen_offset_is_gemma_scale():
    x = _x()
    m = lnflax.RMSNorm(offset=1.0, scale_init=nn.initializers.zeros)
    p = m.init(jax.random.key(0), x)
    p = jax.tree.map(lambda a: a + 0.1, p)
    want = nn.RMSNorm().apply(jax.tree.map(lambda a: a + 1.0, p), x)
    assert_close("y", m.apply(p, x), want, "float32")


@pytest.mark.parametrize("use_x_bias", [False, True])
def test_linen_add_rmsnorm(use_x_bias):
    x, r = _x(seed=1), _x(seed=2)
    m = lnflax.AddRMSNorm(use_x_bias=use_x_bias)
    p = m.init(jax.random.key(0), x, r)
    assert set(p["params"]) == ({"scale", "x_bias"} if use_x_bias else {"scale"})
    y, s = m.apply(p, x, r)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x + r))
    assert_close("y", y, nn.RMSNorm().apply({"params": {"scale": p["params"]["scale"]}}, x + r), "float32")
    with jax_lnbwd.use_ffi_forward(False):
        text = jax.jit(jax.grad(lambda p: jnp.sum(m.apply(p, x, r)[0]))).lower(p).as_text()
    assert text.count(f"@{jax_lnbwd.TARGET_RMS_BWD}(") == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nnx_drop_in(dtype):
    x = _x(dtype)
    ours = lnbwd_nnx.RMSNorm(64, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    theirs = nnx.RMSNorm(64, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    assert jax.tree.structure(nnx.state(ours, nnx.Param)) == jax.tree.structure(nnx.state(theirs, nnx.Param))
    for m in (ours, theirs):
        m.scale[...] = m.scale[...] * 1.5
    assert_close("y", ours(x), theirs(x), dtype)
    g = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(ours)
    g_ref = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(theirs)
    assert_close("dscale", g.scale[...], g_ref.scale[...], dtype, RTOL["bfloat16"] if dtype == "bfloat16" else None)


def test_nnx_add_rmsnorm_and_offset():
    x, r = _x(seed=3), _x(seed=4)
    m = lnbwd_nnx.AddRMSNorm(64, offset=1.0, use_x_bias=True, rngs=nnx.Rngs(0))
    y, s = m(x, r)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x + r))
    want = jax_lnbwd.reference.rmsnorm(x + r, m.scale[...], 1e-6, 1.0)
    assert_close("y", y, want, "float32")


def test_per_head_rmsnorm_is_a_small_row_norm():
    """QK-norm as public Flax code writes it: RMSNorm over head_dim of q shaped [B, T, H, D].
    The drop-in needs no change: its rows are B * T * H of D columns, the values and gradients
    match flax.linen.RMSNorm's, and at a Qwen3-sized step (8 x 2048 tokens, 32 heads of 128) the
    dispatch rule runs our kernel in both directions on CUDA (the small-row kernels)."""
    from jax_lnbwd import dispatch
    x = _x("float32", shape=(2, 16, 4, 64))
    ours, theirs = lnflax.RMSNorm(), nn.RMSNorm()
    p = theirs.init(jax.random.key(0), x)
    scale = jax.tree.map(lambda a: a * 1.5, p)
    assert_close("y", ours.apply(scale, x), theirs.apply(scale, x), "float32")
    dispatch.clear_decisions()
    r = _x("float32", shape=x.shape, seed=1)   # a cotangent (sum(y ** 2) has dx = 0 up to eps)
    g = jax.grad(lambda p, x: jnp.sum(ours.apply(p, x) * r), argnums=(0, 1))(scale, x)
    want = jax.grad(lambda p, x: jnp.sum(theirs.apply(p, x) * r), argnums=(0, 1))(scale, x)
    jax.tree.map(lambda a, b: assert_close("grad", a, b, "float32"), g, want)
    assert {(d.rows, d.C) for d in dispatch.decisions()} == {(2 * 16 * 4, 64)}
    for direction in (dispatch.FORWARD, dispatch.BACKWARD):
        wins, why = dispatch.cuda_kernel_wins("rmsnorm", direction, 8 * 2048 * 32, 128, jnp.bfloat16)
        assert wins, why
