"""QK-norm's raw FFI ops (jax_lnbwd.ops.qk; targets qk_norm_fwd, qk_norm_fused_fwd, qk_norm_bwd,
qk_norm_fused_bwd): both norms, every dtype and mixed precision, absent weights and rmsnorm's
offset, head_dim D from 1 to 256 and grouped-query head counts, against the jnp reference norms
per head in float64 (the backward against jax.vjp of them); the fused form against the separate
one (bit for bit), its v heads passed through untouched, with and without the aliasing; and the
handlers' errors, which name the target's function. Every case runs on the CPU (the C++
handlers) and, where there is one, on the GPU (the CUDA kernels), where rows the kernels do not
take (not a multiple of 16 bytes: D = 1, 17) must fail with an error that says so.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PLATFORMS, RTOL, STAT_RTOL, assert_close, device, f64, np_dtype, put
from jax_lnbwd import _jax_lnbwd, reference
from jax_lnbwd.kernels import WORKSPACE_HEADER_BYTES
from jax_lnbwd.norms import LAYERNORM, QK_TARGETS, RMSNORM
from jax_lnbwd.ops.qk import qk_bwd_call, qk_fused_bwd_call, qk_fused_fwd_call, qk_fwd_call, qk_workspace_bytes

EPS = 1e-6
NORMS = [pytest.param(RMSNORM, id="rmsnorm"), pytest.param(LAYERNORM, id="layernorm")]

# (tokens, q_heads, kv_heads, D): D = 1 (every row its mean: layernorm's x̂ is 0), odd D, the
# common head_dims, one head each, grouped-query (4:2, 32:8) and multi-query (64:1); single tokens.
CASES = [(3, 1, 1, 1), (2, 4, 2, 17), (1, 32, 8, 64), (2, 64, 1, 80), (1, 4, 2, 256)]
SMALL_CASES = [CASES[1], CASES[4]]
# Absent weights and the offset: an odd D and one the GPU kernels take (16-byte rows in every dtype).
EDGE_CASES = [CASES[1], (2, 4, 2, 24)]

# (data dtype, weights' dtype): each dtype, and float32 weights beside bfloat16 data.
DTYPES = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"), ("float64", "float64"),
          ("bfloat16", "float32")]


def gpu_takes(D: int, dtype: str) -> bool:
    """Whether the CUDA targets take rows of D elements of dtype: 16-byte multiples, at most
    head_rows_max_bytes (common/head_rows.h); the CPU handlers take any D."""
    row_bytes = D * np.dtype(np_dtype(dtype)).itemsize
    return row_bytes % 16 == 0 and row_bytes <= _jax_lnbwd.head_rows_max_bytes


def case_id(case) -> str:
    tokens, q_heads, kv_heads, D = case
    return f"T{tokens}-H{q_heads}:{kv_heads}-D{D}"


def make(case, dtype: str, weight_dtype: str, seed: int = 0):
    """(qkv, dqkv_out, q_weight, k_weight) as host arrays: standard normal qkv and its cotangent,
    weights 1 + 0.1 * normal, drawn in float64 and rounded once."""
    tokens, q_heads, kv_heads, D = case
    rng = np.random.default_rng(seed)
    width = (q_heads + 2 * kv_heads) * D
    t, wt = np_dtype(dtype), np_dtype(weight_dtype)
    return (rng.standard_normal((tokens, width)).astype(t), rng.standard_normal((tokens, width)).astype(t),
            (1 + 0.1 * rng.standard_normal(D)).astype(wt), (1 + 0.1 * rng.standard_normal(D)).astype(wt))


def split(qkv, q_heads: int, kv_heads: int):
    """q [tokens * q_heads, D], k [tokens * kv_heads, D] and v [tokens, kv_heads, D] of qkv."""
    tokens, width = qkv.shape
    D = width // (q_heads + 2 * kv_heads)
    heads = qkv.reshape(tokens, q_heads + 2 * kv_heads, D)
    return (heads[:, :q_heads].reshape(-1, D), heads[:, q_heads:q_heads + kv_heads].reshape(-1, D),
            heads[:, q_heads + kv_heads:])


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def both_forms(norm, q_heads, kv_heads, offset, has_weights, qkv, dqkv_out, q_weight, k_weight):
    """The fused and the separate form, forward and backward, in one program. Without weights
    the forwards get None and the backwards ones (what a caller passes for an absent weight)."""
    q, k, _ = split(qkv, q_heads, kv_heads)
    dq_out, dk_out, _ = split(dqkv_out, q_heads, kv_heads)
    fwd_w = (q_weight, k_weight) if has_weights else (None, None)
    fused = qk_fused_fwd_call(norm, qkv, *fwd_w, q_heads, kv_heads, EPS, offset)
    separate = qk_fwd_call(norm, q, k, *fwd_w, EPS, offset)
    fused_bwd = qk_fused_bwd_call(norm, dqkv_out, qkv, q_weight, k_weight, fused[1], fused[2], q_heads, kv_heads,
                                  offset)
    separate_bwd = qk_bwd_call(norm, dq_out, dk_out, q, k, q_weight, k_weight, separate[2], separate[3], offset)
    return fused, separate, fused_bwd, separate_bwd


@functools.partial(jax.jit, static_argnums=(0, 1))
def reference_heads(norm, offset, q, k, q_weight, k_weight, dq_out, dk_out):
    """The reference norm of every head (row) of q and k, its statistics, and jax.vjp of it:
    ((q_out, k_out), (q_stats, k_stats), (dq, dk, dq_weight, dk_weight))."""
    def fwd(q, k, qw, kw):
        q_out, *q_stats = reference.norm_fwd(norm, q, qw, None, EPS, offset)
        k_out, *k_stats = reference.norm_fwd(norm, k, kw, None, EPS, offset)
        return (q_out, k_out), (tuple(q_stats), tuple(k_stats))

    outs, vjp, stats = jax.vjp(fwd, q, k, q_weight, k_weight, has_aux=True)
    return outs, stats, vjp((dq_out, dk_out))


def want(norm, offset, qkv, dqkv_out, q_weight, k_weight, q_heads, kv_heads):
    """reference_heads in float64 on the CPU, from the inputs upcast (exactly)."""
    q, k, _ = split(f64(qkv), q_heads, kv_heads)
    dq_out, dk_out, _ = split(f64(dqkv_out), q_heads, kv_heads)
    args = [jax.device_put(a, device("cpu")) for a in (q, k, f64(q_weight), f64(k_weight), dq_out, dk_out)]
    return jax.tree.map(np.asarray, reference_heads(norm, offset, *args))


def check(platform, norm, case, dtype, weight_dtype, *, has_weights=True, offset=0.0, seed=0):
    """Both forms on `platform` against the reference; their forwards against each other bit for
    bit (one kernel), their backwards each against the reference (on CUDA the fused projection's
    head rows and q and k of their own may take different kernels, whose sums round apart)."""
    tokens, q_heads, kv_heads, D = case
    qkv, dqkv_out, q_weight, k_weight = make(case, dtype, weight_dtype, seed)
    if not has_weights:
        q_weight = k_weight = np.ones(D, np_dtype(weight_dtype))
    if platform == "gpu" and not gpu_takes(D, dtype):
        # The CUDA kernels take rows of a multiple of 16 bytes up to head_rows_max_bytes (the
        # public functions run other rows as two norm calls): the bare call fails, naming why.
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"qk_norm(_fused)?_fwd: .* multiple of 16 bytes"):
            jax.block_until_ready(both_forms(norm, q_heads, kv_heads, offset, has_weights,
                                             *put(platform, qkv, dqkv_out, q_weight, k_weight)))
        return
    got = both_forms(norm, q_heads, kv_heads, offset, has_weights, *put(platform, qkv, dqkv_out, q_weight, k_weight))
    (qkv_out, q_stats, k_stats), (q_out, k_out, q_stats2, k_stats2), fused_bwd, separate_bwd = jax.tree.map(
        np.asarray, got)
    (dqkv, dq_weight, dk_weight), (dq, dk, dq_weight2, dk_weight2) = fused_bwd, separate_bwd

    # Shapes and dtypes: statistics per row, in norm.stats order; gradients in the weights' dtype.
    stat = reference.acc_dtype(dtype)
    assert qkv_out.shape == qkv.shape and qkv_out.dtype == qkv.dtype and dqkv.dtype == qkv.dtype
    assert len(q_stats) == len(norm.stats) == len(k_stats)
    for s in q_stats:
        assert s.shape == (tokens * q_heads,) and s.dtype == stat
    for s in k_stats:
        assert s.shape == (tokens * kv_heads,) and s.dtype == stat
    assert dq_weight.shape == dk_weight.shape == (D,) and dq_weight.dtype == np_dtype(weight_dtype)

    # The fused forward is the separate one, bit for bit; both backwards pass the v heads through
    # untouched.
    q_fused, k_fused, v_fused = split(qkv_out, q_heads, kv_heads)
    np.testing.assert_array_equal(q_fused, q_out)
    np.testing.assert_array_equal(k_fused, k_out)
    np.testing.assert_array_equal(v_fused, split(qkv, q_heads, kv_heads)[2])
    dq_fused, dk_fused, dv_fused = split(dqkv, q_heads, kv_heads)
    np.testing.assert_array_equal(dv_fused, split(dqkv_out, q_heads, kv_heads)[2])
    for a, b in zip((*q_stats, *k_stats), (*q_stats2, *k_stats2)):
        np.testing.assert_array_equal(a, b)

    # Against the reference norms per head, and jax.vjp of them.
    (q_want, k_want), (q_stats_want, k_stats_want), (dq_want, dk_want, dqw_want, dkw_want) = want(
        norm, offset, qkv, dqkv_out, q_weight, k_weight, q_heads, kv_heads)
    assert_close("q_out", q_out, q_want, dtype)
    assert_close("k_out", k_out, k_want, dtype)
    for name, got_s, want_s in zip(norm.stats, (*q_stats, *k_stats), (*q_stats_want, *k_stats_want)):
        assert_close(name, got_s, want_s, dtype, STAT_RTOL[dtype])
    q, k, _ = split(f64(qkv), q_heads, kv_heads)
    dq_out, dk_out, _ = split(f64(dqkv_out), q_heads, kv_heads)
    for name, g, r, x, dy, w in (("dq", dq, dq_want, q, dq_out, q_weight), ("dk", dk, dk_want, k, dk_out, k_weight),
                                 ("fused dq", dq_fused, dq_want, q, dq_out, q_weight),
                                 ("fused dk", dk_fused, dk_want, k, dk_out, k_weight)):
        if D == 1:
            # One element a row: x̂ is 0 (layernorm) or nearly ±1 (rmsnorm), and dx is a
            # cancellation of near-equal terms; it is checked against the size of those terms
            # (as tests/kernels/test_small_rows.py does).
            scale = np.abs(dy * (offset + f64(w)) / np.abs(x))
            assert np.all(np.abs(f64(g) - r) <= 1e-2 * scale + 1e-30), name
        else:
            assert_close(name, g, r, dtype)
    # D = 1: the weight gradients are sums of ±dy over the rows, which cancel.
    weight_rtol = 10 * RTOL[weight_dtype] if D == 1 else RTOL[weight_dtype]
    assert_close("dq_weight", dq_weight, dqw_want, weight_dtype, weight_rtol)
    assert_close("dk_weight", dk_weight, dkw_want, weight_dtype, weight_rtol)
    assert_close("separate dq_weight", dq_weight2, dqw_want, weight_dtype, weight_rtol)
    assert_close("separate dk_weight", dk_weight2, dkw_want, weight_dtype, weight_rtol)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype,weight_dtype", DTYPES, ids=lambda d: d)
@pytest.mark.parametrize("case", SMALL_CASES, ids=case_id)
def test_dtypes(platform, norm, dtype, weight_dtype, case):
    check(platform, norm, case, dtype, weight_dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("case", [c for c in CASES if c not in SMALL_CASES], ids=case_id)
def test_head_shapes(platform, norm, case):
    """The other head_dims and head counts, in bfloat16 with float32 weights (the common
    training setup; the dtypes' own paths are test_dtypes')."""
    check(platform, norm, case, "bfloat16", "float32", seed=1)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", EDGE_CASES, ids=case_id)
def test_absent_weights(platform, norm, dtype, case):
    """No weights: the forward gets (0, D) operands, the backward ones (and their gradients)."""
    check(platform, norm, case, dtype, dtype, has_weights=False, seed=2)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype,weight_dtype", [("float32", "float32"), ("bfloat16", "float32")], ids=lambda d: d)
@pytest.mark.parametrize("case", EDGE_CASES, ids=case_id)
def test_rmsnorm_offset(platform, dtype, weight_dtype, case):
    """Gemma's zero-centred scale: y = x̂ * (1 + w); its gradient has no offset in it."""
    check(platform, RMSNORM, case, dtype, weight_dtype, offset=1.0, seed=3)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("norm", NORMS)
