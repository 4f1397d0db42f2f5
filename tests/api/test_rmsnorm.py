"""rmsnorm, rmsnorm_fwd, rmsnorm_bwd and add_rmsnorm: values against the float64 jnp reference
on every platform (the C++ handlers on the CPU, the CUDA kernels on the GPU), per dtype, with
mixed precision, Gemma's offset, absent weight, odd shapes, and the errors for bad input."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lnbwd
from conftest import PLATFORMS, RTOL, assert_close, f64, make_inputs, np_dtype, put
from jax_lnbwd import add_rmsnorm, reference, rmsnorm, rmsnorm_bwd, rmsnorm_fwd

DTYPES = ("float32", "bfloat16", "float16", "float64")
SHAPES = [(1,), (3, 1), (5, 7), (4, 8, 96), (37, 520), (6, 4100)]


def ref64(fn, *arrays, **kw):
    """fn of reference.py on the arrays upcast to float64, on the CPU."""
    cpu = jax.devices("cpu")[0]
    return jax.tree.map(np.asarray, fn(*(None if a is None else jax.device_put(f64(a), cpu) for a in arrays), **kw))


def loss_grads(platform, x, w, dy, offset=0.0, kernel=None, **kw):
    f = jax.jit(lambda x, w: jax.vjp(lambda x, w: rmsnorm(x, w, offset=offset, kernel=kernel, **kw), x, w))
    y, vjp = f(*put(platform, x, w))
    return y, *vjp(jax.device_put(dy, y.devices().pop()))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values_and_grads(platform, dtype, shape):
    x, dy, w, _ = make_inputs(shape, dtype, seed=len(shape))
    y, dx, dw = loss_grads(platform, x, w, dy)
    y64, rstd = ref64(reference.rmsnorm_fwd, x, w)
    dx64, dw64 = ref64(lambda dy, x, w, r: reference.rmsnorm_bwd(dy, x, w, r), dy, x, w, rstd)
    assert y.dtype == np_dtype(dtype) and dx.dtype == np_dtype(dtype) and dw.dtype == np_dtype(dtype)
    assert_close("y", y, y64, dtype)
    assert_close("dweight", dw, dw64, dtype)
    if shape[-1] == 1:
        # One element per row: x̂ = ±1 up to eps, and dx = g rstd (1 - x̂²) is the cancellation of
        # two equal terms, ~eps/x² of g rstd; only its size is meaningful.
        scale = np.abs(f64(dy) * f64(w) / np.abs(f64(x)))
        assert np.all(np.abs(f64(dx)) <= 1e-2 * scale + 1e-30), (dx, dx64)
    else:
        assert_close("dx", dx, dx64, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_mixed_precision(platform, dtype):
    """A float32 weight beside 16-bit x: never rounded, float32 dweight from one pass."""
    x, dy, w, _ = make_inputs((33, 264), dtype, seed=2)
    w = w.astype(np.float32) + np.float32(1e-3)   # not representable in 16 bits
    y, dx, dw = loss_grads(platform, x, w, dy)
    y64, rstd = ref64(reference.rmsnorm_fwd, x, w)
    dx64, dw64 = ref64(lambda dy, x, w, r: reference.rmsnorm_bwd(dy, x, w, r), dy, x, w, rstd)
    assert dw.dtype == np.float32 and y.dtype == np_dtype(dtype)
    assert_close("y", y, y64, dtype)
    assert_close("dx", dx, dx64, dtype)
    assert_close("dweight", dw, dw64, "float32", RTOL["bfloat16"] if dtype == "bfloat16" else RTOL["float16"])


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_gemma_offset(platform, dtype):
    """offset=1: y = x * rstd * (1 + w); dweight is the same sum as without the offset."""
    x, dy, w, _ = make_inputs((16, 384), dtype, seed=3)
    w = (np.asarray(w, np.float64) - 1.0).astype(np_dtype(dtype))   # stored zero-centred
    y, dx, dw = loss_grads(platform, x, w, dy, offset=1.0)
    y64, rstd = ref64(lambda x, w: reference.rmsnorm_fwd(x, w, 1e-6, 1.0), x, w)
    dx64, dw64 = ref64(lambda dy, x, w, r: reference.rmsnorm_bwd(dy, x, w, r, 1.0), dy, x, w, rstd)
    assert_close("y", y, y64, dtype)
    assert_close("dx", dx, dx64, dtype)
    assert_close("dweight", dw, dw64, dtype)
    _, _, dw0 = loss_grads(platform, x, w, dy)
    assert_close("dweight without offset", dw0, dw64, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_no_weight(platform):
    x, dy, _, _ = make_inputs((9, 40), "float32", seed=4)
    f = jax.jit(jax.value_and_grad(lambda x: jnp.sum(rmsnorm(x, None) * dy)))
    val, dx = f(put(platform, x))
    _, rstd = ref64(reference.rmsnorm_fwd, x, None)
    dx64, _ = ref64(lambda dy, x, r: reference.rmsnorm_bwd(dy, x, jnp.ones(40, jnp.float64), r), dy, x, rstd)
    assert_close("dx", dx, dx64, "float32")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_and_bwd_ops(platform, dtype):
    x, dy, w, _ = make_inputs((12, 136), dtype, seed=5)
    xs, ws, dys = put(platform, x, w, dy)
    y, rstd = jax.jit(rmsnorm_fwd)(xs, ws)
    y64, rstd64 = ref64(reference.rmsnorm_fwd, x, w)
    assert rstd.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert_close("y", y, y64, dtype)
    assert_close("rstd", rstd, rstd64, "float64" if dtype == "float64" else "float32")
    dx, dw = jax.jit(rmsnorm_bwd)(dys, xs, ws, rstd)
    dx64, dw64 = ref64(lambda dy, x, w, r: reference.rmsnorm_bwd(dy, x, w, r), dy, x, w, rstd)
    assert_close("dx", dx, dx64, dtype)
    assert_close("dweight", dw, dw64, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("x_bias", [False, True])
def test_add_rmsnorm(platform, dtype, x_bias):
    """(y, s): s = (x [+ x_bias]) + residual rounded once; grads of x, residual, weight, x_bias
    from ONE backward call that adds s's cotangent in the kernel."""
    x, dy, w, b = make_inputs((24, 200), dtype, seed=6)
    r, ds, _, _ = make_inputs((24, 200), dtype, seed=7)
    xb = b if x_bias else None

    def f(x, r, w, xb):
        return add_rmsnorm(x, r, w, x_bias=xb, offset=0.5)

    (y, s), vjp = jax.jit(lambda *a: jax.vjp(f, *a))(*put(platform, x, r, w, xb))
    gx, gr, gw, gxb = vjp(tuple(put(platform, dy, ds)))
    s64 = ref64(lambda x, r, xb: reference.add_residual(x, r, xb), x, r, xb)
    np.testing.assert_array_equal(f64(s), f64(np.asarray(reference.add_residual(*(None if a is None else jnp.asarray(a) for a in (x, r, xb))))))
    y64, rstd = ref64(lambda s, w: reference.rmsnorm_fwd(s, w, 1e-6, 0.5), np.asarray(s), w)
    gs64, gw64 = ref64(lambda dy, s, w, rr: reference.rmsnorm_bwd(dy, s, w, rr, 0.5), dy, np.asarray(s), w, rstd)
    assert_close("y", y, y64, dtype)
    assert_close("dx", gx, gs64 + f64(ds), dtype)
    np.testing.assert_array_equal(f64(gx), f64(gr))
    assert_close("dweight", gw, gw64, dtype)
    if x_bias:
        assert_close("dx_bias", gxb, (gs64 + f64(ds)).sum(0), dtype)
    text = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32)), argnums=(0, 1, 2))).lower(
        *put(platform, x, r, w, xb)).as_text()
    assert text.count(f"@{jax_lnbwd.TARGET_RMS_BWD}(") == 1


