"""x's own bias in the residual-fused op: add_layernorm(x, residual, weight, bias, x_bias=b) is
s = (x + b) + residual (both adds in fp32, fp64 for float64, rounded once to x's dtype) and
y = layernorm(s). The forward is one FFI call (target jax_lnbwd_add_layernorm_fwd_v2) where the
fused forward runs; b's gradient is the fp32 column sum of ds.

The forward op against reference.add_residual (s bit for bit) and the float64 reference (y,
mean, rstd) on odd shapes and the wide path; the handlers' and Python's checks; add_layernorm's
values and gradients per dtype (mixed precision included) with the FFI forward and with jnp's;
the lowered calls; vmap with per-example biases; forward mode and second order; sharded jit and
shard_map; export; the Flax modules (use_x_bias) against Dense-with-bias + add + Flax's
LayerNorm. Every value test runs on the CPU and, where there is one, on the GPU.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jax_lnbwd.flax
import jax_lnbwd.flax.nnx
from conftest import PLATFORMS, assert_close, device, make_inputs, put, shape_id
from jax_lnbwd import add_layernorm, reference, use_ffi_forward
from jax_lnbwd import TARGET_V2
from jax_lnbwd import TARGET_ADD_FWD as ADD_TARGET, TARGET_ADD_FWD_V2 as ADD_BIAS_TARGET
from jax_lnbwd.ops.forward import add_layernorm_fwd_op
from test_add_forward import ffi
from test_forward import assert_forward

EPS = 1e-5
# Odd C, a row longer than a warp's vectors, rows past the register path: shared memory (fp32
# 30000, 16-bit 40000) and global memory (fp32 70000), rank 1 and 3.
SHAPES = [(1, 1), (7, 3), (7, 1601), (4225, 40), (3, 30000), (2, 40000), (2, 70000), (40,), (2, 5, 72)]
ARGNUMS = (0, 1, 2, 3, 4)


def inputs(platform, shape, dtype, seed, pdtype=None):
    """(x, residual, weight, bias, x_bias, gy, gs) on `platform`; parameters in pdtype (x's)."""
    x, gy, w, b = make_inputs(shape, dtype, seed=seed)
    r, gs, _, xb = make_inputs(shape, dtype, seed=seed + 50)
    p = np.dtype(jnp.dtype(pdtype or dtype))
    return put(platform, x, r, w.astype(p), b.astype(p), xb.astype(p), gy, gs)


def s_want(x, r, xb):
    """reference.add_residual on the CPU: what s must equal bit for bit."""
    cpu = device("cpu")
    return np.asarray(jax.jit(reference.add_residual)(*(jax.device_put(a, cpu) for a in (x, r, xb))))


def _reference(x, r, w, b, xb, eps=EPS):
    s = reference.add_residual(x, r, xb)
    return reference.layernorm(s, w, b, eps), s


def _ours(x, r, w, b, xb):
    return add_layernorm(x, r, w, b, x_bias=xb)


def _loss(f, x, r, w, b, xb, gy, gs):
    y, s = f(x, r, w, b, xb)
    acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    return jnp.sum(y.astype(acc) * gy.astype(acc)) + jnp.sum(s.astype(acc) * gs.astype(acc))


def _want(x, r, w, b, xb, gy, gs):
    """(y, s) and the five gradients by the float64 reference, from s as rounded."""
    cpu = device("cpu")
    s = s_want(x, r, xb)
    f64 = lambda a: jax.device_put(np.asarray(a).astype(np.float64), cpu)  # noqa: E731
    y = reference.layernorm(f64(s), f64(w), f64(b))
    gx, gw, gb = jax.grad(lambda s, w, b: jnp.sum(reference.layernorm(s, w, b) * f64(gy)),
                          argnums=(0, 1, 2))(f64(s), f64(w), f64(b))
    ds = gx + f64(gs)
    return (y, s), (ds, ds, gw, gb, jnp.sum(ds.reshape(-1, ds.shape[-1]), axis=0))


# --- the forward op ------------------------------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype,pdtype", [("float32", None), ("bfloat16", None), ("bfloat16", "float32"),
                                          ("float16", "float32"), ("float64", None)])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_forward_values(platform, dtype, pdtype, shape):
    if shape[-1] == 70000 and dtype != "float32":
        pytest.skip("the global-memory path is fp32's at this C (fp32 sums of 70000 16-bit values "
                    "on the CPU reach the statistics' tolerance)")
    x, r, w, b, xb, _, _ = inputs(platform, shape, dtype, seed=1, pdtype=pdtype)
    y, s, mean, rstd = jax.jit(lambda *a: add_layernorm_fwd_op(*a[:4], EPS, a[4]))(x, r, w, b, xb)
    s_ref = s_want(x, r, xb)
    assert s.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(s), s_ref, err_msg="s must be (x + x_bias) + residual, rounded once")
    assert_forward((y, mean, rstd), s_ref, np.asarray(w), np.asarray(b), dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_forward_absent_params_and_one_call(platform):
    """x_bias alone (no weight, no bias), and the lowered op is the one v2 call."""
    x, r, _, _, xb, _, _ = inputs(platform, (9, 264), "bfloat16", seed=2, pdtype="float32")
    fn = jax.jit(lambda x, r, xb: add_layernorm_fwd_op(x, r, None, None, EPS, xb))
    text = fn.lower(x, r, xb).as_text()
    assert text.count(f"@{ADD_BIAS_TARGET}(") == 1 and f"@{ADD_TARGET}(" not in text
    y, s, mean, rstd = fn(x, r, xb)
    s_ref = s_want(x, r, xb)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    assert_forward((y, mean, rstd), s_ref, None, None, "bfloat16")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_forward_vmap_per_example_bias(platform):
    """vmap over x, residual and x_bias: one FFI call whose x_bias has a row per example."""
    x, r, w, b, _, _, _ = inputs(platform, (3, 6, 40), "float32", seed=3)
    XB = put(platform, np.random.default_rng(3).standard_normal((3, 40)).astype(np.float32))
    fn = jax.jit(jax.vmap(lambda x, r, xb: add_layernorm_fwd_op(x, r, w, b, EPS, xb)))
    assert fn.lower(x, r, XB).as_text().count(f"@{ADD_BIAS_TARGET}(") == 1
    y, s, _, _ = fn(x, r, XB)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(s[i]), s_want(x[i], r[i], XB[i]))
        assert_close(f"y[{i}]", y[i], _reference(x[i], r[i], w, b, XB[i])[0], "float32")


