"""jax_lnbwd.flax: drop-in LayerNorms for flax.linen and flax.nnx.

The linen tests train the transformer of small_transformer.py (embedding, two pre-LN
residual blocks, a final LayerNorm, a head; adam) once with flax.linen.LayerNorm and once
with ours, from the same seed: the parameter trees must be identical (names, shapes, dtypes
and initial values: checkpoints are interchangeable) and the loss curves equal to the compute
dtype's precision, in float32 and in bfloat16 compute with float32 params; the compiled train
step must call our backward once per LayerNorm. The training runs on the CPU, and on the GPU
when there is one; the other tests run on the default device. The nnx tests check the state
and the forward/gradients against flax.nnx.LayerNorm. Every other option: test_flax_options.py.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")
import flax.linen as nn  # noqa: E402

import small_transformer as model_lib  # noqa: E402
from conftest import PLATFORMS, RTOL, device, rel_err  # noqa: E402
from jax_lnbwd import TARGET  # noqa: E402
from jax_lnbwd import TARGET_V2  # noqa: E402
from jax_lnbwd.flax import LayerNorm  # noqa: E402

STEPS = 20
CFG = model_lib.Config()  # batch 4, seq 16, d_model 64, 2 blocks: 5 LayerNorms
# How far the two loss curves may drift apart over 20 adam steps, relative to the loss. The
# two differ only in rounding: Flax's fast variance (E[x²] - E[x]²) against our centered one,
# the order of the backward's sums and, in bfloat16, where y and the gradients are rounded to
# bfloat16. Within RTOL, the tests' per-dtype table (the loss falls from 4.7 to 0.23).


def train(cfg, norm):
    """(initial params, losses of STEPS adam steps, the compiled step's HLO) of the small
    transformer with `norm`."""
    model, params = model_lib.init(cfg, norm)
    tx = model_lib.optimizer()
    opt_state, batch = tx.init(params), model_lib.tokens(cfg)
    step = model_lib.make_train_step(model, tx).lower(params, opt_state, batch).compile()
    initial, losses = params, []
    for _ in range(STEPS):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return initial, np.array(losses), step.as_text()


@pytest.fixture(scope="module", autouse=True)
def full_float32_matmuls():
    """float32 matmuls in full float32 on every platform (a GPU's default may use TF32), so
    that Flax's run and ours differ only by their layernorms' rounding."""
    with jax.default_matmul_precision("highest"):
        yield


def paths(tree) -> list[str]:
    """The key paths of a pytree's leaves, e.g. "['Block_0']['LayerNorm_1']['scale']"."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.fixture(scope="module", params=[pytest.param((platform.values[0], dtype), id=f"{platform.id}-{dtype}",
                                                     marks=platform.marks)
                                        for platform in PLATFORMS for dtype in ("float32", "bfloat16")])
def runs(request):
    """(config, Flax's run, our run) on one platform in one compute dtype."""
    platform, dtype = request.param
    cfg = dataclasses.replace(CFG, dtype=dtype)
    with jax.default_device(device(platform)):
        return cfg, train(cfg, nn.LayerNorm), train(cfg, LayerNorm)


def test_param_trees_identical(runs):
    _, (flax_params, _, _), (our_params, _, _) = runs
    assert paths(flax_params) == paths(our_params)
    assert "['LayerNorm_0']['scale']" in paths(our_params)  # auto-named as Flax names its own
    for a, b in zip(jax.tree.leaves(flax_params), jax.tree.leaves(our_params)):
        assert a.shape == b.shape and a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)


def test_loss_curves_match(runs):
    cfg, (_, flax_losses, _), (_, our_losses, _) = runs
    assert flax_losses[-1] < 0.5 * flax_losses[0]  # it trains
    np.testing.assert_allclose(our_losses, flax_losses, rtol=RTOL[cfg.dtype])


def test_train_step_calls_our_backward(runs):
    # Once per LayerNorm (two per block and the final one); never with Flax's. bf16 compute with
    # float32 params is mixed precision: target v2 (float32 params never rounded); float32: v1.
    cfg, (_, _, flax_hlo), (_, _, our_hlo) = runs
    target = TARGET_V2 if cfg.dtype == "bfloat16" else TARGET
    assert flax_hlo.count('custom_call_target="jax_lnbwd_layernorm_bwd_v') == 0
    assert our_hlo.count(f'custom_call_target="{target}"') == 2 * cfg.layers + 1


# --- options ---------------------------------------------------------------------------------------

X = np.random.default_rng(0).standard_normal((2, 5, 24)).astype(np.float32)


