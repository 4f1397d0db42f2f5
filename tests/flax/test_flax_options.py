"""Every option of Flax's LayerNorm and RMSNorm, linen and nnx, against Flax's own module.

Each case builds Flax's module and ours with the same options, checks that the parameters are
the same (names, shapes, values), and compares the output and the gradients of a random
projection of it (with respect to x and to every parameter) at float32 rounding level. A case
whose options our ops cover must call our backward target in its compiled gradient; one they
do not cover (mask, axis_name, axes other than trailing ones, ...) must run Flax's code, call
no target of ours, and log once which path it took.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from conftest import rel_err  # noqa: E402
from jax_lnbwd.flax import AddLayerNorm, AddRMSNorm, LayerNorm, RMSNorm  # noqa: E402
from jax_lnbwd.flax import nnx as lnbwd_nnx  # noqa: E402

TOL = 2e-5   # float32: rounding level (Flax's default variance is E[x²] - E[x]², ours centered)
SHAPE = (3, 2, 4, 40)   # a batch of 3 examples (2, 4, 40), vmapped with axis name 'batch'
X = jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE) + 0.5, jnp.float32)
R = jnp.asarray(np.random.default_rng(1).standard_normal(SHAPE), jnp.float32)
MASK = jnp.asarray(np.random.default_rng(2).random(SHAPE) > 0.3)
RANDOM = nn.initializers.normal(0.5)

# (options, whether our ops run it). Options are linen's field names; nnx takes the same.
CASES = [
    ({}, True),
    ({"reduction_axes": (1, 2), "feature_axes": (1, 2)}, True),   # one row of 4 * 40 per (example, first axis)
    ({"reduction_axes": (1, 2)}, True),                            # scale (40,) broadcast over the row
    ({"reduction_axes": (0, 1, 2), "feature_axes": (1, 2)}, True),  # the whole array as one row
    ({"reduction_axes": -1, "feature_axes": (-1,), "use_fast_variance": False}, True),
    ({"axis_index_groups": [[0, 1, 2]]}, True),                    # ignored without axis_name, as in Flax
    ({"reduction_axes": 1}, False),                                # not trailing
    ({"reduction_axes": (0, 2)}, False),                           # not contiguous
    ({"feature_axes": (1, 2)}, False),                             # a parameter per row
    ({"mask": True}, False),
    ({"mask": True, "reduction_axes": (1, 2), "feature_axes": (1, 2)}, False),
    ({"axis_name": "batch"}, False),
    ({"force_float32_reductions": False}, False),                  # linen only
]


def ids(case):
    options, _ = case
    return ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in options.items()) or "defaults"


def split(options):
    """(constructor options, call options) of a case."""
    options = dict(options)
    call = {"mask": MASK} if options.pop("mask", False) else {}
    return options, call


def target_calls(fn, *args) -> int:
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return hlo.count('custom_call_target="jax_lnbwd_')


def check_close(ours, theirs):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(a, b) <= TOL


# --- linen ---------------------------------------------------------------------------------------

LINEN = [(nn.LayerNorm, LayerNorm, {}), (nn.RMSNorm, RMSNorm, {}),
         (nn.LayerNorm, LayerNorm, {"scale_init": RANDOM, "bias_init": RANDOM}),
         (nn.RMSNorm, RMSNorm, {"use_scale": False})]


@pytest.mark.parametrize("theirs_cls, ours_cls, init", LINEN,
                         ids=["LayerNorm", "RMSNorm", "LayerNorm-random-params", "RMSNorm-no-scale"])
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_linen_option_matches_flax(theirs_cls, ours_cls, init, case):
    options, ours_runs = case
    options, call = split(options)
    if theirs_cls is nn.RMSNorm and "bias_init" in init:
        pytest.skip("RMSNorm has no bias")
    theirs, ours = theirs_cls(**options, **init), ours_cls(**options, **init)
    x1 = X[0]   # per example: vmapped over the batch (axis_name)
    # Flax's init outside vmap has no axis 'batch': init without axis_name (the same params).
    v_theirs = theirs.clone(axis_name=None).init(jax.random.key(1), x1, **call_for(call, 0))
    v_ours = ours.clone(axis_name=None).init(jax.random.key(1), x1, **call_for(call, 0))
    assert jax.tree.structure(v_theirs) == jax.tree.structure(v_ours)
    for a, b in zip(jax.tree.leaves(v_theirs), jax.tree.leaves(v_ours)):
        np.testing.assert_array_equal(a, b)

    def loss(module):
        def f(v, x):
            y = jax.vmap(lambda x, m: module.apply(v, x, **({"mask": m} if call else {})),
                         axis_name="batch")(x, MASK)
            return jnp.sum(y * R), y
        return f

    (l_t, y_t), g_t = jax.value_and_grad(loss(theirs), argnums=(0, 1), has_aux=True)(v_theirs, X)
    (l_o, y_o), g_o = jax.value_and_grad(loss(ours), argnums=(0, 1), has_aux=True)(v_ours, X)
    check_close(y_o, y_t)
    check_close(g_o, g_t)
    calls = target_calls(jax.grad(lambda v, x: loss(ours)(v, x)[0], argnums=(0, 1)), v_ours, X)
    assert (calls > 0) == ours_runs


def call_for(call, i):
    return {"mask": call["mask"][i]} if call else {}


@pytest.mark.parametrize("case", [c for c in CASES if "force_float32_reductions" not in c[0]], ids=ids)
@pytest.mark.parametrize("ours_cls, norm", [(AddLayerNorm, nn.LayerNorm), (AddRMSNorm, nn.RMSNorm)],
                         ids=["AddLayerNorm", "AddRMSNorm"])
def test_linen_add_option_matches_flax(ours_cls, norm, case):
    # y, s = Add*(x, residual) is s = x + residual; y = Flax's norm(s), for every option.
    options, ours_runs = case
    options, call = split(options)
    ours, theirs = ours_cls(**options), norm(**options)
    x, r = X[0], R[0]
    v = ours.clone(axis_name=None).init(jax.random.key(1), x, r, **call_for(call, 0))
    v_theirs = theirs.clone(axis_name=None).init(jax.random.key(1), x, **call_for(call, 0))
    assert jax.tree.structure(v) == jax.tree.structure(v_theirs)

    def f_ours(v, x, r):
        y, s = jax.vmap(lambda x, r, m: ours.apply(v, x, r, **({"mask": m} if call else {})),
                        axis_name="batch")(x, r, MASK)
        return jnp.sum(y * R) + jnp.sum(s * X), (y, s)

    def f_theirs(v, x, r):
        s = x + r
        y = jax.vmap(lambda s, m: theirs.apply(v, s, **({"mask": m} if call else {})), axis_name="batch")(s, MASK)
        return jnp.sum(y * R) + jnp.sum(s * X), (y, s)

    (_, out_o), g_o = jax.value_and_grad(f_ours, argnums=(0, 1, 2), has_aux=True)(v, X, R)
    (_, out_t), g_t = jax.value_and_grad(f_theirs, argnums=(0, 1, 2), has_aux=True)(v, X, R)
    check_close(out_o, out_t)
    check_close(g_o, g_t)
    assert (target_calls(jax.grad(lambda v, x, r: f_ours(v, x, r)[0], argnums=(0, 1, 2)), v, X, R) > 0) == ours_runs


@pytest.mark.parametrize("options", [{"reduction_axes": (1, 2), "feature_axes": (1, 2)}, {"reduction_axes": 1}],
                         ids=["kernels", "flax"])
def test_linen_add_x_bias_matches_flax(options):
    # use_x_bias: x_bias has the scale's shape and is added before the residual.
    ours = AddLayerNorm(use_x_bias=True, x_bias_init=RANDOM, **options)
    x, r = X[0], R[0]
    v = ours.init(jax.random.key(1), x, r)
    assert v["params"]["x_bias"].shape == v["params"]["scale"].shape
    y, s = ours.apply(v, x, r)
    p = v["params"]
    s_ref = x + p["x_bias"] + r   # the feature axes are the trailing ones in both cases
    y_ref = nn.LayerNorm(**options).apply({"params": {"scale": p["scale"], "bias": p["bias"]}}, s_ref)
    check_close((y, s), (y_ref, s_ref))


def test_linen_rmsnorm_offset_on_flax_path():
    # offset + scale on Flax's code path: offset=1 with a zero scale is Flax's RMSNorm with ones.
    ours, theirs = RMSNorm(offset=1.0, scale_init=nn.initializers.zeros), nn.RMSNorm()
    v_o, v_t = ours.init(jax.random.key(0), X), theirs.init(jax.random.key(0), X)
    for mask in (None, MASK):
        g_o = jax.grad(lambda v: jnp.sum(ours.apply(v, X, mask=mask) * R))(v_o)
        g_t = jax.grad(lambda v: jnp.sum(theirs.apply(v, X, mask=mask) * R))(v_t)
        check_close(ours.apply(v_o, X, mask=mask), theirs.apply(v_t, X, mask=mask))
        check_close(g_o, g_t)


def test_flax_path_logged_once(caplog):
    module = LayerNorm(reduction_axes=0)
    with caplog.at_level(logging.WARNING, logger="jax_lnbwd.flax"):
        v = module.init(jax.random.key(0), X)
        module.apply(v, X)
        module.apply(v, X + 1)
    logged = [r.getMessage() for r in caplog.records if r.name == "jax_lnbwd.flax"]
    assert len(logged) <= 1   # once per process and combination (another test may have logged it)
    with caplog.at_level(logging.WARNING, logger="jax_lnbwd.flax"):
        RMSNorm(reduction_axes=0, feature_axes=(0, 2)).init(jax.random.key(0), X)
    logged = [r.getMessage() for r in caplog.records if r.name == "jax_lnbwd.flax"]
    assert any("RMSNorm with reduction_axes=0: computed by Flax's own code" in m for m in logged)


# --- nnx -----------------------------------------------------------------------------------------

def nnx_num_features(options):
    axes = options.get("feature_axes", -1)
    axes = axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([SHAPE[1:][a] for a in axes]))   # x per example is SHAPE[1:]


def nnx_promote(args, *, dtype=None):
    """A promote_dtype of one's own (Flax's path): cast everything to float32."""
    return tuple(None if a is None else jnp.asarray(a, jnp.float32) for a in args)


NNX_CASES = [c for c in CASES if "force_float32_reductions" not in c[0]] + [({"promote_dtype": nnx_promote}, False)]


@pytest.mark.parametrize("theirs_cls, ours_cls", [(nnx.LayerNorm, lnbwd_nnx.LayerNorm),
                                                  (nnx.RMSNorm, lnbwd_nnx.RMSNorm)], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("case", NNX_CASES, ids=ids)
def test_nnx_option_matches_flax(theirs_cls, ours_cls, case):
    options, ours_runs = case
    options, call = split(options)
    n = nnx_num_features(options)
    theirs = theirs_cls(n, rngs=nnx.Rngs(0), **options)
    ours = ours_cls(n, rngs=nnx.Rngs(0), **options)
    assert isinstance(ours, theirs_cls)
    for a, b in zip(jax.tree.leaves(nnx.state(theirs)), jax.tree.leaves(nnx.state(ours))):
        np.testing.assert_array_equal(a, b)

    def loss(graph, state, x):
        module = nnx.merge(graph, state)
        y = jax.vmap(lambda x, m: module(x, **({"mask": m} if call else {})), axis_name="batch")(x, MASK)
        return jnp.sum(y * R), y

    results = []
    for module in (theirs, ours):
        graph, state = nnx.split(module)
        (_, y), g = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)(graph, state, X)
        results.append((y, g))
    check_close(results[1], results[0])
    graph, state = nnx.split(ours)
    calls = target_calls(jax.grad(lambda s, x: loss(graph, s, x)[0], argnums=(0, 1)), state, X)
    assert (calls > 0) == ours_runs


@pytest.mark.parametrize("mask", [False, True], ids=["kernels", "flax"])
@pytest.mark.parametrize("ours_cls, theirs_cls", [(lnbwd_nnx.AddLayerNorm, nnx.LayerNorm),
                                                  (lnbwd_nnx.AddRMSNorm, nnx.RMSNorm)],
                         ids=["AddLayerNorm", "AddRMSNorm"])
def test_nnx_add_matches_flax(ours_cls, theirs_cls, mask):
    ours, theirs = ours_cls(40, rngs=nnx.Rngs(0)), theirs_cls(40, rngs=nnx.Rngs(0))   # no batch axis here
    kw = {"mask": MASK} if mask else {}
    y, s = ours(X, R, **kw)
    check_close((y, s), (theirs(X + R, **kw), X + R))
    g_o = jax.grad(lambda x, r: jnp.sum(ours(x, r, **kw)[0] * R), argnums=(0, 1))(X, R)
    g_t = jax.grad(lambda x, r: jnp.sum(theirs(x + r, **kw) * R), argnums=(0, 1))(X, R)
    check_close(g_o, g_t)


def test_nnx_rmsnorm_offset_on_flax_path():
    ours = lnbwd_nnx.RMSNorm(40, offset=1.0, scale_init=nnx.initializers.zeros_init(), rngs=nnx.Rngs(0))
    theirs = nnx.RMSNorm(40, rngs=nnx.Rngs(0))
    check_close(ours(X, MASK), theirs(X, MASK))
    check_close(ours(X), theirs(X))
