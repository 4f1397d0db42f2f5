"""Mixed precision in layernorm: float32 weight/bias beside bfloat16/float16 x.

y has x's dtype and is computed in fp32 from the float32 parameters (never rounded to 16 bits);
the backward runs target v2 and returns float32 dweight/dbias; same-dtype calls keep target v1.
Checked against the jnp reference in float64 (inputs upcast), under jit, vmap (per-example
sums), forward mode, double backward, sharded jit and export; kernels 1-10 refuse at trace time.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import PLATFORMS, assert_close, make_inputs, put
from jax_lnbwd import TARGET, layernorm, reference, use_ffi_forward
from jax_lnbwd import TARGET_V2

ARGNUMS = (0, 1, 2)


def _inputs(platform, dtype, shape=(3, 7, 96), seed=0):
    x, dy, w, b = make_inputs(shape, dtype, seed=seed)
    w32, b32 = (np.asarray(a, np.float64).astype(np.float32) + np.float32(1e-3) for a in (w, b))  # not 16-bit values
    return put(platform, x, dy, w32, b32)


def _loss(norm, x, w, b, dy):
    return jnp.sum(norm(x, w, b).astype(jnp.float32) * dy.astype(jnp.float32))


def _want(x, w, b, dy):
    """y and the gradients by the reference in float64 from the same (upcast) inputs."""
    f64 = [jax.device_put(np.asarray(a).astype(np.float64), jax.devices("cpu")[0]) for a in (x, w, b, dy)]
    y = reference.layernorm(*f64[:3])
    grads = jax.grad(lambda x, w, b: jnp.sum(reference.layernorm(x, w, b) * f64[3]), argnums=ARGNUMS)(*f64[:3])
    return y, grads


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("ffi_forward", [False, True])
def test_values_and_dtypes(platform, dtype, ffi_forward):
    x, dy, w, b = _inputs(platform, dtype)
    with use_ffi_forward(ffi_forward if platform == "cpu" else None):
        y = jax.jit(lambda x, w, b: layernorm(x, w, b))(x, w, b)
        grads = jax.jit(jax.grad(lambda *a: _loss(layernorm, *a, dy), argnums=ARGNUMS))(x, w, b)
    y_want, g_want = _want(x, w, b, dy)
    assert y.dtype == x.dtype
    assert_close("y", y, y_want, dtype)
    assert [g.dtype for g in grads] == [x.dtype, jnp.float32, jnp.float32]
    assert_close("dx", grads[0], g_want[0], dtype)
    for name, g, h in zip(("dweight", "dbias"), grads[1:], g_want[1:]):
        assert_close(name, g, h, "float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_target_v2_for_mixed_only(dtype):
    """A mixed call lowers to one v2 call; a same-dtype call to one v1 call (exports unchanged)."""
    x, dy, w, b = _inputs("cpu", dtype)
    if dtype == "float32":
        w, b = w.astype(x.dtype), b.astype(x.dtype)
    text = jax.jit(jax.grad(lambda *a: _loss(layernorm, *a, dy), argnums=ARGNUMS)).lower(x, w, b).as_text()
    v1, v2 = text.count(f"@{TARGET}("), text.count(f"@{TARGET_V2}(")
    assert (v1, v2) == ((0, 1) if dtype == "bfloat16" else (1, 0))


def test_one_param_float32():
    """weight float32, bias absent (or bias float32, weight 16-bit): still v2, float32 sums."""
    x, dy, w, b = _inputs("cpu", "bfloat16")
    g = jax.grad(lambda x, w: _loss(lambda x, w, b: layernorm(x, w, None), x, w, None, dy), argnums=(0, 1))(x, w)
    assert g[1].dtype == jnp.float32
    _, g_want = _want(x, w, jnp.zeros_like(w), dy)
    assert_close("dweight", g[1], g_want[1], "float32")
    wb = w.astype(jnp.bfloat16)
    g = jax.grad(lambda w, b: _loss(layernorm, x, w, b, dy), argnums=(0, 1))(wb, b)
    assert (g[0].dtype, g[1].dtype) == (jnp.bfloat16, jnp.float32)
    _, g_want = _want(x, wb, b, dy)
    assert_close("dbias", g[1], g_want[2], "float32")


def test_vmap_per_example():
    x, dy, w, b = _inputs("cpu", "bfloat16", shape=(4, 5, 64), seed=1)
    W = jnp.stack([w * (1 + i / 10) for i in range(4)])
    per_ex = jax.jit(jax.vmap(jax.grad(lambda x, w, b, dy: _loss(layernorm, x, w, b, dy), argnums=(1, 2)),
                              in_axes=(0, 0, None, 0)))(x, W, b, dy)
    for i in range(4):
        _, g_want = _want(x[i], W[i], b, dy[i])
        assert_close(f"dweight[{i}]", per_ex[0][i], g_want[1], "float32")
        assert_close(f"dbias[{i}]", per_ex[1][i], g_want[2], "float32")
        assert per_ex[0].dtype == jnp.float32


def test_forward_mode_and_double_backward():
    x, dy, w, b = _inputs("cpu", "bfloat16", shape=(6, 32), seed=2)
    tw = jnp.linspace(-1, 1, 32, dtype=jnp.float32)
    _, t = jax.jvp(lambda x, w: layernorm(x, w, b), (x, w), (dy, tw))
    _, t_want = jax.jvp(lambda x, w: reference.layernorm(x, w, b), (x, w), (dy, tw))
    assert t.dtype == x.dtype
    assert_close("jvp", t, t_want, "bfloat16")
    # grad of (grad . v): the backward's own derivative (jnp) with mixed dtypes
    hv = jax.grad(lambda w: jnp.vdot(jax.grad(lambda w: _loss(layernorm, x, w, b, dy))(w), tw))(w)
    hv_want = jax.grad(lambda w: jnp.vdot(jax.grad(lambda w: _loss(reference.layernorm, x, w, b, dy))(w), tw))(w)
    assert hv.dtype == jnp.float32
    assert_close("hvp", hv, hv_want, "bfloat16")


def test_sharded_jit():
    devices = jax.devices("cpu")[:4]
    mesh = Mesh(np.array(devices).reshape(2, 2), ("a", "b"))
    x, dy, w, b = _inputs("cpu", "bfloat16", shape=(4, 6, 64), seed=3)
    rows = NamedSharding(mesh, P("a", "b"))
    x, dy = jax.device_put(x, rows), jax.device_put(dy, rows)
    w, b = (jax.device_put(a, NamedSharding(mesh, P())) for a in (w, b))
    grads = jax.jit(jax.grad(lambda *a: _loss(layernorm, *a, dy), argnums=ARGNUMS))(x, w, b)
    _, g_want = _want(x, w, b, dy)
    assert tuple(grads[0].sharding.spec[:2]) == ("a", "b")
    assert_close("dx", grads[0], g_want[0], "bfloat16")
    for name, g, h in zip(("dweight", "dbias"), grads[1:], g_want[1:]):
        assert g.dtype == jnp.float32
        assert_close(name, g, h, "float32")


def test_export_round_trip():
    x, dy, w, b = _inputs("cpu", "bfloat16", shape=(4, 40), seed=4)
    fn = jax.jit(jax.grad(lambda *a: _loss(layernorm, *a, dy), argnums=ARGNUMS))
    exported = export.export(fn, platforms=["cpu"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(TARGET_V2)])(x, w, b)
    assert f"@{TARGET_V2}(" in exported.mlir_module()
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    restored = export.deserialize(exported.serialize())
    for g, h in zip(restored.call(x, w, b), fn(x, w, b)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


@pytest.mark.parametrize("kernel", [2, 5, 10])
def test_kernels_1_to_10_refuse_mixed(kernel):
    x, _, w, b = _inputs("cpu", "bfloat16", shape=(4, 64))
    with pytest.raises(ValueError, match=rf"layernorm: kernel {kernel} does not support a float32 weight"):
        layernorm(x, w, b, kernel=kernel)
    layernorm(x, w.astype(x.dtype), b.astype(x.dtype), kernel=kernel)   # same dtype: fine


def test_refused_dtypes():
    x, _, w, b = _inputs("cpu", "float32", shape=(4, 64))
    with pytest.raises(TypeError, match="layernorm: 'weight' has dtype bfloat16 but expected float32"):
        layernorm(x, w.astype(jnp.bfloat16), b)
    xb = x.astype(jnp.bfloat16)
    with pytest.raises(TypeError, match="layernorm: 'bias' has dtype float16 but expected bfloat16 or float32"):
        layernorm(xb, w, b.astype(jnp.float16))