def test_fused_unaliased(platform, norm):
    """Called without input_output_aliases the fused targets get a result buffer of their own:
    the handler copies operand 0 into it first, and the results are those of the aliased call."""
    q_heads, kv_heads = 4, 2
    qkv, dqkv_out, q_weight, k_weight = make((3, q_heads, kv_heads, 16), "bfloat16", "float32", seed=4)
    stat = np.float32
    attrs = dict(offset=np.float64(0.0), norm=np.int32(norm.kind), q_heads=np.int64(q_heads),
                 kv_heads=np.int64(kv_heads))
    rows_q, rows_k = 3 * q_heads, 3 * kv_heads
    mean_q, mean_k = (rows_q, rows_k) if norm.centered else (0, 0)
    fwd_types = (jax.ShapeDtypeStruct(qkv.shape, qkv.dtype), jax.ShapeDtypeStruct((mean_q,), stat),
                 jax.ShapeDtypeStruct((rows_q,), stat), jax.ShapeDtypeStruct((mean_k,), stat),
                 jax.ShapeDtypeStruct((rows_k,), stat))
    bwd_types = (jax.ShapeDtypeStruct(qkv.shape, qkv.dtype), jax.ShapeDtypeStruct((2, 16), np.float32),
                 jax.ShapeDtypeStruct((qk_workspace_bytes("bfloat16", rows_q, rows_k, 16, fused=True),), np.uint8))

    def unaliased(qkv, dqkv_out, qw, kw):
        out, qm, qr, km, kr = jax.ffi.ffi_call(QK_TARGETS.fused_fwd, fwd_types)(
            qkv, qw[None], kw[None], eps=np.float64(EPS), **attrs)
        dqkv, dweights, _ = jax.ffi.ffi_call(QK_TARGETS.fused_bwd, bwd_types)(
            dqkv_out, qkv, qw[None], kw[None], qm, qr, km, kr, **attrs)
        return out, dqkv, dweights[0], dweights[1]

    def aliased(qkv, dqkv_out, qw, kw):
        out, q_stats, k_stats = qk_fused_fwd_call(norm, qkv, qw, kw, q_heads, kv_heads, EPS)
        dqkv, dqw, dkw = qk_fused_bwd_call(norm, dqkv_out, qkv, qw, kw, q_stats, k_stats, q_heads, kv_heads)
        return out, dqkv, dqw, dkw

    args = put(platform, qkv, dqkv_out, q_weight, k_weight)
    for a, b in zip(jax.jit(unaliased)(*args), jax.jit(aliased)(*args)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_no_tokens(platform):
    """Zero tokens: empty outputs and statistics, and zero weight gradients."""
    qkv, dqkv_out, q_weight, k_weight = make((0, 4, 2, 8), "float32", "float32")
    (qkv_out, q_stats, _), _, (dqkv, dq_weight, dk_weight), _ = jax.tree.map(
        np.asarray, both_forms(LAYERNORM, 4, 2, 0.0, True, *put(platform, qkv, dqkv_out, q_weight, k_weight)))
    assert qkv_out.shape == dqkv.shape == (0, 64) and q_stats[1].shape == (0,)
    np.testing.assert_array_equal(dq_weight, np.zeros(8, np.float32))
    np.testing.assert_array_equal(dk_weight, np.zeros(8, np.float32))


def test_workspace_without_gpu():
    """Off a GPU (or in a build without the CUDA handlers, or before qk_launch_plan exists) the
    workspace is the header alone: the CPU handler does not use it."""
    has_plan = _jax_lnbwd.with_cuda and hasattr(_jax_lnbwd, "qk_launch_plan") and jax.devices()[0].platform == "gpu"
    if has_plan:
        pytest.skip("a GPU plans the workspace: the CUDA tests size it")
    assert qk_workspace_bytes("bfloat16", 4096, 1024, 128) == WORKSPACE_HEADER_BYTES


# --- Errors: the handlers' checks (ffi/checks/qk_norm.h), named for the target's function ----------

def _q_k(D_k=8, dtype="float32"):
    t = np_dtype(dtype)
    return np.ones((4, 8), t), np.ones((6, D_k), t), np.ones(8, t), np.ones(8, t)


def _fwd(norm=RMSNORM, D_k=8, q_weight_shape=(8,), offset=0.0):
    q, k, qw, kw = _q_k(D_k)
    return lambda: qk_fwd_call(norm, q, k, np.ones(q_weight_shape, np.float32), kw, EPS, offset)


def _fused_fwd(norm=RMSNORM, width=64, q_heads=4, kv_heads=2, weights=(np.float32, np.float32), dtype="float32"):
    qkv = np.ones((2, width), np_dtype(dtype))
    qw, kw = (np.ones(8, w) for w in weights)
    return lambda: qk_fused_fwd_call(norm, qkv, qw, kw, q_heads, kv_heads, EPS)


def _bwd(norm=RMSNORM, k_weight_shape=(8,), rstd_rows=6):
    q, k, qw, _ = _q_k()
    return lambda: qk_bwd_call(norm, q, k, q, k, qw, np.ones(k_weight_shape, np.float32),
                               (np.ones(4, np.float32),), (np.ones(rstd_rows, np.float32),))


def _fused_bwd(norm=RMSNORM, q_rows=8):
    qkv = np.ones((2, 64), np.float32)
    w = np.ones(8, np.float32)
    stats = (np.ones(q_rows, np.float32),), (np.ones(4, np.float32),)
    if norm.centered:
        stats = tuple((s[0], s[0]) for s in stats)
    return lambda: qk_fused_bwd_call(norm, qkv, qkv, w, w, *stats, 4, 2)


ERRORS = [
    ("wrong-D", _fwd(D_k=9), r"qk_norm_fwd: 'k' has shape \(6, 9\) but expected \(6, 8\): k's head_dim must be q's"),
    ("q_weight-shape", _fwd(q_weight_shape=(9,)),
     r"qk_norm_fwd: 'q_weight' has shape \(1, 9\) but expected \(0, 8\) \(absent\) or \(1, 8\)"),
    ("k_weight-shape", _bwd(k_weight_shape=(9,)), r"qk_norm_bwd: 'k_weight' has shape \(1, 9\) but expected \(1, 8\)"),
    ("width", _fused_fwd(width=100),
     r"qk_norm_fused_fwd: 'qkv' has shape \(2, 100\) but its width 100 is not a multiple of "
     r"q_heads \+ 2 \* kv_heads = 8 \(q_heads=4, kv_heads=2\)"),
    ("q_heads", _fused_fwd(q_heads=0), r"qk_norm_fused_fwd: 'q_heads' is 0 but expected at least 1"),
    ("norm-fwd", _fwd(norm=dataclasses.replace(RMSNORM, kind=2)),
     r"qk_norm_fwd: 'norm' is 2 but expected 0 \(layernorm\) or 1 \(rmsnorm\)"),
    ("norm-fused-bwd", _fused_bwd(norm=dataclasses.replace(LAYERNORM, kind=-1)),
     r"qk_norm_fused_bwd: 'norm' is -1 but expected 0 \(layernorm\) or 1 \(rmsnorm\)"),
    ("layernorm-offset", _fwd(norm=LAYERNORM, offset=1.0),
     r"qk_norm_fwd: 'offset' is 1\.0+ but layernorm takes none: expected 0"),
    ("weight-dtypes", _fused_fwd(dtype="bfloat16", weights=(np.float32, jnp.bfloat16)),
     r"qk_norm_fused_fwd: 'q_weight' has dtype float32 but 'k_weight' has bfloat16; pass both in one dtype"),
    ("rstd-rows", _bwd(rstd_rows=5), r"qk_norm_bwd: 'k_rstd' has shape \(5,\) but expected \(6,\) \(k's rows\)"),
    ("fused-stats", _fused_bwd(q_rows=7),
     r"qk_norm_fused_bwd: 'q_rstd' has shape \(7,\) but expected \(8,\) \(tokens \* q_heads\)"),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("call,match", [pytest.param(c, m, id=i) for i, c, m in ERRORS])
def test_errors(platform, call, match):
    with jax.default_device(device(platform)), pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.block_until_ready(call())
