"""Hostile inputs and numerical edge cases, on the CPU and, when present, the GPU.

Every case runs the default kernel and kernels 10-12 through `layernorm_bwd` (the GPU kernels
differ; on the CPU every id runs the C++ reference) and checks the stated behaviour against a
float64 two-pass reference computed from the same (rounded) inputs.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lnbwd
from conftest import (F32_STAT_ELEMENT_RTOL, PLATFORMS, RTOL, XLA_OFFSET_RSTD_RTOL, assert_close, f64, np_dtype, put,
                      reference_bwd, reference_stats)

KERNEL_IDS = [None, 10, 11, 12]


def run_bwd(platform, dy, x, w, mean, rstd, kernel=None):
    args = put(platform, dy, x, w, mean, rstd)
    out = jax.jit(lambda *a: jax_lnbwd.layernorm_bwd(*a, kernel=kernel))(*args)
    return tuple(np.asarray(o) for o in out)


def rng_inputs(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    t = np_dtype(dtype)
    C = shape[-1]
    return (rng.standard_normal(shape).astype(t), rng.standard_normal(shape).astype(t),
            (1 + 0.1 * rng.standard_normal(C)).astype(t))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero_rows_give_exact_zero_sums(platform, kernel, dtype):
    x, dy, w = rng_inputs((0, 24), dtype)
    mean = rstd = np.zeros((0,), np.float32)
    dx, dw, db = run_bwd(platform, dy, x, w, mean, rstd, kernel)
    assert dx.shape == (0, 24)
    assert np.all(f64(dw) == 0) and np.all(f64(db) == 0)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_c_equal_one(platform, kernel, dtype):
    """One column: xhat = 0, so dx = 0 and dweight = 0 exactly, and dbias = sum of dy."""
    x, dy, w = rng_inputs((37, 1), dtype)
    mean, rstd = reference_stats(x)
    dx, dw, db = run_bwd(platform, dy, x, w, mean, rstd, kernel)
    assert np.all(f64(dx) == 0)
    assert np.all(f64(dw) == 0)
    assert_close("dbias", db, f64(dy).sum(axis=0), dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_constant_rows_are_finite(platform, kernel):
    """Constant rows: variance 0, rstd = 1/sqrt(eps), xhat = 0; everything stays finite."""
    x = np.full((9, 64), 3.25, np.float32)
    _, dy, w = rng_inputs((9, 64), "float32")
    mean, rstd = reference_stats(x)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(1e-5), rtol=F32_STAT_ELEMENT_RTOL)
    out = run_bwd(platform, dy, x, w, mean, rstd, kernel)
    for got, want, name in zip(out, reference_bwd(dy, x, w, mean, rstd), ("dx", "dweight", "dbias")):
        assert np.all(np.isfinite(f64(got))), name
        assert_close(name, got, want, "float32")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
@pytest.mark.parametrize("dtype,offset,noise", [("float32", 1e4, 0.1), ("bfloat16", 3e4, 1.0)])
def test_large_offsets_do_not_cancel(platform, kernel, dtype, offset, noise):
    """x = offset + small noise: the forward and the kernels center x before squaring, so the
    result matches a float64 two-pass reference (E[x^2] - E[x]^2 would lose every digit)."""
    rng = np.random.default_rng(1)
    x = (offset + noise * rng.standard_normal((33, 768))).astype(np_dtype(dtype))
    dy = rng.standard_normal((33, 768)).astype(np_dtype(dtype))
    w = (1 + 0.1 * rng.standard_normal(768)).astype(np_dtype(dtype))
    xf = jax.device_put(jnp.asarray(x), jax.devices("cpu")[0])
    _, mean, rstd = jax.jit(jax_lnbwd.layernorm_fwd)(xf, jnp.asarray(w), jnp.asarray(w))
    mean, rstd = np.asarray(mean), np.asarray(rstd)
    # The forward's float32 statistics equal the float64 two-pass ones to float32 rounding
    # (E[x^2] - E[x]^2 in float32 would get the variance wrong by orders of magnitude here).
    x64 = f64(x)
    m64 = x64.mean(axis=1)
    r64 = 1 / np.sqrt(((x64 - m64[:, None]) ** 2).mean(axis=1) + 1e-5)
    # The tolerances allow for XLA's float32 sum order, which differs between jaxlib versions
    # (see XLA_OFFSET_RSTD_RTOL): the mean's error, small itself, is squared into the variance.
    np.testing.assert_allclose(mean, m64, rtol=F32_STAT_ELEMENT_RTOL)
    np.testing.assert_allclose(rstd, r64, rtol=XLA_OFFSET_RSTD_RTOL)
    # The kernels, given those statistics, match float64 math on the same inputs: they center
    # x too, so nothing cancels.
    out = run_bwd(platform, dy, x, w, mean, rstd, kernel)
    for got, ref, name in zip(out, reference_bwd(dy, x, w, mean, rstd), ("dx", "dweight", "dbias")):
        assert_close(name, got, ref, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_float16_large_magnitudes_accumulate_in_float32(platform, kernel):
    """Row sums of 4096 values near 30 reach 1.2e5, past float16's 65504: they must be
    accumulated in float32, and the (small) results come out finite and right."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 4096)).astype(np.float16)
    dy = (30 + rng.standard_normal((16, 4096))).astype(np.float16)
    w = np.ones(4096, np.float16)
    mean, rstd = reference_stats(x)
    out = run_bwd(platform, dy, x, w, mean, rstd, kernel)
    for got, want, name in zip(out, reference_bwd(dy, x, w, mean, rstd), ("dx", "dweight", "dbias")):
        assert np.all(np.isfinite(f64(got))), name
        assert_close(name, got, want, "float16")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