F32 = np.ones((4, 8), np.float32)
W8 = np.ones(8, np.float32)


@pytest.mark.parametrize("args, err, match", [
    ((F32, F32, None, None, EPS, np.ones(7, np.float32)), ValueError,
     r"add_layernorm_fwd: 'x_bias' has shape \(7,\) but expected \(8,\)"),
    ((F32.astype(jnp.bfloat16), F32.astype(jnp.bfloat16), None, None, EPS, W8.astype(np.float16)), TypeError,
     "add_layernorm_fwd: 'x_bias' has dtype float16 but expected bfloat16 or float32"),
])
def test_forward_bad_inputs(args, err, match):
    with pytest.raises(err, match=match):
        add_layernorm_fwd_op(*args)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case, match", [
    ("absent", r"add_layernorm_fwd: 'x_bias' has shape \(0, 8\) but expected \(1, 8\) or \(segments, 8\)"),
    ("columns", r"add_layernorm_fwd: 'x_bias' has shape \(1, 7\) but expected"),
    ("segments", r"add_layernorm_fwd: 'x_bias' has shape \(3, 8\) but its 3 rows must divide the 4 rows"),
    ("dtype", r"add_layernorm_fwd: 'x_bias' has dtype float64 but expected float32"),
    ("mixed", r"add_layernorm_fwd: 'x_bias' has dtype float32 but weight and bias have bfloat16"),
])
def test_handler_checks(platform, case, match):
    """The v2 target called directly (no Python checks): the handlers' own checks."""
    x, r, w, b, xb = F32, F32, W8[None], W8[None], W8[None]
    if case == "absent":
        xb = np.zeros((0, 8), np.float32)
    elif case == "columns":
        xb = xb[:, :7]
    elif case == "segments":
        xb = np.ones((3, 8), np.float32)
    elif case == "dtype":
        xb = xb.astype(np.float64)
    elif case == "mixed":
        x = r = F32.astype(jnp.bfloat16)
        w = b = w.astype(jnp.bfloat16)
    if case == "dtype" and not jax.config.jax_enable_x64:
        pytest.skip("float64 needs jax_enable_x64")
    with pytest.raises(Exception, match=match):
        ffi(platform, x, r, w, b, x_bias=xb)


