"""The residual-fused forward (jax_lnbwd.ops.forward.add_layernorm_fwd_op, FFI target
jax_lnbwd_add_layernorm_fwd_v1): s = x + residual rounded to x's dtype, bit-equal to jnp's add,
and y, mean, rstd of that s against the float64 reference; odd shapes, the wide path, absent and
float32 parameters, bad inputs (Python's checks and the handlers'), jit, vmap, derivatives and
jax.export. Every value test runs on the CPU (the C++ reference) and, where there is one, on the
GPU (the CUDA kernels). add_layernorm's use of it: test_add_layernorm.py; sharding:
test_forward_sharding.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from conftest import DTYPES, PLATFORMS, STAT_RTOL, assert_close, device, make_inputs, np_dtype, put, shape_id
from jax_lnbwd import reference
from jax_lnbwd import TARGET_ADD_FWD as ADD_TARGET, TARGET_ADD_FWD_V2 as ADD_BIAS_TARGET, TARGET_FWD as TARGET
from jax_lnbwd.ops.forward import add_layernorm_fwd_op, layernorm_fwd_op
from test_forward import assert_forward, float32_params

EPS = 1e-5
# test_forward.py's shapes (C = 1, odd C: scalar accesses, C not a multiple of a warp's vectors,
# several warps per row, rows = 1, rank 1 and 3) and rows past the register path.
SHAPES = [(1, 1), (7, 1), (7, 3), (1, 1601), (7, 1601), (4225, 40), (5, 256), (3, 30000), (40,), (2, 5, 72)]


def inputs(shape, dtype, seed):
    """(x, residual, weight, bias) as host arrays; residual of x's magnitude, so that the sum
    rounds (its low bits differ from x's)."""
    x, r, w, b = make_inputs(shape, dtype, seed=seed)
    return x, r, w, b


def s_want(x, r):
    """jnp's x + residual on the CPU, in x's dtype: what s must equal bit for bit."""
    cpu = device("cpu")
    return np.asarray(jax.jit(jnp.add)(jax.device_put(x, cpu), jax.device_put(r, cpu)))


def run(platform, x, r, w, b, eps=EPS):
    """The op jitted on `platform`; an absent (None) parameter stays None."""
    present = [a for a in (w, b) if a is not None]
    arrays = put(platform, x, r, *present)

    def fn(x, r, *params):
        it = iter(params)
        return add_layernorm_fwd_op(x, r, None if w is None else next(it), None if b is None else next(it), eps)

    return jax.block_until_ready(jax.jit(fn)(*arrays))


def assert_add_forward(got, x, r, w, b, dtype):
    y, s, mean, rstd = got
    assert s.shape == x.shape and s.dtype == np.asarray(x).dtype
    s_ref = s_want(x, r)
    np.testing.assert_array_equal(np.asarray(s), s_ref, err_msg="s must be jnp's x + residual")
    assert_forward((y, mean, rstd), s_ref, w, b, dtype)   # the layernorm of the rounded s


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_values(platform, dtype, shape):
    x, r, w, b = inputs(shape, dtype, seed=1)
    assert_add_forward(run(platform, x, r, w, b), x, r, w, b, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 40000), (2, 70000), (2, 3, 1000)], ids=shape_id)
