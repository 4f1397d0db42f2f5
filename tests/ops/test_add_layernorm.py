"""add_layernorm(x, residual, weight, bias) -> (y, s): s = x + residual, y = layernorm(s), whose
backward is ONE target-v2 call with the residual cotangent added to dx in the kernel.

Values against the jnp reference (x + residual, then reference.layernorm, differentiated by
JAX) per dtype, the one v2 call in the lowered grad, vmap, forward mode, sharded jit, export,
the XLA-backward switch and the errors."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.test_util import check_grads
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import DTYPES, PLATFORMS, assert_close, make_inputs, put
from jax_lnbwd import TARGET, add_layernorm, reference, use_xla_backward
from jax_lnbwd import TARGET_V2

ARGNUMS = (0, 1, 2, 3)


def _reference(x, r, w, b, eps=1e-5):
    s = x + r
    return reference.layernorm(s, w, b, eps), s


def _inputs(platform, dtype, shape=(3, 5, 72), seed=0, mixed=False):
    x, gy, w, b = make_inputs(shape, dtype, seed=seed)
    r, gs, _, _ = make_inputs(shape, dtype, seed=seed + 100)
    if mixed:
        w, b = w.astype(np.float32), b.astype(np.float32)
    return put(platform, x, r, w, b, gy, gs)


def _loss(f, x, r, w, b, gy, gs):
    """Uses both outputs: y (cotangent gy) and the residual stream s (cotangent gs)."""
    y, s = f(x, r, w, b)
    acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    return jnp.sum(y.astype(acc) * gy.astype(acc)) + jnp.sum(s.astype(acc) * gs.astype(acc))


def _want(x, r, w, b, gy, gs):
    """(y, s) and the four gradients by the reference in float64 (s rounded as in x's dtype)."""
    cpu = jax.devices("cpu")[0]
    s = np.asarray(x + r)
    f64 = lambda a: jax.device_put(np.asarray(a).astype(np.float64), cpu)  # noqa: E731
    y = reference.layernorm(f64(s), f64(w), f64(b))
    gx, gw, gb = jax.grad(lambda s, w, b: jnp.sum(reference.layernorm(s, w, b) * f64(gy)),
                          argnums=(0, 1, 2))(f64(s), f64(w), f64(b))
    ds = gx + f64(gs)
    return (y, s), (ds, ds, gw, gb)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype,mixed", [(d, False) for d in DTYPES] + [("bfloat16", True), ("float16", True)])
def test_values(platform, dtype, mixed):
    x, r, w, b, gy, gs = _inputs(platform, dtype, mixed=mixed)
    y, s = jax.jit(add_layernorm)(x, r, w, b)
    grads = jax.jit(jax.grad(lambda *a: _loss(add_layernorm, *a, gy, gs), argnums=ARGNUMS))(x, r, w, b)
    (y_want, s_want), g_want = _want(x, r, w, b, gy, gs)
    assert (y.dtype, s.dtype) == (x.dtype, x.dtype)
    np.testing.assert_array_equal(np.asarray(s), s_want)        # s is x + residual in x's dtype
    assert_close("y", y, y_want, dtype)
    assert [g.dtype for g in grads] == [x.dtype, x.dtype, w.dtype, b.dtype]
    for name, g, h in zip(("dx", "dresidual"), grads[:2], g_want[:2]):
        assert_close(name, g, h, dtype)
    # The float32 sums are limited by s itself, held in x's dtype: XLA may keep x + residual
    # unrounded inside the fused forward's statistics while x-hat in the backward reads the
    # stored (rounded) s. So x's dtype's tolerance applies to them too.
    for name, g, h in zip(("dweight", "dbias"), grads[2:], g_want[2:]):
        assert_close(name, g, h, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_v2_call_and_no_separate_add(dtype):
    x, r, w, b, gy, gs = _inputs("cpu", dtype)
    fn = jax.jit(jax.grad(lambda *a: _loss(add_layernorm, *a, gy, gs), argnums=ARGNUMS))
    lowered = fn.lower(x, r, w, b)
    text = lowered.as_text()
    assert text.count(f"@{TARGET_V2}(") == 1 and text.count(f"@{TARGET}(") == 0
    # gs is added in the call (no add after it), and dx is a buffer of its own: gs stays readable
    assert "output_operand_aliases" not in text


@pytest.mark.parametrize("platform", PLATFORMS)
def test_residual_gradient_not_copied_in_a_block(platform):
    """Two blocks' add & norm with a Dense between them: the second call's dx (the residual
    stream's gradient) is read by the first call AND by that Dense's weight and bias gradients.
    Aliased to the first call's dx, XLA would have to copy it first; it is passed unaliased, so
    the compiled step copies no output of a layernorm call. Values against the jnp reference."""
    C = 64
    x, r, w, b, _, _ = _inputs(platform, "float32", shape=(32, C), seed=3)
    k = jax.random.split(jax.random.key(3), 2)
    W, W2 = put(platform, *(np.asarray(jax.random.normal(kk, (C, C), jnp.float32)) / 8 for kk in k))

    def block(x, r, w, b, W, bW, f):
        y, s = f(x, r, w, b)
        y2, s2 = f(y @ W + bW, s, w, b)
        return jnp.sum(y2 @ W2) + jnp.sum(s2 * s2)

    args = (x, r, w, b, W, b)
    fn = jax.jit(jax.grad(lambda *a: block(*a, add_layernorm), argnums=(0, 1, 2, 3, 4, 5)))
    hlo = fn.lower(*args).compile().as_text()
    assert hlo.count("jax_lnbwd_layernorm_bwd_v2") >= 2
    assert "output_to_operand_aliasing" not in hlo
    assert not re.search(r"copy\(%?ffi_call", hlo), [ln for ln in hlo.splitlines() if "copy(" in ln]
    with jax.default_matmul_precision("highest"):   # no TF32 on the GPU: the norms are compared
        got = jax.jit(jax.grad(lambda *a: block(*a, add_layernorm), argnums=(0, 1, 2, 3, 4, 5)))(*args)
        want = jax.grad(lambda *a: block(*a, _reference), argnums=(0, 1, 2, 3, 4, 5))(*args)
    for name, g, h in zip(("x", "residual", "weight", "bias", "W", "bW"), got, want):
        assert_close(name, g, h, "float32")


def test_only_y_or_only_s_used():
    x, r, w, b, gy, gs = _inputs("cpu", "float32", seed=1)
    g = jax.grad(lambda x, r: jnp.sum(add_layernorm(x, r, w, b)[0] * gy), argnums=(0, 1))(x, r)
    g_want = jax.grad(lambda x, r: jnp.sum(_reference(x, r, w, b)[0] * gy), argnums=(0, 1))(x, r)
    for a, h in zip(g, g_want):
        assert_close("dx (y only)", a, h, "float32")
    g = jax.grad(lambda x, r: jnp.sum(add_layernorm(x, r, w, b)[1] * gs), argnums=(0, 1))(x, r)
    for a in g:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(gs))


def test_vmap_per_example():
    x, r, w, b, gy, gs = _inputs("cpu", "bfloat16", shape=(4, 6, 64), seed=2, mixed=True)
    W = jnp.stack([w * (1 + i / 8) for i in range(4)])
    grads = jax.jit(jax.vmap(jax.grad(lambda x, r, w, gy, gs: _loss(add_layernorm, x, r, w, b, gy, gs),
                                      argnums=(0, 1, 2)), in_axes=(0, 0, 0, 0, 0)))(x, r, W, gy, gs)
    for i in range(4):
        _, g_want = _want(x[i], r[i], W[i], b, gy[i], gs[i])
        assert_close(f"dx[{i}]", grads[0][i], g_want[0], "bfloat16")
        assert_close(f"dresidual[{i}]", grads[1][i], g_want[1], "bfloat16")
        assert_close(f"dweight[{i}]", grads[2][i], g_want[2], "bfloat16")   # s is bf16: see test_values
        assert grads[2].dtype == jnp.float32


def test_forward_mode_and_second_order():
    x, r, w, b, gy, gs = _inputs("cpu", "float64", shape=(5, 24), seed=3)
    tangents = (gy, gs, w[::-1], b[::-1])
    out, t = jax.jvp(add_layernorm, (x, r, w, b), tangents)
    out_want, t_want = jax.jvp(_reference, (x, r, w, b), tangents)
    for name, a, h in zip(("dy", "ds"), t, t_want):
        assert_close(name, a, h, "float64")
    loss = lambda f: lambda *a: _loss(f, *a, gy, gs)  # noqa: E731
    hvp = jax.jvp(jax.grad(loss(add_layernorm), argnums=ARGNUMS), (x, r, w, b), tangents)[1]
    hvp_want = jax.jvp(jax.grad(loss(_reference), argnums=ARGNUMS), (x, r, w, b), tangents)[1]
    for name, a, h in zip(("x", "r", "w", "b"), hvp, hvp_want):
        assert_close(f"hvp {name}", a, h, "float64")
    check_grads(add_layernorm, (x, r, w, b), order=2, modes=("fwd", "rev"))


def test_sharded_jit_and_shard_map():
    mesh = Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("a", "b"))
    x, r, w, b, gy, gs = _inputs("cpu", "float32", shape=(4, 6, 64), seed=4)
    rows = NamedSharding(mesh, P("a", "b"))
    x, r, gy, gs = (jax.device_put(a, rows) for a in (x, r, gy, gs))
    w, b = (jax.device_put(a, NamedSharding(mesh, P())) for a in (w, b))
    fn = jax.jit(jax.grad(lambda *a: _loss(add_layernorm, *a, gy, gs), argnums=ARGNUMS))
    grads = fn(x, r, w, b)
    _, g_want = _want(x, r, w, b, gy, gs)
    assert tuple(grads[0].sharding.spec[:2]) == ("a", "b")
    for name, g, h in zip(("dx", "dresidual", "dweight", "dbias"), grads, g_want):
        assert_close(name, g, h, "float32")
    smap = jax.jit(jax.shard_map(lambda x, r, w, b: add_layernorm(x, r, w, b), mesh=mesh,
                                 in_specs=(P("a", "b"), P("a", "b"), P(), P()), out_specs=P("a", "b")))
    y, s = smap(x, r, w, b)
    assert_close("y", y, _reference(x, r, w, b)[0], "float32")