# --- add_layernorm(..., x_bias=) -----------------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype,pdtype", [("float32", None), ("bfloat16", None), ("bfloat16", "float32"),
                                          ("float16", "float32"), ("float64", None)])
@pytest.mark.parametrize("ffi_forward", [True, False], ids=["ffi_fwd", "jnp_fwd"])
def test_values_and_grads(platform, dtype, pdtype, ffi_forward):
    x, r, w, b, xb, gy, gs = inputs(platform, (3, 5, 72), dtype, seed=4, pdtype=pdtype)
    with use_ffi_forward(True if ffi_forward else False):
        y, s = jax.jit(_ours)(x, r, w, b, xb)
        grads = jax.jit(jax.grad(lambda *a: _loss(_ours, *a, gy, gs), argnums=ARGNUMS))(x, r, w, b, xb)
    (y_want, s_want_), g_want = _want(x, r, w, b, xb, gy, gs)
    np.testing.assert_array_equal(np.asarray(s), s_want_)
    assert_close("y", y, y_want, dtype)
    assert [g.dtype for g in grads] == [x.dtype, x.dtype, w.dtype, b.dtype, xb.dtype]
    for name, g, h in zip(("dx", "dresidual", "dweight", "dbias", "dx_bias"), grads, g_want):
        assert_close(name, g, h, dtype)


def test_one_call_each_way():
    """With the FFI forward: one v2 forward (the bias added in it) and one v2 backward call."""
    x, r, w, b, xb, gy, gs = inputs("cpu", (4, 64), "bfloat16", seed=5, pdtype="float32")
    with use_ffi_forward(True):
        text = jax.jit(jax.grad(lambda *a: _loss(_ours, *a, gy, gs), argnums=ARGNUMS)).lower(x, r, w, b, xb).as_text()
    assert text.count(f"@{ADD_BIAS_TARGET}(") == 1 and f"@{ADD_TARGET}(" not in text
    assert text.count(f"@{TARGET_V2}(") == 1


@pytest.mark.parametrize("platforms", [("cuda", "cpu"), ("cuda",)], ids=["ffi_branch", "jnp_branch"])
def test_default_forward_per_platform(monkeypatch, platforms):
    """The default forward (no switch): jax.lax.platform_dependent picks the fused v2 forward on
    the platforms that have it, jnp's add and forward elsewhere; both give the reference's values.
    Here the CPU is made one of those platforms, or not. Under autodiff the rule takes jnp's
    forward on every platform (dispatch.py), so only the un-differentiated forward shows it."""
    import sys
    from jax_lnbwd import config
    monkeypatch.delenv(config.FORWARD_ENV_VAR, raising=False)
    monkeypatch.setitem(config._overrides, config.FORWARD_ENV_VAR, None)
    monkeypatch.setattr(sys.modules["jax_lnbwd.dispatch"], "KERNEL_PLATFORMS", platforms)
    x, r, w, b, xb, gy, gs = inputs("cpu", (6, 80), "bfloat16", seed=13, pdtype="float32")
    fn = jax.jit(jax.grad(lambda *a: _loss(_ours, *a, gy, gs), argnums=ARGNUMS))
    assert f"@{ADD_BIAS_TARGET}(" not in fn.lower(x, r, w, b, xb).as_text()
    fresh = jax.jit(lambda *a: _ours(*a))   # traced now (jit caches by function, not by the rule)
    assert (f"@{ADD_BIAS_TARGET}(" in fresh.lower(x, r, w, b, xb).as_text()) == ("cpu" in platforms)
    y, s = jax.jit(_ours)(x, r, w, b, xb)
    (y_want, s_want_), g_want = _want(x, r, w, b, xb, gy, gs)
    np.testing.assert_array_equal(np.asarray(s), s_want_)
    assert_close("y", y, y_want, "bfloat16")
    for name, g, h in zip(("dx", "dresidual", "dweight", "dbias", "dx_bias"), fn(x, r, w, b, xb), g_want):
        assert_close(name, g, h, "bfloat16")