def test_wide_rows(platform, dtype, shape):
    """Rows beyond the register path on the GPU: shared memory (fp32 40000, bf16 70000) and
    global memory (fp32 70000), where s is re-read from the output written in pass 1."""
    x, r, w, b = inputs(shape, dtype, seed=2)
    assert_add_forward(run(platform, x, r, w, b), x, r, w, b, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("which", ["weight", "bias", "neither"])
def test_absent_parameters(platform, dtype, which):
    x, r, w, b = inputs((9, 1601), dtype, seed=3)
    w = None if which in ("weight", "neither") else w
    b = None if which in ("bias", "neither") else b
    assert_add_forward(run(platform, x, r, w, b), x, r, w, b, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("params", ["both", "weight", "bias", "mixed"])
def test_float32_parameters(platform, dtype, params):
    """16-bit x and residual with float32 weight/bias (used as they are, y rounded once); a
    16-bit parameter next to a float32 one is upcast (exact)."""
    x, r, _, _ = inputs((33, 1024), dtype, seed=4)
    w, b = float32_params(1024, dtype, params)
    got = run(platform, x, r, w, b)
    assert got[0].dtype == np_dtype(dtype) and got[2].dtype == np.float32
    assert_add_forward(got, x, r, w, b, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(7, 3), (64, 1600), (3, 40000), (2, 70000)], ids=shape_id)
def test_equals_add_then_fused_forward(platform, dtype, shape):
    """Bit for bit what the unfused path gives (jnp's add, then the plain fused forward of the
    stored s): the same rows, the same configuration, the same order of sums."""
    x, r, w, b = inputs(shape, dtype, seed=6)
    w = w.astype(np.float32)
    x, r, w, b = put(platform, x, r, w, b)
    fused = jax.jit(lambda x, r, w, b: add_layernorm_fwd_op(x, r, w, b, EPS))(x, r, w, b)
    s = jax.jit(jnp.add)(x, r)
    y, mean, rstd = jax.jit(lambda s, w, b: layernorm_fwd_op(s, w, b, EPS))(s, w, b)
    for name, g, h in zip(("y", "s", "mean", "rstd"), fused, (y, s, mean, rstd)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h), err_msg=name)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_sum_rounds_before_normalizing(platform):
    """x + residual that does not fit bf16: y is the layernorm of the rounded s (what the
    caller gets back), not of the exact sum. At C = 2 the two differ visibly."""
    x = np.array([[1.0, 0.0]], jnp.bfloat16)
    r = np.array([[2.0 ** -9, 0.0]], jnp.bfloat16)   # 1 + 2^-9 rounds to 1 in bf16
    y, s, mean, _ = run(platform, x, r, None, None)
    np.testing.assert_array_equal(np.asarray(s, np.float32), [[1.0, 0.0]])
    assert float(mean[0]) == 0.5


@pytest.mark.parametrize("platform", PLATFORMS)
def test_deterministic_and_zero_rows(platform):
    x, r, w, b = inputs((512, 4096), "bfloat16", seed=7)
    a = run(platform, x, r, w, b)
    for g, h in zip(run(platform, x, r, w, b), a):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))
    z = np.zeros((0, 8), np.float32)
    y, s, mean, rstd = run(platform, z, z, np.ones(8, np.float32), np.zeros(8, np.float32))
    assert y.shape == s.shape == (0, 8) and mean.shape == rstd.shape == (0,)


# --- bad inputs ---------------------------------------------------------------------------------

F32 = np.ones((4, 8), np.float32)
W8 = np.ones(8, np.float32)


@pytest.mark.parametrize("args, err, match", [
    ((F32, F32[:, :7], None, None), ValueError, r"add_layernorm_fwd: 'residual' has shape \(4, 7\) but x has shape \(4, 8\)"),
    ((F32, F32[None], None, None), ValueError, r"'residual' has shape \(1, 4, 8\)"),
    ((F32, F32.astype(jnp.bfloat16), None, None), TypeError,
     r"add_layernorm_fwd: 'residual' has dtype bfloat16 but x has dtype float32"),
    ((F32, [[1.0] * 8] * 4, None, None), TypeError, "add_layernorm_fwd: 'residual' must be an array"),
    ((F32.astype(np.int32), F32, None, None), TypeError, "add_layernorm_fwd: 'x' has dtype int32"),
    ((F32, F32, np.ones(7, np.float32), None), ValueError, r"add_layernorm_fwd: 'weight' has shape \(7,\)"),
    ((F32.astype(jnp.bfloat16), F32.astype(jnp.bfloat16), None, W8.astype(np.float16)), TypeError,
     "add_layernorm_fwd: 'bias' has dtype float16 but expected bfloat16 or float32"),
])
def test_bad_inputs(args, err, match):
    with pytest.raises(err, match=match):
        add_layernorm_fwd_op(*args)


