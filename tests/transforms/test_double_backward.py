"""Second-order derivatives: the backward op is itself differentiable.

layernorm's reverse mode calls our FFI op (the transpose of its tangent map, see
jax_lnbwd/tangent.py); that op is a custom_jvp whose tangents are the JVP of the same math in
jnp (jax_lnbwd/ops/backward.py). So grad of grad works (reverse over reverse), and so does jax.jvp
of jax.grad (forward over reverse, the usual Hessian-vector product), alone and combined with
vmap in either order. Everything in float64 against JAX's own derivatives of the pure-jnp
reference. (Forward mode of layernorm itself, and forward over forward: test_forward_mode.py.)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from conftest import PLATFORMS, RTOL2, assert_close, device, f64, make_inputs, put, reference_stats
from jax_lnbwd import layernorm, layernorm_bwd, reference

F64 = "float64"

# Which of weight and bias are given (None: absent).
PARAMS = {"weight-bias": (True, True), "weight": (True, False), "bias": (False, True), "none": (False, False)}


def _inputs(shape, seed):
    x, r, w, b = make_inputs(shape, F64, seed=seed)
    return x, w, b, r


def _loss(fn, x, w, b, r):
    """A scalar that depends nonlinearly on fn's output, so its Hessian is not just fn's."""
    return jnp.sum(jnp.sin(fn(x, w, b)) * r)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("params", list(PARAMS))
def test_check_grads_second_order(platform, params):
    x, w, b, _ = _inputs((2, 3, 4), seed=1)
    use_w, use_b = PARAMS[params]
    fn = jax.jit(lambda x, w, b: layernorm(x, w if use_w else None, b if use_b else None))
    with jax.default_device(device(platform)):
        check_grads(fn, put(platform, x, w, b), order=2)  # default modes: forward and reverse


@pytest.mark.parametrize("platform", PLATFORMS)
def test_layernorm_bwd_derivatives(platform):
    # The raw op is a custom_jvp: forward and reverse mode, in all five arguments. (Its
    # derivative is jnp, whose own derivatives JAX provides: order 1 tests what is ours.)
    x, w, _, dy = _inputs((4, 6), seed=2)
    mean, rstd = reference_stats(x)
    with jax.default_device(device(platform)):
        check_grads(jax.jit(layernorm_bwd), put(platform, dy, x, w, mean, rstd), order=1, modes=("fwd", "rev"))


def _hvps(fn, args, v):
    """H·v of _loss(fn) w.r.t. (x, w, b), forward over reverse and reverse over reverse."""
    grad = jax.grad(functools.partial(_loss, fn), argnums=(0, 1, 2))
    fwd_rev = jax.jvp(lambda *p: grad(*p, args[3]), tuple(args[:3]), tuple(v))[1]
    rev_rev = jax.grad(lambda *p: sum(jnp.vdot(g, t) for g, t in zip(grad(*p, args[3]), v)),
                       argnums=(0, 1, 2))(*args[:3])
    return fwd_rev, rev_rev


hvps_ours = jax.jit(functools.partial(_hvps, layernorm))
hvps_ref = jax.jit(functools.partial(_hvps, reference.layernorm))


def on_cpu(*arrays):
    return tuple(jax.device_put(f64(a), device("cpu")) for a in arrays)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_hessian_vector_product(platform):
    args = _inputs((5, 12), seed=3)
    v = _inputs((5, 12), seed=4)[:3]
    fwd_rev, rev_rev = hvps_ours(put(platform, *args), put(platform, *v))
    want, _ = hvps_ref(on_cpu(*args), on_cpu(*v))
    for name, got_f, got_r, ref in zip(("x", "weight", "bias"), fwd_rev, rev_rev, want):
        assert_close(f"jvp(grad) {name}", got_f, ref, F64, RTOL2[F64])
        assert_close(f"grad(grad) {name}", got_r, ref, F64, RTOL2[F64])


@pytest.mark.parametrize("platform", PLATFORMS)
def test_vmap_of_hessian_vector_product(platform):
    # Per-example HVPs (weight and bias shared) against a loop over the examples.
    x, w, b, r = (np.stack(a) for a in zip(*[_inputs((4, 8), seed=10 + i) for i in range(3)]))
    w, b = w[0], b[0]
    vx, vw, vb = (np.stack(a) for a in zip(*[_inputs((4, 8), seed=20 + i)[:3] for i in range(3)]))
    axes = ((0, None, None, 0), (0, 0, 0))
    got = jax.jit(jax.vmap(functools.partial(_hvps, layernorm), in_axes=axes))(
        put(platform, x, w, b, r), put(platform, vx, vw, vb))
    for i in range(3):
        want, _ = hvps_ref(on_cpu(x[i], w, b, r[i]), on_cpu(vx[i], vw[i], vb[i]))
        for mode, hv in zip(("jvp(grad)", "grad(grad)"), got):
            for name, g, ref in zip(("x", "weight", "bias"), hv, want):
                assert_close(f"example {i} {mode} {name}", g[i], ref, F64, RTOL2[F64])


@pytest.mark.parametrize("platform", PLATFORMS)
def test_grad_of_vmap_of_grad(platform):
    # A gradient penalty: the parameters' gradient of Σ_i |∂loss_i/∂x_i|² over a batch.
    x, w, b, r = (np.stack(a) for a in zip(*[_inputs((4, 8), seed=30 + i) for i in range(3)]))
    w, b = w[0], b[0]

    def penalty(fn, w, b, x, r):
        dx = jax.vmap(jax.grad(functools.partial(_loss, fn)), in_axes=(0, None, None, 0))(x, w, b, r)
        return jnp.sum(dx ** 2)

    got = jax.jit(jax.grad(functools.partial(penalty, layernorm), argnums=(0, 1)))(*put(platform, w, b, x, r))
    want = jax.jit(jax.grad(functools.partial(penalty, reference.layernorm), argnums=(0, 1)))(*on_cpu(w, b, x, r))
    for name, g, ref in zip(("weight", "bias"), got, want):
        assert_close(name, g, ref, F64, RTOL2[F64])