def test_export_round_trip():
    x, r, w, b, gy, gs = _inputs("cpu", "bfloat16", shape=(4, 40), seed=5, mixed=True)
    fn = jax.jit(jax.grad(lambda *a: _loss(add_layernorm, *a, gy, gs), argnums=ARGNUMS))
    exported = export.export(fn, platforms=["cpu"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(TARGET_V2)])(x, r, w, b)
    assert f"@{TARGET_V2}(" in exported.mlir_module()
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    restored = export.deserialize(exported.serialize())
    for g, h in zip(restored.call(x, r, w, b), fn(x, r, w, b)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


def test_xla_backward_switch():
    x, r, w, b, gy, gs = _inputs("cpu", "float32", seed=6)
    with use_xla_backward(True):
        fn = jax.jit(jax.grad(lambda *a: _loss(add_layernorm, *a, gy, gs), argnums=ARGNUMS))
        assert f"@{TARGET_V2}(" not in fn.lower(x, r, w, b).as_text()
        got = fn(x, r, w, b)
    want = jax.grad(lambda *a: _loss(_reference, *a, gy, gs), argnums=ARGNUMS)(x, r, w, b)
    for name, g, h in zip(("dx", "dresidual", "dweight", "dbias"), got, want):
        assert_close(name, g, h, "float32")


def test_errors():
    x, r, w, b, _, _ = _inputs("cpu", "bfloat16", shape=(4, 256))
    with pytest.raises(ValueError, match=r"add_layernorm: 'residual' has shape \(4, 255\) but x has shape \(4, 256\)"):
        add_layernorm(x, r[:, :255], w, b)
    with pytest.raises(TypeError, match="add_layernorm: 'residual' has dtype float32 but x has dtype bfloat16"):
        add_layernorm(x, r.astype(jnp.float32), w, b)
    with pytest.raises(ValueError, match="add_layernorm: kernel 9 does not support an added residual gradient"):
        add_layernorm(x, r, w, b, kernel=9)
    with pytest.raises(TypeError, match="add_layernorm: 'residual' must be an array"):
        add_layernorm(x, 1.0, w, b)


@pytest.mark.parametrize("platform", [p for p in PLATFORMS if p.id == "gpu"])
@pytest.mark.parametrize("mixed", [False, True])
def test_gpu_one_v2_call_and_fused_forward(platform, mixed):
    x, r, w, b, gy, gs = _inputs(platform, "bfloat16", shape=(8, 128, 1600), seed=7, mixed=mixed)
    fn = jax.jit(jax.grad(lambda *a: _loss(add_layernorm, *a, gy, gs), argnums=ARGNUMS))
    hlo = fn.lower(x, r, w, b).compile().as_text()
    assert hlo.count(f'custom_call_target="{TARGET_V2}"') == 1
    # Under autodiff the forward is XLA's (jax_lnbwd/dispatch.py); without it, the forward is the
    # residual-fused one (x + residual inside it), not an add then fwd_v1.
    assert 'custom_call_target="jax_lnbwd_add_layernorm_fwd_v1"' not in hlo
    fwd = jax.jit(lambda *a: add_layernorm(*a)).lower(x, r, w, b).compile().as_text()
    assert 'custom_call_target="jax_lnbwd_add_layernorm_fwd_v1"' in fwd
    assert 'custom_call_target="jax_lnbwd_layernorm_fwd_v1"' not in fwd
    grads = fn(x, r, w, b)
    _, g_want = _want(x, r, w, b, gy, gs)
    for name, g, h in zip(("dx", "dresidual"), grads[:2], g_want[:2]):
        assert_close(name, g, h, "bfloat16")
    for name, g, h in zip(("dweight", "dbias"), grads[2:], g_want[2:]):
        assert_close(name, g, h, "bfloat16")