@pytest.mark.parametrize("where", ["x", "dy"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_value_stays_in_its_row(platform, kernel, where, bad):
    x, dy, w = rng_inputs((12, 200), "float32", seed=3)
    mean, rstd = reference_stats(x)
    (x if where == "x" else dy)[5, 17] = bad
    if where == "x":
        mean, rstd = reference_stats(x)   # the forward would have produced NaN stats for row 5
    dx, dw, db = run_bwd(platform, dy, x, w, mean, rstd, kernel)
    assert not np.all(np.isfinite(dx[5])), "the bad row's dx must be non-finite"
    others = np.delete(np.arange(12), 5)
    assert np.all(np.isfinite(dx[others]))
    good = reference_bwd(dy[others], x[others], w, mean[others], rstd[others])
    assert_close("dx of the other rows", dx[others], good[0], "float32")
    # dweight = sum dy * xhat and dbias = sum dy: the bad value reaches them as the math says.
    assert not np.all(np.isfinite(dw))
    if where == "dy":
        assert not np.isfinite(db[17]) and np.all(np.isfinite(np.delete(db, 17)))
    else:
        assert np.all(np.isfinite(db))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("eps", [1e-12, 1e-6, 1e-2, 0.5])
def test_eps_values(platform, eps):
    x, dy, w = rng_inputs((8, 96), "float64")
    b = w[::-1].copy()
    xs, ws, bs, r = put(platform, x, w, b, dy)
    f = lambda x, w, b: jnp.sum(jax_lnbwd.layernorm(x, w, b, eps=eps) * r)
    g = lambda x, w, b: jnp.sum(jax_lnbwd.reference.layernorm(x, w, b, eps) * r)
    for got, want in zip(jax.grad(f, (0, 1, 2))(xs, ws, bs), jax.grad(g, (0, 1, 2))(xs, ws, bs)):
        assert_close("grad", got, want, "float64")


def assert_close_scaled(name, got, want, dy, w, rstd, dtype):
    """Relative error against the size of the terms dx is made of (|dy * w| * rstd): for C = 2
    dx is zero up to rounding (each xhat is +-1), so relative to itself it is all noise."""
    scale = np.linalg.norm(f64(dy) * f64(w)) * float(np.max(rstd)) if name.startswith("dx") else np.linalg.norm(f64(want))
    err = np.linalg.norm(f64(got) - f64(want)) / max(scale, 1e-300)
    assert err <= RTOL[dtype], f"{name}: {err:.2e} ({dtype}, {np.shape(got)})"


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("C", list(range(1, 41)) + [1601, 4099])
def test_misaligned_widths(platform, C):
    """Every C from 1 to 40 (most rows start off a 16-byte boundary). On the GPU for rows 1, 7
    and 9 (the grid's edge cases) in bf16 and f32; the CPU's C++ reference has no grid, so it
    checks rows = 7 in f32 only (keeping CI quick)."""
    cases = [(7, "float32")] if platform == "cpu" else [(r, d) for r in (1, 7, 9) for d in ("bfloat16", "float32")]
    for rows, dtype in cases:
        x, dy, w = rng_inputs((rows, C), dtype, seed=C)
        mean, rstd = reference_stats(x)
        out = run_bwd(platform, dy, x, w, mean, rstd)
        for got, want, name in zip(out, reference_bwd(dy, x, w, mean, rstd), ("dx", "dweight", "dbias")):
            assert_close_scaled(f"{name} rows={rows}", got, want, dy, w, rstd, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 4225])
def test_row_counts(platform, rows):
    x, dy, w = rng_inputs((rows, 1601), "float32", seed=rows)
    mean, rstd = reference_stats(x)
    out = run_bwd(platform, dy, x, w, mean, rstd)
    for got, want, name in zip(out, reference_bwd(dy, x, w, mean, rstd), ("dx", "dweight", "dbias")):
        assert_close(name, got, want, "float32")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", [k for k, info in jax_lnbwd.KERNELS.items() if info.deterministic])
def test_repeats_into_reused_buffers_are_bit_identical(platform, kernel):
    """Calls whose outputs land in buffers XLA reuses (full of the previous call's values)."""
    info = jax_lnbwd.KERNELS[kernel]
    dtype = "float32" if "float32" in info.dtypes else info.dtypes[0]
    C = 1024 if info.refuse(1024, dtype, info.default_block_size) is None else 2048
    x, dy, w = rng_inputs((333, C), dtype, seed=4)
    mean, rstd = reference_stats(x)
    args = put(platform, dy, x, w, mean, rstd)
    f = jax.jit(lambda *a: jax_lnbwd.layernorm_bwd(*a, kernel=kernel))
    first = [np.asarray(o).tobytes() for o in f(*args)]
    for _ in range(3):
        assert [np.asarray(o).tobytes() for o in f(*args)] == first


@pytest.mark.gpu
@pytest.mark.parametrize("platform", [pytest.param("gpu", marks=pytest.mark.gpu)])
def test_more_than_2_pow_31_elements(platform):
    """A bf16 tensor of 2^31 + 4096 elements (about 4.3 GB): row offsets are 64-bit. Checks
    the first and last rows against the reference."""
    rows, C = 2 ** 21 + 4, 1024
    key = jax.random.key(0)
    dev = jax.devices(platform)[0]
    x = jax.device_put(jax.random.normal(key, (rows, C), jnp.bfloat16), dev)
    dy = jax.device_put(jax.random.normal(jax.random.key(1), (rows, C), jnp.bfloat16), dev)
    w = jnp.ones((C,), jnp.bfloat16)
    _, mean, rstd = jax.jit(jax_lnbwd.layernorm_fwd)(x, w, w)
    dx, dw, db = jax.jit(jax_lnbwd.layernorm_bwd)(dy, x, w, mean, rstd)
    for sl in (slice(0, 2), slice(rows - 2, rows)):
        want = reference_bwd(np.asarray(dy[sl]), np.asarray(x[sl]), np.asarray(w), np.asarray(mean[sl]),
                             np.asarray(rstd[sl]))
        assert_close("dx", np.asarray(dx[sl]), want[0], "bfloat16")
    ref_db = jnp.sum(dy.astype(jnp.float32), axis=0)
    assert_close("dbias", np.asarray(db), np.asarray(ref_db), "bfloat16")
