"""vmap of layernorm's gradients, and of layernorm_bwd, against a Python loop over the batch.

Under vmap the backward folds the batch into the rows of ONE FFI call whose rows form one
segment per example, so dweight/dbias come out per example, shape (batch, C): vmap(grad(f))
is a batch of independent gradients, never their sum. grad(vmap(f)) sums them (JAX adds up
the per-example cotangents of a weight shared by the batch). Each case is checked against the
same function applied example by example in a Python loop, in float64 through the pure-jnp
reference (float32 runs of ours against it within RTOL).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PLATFORMS, assert_close, device, f64, make_inputs, put, reference_stats
from jax_lnbwd import TARGET, layernorm, layernorm_bwd, reference

ARGNUMS = (0, 1, 2)


def _loss(fn, x, w, b, r):
    return jnp.sum(fn(x, w, b) * r)


def _grads(fn):
    """(x, w, b, r) -> (dx, dweight, dbias) of sum(fn(x, w, b) * r)."""
    return jax.grad(functools.partial(_loss, fn), argnums=ARGNUMS)


def loop(fn, in_axes):
    """vmap's meaning, spelled out: fn on each example (slices along in_axes), stacked on axis 0."""
    def looped(*args):
        size = next(np.shape(a)[ax] for a, ax in zip(args, in_axes) if ax is not None)
        outs = [fn(*(a if ax is None else np.take(a, i, axis=ax) for a, ax in zip(args, in_axes)))
                for i in range(size)]
        return jax.tree.map(lambda *o: np.stack(o), *outs)
    return looped


def on_cpu_f64(fn):
    """fn on float64 copies of numpy arguments, on the CPU: the reference side of a comparison."""
    return lambda *args: fn(*(jax.device_put(f64(a), device("cpu")) for a in args))


def assert_all_close(got, want, dtype="float32"):
    for name, g, w in zip(("dx", "dweight", "dbias"), got, want):
        assert np.shape(g) == np.shape(w), f"{name}: shape {np.shape(g)} vs {np.shape(w)}"
        assert_close(name, g, w, dtype)


def _batch(shape, batch: int, seed: int, dtype="float32"):
    """x, r of shape (batch, *shape) and w, b of shape (batch, C): independent problems."""
    parts = [make_inputs(shape, dtype, seed=seed + i) for i in range(batch)]
    x, r, w, b = (np.stack(a) for a in zip(*parts))
    return x, w, b, r


# (in_axes of x, w, b, r; how to lay out the batched arrays): the batch axis of x and r at
# 0, 1 or -2 (a negative axis), weight/bias shared (None) or per example.
CASES = {
    "x-batched-params-shared": (0, None, None, 0),
    "all-batched": (0, 0, 0, 0),
    "params-batched-x-shared": (None, 0, 0, None),
    "only-weight-batched": (0, 0, None, 0),
    "x-axis1": (1, None, None, 1),
    "x-axis-2-params-axis-1": (-2, -1, None, -2),
}


def _lay_out(x, w, b, r, in_axes):
    """Move the batch axis (0 in _batch's arrays) to in_axes; drop it for unbatched ones."""
    return tuple(a[0] if ax is None else np.moveaxis(a, 0, ax) for a, ax in zip((x, w, b, r), in_axes))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", list(CASES))
def test_vmap_of_grad_is_per_example(platform, case):
    in_axes = CASES[case]
    args = _lay_out(*_batch((5, 24), 3, seed=20), in_axes)
    got = jax.jit(jax.vmap(_grads(layernorm), in_axes=in_axes))(*put(platform, *args))
    want = loop(on_cpu_f64(_grads(reference.layernorm)), in_axes)(*args)
    assert got[1].shape == (3, 24)  # per example, never summed over the batch
    assert_all_close(got, want)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_vmap_of_grad_rank3_examples_float64(platform):
    # Each example has two leading axes (all folded into rows) and its own weight; float64.
    x, w, b, r = _batch((2, 3, 16), 4, seed=30, dtype="float64")
    got = jax.jit(jax.vmap(_grads(layernorm)))(*put(platform, x, w, b, r))
    want = loop(on_cpu_f64(_grads(reference.layernorm)), (0, 0, 0, 0))(x, w, b, r)
    assert_all_close(got, want, "float64")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_nested_vmap_of_grad(platform):
    # Outer batch of 2 with its own weight, inner batch of 3 sharing it, bias shared by all.
    x, w, b, r = _batch((4, 16), 6, seed=40)
    x, r = x.reshape(2, 3, 4, 16), r.reshape(2, 3, 4, 16)
    w = w[::3]
    inner, outer = (0, None, None, 0), (0, 0, None, 0)
    got = jax.jit(jax.vmap(jax.vmap(_grads(layernorm), in_axes=inner), in_axes=outer))(*put(platform, x, w, b[0], r))
    want = loop(loop(on_cpu_f64(_grads(reference.layernorm)), inner), outer)(x, w, b[0], r)
    assert got[1].shape == got[2].shape == (2, 3, 16)
    assert_all_close(got, want)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vmap_of_grad_more_examples_than_resident_blocks(platform, dtype):
    # 1500 examples: one segment each, so the GPU grid has at least 1500 blocks, more than fit on
    # the GPU at once (at most 2048 threads of 132 SMs on an H200): later blocks start as earlier
    # ones finish, and finalize_partials sums each segment's slots (launch_with_partials,
    # ffi/kernels/backward/launch.cuh).
    x, w, b, r = _batch((2, 64), 1500, seed=45, dtype=dtype)
    got = jax.jit(jax.vmap(_grads(layernorm)))(*put(platform, x, w, b, r))
    want = on_cpu_f64(jax.vmap(_grads(reference.layernorm)))(x, w, b, r)
    assert got[1].shape == (1500, 64)
    assert_all_close(got, want, dtype)
    for name, g, w in zip(("dweight", "dbias"), got[1:], want[1:]):  # every example, not the norm of all
        for i in (0, 749, 1499):
            assert_close(f"{name}[{i}]", g[i], w[i], dtype)


