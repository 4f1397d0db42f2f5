"""rmsnorm and add_rmsnorm under every transformation we claim: vmap with per-example dweight
(one FFI call), forward mode and second order (check_grads fwd+rev, orders 1 and 2), scan,
checkpoint, sharded jit (Shardy and GSPMD: rows stay sharded, one all-reduce of dweight) and
shard_map. The layout and rules are layernorm's, parametrized by the norm (jax_lnbwd/norms.py)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jax_lnbwd
from conftest import HAS_GPU, PLATFORMS, assert_close, f64, make_inputs, put
from jax_lnbwd import add_rmsnorm, reference, rmsnorm

BWD_CALL = f"@{jax_lnbwd.TARGET_RMS_BWD}("


def loss(x, w):
    return jnp.sum(rmsnorm(x, w, offset=0.25) ** 2)


def ref_loss(x, w):
    return jnp.sum(reference.rmsnorm(x, w, 1e-6, 0.25) ** 2)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_vmap_per_example_weight_is_one_call(platform):
    x, _, _, _ = make_inputs((3, 5, 40), "float32", seed=1)
    ws = 1 + 0.1 * np.random.default_rng(2).standard_normal((3, 40)).astype(np.float32)
    f = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))
    args = put(platform, x, ws)
    assert f.lower(*args).as_text().count(BWD_CALL) == 1
    got = f(*args)
    for b in range(3):
        want = jax.grad(ref_loss, argnums=(0, 1))(jnp.asarray(f64(x[b])), jnp.asarray(f64(ws[b])))
        assert_close(f"dx[{b}]", got[0][b], want[0], "float32")
        assert_close(f"dweight[{b}]", got[1][b], want[1], "float32")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_grad_of_vmap_shared_weight(platform):
    x, _, w, _ = make_inputs((4, 6, 32), "float32", seed=3)
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(jax.vmap(lambda x: rmsnorm(x, w, offset=0.25))(x) ** 2),
                         argnums=(0, 1)))
    got = f(*put(platform, x, w))
    want = jax.grad(ref_loss, argnums=(0, 1))(jnp.asarray(f64(x)), jnp.asarray(f64(w)))
    assert_close("dx", got[0], want[0], "float32")
    assert_close("dweight", got[1], want[1], "float32")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("fn", ["rmsnorm", "add_rmsnorm"])
def test_check_grads_orders_1_and_2(platform, fn):
    """JAX's numerical check in float64, forward and reverse mode, orders 1 and 2."""
    x, dy, w, b = make_inputs((3, 7), "float64", seed=4)
    if fn == "rmsnorm":
        f = lambda x, w: jnp.sum(rmsnorm(x, w, offset=0.5) * dy)  # noqa: E731
        args = put(platform, x, w)
    else:
        f = lambda x, r, w, xb: jnp.sum(add_rmsnorm(x, r, w, x_bias=xb)[0] * dy)  # noqa: E731
        args = put(platform, x, dy, w, b)
    check_grads(f, args, order=2, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_jvp_linearize_hessian(platform):
    x, dy, w, _ = make_inputs((4, 16), "float64", seed=5)
    xs, ws, ts = put(platform, x, w, dy)
    y, t = jax.jit(lambda x, w, t: jax.jvp(lambda x: rmsnorm(x, w), (x,), (t,)))(xs, ws, ts)
    _, t_ref = jax.jvp(lambda x: reference.rmsnorm(x, jnp.asarray(w)), (jnp.asarray(x),), (jnp.asarray(dy),))
    assert_close("jvp", t, t_ref, "float64")
    _, lin = jax.linearize(lambda x: rmsnorm(x, ws), xs)
    assert_close("linearize", lin(ts), t_ref, "float64")
    h = jax.jit(jax.hessian(lambda w: jnp.sum(rmsnorm(xs, w) ** 3)))(ws)
    h_ref = jax.hessian(lambda w: jnp.sum(reference.rmsnorm(jnp.asarray(x), w) ** 3))(jnp.asarray(w))
    assert_close("hessian", h, h_ref, "float64")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_scan_and_checkpoint(platform):
    x, _, _, _ = make_inputs((8, 64), "float32", seed=6)
    ws = (1 + 0.1 * np.random.default_rng(7).standard_normal((3, 64))).astype(np.float32)

    def deep(norm, x, ws):
        def layer(h, w):
            y, h = jax.checkpoint(lambda h, w: norm(jnp.tanh(h), h, w))(h, w)
            return h + y, None
        return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

    ours = jax.jit(jax.grad(lambda x, ws: deep(add_rmsnorm, x, ws), argnums=(0, 1)))(*put(platform, x, ws))

    def ref_add(x, r, w):
        s = x + r
        return reference.rmsnorm(s, w), s

    want = jax.grad(lambda x, ws: deep(ref_add, x, ws), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(ws))
    assert_close("dx", ours[0], want[0], "float32", 1e-4)
    assert_close("dweights", ours[1], want[1], "float32", 1e-4)


COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
@pytest.mark.parametrize("fn", ["rmsnorm", "add_rmsnorm"])
def test_sharded_jit_one_psum_no_gather(shardy, fn):
    """Rows over 8 CPU devices (2-D mesh): equal to one device's, dx keeps x's sharding, and the
    compiled program moves nothing row-sized: one all-reduce of f32[1, C] (dweight alone)."""
    devices = jax.devices("cpu")[:8]
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    x, dy, w, _ = make_inputs((8, 16, 128), "float32", seed=8)
    if fn == "rmsnorm":
        f = jax.grad(lambda x, r, w: jnp.sum(rmsnorm(x, w) * r), argnums=(0, 2))
    else:
        f = jax.grad(lambda x, r, w: jnp.sum(add_rmsnorm(x, r, w)[0] * r), argnums=(0, 2))
    want = jax.jit(f)(*(jax.device_put(a, devices[0]) for a in (x, dy, w)))
    rows, rep = NamedSharding(mesh, P("a", "b")), NamedSharding(mesh, P())
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        jitted = jax.jit(f, in_shardings=(rows, rows, rep))
        got = jitted(x, dy, w)
        text = jitted.lower(x, dy, w).compile().as_text()
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    ops = [line.strip() for line in text.splitlines() if COLLECTIVE.search(line)]
    assert [op for op in ops if "all-reduce" not in op] == [], "\n".join(ops)
    reduces = [op for op in ops if "all-reduce" in op]
    assert len(reduces) == 1 and "f32[1,128]" in reduces[0], "\n".join(reduces)
    assert got[0].sharding.is_equivalent_to(rows, 3)
    assert_close("dx", got[0], want[0], "float32")
    assert_close("dweight", got[1], want[1], "float32")


def test_shard_map_local_rows():
    """Inside shard_map over all axes: the plain FFI call on each device's rows; the replicated
    weight's gradient is summed over the shards (psum), as for jnp code."""
    devices = jax.devices("cpu")[:4]
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    x, dy, w, _ = make_inputs((8, 32), "float32", seed=9)
    f = jax.shard_map(jax.grad(lambda x, w: jnp.sum(rmsnorm(x, w) ** 2), argnums=(0, 1)), mesh=mesh,
                      in_specs=(P("d"), P()), out_specs=(P("d"), P()))
    got = jax.jit(f)(x, w)
    want = jax.grad(lambda x, w: jnp.sum(reference.rmsnorm(x, w) ** 2), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    assert_close("dx", got[0], want[0], "float32")
    assert_close("dweight", got[1], want[1], "float32")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_bit_identical_runs():
    x, dy, w, _ = make_inputs((4096, 1024), "bfloat16", seed=10)
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(rmsnorm(x, w).astype(jnp.float32) * dy), argnums=(0, 1)))
    args = put("gpu", x, w.astype(np.float32))
    first = [np.asarray(a) for a in f(*args)]
    for _ in range(3):
        for a, b in zip(first, f(*args)):
            np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", [11, 12])
