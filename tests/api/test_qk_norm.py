"""qk_norm and qk_norm_fused: values and gradients against the jnp reference norms per head,
every transformation (jit, grad, vmap, jvp, check_grads, scan, checkpoint, export), the fused
form against slicing, and every error. Sharding over rows and over the head axis:
test_qk_norm_sharding.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.test_util import check_grads

import jax_lnbwd
from conftest import PLATFORMS, assert_close, f64, np_dtype, put
from jax_lnbwd import qk_norm, qk_norm_fused, reference
from qk_norm_cases import inputs, loss

NORMS = ("rmsnorm", "layernorm")


def reference_qk(q, k, qw, kw, *, eps=1e-6, offset=0.0, norm="rmsnorm"):
    """The two reference norms, in whatever dtype the inputs have (float64 for the oracle)."""
    if norm == "rmsnorm":
        return reference.rmsnorm(q, qw, eps, offset), reference.rmsnorm(k, kw, eps, offset)
    return reference.layernorm(q, qw, None, eps), reference.layernorm(k, kw, None, eps)


def value_and_grads(fn, args, **kw_):
    """(q_out, k_out), (dq, dk, dq_weight, dk_weight) of `fn` (qk_norm or reference_qk), jitted."""
    q, k, qw, kw, rq, rk = args
    argnums = tuple(i for i, a in enumerate((q, k, qw, kw)) if a is not None)
    outs = jax.jit(lambda *a: fn(*a, **kw_))(q, k, qw, kw)
    grads = jax.jit(jax.grad(lambda *a: loss(fn, *a, **kw_), argnums=argnums))(q, k, qw, kw, rq, rk)
    return outs, grads


def oracle(args, **kw_):
    """The reference in float64 from the same (upcast) inputs, on the CPU."""
    cpu = jax.devices("cpu")[0]
    up = [None if a is None else jax.device_put(f64(a), cpu) for a in args]
    return value_and_grads(reference_qk, up, **kw_)


def assert_matches_oracle(args, dtype, what="", **kw_):
    (qo, ko), grads = value_and_grads(qk_norm, args, **kw_)
    (wq, wk), wgrads = oracle(args, **kw_)
    assert qo.dtype == args[0].dtype and ko.dtype == args[1].dtype
    assert_close(f"{what} q_out", qo, wq, dtype)
    assert_close(f"{what} k_out", ko, wk, dtype)
    for name, g, w in zip(("dq", "dk", "dq_weight", "dk_weight"), grads, wgrads):
        assert_close(f"{what} {name}", g, w, dtype)
    for g, a in zip(grads[2:], args[2:4]):   # the weights' gradients have the weights' dtypes
        assert g.dtype == a.dtype


# --- values and gradients -------------------------------------------------------------------------

# (q shape, k shape): GQA, head counts 1 and 64, D = 32, 80, 256, a single token, other axes of k.
SHAPES = {
    "gqa-D32": ((2, 3, 4, 32), (2, 3, 2, 32)),
    "gqa-D80": ((2, 3, 4, 80), (2, 3, 2, 80)),
    "gqa-D256": ((2, 3, 4, 256), (2, 3, 2, 256)),
    "heads-1": ((2, 5, 1, 64), (2, 5, 1, 64)),
    "heads-64": ((1, 3, 64, 32), (1, 3, 64, 32)),
    "single-token": ((1, 1, 4, 128), (1, 1, 2, 128)),
    "rank-2": ((4, 32), (2, 32)),
    "cross-attention": ((2, 3, 4, 32), (2, 7, 2, 32)),
}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_values_and_grads(platform, norm, dtype, shape):
    args = inputs(*SHAPES[shape], dtype)
    assert_matches_oracle(put(platform, *args), dtype, shape, norm=norm)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("norm", NORMS)
def test_mixed_precision_float32_weights(platform, norm):
    """bfloat16 q and k with float32 weights: float32 weight gradients, never rounded."""
    args = inputs((2, 3, 4, 64), (2, 3, 2, 64), "bfloat16", weight_dtype="float32")
    assert_matches_oracle(put(platform, *args), "bfloat16", norm=norm)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("norm", NORMS)
def test_weights_none(platform, norm):
    q, k, _, _, rq, rk = inputs((2, 3, 4, 32), (2, 3, 2, 32))
    args = (*put(platform, q, k), None, None, *put(platform, rq, rk))
    assert_matches_oracle(args, "float32", norm=norm)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offset(platform, dtype):
    """Gemma's zero-centred scale: offset=1.0 with weights near 0."""
    q, k, qw, kw, rq, rk = inputs((2, 3, 4, 32), (2, 3, 2, 32), dtype)
    qw, kw = (qw - 1).astype(qw.dtype), (kw - 1).astype(kw.dtype)
    assert_matches_oracle(put(platform, q, k, qw, kw, rq, rk), dtype, offset=1.0)


