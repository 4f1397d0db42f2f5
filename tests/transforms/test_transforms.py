"""layernorm inside jax.lax.scan, jax.checkpoint (remat) and a jit with donated buffers; eps.

Each runs a small stack of layers (layernorm, then a tanh) and compares the loss and its
gradients with the same program built on the pure-jnp reference, in float64 on the CPU.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PLATFORMS, assert_close, device, f64, make_inputs, put
from jax_lnbwd import layernorm, layernorm_fwd, reference

LAYERS, SHAPE = 3, (6, 32)


def _stack(seed=0, dtype="float32"):
    """x, r of SHAPE and LAYERS stacked weights and biases, each (LAYERS, C)."""
    x, r, _, _ = make_inputs(SHAPE, dtype, seed=seed)
    layers = [make_inputs(SHAPE, dtype, seed=seed + 1 + i) for i in range(LAYERS)]
    w, b = (np.stack(a) for a in zip(*[(lw, lb) for _, _, lw, lb in layers]))
    return x, w, b, r


def _block(norm, h, wb):
    w, b = wb
    return jnp.tanh(norm(h, w, b)), None


def scan_loss(norm, x, w, b, r, *, remat=False):
    """Σ r·h after LAYERS blocks, the layers run by lax.scan over the stacked parameters."""
    block = functools.partial(_block, norm)
    if remat:
        block = jax.checkpoint(block)
    h, _ = jax.lax.scan(block, x, (w, b))
    return jnp.sum(h * r)


def loop_loss(norm, x, w, b, r):
    """The same as scan_loss, the layers unrolled in Python: the reference program."""
    h = x
    for i in range(LAYERS):
        h, _ = _block(norm, h, (w[i], b[i]))
    return jnp.sum(h * r)


ARGNUMS = (0, 1, 2)
ref_value_and_grad = jax.jit(jax.value_and_grad(functools.partial(loop_loss, reference.layernorm), argnums=ARGNUMS))


def _check(value_and_grads, x, w, b, r, dtype="float32"):
    value, grads = value_and_grads
    cpu = device("cpu")
    want_value, want = ref_value_and_grad(*(jax.device_put(f64(a), cpu) for a in (x, w, b, r)))
    assert_close("loss", value, want_value, dtype)
    for name, got, ref in zip(("dx", "dweight", "dbias"), grads, want):
        assert_close(name, got, ref, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan-remat"])
def test_scan(platform, remat):
    args = _stack(seed=1)
    loss = functools.partial(scan_loss, layernorm, remat=remat)
    _check(jax.jit(jax.value_and_grad(loss, argnums=ARGNUMS))(*put(platform, *args)), *args)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("policy", [None, "nothing_saveable", "everything_saveable"])
def test_checkpoint(platform, policy):
    # Remat of each layer: the backward recomputes the forward (and its mean/rstd) from the
    # layer's input, whatever the policy lets it save.
    args = _stack(seed=2)
    kw = {} if policy is None else {"policy": getattr(jax.checkpoint_policies, policy)}
    layer = jax.checkpoint(lambda h, w, b: jnp.tanh(layernorm(h, w, b)), **kw)

    def loss(x, w, b, r):
        h = x
        for i in range(LAYERS):
            h = layer(h, w[i], b[i])
        return jnp.sum(h * r)

    _check(jax.jit(jax.value_and_grad(loss, argnums=ARGNUMS))(*put(platform, *args)), *args)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_donated_arguments(platform):
    # A training step that donates x and the parameters: their buffers may be reused for the
    # outputs. The results are those of the reference, and the donated arrays are consumed.
    args = _stack(seed=3)
    step = jax.jit(jax.value_and_grad(functools.partial(loop_loss, layernorm), argnums=ARGNUMS),
                   donate_argnums=(0, 1, 2))
    x, w, b, r = put(platform, *args)
    result = step(x, w, b, r)
    _check(result, *args)
    assert x.is_deleted() and w.is_deleted() and b.is_deleted()
    assert not r.is_deleted()


# --- eps ---------------------------------------------------------------------------------------

BAD_EPS = {"zero": 0.0, "negative": -1e-5, "nan": math.nan, "inf": math.inf, "-inf": -math.inf,
           "str": "1e-5", "bool": True, "none": None, "list": [1e-5], "complex": 1e-5j,
           "array": np.array([1e-5, 1e-5])}


@pytest.mark.parametrize("fn", [layernorm, layernorm_fwd], ids=["layernorm", "layernorm_fwd"])
@pytest.mark.parametrize("eps", list(BAD_EPS))
def test_bad_eps_raises(fn, eps):
    x, _, w, b = make_inputs((2, 8), "float32")
    with pytest.raises(ValueError, match="eps"):
        fn(x, w, b, eps=BAD_EPS[eps])


@pytest.mark.parametrize("eps", [1, 1e-12, np.float32(1e-3), np.float64(0.5)], ids=repr)
def test_eps_values(eps):
    # Any positive finite number, whatever its Python or NumPy type, is the eps of the formula.
    x, r, w, b = make_inputs((4, 16), "float64", seed=4)
    args = tuple(jnp.asarray(a) for a in (x, w, b, r))
    assert_close("y", layernorm(*args[:3], eps=eps), reference.layernorm(*args[:3], float(eps)), "float64")
    grads = jax.grad(lambda *a: jnp.sum(layernorm(*a[:3], eps=eps) * a[3]), argnums=ARGNUMS)(*args)
    want = jax.grad(lambda *a: jnp.sum(reference.layernorm(*a[:3], float(eps)) * a[3]), argnums=ARGNUMS)(*args)
    for name, got, ref in zip(("dx", "dweight", "dbias"), grads, want):
        assert_close(name, got, ref, "float64")