def test_nested_vmap_add_rmsnorm_per_example(platform, kernel):
    """vmap of vmap of add_rmsnorm's gradient with per-example weights, on kernels 11 and 12: one
    backward call, each example's dweight its own sum, x and residual getting the same ds."""
    rng = np.random.default_rng(11)
    x, r = (rng.standard_normal((2, 3, 4, 24)).astype(np.float32) for _ in range(2))
    ws = (1 + 0.1 * rng.standard_normal((2, 3, 24))).astype(np.float32)

    def g(x, r, w):
        return jax.grad(lambda x, r, w: jnp.sum(add_rmsnorm(x, r, w, kernel=kernel)[0] ** 2), argnums=(0, 1, 2))(x, r, w)

    f = jax.jit(jax.vmap(jax.vmap(g)))
    args = put(platform, x, r, ws)
    assert f.lower(*args).as_text().count(BWD_CALL) == 1
    got = f(*args)

    def ref(x, r, w):
        return jnp.sum(reference.rmsnorm(x + r, w) ** 2)

    for i in range(2):
        for j in range(3):
            want = jax.grad(ref, argnums=(0, 1, 2))(*(jnp.asarray(f64(a[i, j])) for a in (x, r, ws)))
            for name, a, b in zip(("dx", "dresidual", "dweight"), got, want):
                assert_close(f"{name}[{i},{j}]", a[i, j], b, "float32")
