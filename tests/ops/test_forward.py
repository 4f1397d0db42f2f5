"""The fused forward op (jax_lnbwd.ops.forward.layernorm_fwd_op, FFI target jax_lnbwd_layernorm_fwd_v1):
values against the jnp reference per dtype, odd shapes, absent and float32 parameters, bad
inputs, jit, vmap, derivatives and jax.export. Every value test runs on the CPU (the C++
reference) and, where there is one, on the GPU (the CUDA kernels). Sharding: test_forward_sharding.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from conftest import (CHILD_CWD, DTYPES, OFFSET_RSTD_RTOL, PLATFORMS, STAT_RTOL, assert_close, device, f64, make_inputs,
                      np_dtype, put, shape_id)
from jax_lnbwd import reference
from jax_lnbwd import TARGET_FWD as TARGET
from jax_lnbwd.ops.forward import layernorm_fwd_op

EPS = 1e-5

# C = 1 (variance 0), 3, odd C (scalar accesses), C not a multiple of a warp's vectors, wide rows
# (several warps per row; 30000 fp32 leaves the register path), a rank-1 and a rank-3 x.
SHAPES = [(1, 1), (7, 1), (7, 3), (1, 1601), (7, 1601), (4225, 40), (5, 256), (3, 30000), (40,), (2, 5, 72)]


def want(x, w, b, eps=EPS):
    """reference.layernorm_fwd in float64 on the CPU, from the inputs upcast (exactly)."""
    cpu = device("cpu")
    args = [None if a is None else jax.device_put(f64(a), cpu) for a in (x, w, b)]
    return tuple(np.asarray(o) for o in reference.layernorm_fwd(*args, eps))


def run(platform, x, w, b, eps=EPS):
    """The op jitted on `platform`; an absent (None) parameter stays None."""
    present = [a for a in (w, b) if a is not None]
    arrays = put(platform, x, *present) if present else (put(platform, x),)

    def fn(x, *params):
        it = iter(params)
        return layernorm_fwd_op(x, None if w is None else next(it), None if b is None else next(it), eps)

    return jax.block_until_ready(jax.jit(fn)(*arrays))


def assert_forward(got, x, w, b, dtype, eps=EPS):
    y, mean, rstd = got
    stat = np.float64 if dtype == "float64" else np.float32
    assert y.shape == x.shape and y.dtype == np.asarray(x).dtype
    assert mean.shape == x.shape[:-1] and mean.dtype == stat and rstd.dtype == stat
    y_want, mean_want, rstd_want = want(x, w, b, eps)
    assert_close("y", y, y_want, dtype)
    assert_close("mean", mean, mean_want, dtype, STAT_RTOL[dtype])
    assert_close("rstd", rstd, rstd_want, dtype, STAT_RTOL[dtype])


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_values(platform, dtype, shape):
    x, _, w, b = make_inputs(shape, dtype, seed=1)
    assert_forward(run(platform, x, w, b), x, w, b, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 40000), (2, 70000), (2, 3, 1000)], ids=shape_id)
def test_wide_rows(platform, dtype, shape):
    """Rows beyond the register path: shared memory (fp32 40000, bf16 70000) and global memory
    (fp32 70000: 280 KB, more than a block's shared memory)."""
    x, _, w, b = make_inputs(shape, dtype, seed=2)
    assert_forward(run(platform, x, w, b), x, w, b, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("which", ["weight", "bias", "neither"])
def test_absent_parameters(platform, dtype, which):
    x, _, w, b = make_inputs((9, 1601), dtype, seed=3)
    w = None if which in ("weight", "neither") else w
    b = None if which in ("bias", "neither") else b
    assert_forward(run(platform, x, w, b), x, w, b, dtype)


def float32_params(C: int, dtype: str, params: str):
    """(weight, bias) of shape (C,) in float32 beside 16-bit `dtype` x: "both", only the weight,
    only the bias, or "mixed" (bias in `dtype`). The weight is not representable in 16 bits, so
    a kernel that rounded it would show."""
    _, _, w, b = make_inputs((33, C), "float32", seed=5)
    w = w * np.float32(1 + 2 ** -12)
    if params == "weight":
        b = None
    elif params == "bias":
        w = None
    elif params == "mixed":
        b = b.astype(np_dtype(dtype))
    return w, b


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("params", ["both", "weight", "bias", "mixed"])
def test_float32_parameters(platform, dtype, params):
    """16-bit x with float32 weight/bias: used in fp32 as they are (never rounded to 16 bits),
    the output rounded once. A bf16 weight or bias next to a float32 one is upcast (exact)."""
    x, _, _, _ = make_inputs((33, 1024), dtype, seed=4)
    w, b = float32_params(1024, dtype, params)
    y, mean, rstd = run(platform, x, w, b)
    assert y.dtype == np_dtype(dtype)
    assert_forward((y, mean, rstd), x, w, b, dtype)
    # Against the jnp reference with the same float32 parameters: rounding the output once.
    y_ref = reference.layernorm_fwd(put("cpu", x), None if w is None else jnp.asarray(w),
                                    None if b is None else jnp.asarray(b), EPS)[0]
    assert np.mean(np.asarray(y, np.float32) != np.asarray(y_ref, np.float32)) < 0.02


@pytest.mark.parametrize("platform", PLATFORMS)
def test_centered_variance(platform):
    """|mean| >> std: E[x^2] - E[x]^2 would lose every digit of the variance in fp32."""
    rng = np.random.default_rng(6)
    x = (1.0e4 + rng.standard_normal((16, 2048))).astype(np.float32)
    _, mean, rstd = run(platform, x, None, None)
    _, mean_want, rstd_want = want(x, None, None)
    assert_close("mean", mean, mean_want, "float32")
    assert_close("rstd", rstd, rstd_want, "float32", OFFSET_RSTD_RTOL)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_deterministic(platform):
    x, _, w, b = make_inputs((512, 4096), "bfloat16", seed=7)
    a = run(platform, x, w, b)
    for _ in range(2):
        for g, h in zip(run(platform, x, w, b), a):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_zero_rows(platform):
    x = np.zeros((0, 8), np.float32)
    y, mean, rstd = run(platform, x, np.ones(8, np.float32), np.zeros(8, np.float32))
    assert y.shape == (0, 8) and mean.shape == (0,) and rstd.shape == (0,)


# --- bad inputs ---------------------------------------------------------------------------------

F32 = np.ones((4, 8), np.float32)
W8 = np.ones(8, np.float32)


@pytest.mark.parametrize("args, err, match", [
    ((F32.astype(np.int32), None, None), TypeError, "'x' has dtype int32"),
    ((np.float32(1.0), None, None), ValueError, "rank >= 1"),
    ((np.ones((4, 0), np.float32), None, None), ValueError, r"its last axis \(C, the one normalized over\) must have at least 1 element"),
    ((F32, np.ones(7, np.float32), None), ValueError, r"'weight' has shape \(7,\) but expected \(8,\)"),
    ((F32, None, np.ones((1, 8), np.float32)), ValueError, r"'bias' has shape \(1, 8\)"),
    ((F32, W8.astype(np.float64), None), TypeError, "'weight' has dtype float64 but expected float32"),
    ((F32.astype(np.float64), W8, None), TypeError, "'weight' has dtype float32 but expected float64"),
    ((F32.astype(jnp.bfloat16), W8.astype(np.float16), None), TypeError, "expected bfloat16 or float32"),
    ((F32, [1.0] * 8, None), TypeError, "'weight' must be an array or None"),
    (("x", None, None), TypeError, "'x' must be an array"),
])
def test_bad_inputs(args, err, match):
    with pytest.raises(err, match=match):
        layernorm_fwd_op(*args)


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan"), float("inf"), "1e-5", True])
def test_bad_eps(eps):
    with pytest.raises(ValueError, match="eps must be a positive finite float"):
        layernorm_fwd_op(F32, None, None, eps)


def ffi(platform, x, w, b, y_shape=None, stat_dtype=np.float32, eps=EPS):
    """The FFI target called directly, with no Python check: the handler's own checks."""
    rows, C = x.shape
    out = (jax.ShapeDtypeStruct(y_shape or x.shape, x.dtype), jax.ShapeDtypeStruct((rows,), stat_dtype),
           jax.ShapeDtypeStruct((rows,), stat_dtype))
    f = jax.jit(lambda *a: jax.ffi.ffi_call(TARGET, out)(*a, eps=np.float64(eps)))
    return jax.block_until_ready(f(*put(platform, x, w, b)))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case, match", [
    ("y_shape", r"layernorm_fwd: 'y' has shape \(4, 9\) but expected \(4, 8\) for x of shape \(4, 8\)"),
    ("stat_dtype", r"layernorm_fwd: 'mean' has dtype float64 but expected float32"),
    ("param_rows", r"layernorm_fwd: 'weight' has shape \(3, 8\) but its 3 rows must divide the 4 rows"),
    ("param_dtype", r"layernorm_fwd: 'weight' has dtype float16 but expected float32"),
    ("param_mismatch", r"layernorm_fwd: 'weight' has dtype float32 but 'bias' has bfloat16"),
    ("eps", r"layernorm_fwd: 'eps' is -1.0+ but expected a positive finite number"),
])
def test_handler_checks(platform, case, match):
    x, w, b = F32, W8[None], W8[None]
    kw = {}
    if case == "y_shape":
        kw["y_shape"] = (4, 9)
    elif case == "stat_dtype":
        kw["stat_dtype"] = np.float64
    elif case == "param_rows":
        w = np.ones((3, 8), np.float32)
    elif case == "param_dtype":
        w = w.astype(np.float16)
    elif case == "param_mismatch":
        x, b = x.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    elif case == "eps":
        kw["eps"] = -1.0
    with pytest.raises(Exception, match=match):
        ffi(platform, x, w, b, **kw)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_handler_per_segment_parameters(platform):
    """(S, C) parameters: rows form S equal segments, segment s uses parameter row s."""
    x, _, _, _ = make_inputs((6, 40), "float32", seed=8)
    rng = np.random.default_rng(9)
    w, b = rng.standard_normal((3, 40)).astype(np.float32), rng.standard_normal((1, 40)).astype(np.float32)
    y, _, _ = ffi(platform, x, w, b)
    for s in range(3):
        y_want = want(x[2 * s:2 * s + 2], w[s], b[0])[0]
        assert_close(f"y segment {s}", y[2 * s:2 * s + 2], y_want, "float32")