@pytest.mark.gpu
@pytest.mark.slow
def test_vmap_of_grad_over_100000_examples(platform="gpu"):
    # 100,000 segments: more than a grid's y dimension allows (65,535), so the finalize kernel's
    # grid is one-dimensional over (segment, tile) (ffi/kernels/backward/partials_finalize.cu).
    # GPU only: the CPU handler loops over segments and has no such limit.
    n, rows, C = 100_000, 2, 64
    rng = np.random.default_rng(46)
    x, r = rng.standard_normal((n, rows, C)), rng.standard_normal((n, rows, C))
    w, b = 1 + 0.1 * rng.standard_normal(C), rng.standard_normal(C)
    x, r, w, b = (a.astype(np.float32) for a in (x, r, w, b))
    in_axes = (0, None, None, 0)
    got = jax.jit(jax.vmap(_grads(layernorm), in_axes=in_axes))(*put(platform, x, w, b, r))
    want = on_cpu_f64(jax.vmap(_grads(reference.layernorm), in_axes=in_axes))(x, w, b, r)
    assert got[1].shape == got[2].shape == (n, C)
    assert_all_close(got, want)
    for name, g, wt in zip(("dweight", "dbias"), got[1:], want[1:]):  # every example, not the norm of all
        for i in (0, 65_535, 65_536, n - 1):
            assert_close(f"{name}[{i}]", g[i], wt[i], "float32")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_vmap_of_grad_split_rows_more_examples_than_resident_clusters(platform):
    # bf16 rows of 4096 columns: on Hopper kernel 12 splits each row over a cluster of two blocks
    # that share one partial slot. 150 examples, one cluster each at the least, are more than the
    # 66 clusters an H200 holds at once: a plain cluster launch, then finalize_partials over one
    # slot per cluster.
    x, w, b, r = _batch((2, 4096), 150, seed=46, dtype="bfloat16")
    got = jax.jit(jax.vmap(_grads(layernorm)))(*put(platform, x, w, b, r))
    want = on_cpu_f64(jax.vmap(_grads(reference.layernorm)))(x, w, b, r)
    assert got[1].shape == (150, 4096)
    assert_all_close(got, want, "bfloat16")
    for name, g, w in zip(("dweight", "dbias"), got[1:], want[1:]):
        for i in (0, 75, 149):
            assert_close(f"{name}[{i}]", g[i], w[i], "bfloat16")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_grad_of_vmap_sums_over_the_batch(platform):
    # A weight shared by the batch gets the sum of the per-example gradients.
    x, w, b, r = _batch((5, 24), 3, seed=50)
    w, b = w[0], b[0]

    def batch_loss(fn, x, w, b, r):
        return jnp.sum(jax.vmap(fn, in_axes=(0, None, None))(x, w, b) * r)

    got = jax.jit(jax.grad(functools.partial(batch_loss, layernorm), argnums=ARGNUMS))(*put(platform, x, w, b, r))
    per_example = loop(on_cpu_f64(_grads(reference.layernorm)), (0, None, None, 0))(x, w, b, r)
    want = (per_example[0], per_example[1].sum(0), per_example[2].sum(0))
    assert got[1].shape == (24,)
    assert_all_close(got, want)


# --- the raw layernorm_bwd under vmap ------------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("in_axes", [(0, 0, 0, 0, 0), (0, 0, None, 0, 0), (0, None, None, None, None),
                                     (None, 0, 0, 0, 0), (1, 1, 0, 1, 1)],
                         ids=["all", "weight-shared", "only-dy", "dy-shared", "axis1"])