def test_bad_eps():
    with pytest.raises(ValueError, match="add_layernorm_fwd: eps must be a positive finite float"):
        add_layernorm_fwd_op(F32, F32, None, None, 0.0)


def ffi(platform, x, r, w, b, s_shape=None, s_dtype=None, y_shape=None, eps=EPS, x_bias=None):
    """The FFI target called directly, with no Python check: the handlers' own checks. With
    x_bias, target v2 (x, x_bias, residual, weight, bias)."""
    rows, C = x.shape
    out = (jax.ShapeDtypeStruct(y_shape or x.shape, x.dtype),
           jax.ShapeDtypeStruct(s_shape or x.shape, s_dtype or x.dtype),
           jax.ShapeDtypeStruct((rows,), np.float32), jax.ShapeDtypeStruct((rows,), np.float32))
    target, arrays = (ADD_TARGET, (x, r, w, b)) if x_bias is None else (ADD_BIAS_TARGET, (x, x_bias, r, w, b))
    f = jax.jit(lambda *a: jax.ffi.ffi_call(target, out)(*a, eps=np.float64(eps)))
    return jax.block_until_ready(f(*put(platform, *arrays)))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case, match", [
    ("residual_shape", r"add_layernorm_fwd: 'residual' has shape \(4, 7\) but expected \(4, 8\) \(x's shape\)"),
    ("residual_dtype", r"add_layernorm_fwd: 'residual' has dtype float16 but expected float32 \(x's dtype\)"),
    ("s_shape", r"add_layernorm_fwd: 's' has shape \(8, 4\) but expected \(4, 8\)"),
    ("s_dtype", r"add_layernorm_fwd: 's' has dtype bfloat16 but expected float32"),
    ("y_shape", r"add_layernorm_fwd: 'y' has shape \(4, 9\) but expected \(4, 8\) for x of shape \(4, 8\)"),
    ("param_dtype", r"add_layernorm_fwd: 'weight' has dtype float16 but expected float32"),
    ("eps", r"add_layernorm_fwd: 'eps' is -1.0+ but expected a positive finite number"),
])
def test_handler_checks(platform, case, match):
    x, r, w, b = F32, F32, W8[None], W8[None]
    kw = {}
    if case == "residual_shape":
        r = F32[:, :7]
    elif case == "residual_dtype":
        r = F32.astype(np.float16)
    elif case == "s_shape":
        kw["s_shape"] = (8, 4)
    elif case == "s_dtype":
        kw["s_dtype"] = jnp.bfloat16
    elif case == "y_shape":
        kw["y_shape"] = (4, 9)
    elif case == "param_dtype":
        w = w.astype(np.float16)
    elif case == "eps":
        kw["eps"] = -1.0
    with pytest.raises(Exception, match=match):
        ffi(platform, x, r, w, b, **kw)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_handler_per_segment_parameters(platform):
    """(S, C) parameters: rows form S equal segments, segment s uses parameter row s."""
    x, r, _, _ = inputs((6, 40), "float32", seed=8)
    rng = np.random.default_rng(9)
    w, b = rng.standard_normal((3, 40)).astype(np.float32), rng.standard_normal((1, 40)).astype(np.float32)
    y, s, _, _ = ffi(platform, x, r, w, b)
    np.testing.assert_array_equal(np.asarray(s), x + r)
    for k in range(3):
        y_want = reference.layernorm_fwd(jnp.asarray(x + r)[2 * k:2 * k + 2], w[k], b[0], EPS)[0]
        assert_close(f"y segment {k}", y[2 * k:2 * k + 2], y_want, "float32")


# --- transformations ------------------------------------------------------------------------------