# --- transformations ------------------------------------------------------------------------------

def close_tree(got, wanted, dtype):
    for name, g, w in zip(("y", "mean", "rstd"), got, wanted):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert_close(name, g, w, dtype, None if name == "y" else STAT_RTOL[dtype])


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", ["x", "x-weight", "weight-only", "axis1", "nested", "nested-inner-weight"])
def test_vmap(platform, case):
    """vmap is one FFI call on the batch folded into rows (batched parameters: one row each)."""
    dtype = "float32"
    x, _, w, b = make_inputs((3, 5, 7, 48), dtype, seed=10)
    W = make_inputs((3, 5, 48), dtype, seed=11)[0]
    x, w, b, W = put(platform, x, w, b, W)
    ref = lambda x, w, b: reference.layernorm_fwd(x, w, b, EPS)  # noqa: E731
    if case == "x":
        f = lambda fn: jax.vmap(fn, in_axes=(0, None, None))(x, w, b)  # noqa: E731
    elif case == "x-weight":
        f = lambda fn: jax.vmap(fn, in_axes=(0, 0, None))(x[:, 0], W[:, 0], b)  # noqa: E731
    elif case == "weight-only":
        f = lambda fn: jax.vmap(fn, in_axes=(None, 0, None))(x[0, 0], W[:, 0], b)  # noqa: E731
    elif case == "axis1":
        f = lambda fn: jax.vmap(fn, in_axes=(1, None, 0), out_axes=1)(x[0], w, x[1, 0])  # noqa: E731
    elif case == "nested":
        f = lambda fn: jax.vmap(jax.vmap(fn, in_axes=(0, 0, None)), in_axes=(0, 0, None))(x, W, b)  # noqa: E731
    else:
        f = lambda fn: jax.vmap(jax.vmap(fn, in_axes=(0, 0, None)), in_axes=(0, None, None))(x, W[0], b)  # noqa: E731
    got = jax.jit(lambda: f(lambda x, w, b: layernorm_fwd_op(x, w, b, EPS)))()
    close_tree(got, jax.jit(lambda: f(ref))(), dtype)
    text = jax.jit(lambda: f(lambda x, w, b: layernorm_fwd_op(x, w, b, EPS))).lower().as_text()
    assert text.count(f"@{TARGET}(") == 1, "vmap should make one FFI call"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_derivatives(platform):
    """grad and jvp through the op: the JVP of the jnp reference."""
    x, r, w, b = put(platform, *make_inputs((6, 40), "float64", seed=12))

    def loss(fn):
        return lambda x, w, b: jnp.sum(fn(x, w, b, EPS)[0] * r) + jnp.sum(fn(x, w, b, EPS)[2])

    got = jax.jit(jax.grad(loss(layernorm_fwd_op), argnums=(0, 1, 2)))(x, w, b)
    wanted = jax.grad(loss(reference.layernorm_fwd), argnums=(0, 1, 2))(x, w, b)
    for name, g, h in zip(("dx", "dweight", "dbias"), got, wanted):
        assert_close(f"grad {name}", g, h, "float64")
    _, t = jax.jvp(lambda x: layernorm_fwd_op(x, w, b, EPS), (x,), (r,))
    _, t_want = jax.jvp(lambda x: reference.layernorm_fwd(x, w, b, EPS), (x,), (r,))
    for name, g, h in zip(("y", "mean", "rstd"), t, t_want):
        assert_close(f"jvp {name}", g, h, "float64")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_export_round_trip(platform):
    """The exported program names the versioned target and round-trips bit-identically."""
    x, _, w, b = put(platform, *make_inputs((4, 6, 40), "bfloat16", seed=13))
    w32 = w.astype(jnp.float32)
    fn = jax.jit(lambda x, w, b: layernorm_fwd_op(x, w, b, EPS))
    exported = export.export(fn, platforms=[{"cpu": "cpu", "gpu": "cuda"}[platform]],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(TARGET)])(x, w32, None)
    assert f"@{TARGET}(" in exported.mlir_module()
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    restored = export.deserialize(exported.serialize())
    for g, h in zip(restored.call(x, w32, None), fn(x, w32, None)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


# A program run by test_cuda_graph_replay in a subprocess (XLA flags are read once per process):
# the forward jitted, called on inputs A, B, A, B, A; prints whether every A (and every B) result
# is bit-identical and A's differ from B's (a replay reusing stale buffers would repeat one).
_GRAPH_PROGRAM = """
import jax, jax.numpy as jnp, numpy as np
from jax_lnbwd.ops.forward import layernorm_fwd_op
rng = np.random.default_rng(0)
A, B = (jnp.asarray(rng.standard_normal((512, 1600)), jnp.bfloat16) for _ in range(2))
w, b = jnp.ones(1600, jnp.float32), jnp.zeros(1600, jnp.float32)
f = jax.jit(lambda x: layernorm_fwd_op(x, w, b, 1e-5))
outs = [[np.asarray(o) for o in f(x)] for x in (A, B, A, B, A)]
same = lambda p, q: all(np.array_equal(u, v) for u, v in zip(p, q))
print("RESULT", same(outs[0], outs[2]) and same(outs[0], outs[4]) and same(outs[1], outs[3])
      and not same(outs[0], outs[1]))
"""


@pytest.mark.gpu
def test_cuda_graph_replay():
    """The CUDA handler is command-buffer compatible: captured into a CUDA graph and replayed,
    it gives the same bits for the same input."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
    proc = subprocess.run([sys.executable, "-c", _GRAPH_PROGRAM], env=env, cwd=CHILD_CWD, capture_output=True, text=True, timeout=300)
    assert "RESULT True" in proc.stdout, proc.stdout + proc.stderr[-3000:]