def test_one_backward_call_per_rmsnorm():
    x, _, w, _ = make_inputs((4, 8), "float32")
    text = jax.jit(jax.grad(lambda x, w: jnp.sum(rmsnorm(rmsnorm(x, w), w) ** 2), argnums=(0, 1))).lower(x, w).as_text()
    assert text.count(f"@{jax_lnbwd.TARGET_RMS_BWD}(") == 2
    assert jax_lnbwd.TARGET not in text and jax_lnbwd.TARGET_V2 not in text


@pytest.mark.parametrize("platform", PLATFORMS)
def test_forced_ffi_forward_equals_jnp(platform):
    """The fused FFI forward (rmsnorm's own target) gives the jnp forward's numbers."""
    x, _, w, _ = make_inputs((10, 72), "float32", seed=8)
    with jax_lnbwd.use_ffi_forward(True):
        yf, rf = jax.jit(lambda x, w: rmsnorm_fwd(x, w, offset=1.0))(*put(platform, x, w))
    with jax_lnbwd.use_ffi_forward(False):
        yj, rj = jax.jit(lambda x, w: rmsnorm_fwd(x, w, offset=1.0))(*put(platform, x, w))
    assert_close("y", yf, yj, "float32")
    assert_close("rstd", rf, rj, "float32")


