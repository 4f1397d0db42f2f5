"""Small rows (C up to a few hundred: per-head QK-norm over head_dim, small models). The CUDA
kernels hold such a row in a group of 4 to 32 threads, several groups to a warp (forward_rows.cu;
kernel 12's ring of row chunks on sm_90, kernel 11's small rows elsewhere and for float64). Values
and gradients of every norm op against the float64 reference on every platform, our forward and
backward forced: the widths that pick each group size and their unaligned neighbours, row counts
that leave some of a warp's groups without a row, 2^24 rows, per-example dweight under vmap, and
bit-identical repeats."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lnbwd
from conftest import PLATFORMS, RTOL, assert_close, f64, make_inputs, np_dtype, put
from jax_lnbwd import reference

# Aligned widths (16 bytes: 8 bf16 or 4 fp32 elements) take groups of 4 to 16 threads; the odd
# ones are their unaligned neighbours (one element per access, groups of whole warps).
WIDTHS = (8, 16, 32, 40, 64, 96, 128, 256, 512, 1, 17, 33, 511, 513)
CASES = ([(C, dtype) for C in WIDTHS for dtype in ("float32", "bfloat16")]
         + [(C, dtype) for C in (64, 128) for dtype in ("float16", "float64")])


def ref64(fn, *arrays, **kw):
    """fn of reference.py on the arrays upcast to float64, on the CPU."""
    cpu = jax.devices("cpu")[0]
    return jax.tree.map(np.asarray, fn(*(None if a is None else jax.device_put(f64(a), cpu) for a in arrays), **kw))


def ours_vjp_traced(norm, x, w, b, dy):
    """y and the gradients of `norm` ("layernorm" or "rmsnorm"), our forward and backward forced."""
    def f(x, w, b):
        return jax_lnbwd.layernorm(x, w, b) if norm == "layernorm" else jax_lnbwd.rmsnorm(x, w)

    with jax_lnbwd.use_ffi_forward(True), jax_lnbwd.use_ffi_backward(True):
        y, vjp = jax.vjp(f, x, jnp.asarray(w), jnp.asarray(b))
        return (y, *vjp(dy))


def ours_vjp(platform, norm, x, w, b, dy):
    """ours_vjp_traced under jit on `platform`, as numpy arrays."""
    fn = jax.jit(lambda *a: ours_vjp_traced(norm, *a))
    return [np.asarray(o) for o in fn(*put(platform, x, w, b, dy))]


def reference_vjp(norm, x, w, b, dy):
    if norm == "layernorm":
        y, mean, rstd = ref64(reference.layernorm_fwd, x, w, b)
        return [y, *ref64(reference.layernorm_bwd, dy, x, w, mean, rstd)]
    y, rstd = ref64(reference.rmsnorm_fwd, x, w)
    return [y, *ref64(reference.rmsnorm_bwd, dy, x, w, rstd), np.zeros_like(f64(b))]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("C,dtype", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("rows", [1, 1001])
def test_values_and_grads(platform, norm, C, dtype, rows):
    x, dy, w, b = make_inputs((rows, C), dtype, seed=C + rows)
    got = ours_vjp(platform, norm, x, w, b, dy)
    want = reference_vjp(norm, x, w, b, dy)
    for name, g, r in zip(("y", "dx", "dweight", "dbias"), got, want):
        if C == 1 and name == "dx":
            # One element a row: x̂ is 0 (layernorm) or nearly ±1 (RMSNorm), and dx is a
            # cancellation of near-equal terms; it is checked against the size of those terms.
            scale = np.abs(f64(dy) * f64(w) / np.abs(f64(x)))
            assert np.all(np.abs(f64(g) - r) <= 1e-2 * scale + 1e-30), name
            continue
        assert g.dtype == np_dtype(dtype), name
        # C = 1: dweight and dbias are sums of ±dy over the rows, which cancel.
        assert_close(name, g, r, dtype, rtol=10 * RTOL[dtype] if C == 1 else None)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_two_to_the_24_rows(platform):
    """2^24 rows of 4 fp32: one 16-byte vector a row, a group of 4 threads, 16.7M rows."""
    x, dy, w, b = make_inputs((1 << 24, 4), "float32", seed=24)
    got = ours_vjp(platform, "rmsnorm", x, w, b, dy)
    want = reference_vjp("rmsnorm", x, w, b, dy)
    for name, g, r in zip(("y", "dx", "dweight"), got, want):
        # dweight sums 2^24 fp32 terms a column: the CPU handler's running sum loses a few
        # more digits than the GPU's per-block partial sums.
        assert_close(name, g, r, "float32", rtol=1e-4 if name == "dweight" else None)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_per_example_dweight_under_vmap(platform, norm):
    """vmap over a batch of 3: each example's dweight is its own (segments of rows)."""
    x, dy, w, b = make_inputs((3, 257, 128), "float32", seed=5)
    got = jax.vmap(lambda x, dy: ours_vjp_traced(norm, x, w, b, dy))(*put(platform, x, dy))
    for e in range(3):
        want = reference_vjp(norm, x[e], w, b, dy[e])
        for name, g, r in zip(("y", "dx", "dweight", "dbias"), got, want):
            assert_close(name, np.asarray(g)[e], r, "float32")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("C", [64, 128, 256])