@pytest.mark.parametrize("options", [
    {}, {"use_scale": False}, {"use_bias": False}, {"use_scale": False, "use_bias": False},
    {"epsilon": 1e-3}, {"dtype": jnp.bfloat16}, {"param_dtype": jnp.bfloat16},
    {"scale_init": nn.initializers.normal(0.5), "bias_init": nn.initializers.normal(0.5)},
    {"reduction_axes": (-1,), "feature_axes": 2, "use_fast_variance": False},
], ids=lambda o: ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in o.items()) or "defaults")
def test_linen_options_match_flax(options):
    # Same params (values and dtypes), same output dtype, and output and gradients within the
    # output dtype's rounding (measured: float32 <= 1e-7, bfloat16 <= 2.8e-3).
    x = jnp.asarray(X)
    theirs, ours = nn.LayerNorm(**options), LayerNorm(**options)
    v_theirs, v_ours = theirs.init(jax.random.key(1), x), ours.init(jax.random.key(1), x)
    assert jax.tree.structure(v_theirs) == jax.tree.structure(v_ours)
    for a, b in zip(jax.tree.leaves(v_theirs), jax.tree.leaves(v_ours)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    y_theirs, y_ours = theirs.apply(v_theirs, x), ours.apply(v_ours, x)
    assert y_theirs.dtype == y_ours.dtype
    tol = RTOL[str(y_ours.dtype)]
    assert rel_err(y_ours, y_theirs) <= tol

    def grads(module, variables):
        r = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.float32)
        return jax.grad(lambda v, x: jnp.sum(module.apply(v, x).astype(jnp.float32) * r), argnums=(0, 1))(variables, x)

    for a, b in zip(jax.tree.leaves(grads(theirs, v_theirs)), jax.tree.leaves(grads(ours, v_ours))):
        assert rel_err(b, a) <= tol


# --- nnx -----------------------------------------------------------------------------------------

try:
    from flax import nnx
except ImportError:  # older Flax: linen only
    nnx = None
requires_nnx = pytest.mark.skipif(nnx is None, reason="flax.nnx is not importable")


def nnx_model(norm_cls, rngs, dtype=None):
    """Two LayerNorms around a Linear, as an nnx module tree."""
    class Net(nnx.Module):
        def __init__(self):
            self.norm_in = norm_cls(24, rngs=rngs, dtype=dtype)
            self.linear = nnx.Linear(24, 24, rngs=rngs, dtype=dtype)
            self.norm_out = norm_cls(24, rngs=rngs, dtype=dtype, use_bias=False)

        def __call__(self, x):
            return self.norm_out(self.linear(self.norm_in(x)))
    return Net()


@requires_nnx
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_nnx_state_forward_and_grads_match(dtype):
    from jax_lnbwd.flax import nnx as lnbwd_nnx

    theirs = nnx_model(nnx.LayerNorm, nnx.Rngs(0), dtype)
    ours = nnx_model(lnbwd_nnx.LayerNorm, nnx.Rngs(0), dtype)
    assert isinstance(ours.norm_in, nnx.LayerNorm)
    graph_theirs, state_theirs = nnx.split(theirs)
    graph_ours, state_ours = nnx.split(ours)
    assert paths(state_theirs) == paths(state_ours)
    assert any("norm_in" in p and "scale" in p for p in paths(state_ours))
    for a, b in zip(jax.tree.leaves(state_theirs), jax.tree.leaves(state_ours)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)

    x = jnp.asarray(X)
    r = jnp.asarray(np.random.default_rng(1).standard_normal(X.shape), jnp.float32)

    def loss(graph, state, x):
        return jnp.sum(nnx.merge(graph, state)(x).astype(jnp.float32) * r)

    tol = RTOL["bfloat16" if dtype == jnp.bfloat16 else "float32"]
    (l_theirs, g_theirs), (l_ours, g_ours) = (
        jax.jit(jax.value_and_grad(loss, argnums=(1, 2)), static_argnums=0)(graph, state, x)
        for graph, state in ((graph_theirs, state_theirs), (graph_ours, state_ours)))
    assert rel_err(l_ours, l_theirs) <= tol
    for a, b in zip(jax.tree.leaves(g_theirs), jax.tree.leaves(g_ours)):
        assert rel_err(b, a) <= tol
    hlo = jax.jit(jax.grad(loss, argnums=1), static_argnums=0).lower(graph_ours, state_ours, x).compile().as_text()
    target = TARGET if dtype is None else TARGET_V2   # bf16 x beside float32 params: mixed precision
    assert hlo.count(f'custom_call_target="{target}"') == 2