def test_vmap_of_layernorm_bwd(platform, in_axes):
    # Unbatched arguments (dy alone batched, say) are broadcast to the batch inside the rule.
    x, w, _, dy = _batch((4, 3, 40), 3, seed=60)
    mean, rstd = reference_stats(x)
    args = tuple(a[0] if ax is None else np.moveaxis(a, 0, ax)
                 for a, ax in zip((dy, x, w, mean, rstd), in_axes))
    got = jax.jit(jax.vmap(layernorm_bwd, in_axes=in_axes))(*put(platform, *args))
    want = loop(on_cpu_f64(reference.layernorm_bwd), in_axes)(*args)
    assert_all_close(got, want)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_vmap_over_an_empty_batch(platform):
    x, w, b, r = (a[:0] for a in _batch((5, 8), 1, seed=70))
    dx, dw, db = jax.jit(jax.vmap(_grads(layernorm)))(*put(platform, x, w, b, r))
    assert dx.shape == (0, 5, 8) and dw.shape == db.shape == (0, 8)


# --- one FFI call, not a loop of them --------------------------------------------------------------

def _count_calls(fn, *args):
    """Custom calls of our target and while loops in fn's lowered (StableHLO) and compiled HLO."""
    lowered = jax.jit(fn).lower(*args)
    texts = (lowered.as_text(), lowered.compile().as_text())
    return [t.count(f"@{TARGET}(") + t.count(f'"{TARGET}"') for t in texts], ["while" in t for t in texts]


@pytest.mark.parametrize("program", ["vmap-grad", "vmap-vmap-grad", "grad-vmap", "vmap-bwd"])
def test_vmapped_program_makes_one_call(program):
    x, w, b, r = _batch((5, 24), 6, seed=80)
    grads = _grads(layernorm)
    fn, args = {
        "vmap-grad": (jax.vmap(grads), (x, w, b, r)),
        "vmap-vmap-grad": (jax.vmap(jax.vmap(grads, in_axes=(0, None, None, 0))),
                           (x.reshape(2, 3, 5, 24), w[:2], b[:2], r.reshape(2, 3, 5, 24))),
        "grad-vmap": (jax.grad(lambda x, w, b: jnp.sum(jax.vmap(layernorm, in_axes=(0, None, None))(x, w, b) * r),
                               argnums=ARGNUMS), (x, w[0], b[0])),
        "vmap-bwd": (jax.vmap(layernorm_bwd), (r, x, w, *reference_stats(x))),
    }[program]
    calls, loops = _count_calls(fn, *args)
    assert calls == [1, 1], f"custom calls of {TARGET} (lowered, compiled): {calls}"
    assert loops == [False, False], "a while loop: vmap fell back to one call per example"
    # The one call carries one segment per example: dweight/dbias are (6, 24). Under grad of
    # vmap with a weight shared by the batch only the total is wanted: the batch folds into the
    # rows, one segment of 30 rows.
    call = next(line for line in jax.jit(fn).lower(*args).as_text().splitlines() if f"@{TARGET}(" in line)
    sums = "tensor<1x24xf32>" if program == "grad-vmap" else "tensor<6x24xf32>"
    assert call.count(sums) >= 2, call


# --- kernels that cannot keep per-example sums ---------------------------------------------------

def test_kernel_without_segments_refuses_vmap_at_trace_time():
    # Kernel 10 sums dweight/dbias over all rows: fine without vmap, a clear error under it.
    x, w, b, r = _batch((5, 24), 3, seed=90)
    grads = jax.grad(lambda x, w, b, r: jnp.sum(layernorm(x, w, b, kernel=10) * r), argnums=ARGNUMS)
    jax.eval_shape(grads, x[0], w[0], b[0], r[0])
    with pytest.raises(ValueError, match="^layernorm: kernel 10.*per-example.*kernel 11"):
        jax.eval_shape(jax.vmap(grads), x, w, b, r)
    with pytest.raises(ValueError, match="^layernorm_bwd: kernel 10"):
        jax.eval_shape(jax.vmap(functools.partial(layernorm_bwd, kernel=10)), r, x, w, *reference_stats(x))
    # grad of vmap with the parameters shared by the batch wants only their total: the batch
    # is more rows, and kernel 10 runs (one segment).
    total = jax.grad(lambda x, w, b: jnp.sum(jax.vmap(functools.partial(layernorm, kernel=10), in_axes=(0, None, None))(
        x, w, b) * r), argnums=ARGNUMS)
    want = jax.grad(lambda x, w, b: jnp.sum(jax.vmap(layernorm, in_axes=(0, None, None))(x, w, b) * r),
                    argnums=ARGNUMS)(x, w[0], b[0])
    assert_all_close(jax.jit(total)(x, w[0], b[0]), want)