def test_eps_is_used():
    q, k, qw, kw, rq, rk = inputs((2, 4, 32), (2, 2, 32))
    assert_matches_oracle((q, k, qw, kw, rq, rk), "float32", eps=0.5)


# --- transformations ------------------------------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
def test_vmap_per_example_weights(platform):
    """vmap over a batch with per-example weights: per-example weight gradients."""
    q, k, _, _, rq, rk = inputs((3, 5, 4, 32), (3, 5, 2, 32))
    rng = np.random.default_rng(1)
    qws, kws = (1 + 0.1 * rng.standard_normal((2, 3, 32))).astype(np.float32)
    args = put(platform, q, k, qws, kws, rq, rk)
    got = jax.jit(jax.vmap(jax.grad(lambda *a: loss(qk_norm, *a), argnums=(0, 1, 2, 3))))(*args)
    for b in range(3):
        _, want = oracle([a[b] for a in (q, k, qws, kws, rq, rk)])
        for name, g, w in zip(("dq", "dk", "dq_weight", "dk_weight"), got, want):
            assert_close(f"{name}[{b}]", g[b], w, "float32")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_jvp_matches_reference(platform):
    q, k, qw, kw, tq, tk = inputs((2, 4, 32), (2, 2, 32))
    primals, tangents = put(platform, q, k, qw, kw), put(platform, tq, tk, 0.1 * qw, 0.1 * kw)
    got = jax.jit(lambda p, t: jax.jvp(qk_norm, p, t))(primals, tangents)
    up = lambda xs: tuple(jnp.asarray(f64(a)) for a in xs)  # noqa: E731
    want = jax.jvp(reference_qk, up(primals), up(tangents))
    for name, g, w in zip(("q_out", "k_out", "dq_out", "dk_out"), jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(name, g, w, "float32")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("norm", NORMS)
def test_check_grads_orders_1_and_2(platform, norm):
    """JAX's numerical check in float64, forward and reverse mode, orders 1 and 2."""
    q, k, qw, kw, rq, rk = inputs((2, 3, 7), (1, 3, 7), "float64", seed=4)
    f = lambda *a: loss(qk_norm, *a, rq, rk, norm=norm, offset=0.25 if norm == "rmsnorm" else 0.0)  # noqa: E731
    check_grads(f, put(platform, q, k, qw, kw), order=2, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_hessian_of_weights(platform):
    q, k, qw, kw, rq, rk = inputs((2, 3, 8), (2, 1, 8), "float64", seed=5)
    f = lambda qw, kw: loss(qk_norm, q, k, qw, kw, rq, rk) ** 2  # noqa: E731
    ref = lambda qw, kw: loss(reference_qk, q, k, qw, kw, rq, rk) ** 2  # noqa: E731
    got = jax.jit(jax.hessian(f, argnums=(0, 1)))(*put(platform, qw, kw))
    want = jax.hessian(ref, argnums=(0, 1))(qw, kw)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close("hessian", g, w, "float64", rtol=1e-10)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_scan_and_checkpoint(platform):
    """lax.scan over stacked layers' weights, each layer rematerialized (jax.checkpoint)."""
    q, k, _, _, rq, rk = inputs((2, 4, 32), (2, 2, 32))
    qws, kws = (1 + 0.1 * np.random.default_rng(2).standard_normal((2, 3, 32))).astype(np.float32)

    def deep(norm_fn):
        def f(q, k, qws, kws):
            def layer(carry, w):
                q, k = jax.checkpoint(lambda q, k, qw, kw: norm_fn(q, k, qw, kw))(*carry, *w)
                return (q * 1.5, k * 1.5), None
            (q, k), _ = jax.lax.scan(layer, (q, k), (qws, kws))
            return jnp.sum(q * rq) + jnp.sum(k * rk)
        return f

    got = jax.jit(jax.value_and_grad(deep(qk_norm), argnums=(0, 1, 2, 3)))(*put(platform, q, k, qws, kws))
    want = jax.value_and_grad(deep(reference_qk), argnums=(0, 1, 2, 3))(*(f64(a) for a in (q, k, qws, kws)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close("scan", g, w, "float32")


EXPORT_PLATFORM = {"cpu": "cpu", "gpu": "cuda"}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("form", ["qk_norm", "qk_norm_fused"])
def test_export_round_trip(platform, form):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    if form == "qk_norm":
        q, k, qw, kw, rq, rk = inputs((2, 3, 4, 32), (2, 3, 2, 32))
        fn = jax.grad(lambda *a: loss(qk_norm, *a), argnums=(0, 1, 2, 3))
        args = put(platform, q, k, qw, kw, rq, rk)
    else:
        qkv = np.random.default_rng(0).standard_normal((2, 3, 8 * 32)).astype(np.float32)
        r = np.random.default_rng(1).standard_normal(qkv.shape).astype(np.float32)
        fn = jax.grad(lambda x, qw, kw: jnp.sum(qk_norm_fused(x, qw, kw, q_heads=4, kv_heads=2) * r),
                      argnums=(0, 1, 2))
        args = put(platform, qkv, *inputs((1, 32), (1, 32))[2:4])
    allow = [export.DisabledSafetyCheck.custom_call(t) for t in jax_lnbwd.TARGETS]
    exported = export.export(jax.jit(fn), platforms=[EXPORT_PLATFORM[platform]], disabled_checks=allow)(*args)
    restored = export.deserialize(exported.serialize())
    want = jax.jit(fn)(*args)
    for g, w in zip(jax.tree.leaves(restored.call(*args)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# --- qk_norm_fused --------------------------------------------------------------------------------

def split_then_qk_norm(qkv, qw, kw, *, q_heads, kv_heads, **kw_):
    """What qk_norm_fused computes, written with slices and qk_norm."""
    H = q_heads + 2 * kv_heads
    heads = qkv.reshape(qkv.shape[:-1] + (H, qkv.shape[-1] // H))
    q, k = qk_norm(heads[..., :q_heads, :], heads[..., q_heads:q_heads + kv_heads, :], qw, kw, **kw_)
    return jnp.concatenate([q, k, heads[..., q_heads + kv_heads:, :]], axis=-2).reshape(qkv.shape)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,D", [((4, 2), 32), ((1, 1), 80), ((8, 8), 256)], ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_fused_equals_slicing(platform, dtype, heads, D, norm):
    Hq, Hk = heads
    rng = np.random.default_rng(0)
    t = np_dtype(dtype)
    qkv = rng.standard_normal((2, 3, (Hq + 2 * Hk) * D)).astype(t)
    r = rng.standard_normal(qkv.shape).astype(np.float32)
    qw, kw = (1 + 0.1 * rng.standard_normal((2, D))).astype(t)
    kw_ = dict(q_heads=Hq, kv_heads=Hk, norm=norm)
    args = put(platform, qkv, qw, kw)

    def run(fn):
        out = jax.jit(lambda *a: fn(*a, **kw_))(*args)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a, **kw_).astype(jnp.float32) * r), argnums=(0, 1, 2)))(*args)
        return out, grads

    (out, grads), (want, wgrads) = run(qk_norm_fused), run(split_then_qk_norm)
    assert out.shape == qkv.shape and out.dtype == qkv.dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    v = slice((Hq + Hk) * D, None)
    np.testing.assert_array_equal(np.asarray(out)[..., v], qkv[..., v])   # v passes unchanged
    for g, w in zip(grads, wgrads):
        assert_close("fused grad", g, w, dtype)


def test_fused_vmap_and_offset():
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((3, 2, 4 * 16)).astype(np.float32)
    qw, kw = (0.1 * rng.standard_normal((2, 16))).astype(np.float32)
    f = lambda x: qk_norm_fused(x, qw, kw, q_heads=2, kv_heads=1, offset=1.0)  # noqa: E731
    want = split_then_qk_norm(qkv, qw, kw, q_heads=2, kv_heads=1, offset=1.0)
    assert_close("vmap", jax.jit(jax.vmap(f))(qkv), want, "float32")


# --- errors ---------------------------------------------------------------------------------------

Q, K, W = jnp.ones((2, 4, 8)), jnp.ones((2, 2, 8)), jnp.ones(8)

ERRORS = {
    "head_dim mismatch": (lambda: qk_norm(Q, jnp.ones((2, 2, 4)), W, None),
                          ValueError, r"qk_norm: 'q' has head_dim 8 .* 'k' has head_dim 4"),
    "q rank 1": (lambda: qk_norm(jnp.ones(8), K, W, W), ValueError, r"qk_norm: 'q' has shape \(8,\) .*rank >= 2"),
    "k rank 1": (lambda: qk_norm(Q, jnp.ones(8), W, W), ValueError, r"qk_norm: 'k' has shape \(8,\)"),
    "empty head_dim": (lambda: qk_norm(jnp.ones((2, 0)), jnp.ones((2, 0)), None, None), ValueError,
                       r"qk_norm: 'q' has shape \(2, 0\)"),
    "q_weight shape": (lambda: qk_norm(Q, K, jnp.ones(4), W), ValueError,
                       r"qk_norm: 'q_weight' has shape \(4,\) but expected \(8,\)"),
    "k_weight shape": (lambda: qk_norm(Q, K, W, jnp.ones((1, 8))), ValueError,
                       r"qk_norm: 'k_weight' has shape \(1, 8\) but expected \(8,\)"),
    "k_weight dtype": (lambda: qk_norm(Q, K, W, jnp.ones(8, jnp.float16)), TypeError,
                       r"qk_norm: 'k_weight' has dtype float16"),
    "q not an array": (lambda: qk_norm([1.0], K, W, W), TypeError, r"qk_norm: 'q' must be an array"),
    "q int": (lambda: qk_norm(jnp.ones((2, 8), jnp.int32), K, W, W), TypeError, r"qk_norm: 'q' has dtype int32"),
    "norm name": (lambda: qk_norm(Q, K, W, W, norm="rms"), ValueError,
                  r"qk_norm: norm must be one of 'layernorm', 'rmsnorm', got 'rms'"),
    "norm type": (lambda: qk_norm(Q, K, W, W, norm=None), ValueError, r"qk_norm: norm must be one of"),
    "eps": (lambda: qk_norm(Q, K, W, W, eps=0.0), ValueError, r"qk_norm: eps must be a positive finite float"),
    "eps traced": (lambda: jax.jit(lambda e: qk_norm(Q, K, W, W, eps=e))(1e-6), ValueError,
                   r"qk_norm: eps must be a static Python float"),
    "offset traced": (lambda: jax.jit(lambda o: qk_norm(Q, K, W, W, offset=o))(1.0), ValueError,
                      r"qk_norm: offset must be a static Python float"),
    "offset without k_weight": (lambda: qk_norm(Q, K, W, None, offset=1.0), ValueError,
                                r"qk_norm: offset=1.0 shifts the weight, but k_weight is None"),
    "offset with layernorm": (lambda: qk_norm(Q, K, W, W, offset=1.0, norm="layernorm"), ValueError,
                              r"qk_norm: offset=1.0 is rmsnorm's; norm='layernorm' takes none"),
    "fused not divisible": (lambda: qk_norm_fused(jnp.ones((2, 100)), None, None, q_heads=4, kv_heads=2), ValueError,
                            r"qk_norm_fused: 'qkv' has shape \(2, 100\) .*\(4 \+ 2 \* 2\) \* head_dim.* multiple of 8"),
    "fused empty": (lambda: qk_norm_fused(jnp.ones((2, 0)), None, None, q_heads=1, kv_heads=1), ValueError,
                    r"qk_norm_fused: 'qkv' has shape \(2, 0\)"),
    "fused rank 0": (lambda: qk_norm_fused(jnp.ones(()), None, None, q_heads=1, kv_heads=1), ValueError,
                     r"qk_norm_fused: 'qkv' has shape \(\)"),
    "fused q_heads": (lambda: qk_norm_fused(jnp.ones((2, 64)), None, None, q_heads=0, kv_heads=2), ValueError,
                      r"qk_norm_fused: q_heads must be a positive int, got 0"),
    "fused kv_heads": (lambda: qk_norm_fused(jnp.ones((2, 64)), None, None, q_heads=4, kv_heads=2.0), ValueError,
                       r"qk_norm_fused: kv_heads must be a positive int, got 2.0"),
    "fused weight shape": (lambda: qk_norm_fused(jnp.ones((2, 64)), jnp.ones(64), None, q_heads=4, kv_heads=2),
                           ValueError, r"qk_norm_fused: 'q_weight' has shape \(64,\) but expected \(8,\)"),
    "fused norm": (lambda: qk_norm_fused(jnp.ones((2, 64)), None, None, q_heads=4, kv_heads=2, norm="ln"),
                   ValueError, r"qk_norm_fused: norm must be one of"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(case):
    fn, exc, pattern = ERRORS[case]
    with pytest.raises(exc, match=pattern):
        fn()


def test_norm_rows_accepted():
    """The norms' rows (jax_lnbwd.RMSNORM, LAYERNORM) are accepted beside their names."""
    for row in (jax_lnbwd.RMSNORM, jax_lnbwd.LAYERNORM):
        got = qk_norm(Q, K, W, W, norm=row)
        want = qk_norm(Q, K, W, W, norm=row.name)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