def test_xla_switch():
    x, _, w, _ = make_inputs((4, 8), "float32")
    with jax_lnbwd.use_xla_backward():
        text = jax.jit(jax.grad(lambda x, w: jnp.sum(rmsnorm(x, w) ** 2))).lower(x, w).as_text()
        val = rmsnorm(x, w)
    assert "jax_lnbwd" not in text
    assert_close("y", val, ref64(reference.rmsnorm, x, w), "float32")


@pytest.mark.parametrize("call, err, match", [
    (lambda x, w: rmsnorm(x.astype(np.int32), w), TypeError, "rmsnorm: 'x' has dtype int32"),
    (lambda x, w: rmsnorm(x, w[:7]), ValueError, r"rmsnorm: 'weight' has shape \(7,\) but expected \(8,\)"),
    (lambda x, w: rmsnorm(x, None, offset=1.0), ValueError, "rmsnorm: offset=1.0 shifts the weight, but weight is None"),
    (lambda x, w: rmsnorm(x, w, offset="one"), ValueError, "rmsnorm: offset must be a finite float"),
    (lambda x, w: rmsnorm(x, w, eps=0.0), ValueError, "rmsnorm: eps must be a positive finite float"),
    (lambda x, w: rmsnorm(x, w, kernel=8), ValueError, "rmsnorm: kernel 8 does not support rmsnorm"),
    (lambda x, w: rmsnorm(x[:, :0], w[:0]), ValueError, "must have at least 1 element"),
    (lambda x, w: rmsnorm_bwd(x[:, :7], x, w, jnp.ones(4)), ValueError, r"rmsnorm_bwd: 'dy' has shape \(4, 7\) but x has shape \(4, 8\)"),
    (lambda x, w: rmsnorm_bwd(x, x, w, jnp.ones(3)), ValueError, r"rmsnorm_bwd: 'rstd' has shape \(3,\) but expected \(4,\)"),
    (lambda x, w: add_rmsnorm(x, x[:, :7], w), ValueError, r"add_rmsnorm: 'residual' has shape \(4, 7\) but x has shape \(4, 8\)"),
    (lambda x, w: add_rmsnorm(x, x, w, x_bias=w[:3]), ValueError, r"add_rmsnorm: 'x_bias' has shape \(3,\)"),
    (lambda x, w: add_rmsnorm(x, x, w, kernel=3), ValueError, "add_rmsnorm: kernel 3 does not support rmsnorm"),
])
def test_bad_input_raises_at_trace_time(call, err, match):
    x, _, w, _ = make_inputs((4, 8), "float32")
    with pytest.raises(err, match=match):
        jax.jit(call).lower(jnp.asarray(x), jnp.asarray(w))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_export_round_trip(platform):
    from jax import export
    x, dy, w, _ = make_inputs((8, 64), "float32", seed=9)
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(rmsnorm(x, w, offset=1.0) * dy), argnums=(0, 1)))
    plat = {"cpu": "cpu", "gpu": "cuda"}[platform]
    args = put(platform, x, w)
    exp = export.export(f, platforms=[plat],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(t) for t in jax_lnbwd.TARGETS])(*args)
    assert f"@{jax_lnbwd.TARGET_RMS_BWD}(" in exp.mlir_module()
    again = export.deserialize(exp.serialize()).call(*args)
    for a, b in zip(again, f(*args)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
