"""QK-norm as one op, forced by the switches, under every transformation the public functions
claim (both forms): jvp, linearize and linear_transpose, vmap with shared weights (still one call
per direction) and with per-example weights, check_grads (order 2) and hessian in float64, scan
with checkpoint, and export; each gives the two-call path's numbers (the default, mode "auto").
The dispatch rule, the values against the two calls, sharding and refusals: test_qk_one_op.py."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import export
from jax.test_util import check_grads

import jax_lnbwd
from qk_one_op_cases import (FORMS, NORMS, _auto, assert_same, forced, form_fn, loss, lowered,  # noqa: F401
                             make, one_op_targets, targets, values_and_grads)


@pytest.mark.parametrize("form", FORMS)
def test_jvp_linearize_and_transpose(form):
    data, qw, kw, _ = make(form, seed=2)
    tangents = tuple(0.5 * a for a in (*make(form, seed=3)[0], qw, kw))

    def run():
        fn, primals = form_fn(form), (*data, qw, kw)
        out, t = jax.jit(lambda p, t: jax.jvp(fn, p, t))(primals, tangents)
        y, lin = jax.linearize(fn, *primals)
        cts = jax.linear_transpose(lin, *primals)(t)
        return out, t, lin(*tangents), cts

    want = run()
    with forced():
        got = run()
    assert_same(got, want, "float32")


@pytest.mark.parametrize("form", FORMS)
def test_vmap_shared_weights_is_more_rows(form):
    """vmap (and vmap of vmap) with shared weights: still one call per direction, the same numbers."""
    data, qw, kw, cts = make(form, lead=(2, 3, 5), seed=4)
    axes = (0,) * len(data) + (None, None)
    batched = lambda: jax.vmap(jax.vmap(form_fn(form), in_axes=axes), in_axes=axes)  # noqa: E731
    want = values_and_grads(batched(), data, qw, kw, cts)
    with forced():
        got = values_and_grads(batched(), data, qw, kw, cts)
        fwd, bwd = one_op_targets(form)
        assert lowered(batched(), *data, qw, kw) == {fwd: 1}
        assert lowered(jax.grad(loss(batched(), cts), argnums=(0, len(data))), *data, qw, kw) == {fwd: 1, bwd: 1}
    assert_same(got, want, "float32")


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("form", FORMS)
def test_vmap_per_example_weights(form, norm):
    """Per-example weights: the values under vmap, the per-example gradients (vmap of grad: the
    backward batched) and the gradient of the batch's loss (grad of vmap: the tangent map batched)."""
    data, _, _, cts = make(form, lead=(3, 2), seed=5)
    rng = np.random.default_rng(6)
    qws, kws = (1 + 0.1 * rng.standard_normal((2, 3, 32))).astype(np.float32)
    argnums = tuple(range(len(data) + 2))

    def run():
        fn = form_fn(form, norm=norm)
        values = jax.jit(jax.vmap(fn))(*data, qws, kws)
        per_example = jax.vmap(jax.grad(loss(fn, [c[0] for c in cts]), argnums=argnums))
        of_batch = jax.grad(loss(jax.vmap(fn), cts), argnums=argnums)
        return values, jax.jit(per_example)(*data, qws, kws), jax.jit(of_batch)(*data, qws, kws)

    want = run()
    with forced():
        got = run()
    assert_same(got, want, "float32")


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("form", FORMS)
def test_check_grads_order_2(form, norm):
    """JAX's numerical check in float64 (16-byte rows: D = 8), forward and reverse, order 2."""
    data, qw, kw, cts = make(form, "float64", lead=(2,), D=8, seed=7)   # float64: conftest enables x64
    offset = 0.25 if norm == "rmsnorm" else 0.0
    with forced():
        check_grads(loss(form_fn(form, norm=norm, offset=offset), cts), (*data, qw, kw), order=2,
                    modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_hessian_of_weights(form):
    data, qw, kw, cts = make(form, "float64", lead=(3,), D=8, seed=8)

    def run():
        f = loss(form_fn(form), cts)
        return jax.jit(jax.hessian(lambda qw, kw: f(*data, qw, kw), argnums=(0, 1)))(qw, kw)

    with forced():
        got = run()
    want = run()   # "auto" on the CPU: the jnp reference per set, differentiated by JAX
    assert_same(got, want, "float64")


@pytest.mark.parametrize("form", FORMS)
def test_scan_and_checkpoint(form):
    """lax.scan over stacked layers' weights, each layer rematerialized (jax.checkpoint)."""
    data, _, _, cts = make(form, seed=9)
    qws, kws = (1 + 0.1 * np.random.default_rng(10).standard_normal((2, 3, 32))).astype(np.float32)

    def deep(*args):
        *data, qws, kws = args
        fn = form_fn(form)

        def layer(carry, w):
            return tuple(o * 1.5 for o in jax.checkpoint(fn)(*carry, *w)), None
        out, _ = jax.lax.scan(layer, tuple(data), (qws, kws))
        return out

    want = values_and_grads(deep, data, qws, kws, cts)
    with forced():
        got = values_and_grads(deep, data, qws, kws, cts)
    assert_same(got, want, "float32")


@pytest.mark.parametrize("form", FORMS)
def test_export_round_trip(form):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    data, qw, kw, cts = make(form, seed=11)
    with forced():
        fn = jax.jit(jax.grad(loss(form_fn(form), cts), argnums=tuple(range(len(data) + 2))))
        allow = [export.DisabledSafetyCheck.custom_call(t) for t in jax_lnbwd.TARGETS]
        exported = export.export(fn, platforms=["cpu"], disabled_checks=allow)(*data, qw, kw)
        want = fn(*data, qw, kw)
    assert targets(exported.mlir_module()) == dict.fromkeys(one_op_targets(form), 1)
    restored = export.deserialize(exported.serialize())
    for g, w in zip(jax.tree.leaves(restored.call(*data, qw, kw)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