def test_vmap_per_example_bias():
    x, r, w, b, _, gy, gs = inputs("cpu", (4, 6, 64), "float32", seed=6)
    XB = jnp.asarray(np.random.default_rng(6).standard_normal((4, 64)), jnp.float32)
    fn = jax.jit(jax.vmap(jax.grad(lambda x, r, xb, gy, gs: _loss(_ours, x, r, w, b, xb, gy, gs),
                                   argnums=(0, 1, 2))))
    with use_ffi_forward(True):
        grads = fn(x, r, XB, gy, gs)
    for i in range(4):
        _, g_want = _want(x[i], r[i], w, b, XB[i], gy[i], gs[i])
        assert_close(f"dx[{i}]", grads[0][i], g_want[0], "float32")
        assert_close(f"dx_bias[{i}]", grads[2][i], g_want[4], "float32")


def test_forward_mode_and_second_order():
    x, r, w, b, xb, gy, gs = inputs("cpu", (5, 24), "float64", seed=7)
    tangents = (gy, gs, w[::-1], b[::-1], xb[::-1])
    for ffi_forward in (True, False):
        with use_ffi_forward(ffi_forward):
            _, t = jax.jvp(_ours, (x, r, w, b, xb), tangents)
            _, t_want = jax.jvp(_reference, (x, r, w, b, xb), tangents)
            for name, a, h in zip(("dy", "ds"), t, t_want):
                assert_close(name, a, h, "float64")
            check_grads(_ours, (x, r, w, b, xb), order=2, modes=("fwd", "rev"))


def test_sharded_jit_and_shard_map():
    mesh = Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("a", "b"))
    x, r, w, b, xb, gy, gs = inputs("cpu", (4, 6, 64), "float32", seed=8)
    rows = NamedSharding(mesh, P("a", "b"))
    x, r, gy, gs = (jax.device_put(a, rows) for a in (x, r, gy, gs))
    w, b, xb = (jax.device_put(a, NamedSharding(mesh, P())) for a in (w, b, xb))
    with use_ffi_forward(True):
        fn = jax.jit(jax.grad(lambda *a: _loss(_ours, *a, gy, gs), argnums=ARGNUMS))
        grads = fn(x, r, w, b, xb)
        smap = jax.jit(jax.shard_map(_ours, mesh=mesh, in_specs=(P("a", "b"), P("a", "b"), P(), P(), P()),
                                     out_specs=P("a", "b")))
        y, _ = smap(x, r, w, b, xb)
    _, g_want = _want(x, r, w, b, xb, gy, gs)
    assert tuple(grads[0].sharding.spec[:2]) == ("a", "b")
    for name, g, h in zip(("dx", "dresidual", "dweight", "dbias", "dx_bias"), grads, g_want):
        assert_close(name, g, h, "float32")
    assert_close("y", y, _reference(x, r, w, b, xb)[0], "float32")