def test_add_rmsnorm_residual_gradient(platform, C):
    """add_rmsnorm at head_dim widths: s = x + residual, and the residual's gradient is dx."""
    x, dy, w, _ = make_inputs((515, C), "bfloat16", seed=C)
    r, _, _, _ = make_inputs((515, C), "bfloat16", seed=C + 1)

    def f(x, r, w):
        y, s = jax_lnbwd.add_rmsnorm(x, r, w)
        return y.astype(jnp.float32) * f64(dy).astype(np.float32) + 0 * s.astype(jnp.float32)

    with jax_lnbwd.use_ffi_forward(True), jax_lnbwd.use_ffi_backward(True):
        g = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2)))(*put(platform, x, r, w))
    s = (f64(x) + f64(r)).astype(np_dtype("bfloat16"))
    _, rstd = ref64(reference.rmsnorm_fwd, s, w)
    dx64, dw64 = ref64(reference.rmsnorm_bwd, dy, s, w, rstd)
    assert_close("dx", g[0], dx64, "bfloat16")
    assert_close("dresidual", g[1], dx64, "bfloat16")
    assert_close("dweight", g[2], dw64, "bfloat16")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("C", [64, 128, 256])
def test_repeats_are_bit_identical(platform, C):
    x, dy, w, b = make_inputs((20001, C), "bfloat16", seed=C)
    first = ours_vjp(platform, "layernorm", x, w, b, dy)
    for _ in range(2):
        for a, o in zip(first, ours_vjp(platform, "layernorm", x, w, b, dy)):
            assert np.array_equal(a.view(np.uint16), o.view(np.uint16))


def _plans_on_hopper():
    """The nanobind module and JAX's first GPU, where that GPU runs kernel 12 (sm_90 and a build
    with its code: kernel 12 plans 2 KB bf16 rows on its ring); else the test skips."""
    from jax_lnbwd import _jax_lnbwd, kernels

    dev = kernels._cuda_device()
    if dev is None or not hasattr(_jax_lnbwd, "launch_plan"):
        pytest.skip("needs a CUDA build on a GPU")
    if _jax_lnbwd.launch_plan(12, "bfloat16", 32768, 1024, 1, dev)["kernel"] != 12:
        pytest.skip("kernel 12 does not run here (not sm_90, or no sm_90 code)")
    return _jax_lnbwd, dev


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,C,kernel,path", [
    ("bfloat16", 128, 12, "ring of row chunks"),   # a group narrower than a warp: the chunk ring
    ("float32", 128, 12, "ring of row chunks"),
    ("float32", 256, 11, ""),                      # 1 KB rows, a warp at two vectors a thread
    ("bfloat16", 512, 11, ""),
    ("float32", 512, 12, "ring"),                  # more vectors a thread: kernel 12's row ring
    ("bfloat16", 1024, 12, "ring"),
])
def test_backward_pick_by_row_bytes(dtype, C, kernel, path):
    """The backward's default (kernel 12's launcher) by the row's bytes on sm_90: small rows on
    the ring of row chunks, 1 KB rows on kernel 11, wider rows on the ring."""
    module, dev = _plans_on_hopper()
    plan = module.launch_plan(12, dtype, (1 << 25) // (C * np.dtype(np_dtype(dtype)).itemsize), C, 1, dev)
    assert plan["kernel"] == kernel and plan["path"].startswith(path), plan


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D,fused,kernel,path", [
    ("bfloat16", 64, False, 12, "ring of row chunks, a launch a set"),   # rows of at most a warp
    ("bfloat16", 128, False, 12, "ring of row chunks, a launch a set"),
    ("bfloat16", 256, False, 12, "ring of row chunks, a launch a set"),
    ("float32", 64, False, 12, "ring of row chunks, a launch a set"),
    ("float32", 128, False, 12, "ring of row chunks, a launch a set"),
    ("float32", 256, False, 11, "head rows, two sets"),                  # 1 KB rows: kernel 11's sets
    ("bfloat16", 64, True, 11, "head rows, two sets"),                   # the fused projection
    ("float32", 64, True, 11, "head rows, two sets"),
])
def test_qk_backward_pick(dtype, D, fused, kernel, path):
    """QK-norm's backward on sm_90: q and k of their own in rows of at most a warp of vectors run
    on the chunk ring, one launch a set; the rest on kernel 11's sets in one grid."""
    module, dev = _plans_on_hopper()
    plan = module.qk_launch_plan(dtype, 16384 * 32, 16384 * 8, D, dev, fused=fused)
    assert plan["kernel"] == kernel and plan["path"] == path, plan