def _ref(x, r, w, b):
    s = x + r
    y, mean, rstd = reference.layernorm_fwd(s, w, b, EPS)
    return y, s, mean, rstd


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", ["x-and-residual", "x-only", "residual-only", "per-example-weight", "nested"])
def test_vmap(platform, case):
    """vmap is one FFI call on the batch folded into rows; an unbatched x or residual is
    broadcast, a batched weight becomes one parameter row per example."""
    x, r, w, b = inputs((3, 5, 7, 48), "float32", seed=10)
    W = make_inputs((3, 5, 48), "float32", seed=11)[0]
    x, r, w, b, W = put(platform, x, r, w, b, W)
    if case == "x-and-residual":
        f = lambda fn: jax.vmap(fn, in_axes=(0, 0, None, None))(x, r, w, b)  # noqa: E731
    elif case == "x-only":
        f = lambda fn: jax.vmap(fn, in_axes=(0, None, None, None))(x, r[0], w, b)  # noqa: E731
    elif case == "residual-only":
        f = lambda fn: jax.vmap(fn, in_axes=(None, 1, None, None), out_axes=1)(x[:, 0], r, w, b)  # noqa: E731
    elif case == "per-example-weight":
        f = lambda fn: jax.vmap(fn, in_axes=(0, 0, 0, None))(x[:, 0], r[:, 0], W[:, 0], b)  # noqa: E731
    else:
        f = lambda fn: jax.vmap(jax.vmap(fn, in_axes=(0, 0, 0, None)), in_axes=(0, 0, 0, None))(x, r, W, b)  # noqa: E731
    op = lambda x, r, w, b: add_layernorm_fwd_op(x, r, w, b, EPS)  # noqa: E731
    got, wanted = jax.jit(lambda: f(op))(), jax.jit(lambda: f(_ref))()
    for name, g, h in zip(("y", "s", "mean", "rstd"), got, wanted):
        assert g.shape == h.shape, (name, g.shape, h.shape)
        if name == "s":
            np.testing.assert_array_equal(np.asarray(g), np.asarray(h))
        else:
            assert_close(name, g, h, "float32", None if name == "y" else STAT_RTOL["float32"])
    text = jax.jit(lambda: f(op)).lower().as_text()
    assert text.count(f"@{ADD_TARGET}(") == 1, "vmap should make one FFI call"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_derivatives(platform):
    """grad and jvp through the op: the JVP of the jnp reference (s = x + residual, then the
    layernorm of s)."""
    x, r, w, b = put(platform, *inputs((6, 40), "float64", seed=12))
    g_out = put(platform, make_inputs((6, 40), "float64", seed=13)[0])

    def loss(fn):
        def f(x, r, w, b):
            y, s, mean, rstd = fn(x, r, w, b)
            return jnp.sum(y * g_out) + jnp.sum(s * s) + jnp.sum(rstd)
        return f

    op = lambda x, r, w, b: add_layernorm_fwd_op(x, r, w, b, EPS)  # noqa: E731
    got = jax.jit(jax.grad(loss(op), argnums=(0, 1, 2, 3)))(x, r, w, b)
    wanted = jax.grad(loss(_ref), argnums=(0, 1, 2, 3))(x, r, w, b)
    for i, (g, h) in enumerate(zip(got, wanted)):
        assert_close(f"grad {i}", g, h, "float64")
    _, t = jax.jvp(op, (x, r, w, b), (g_out, 2 * g_out, w, b))
    _, t_want = jax.jvp(_ref, (x, r, w, b), (g_out, 2 * g_out, w, b))
    for i, (g, h) in enumerate(zip(t, t_want)):
        assert_close(f"jvp {i}", g, h, "float64")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_export_round_trip(platform):
    """The exported program names the new target (not the plain forward's) and round-trips
    bit-identically."""
    x, r, w, b = put(platform, *inputs((4, 6, 40), "bfloat16", seed=14))
    w32 = w.astype(jnp.float32)
    fn = jax.jit(lambda x, r, w, b: add_layernorm_fwd_op(x, r, w, b, EPS))
    exported = export.export(fn, platforms=[{"cpu": "cpu", "gpu": "cuda"}[platform]],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(ADD_TARGET)])(x, r, w32, None)
    text = exported.mlir_module()
    assert f"@{ADD_TARGET}(" in text and f"@{TARGET}(" not in text
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    restored = export.deserialize(exported.serialize())
    for g, h in zip(restored.call(x, r, w32, None), fn(x, r, w32, None)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))