def test_export_round_trip():
    x, r, w, b, xb, gy, gs = inputs("cpu", (4, 40), "bfloat16", seed=9, pdtype="float32")
    with use_ffi_forward(True):
        fn = jax.jit(jax.grad(lambda *a: _loss(_ours, *a, gy, gs), argnums=ARGNUMS))
        exported = export.export(fn, platforms=["cpu"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call(t) for t in (TARGET_V2, ADD_BIAS_TARGET)])(x, r, w, b, xb)
        assert f"@{ADD_BIAS_TARGET}(" in exported.mlir_module()
        want = fn(x, r, w, b, xb)
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    restored = export.deserialize(exported.serialize())
    for g, h in zip(restored.call(x, r, w, b, xb), want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


def test_errors():
    x, r, w, b, xb, _, _ = inputs("cpu", (4, 256), "bfloat16", seed=10)
    with pytest.raises(ValueError, match=r"add_layernorm: 'x_bias' has shape \(255,\) but expected \(256,\)"):
        add_layernorm(x, r, w, b, x_bias=xb[:255])
    with pytest.raises(TypeError, match="add_layernorm: 'x_bias' has dtype float16 but expected bfloat16 or float32"):
        add_layernorm(x, r, w, b, x_bias=xb.astype(jnp.float16))


# --- Flax: AddLayerNorm(use_x_bias=True) ---------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linen_module_moves_the_dense_bias(platform, dtype):
    """Dense(use_bias=False) + AddLayerNorm(use_x_bias=True) against Dense(use_bias=True), the add
    and flax.linen.LayerNorm, with the Dense's bias copied into x_bias: the same output and the
    same gradients (the bias's included), to the compute dtype's tolerance."""
    dt = jnp.dtype(dtype)
    h, r, *_ = inputs(platform, (4, 16, 32), dtype, seed=11)

    class Ours(nn.Module):
        @nn.compact
        def __call__(self, h, r):
            x = nn.Dense(32, use_bias=False, dtype=dt, name="dense")(h)
            return jax_lnbwd.flax.AddLayerNorm(use_x_bias=True, dtype=dt, name="norm")(x, r)

    class Flax(nn.Module):
        @nn.compact
        def __call__(self, h, r):
            s = nn.Dense(32, dtype=dt, name="dense")(h) + r
            return nn.LayerNorm(dtype=dt, name="norm")(s), s

    p = Flax().init(jax.random.key(0), h, r)["params"]
    p = jax.tree.map(lambda a: a + 0.1, p)   # a nonzero bias
    ours_p = {"dense": {"kernel": p["dense"]["kernel"]},
              "norm": {**p["norm"], "x_bias": p["dense"]["bias"]}}
    assert jax.tree.map(jnp.shape, Ours().init(jax.random.key(0), h, r)["params"]) == jax.tree.map(jnp.shape, ours_p)

    def loss(module, p):
        y, s = module.apply({"params": p}, h, r)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s.astype(jnp.float32))

    with jax.default_matmul_precision("highest"):
        (y, s), (y2, s2) = Ours().apply({"params": ours_p}, h, r), Flax().apply({"params": p}, h, r)
        g, g2 = jax.grad(lambda p: loss(Ours(), p))(ours_p), jax.grad(lambda p: loss(Flax(), p))(p)
    assert y.dtype == y2.dtype and s.dtype == s2.dtype
    assert_close("y", y, y2, dtype)
    assert_close("s", s, s2, dtype)
    assert g["norm"]["x_bias"].dtype == jnp.float32
    assert_close("d x_bias", g["norm"]["x_bias"], g2["dense"]["bias"], dtype)
    assert_close("d kernel", g["dense"]["kernel"], g2["dense"]["kernel"], dtype)
    assert_close("d scale", g["norm"]["scale"], g2["norm"]["scale"], dtype)


def test_nnx_module_has_x_bias():
    x, r, *_ = inputs("cpu", (4, 32), "float32", seed=12)
    m = jax_lnbwd.flax.nnx.AddLayerNorm(32, use_x_bias=True, rngs=nnx.Rngs(0))
    assert m.x_bias[...].shape == (32,) and m.x_bias[...].dtype == jnp.float32
    m.x_bias[...] = jnp.linspace(-1, 1, 32, dtype=jnp.float32)
    y, s = m(x, r)
    y_want, s_ref = _reference(x, r, m.scale[...], m.bias[...], m.x_bias[...], eps=m.epsilon)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
    assert_close("y", y, y_want, "float32")
    assert jax_lnbwd.flax.nnx.AddLayerNorm(32, rngs=nnx.Rngs(0)).x_bias is None
    # without a residual: (LN(x + x_bias), x + x_bias)
    y0, s0 = m(x)
    assert_close("s (no residual)", s0, x + m.x_bias[...], "float32")
