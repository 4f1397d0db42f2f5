"""Target v2 (jax_lnbwd_layernorm_bwd_v2), called directly: mixed precision and the residual.

v2 is v1 plus (a) a float32 weight beside bfloat16/float16 x, dy, dx, with dweight/dbias in
float32, and (b) an optional residual gradient `dresidual`, aliased to dx, added to dx inside
the kernel. Every case is checked against reference.layernorm_bwd in float64 (plus dresidual),
with the tolerance of the dtype each output is stored in: dweight/dbias of a mixed call must be
float32-accurate, which a bf16/f16 kernel or a bf16/f16 store could not be. v1 keeps its
signature and results (tests at the end).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lnbwd
from conftest import PLATFORMS, assert_close, f64, np_dtype, put, reference_bwd, reference_stats
from jax_lnbwd import LAYERNORM, TARGET, TARGET_V2
from jax_lnbwd.ops import backward as backward_op

# (x dtype, weight dtype): the four same-dtype calls and the two mixed ones.
COMBOS = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"), ("float64", "float64"),
          ("bfloat16", "float32"), ("float16", "float32")]
COMBO_IDS = [x if x == w else f"{x}-w{w}" for x, w in COMBOS]

# Odd shapes (rows, C) on every platform: C = 1, 3 (misaligned), 1601 (odd), 4096, 30000 (wide).
SHAPES = [(1, 1), (7, 1), (7, 3), (4225, 3), (1, 1601), (7, 1601), (7, 4096), (1, 30000), (7, 30000)]
# And on the GPU the shapes that take kernel 12's other paths and many blocks: whole 16-bit rows
# (1600), split rows (16-bit 4096 and 30000), fp32 wide rows (16384), long sums (4225 rows).
GPU_SHAPES = [(4225, 1601), (4225, 1600), (4225, 4096), (257, 16384), (257, 30000)]


def make(rows, C, dtype, wdtype, seed, segments=1, weight_rows=1):
    """Host arrays (dy, x, weight (weight_rows, C), mean, rstd, dresidual) for one case."""
    rng = np.random.default_rng(seed)
    t = np_dtype(dtype)
    x = rng.standard_normal((rows, C)).astype(t)
    dy = rng.standard_normal((rows, C)).astype(t)
    res = rng.standard_normal((rows, C)).astype(t)
    # A float32 weight with bits below bf16's: rounding it would show in dweight-independent dx.
    w = (1.0 + 0.1 * rng.standard_normal((weight_rows, C))).astype(np_dtype(wdtype))
    mean, rstd = reference_stats(x)
    return dy, x, w, mean, rstd, res


def v2_call(platform, dy, x, w, mean, rstd, dres=None, *, segments=1, kernel=12, alias=True):
    """Run target v2 through backward_op.ffi_call with dresidual aliased to dx, in place
    (alias=True), or a bare ffi_call without input_output_aliases (alias=False); returns numpy
    (dx, dweight, dbias)."""
    rows, C = x.shape
    ws = 256 + max(rows, segments, 1) * 2 * C * (8 if x.dtype == np.float64 else 4)
    if alias:
        def f(dy, x, w, mean, rstd, *r):
            return backward_op.ffi_call(dy, x, w, mean, rstd, v2=True, norm=LAYERNORM, segments=segments, kernel=kernel,
                                                  block_size=0, workspace_bytes=ws,
                                                  dresidual=r[0] if r else None, alias_residual=True)
    else:
        out_types = (jax.ShapeDtypeStruct((rows, C), x.dtype), jax.ShapeDtypeStruct((segments, C), w.dtype),
                     jax.ShapeDtypeStruct((segments, C), w.dtype), jax.ShapeDtypeStruct((ws,), np.uint8))

        def f(dy, x, w, mean, rstd, *r):
            res = r[0] if r else jnp.zeros((0,), x.dtype)
            out = jax.ffi.ffi_call(TARGET_V2, out_types)(
                dy, x, w, mean, rstd, res, kernel=np.int32(kernel), block_size=np.int32(0),
                has_residual=bool(r))
            return out[:3]
    args = (dy, x, w, mean, rstd) + (() if dres is None else (dres,))
    out = jax.block_until_ready(jax.jit(f)(*put(platform, *args)))
    return tuple(np.asarray(o) for o in out)


def check(name, got, dy, x, w, mean, rstd, dres, dtype, wdtype, segments=1):
    dx, dweight, dbias = got
    rows, C = x.shape
    assert dx.dtype == np_dtype(dtype) and dweight.dtype == dbias.dtype == np_dtype(wdtype)
    assert dx.shape == (rows, C) and dweight.shape == dbias.shape == (segments, C)
    n = rows // segments
    for s in range(segments):
        rs = slice(s * n, (s + 1) * n)
        ref_dx, ref_dw, ref_db = reference_bwd(dy[rs], x[rs], w[s if len(w) > 1 else 0], mean[rs], rstd[rs])
        if dres is not None:
            ref_dx = ref_dx + f64(dres[rs])
        assert_close(f"{name} segment {s} dx", dx[rs], ref_dx, dtype)
        assert_close(f"{name} segment {s} dweight", dweight[s], ref_dw, wdtype)
        assert_close(f"{name} segment {s} dbias", dbias[s], ref_db, wdtype)


def _case(platform, kernel, rows, C, dtype, wdtype, residual, seed=0):
    dy, x, w, mean, rstd, res = make(rows, C, dtype, wdtype, seed)
    dres = res if residual else None
    got = v2_call(platform, dy, x, w, mean, rstd, dres, kernel=kernel)
    check(f"k{kernel} {rows}x{C}", got, dy, x, w, mean, rstd, dres, dtype, wdtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rows,C", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype,wdtype", COMBOS, ids=COMBO_IDS)
def test_v2_matches_reference(platform, dtype, wdtype, rows, C, residual):
    _case(platform, 12, rows, C, dtype, wdtype, residual)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [11, 12], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rows,C", SHAPES + GPU_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype,wdtype", COMBOS, ids=COMBO_IDS)
def test_v2_kernels_match_reference_gpu(kernel, dtype, wdtype, rows, C, residual):
    _case("gpu", kernel, rows, C, dtype, wdtype, residual, seed=1)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", [11, 12], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("weight_rows", [1, 4], ids=["shared-weight", "weight-per-segment"])
@pytest.mark.parametrize("dtype,wdtype", [("float32", "float32"), ("bfloat16", "float32"),
                                          ("float16", "float16")], ids=["float32", "bfloat16-wfloat32", "float16"])
@pytest.mark.parametrize("rows,C", [(8, 40), (12, 1601), (4224, 768)], ids=lambda v: str(v))
def test_v2_segments(platform, kernel, dtype, wdtype, rows, C, weight_rows):
    """Per-segment sums (vmap's per-example gradients) with the residual and mixed precision."""
    dy, x, _, mean, rstd, res = make(rows, C, dtype, wdtype, seed=2)
    w = make(weight_rows, C, dtype, wdtype, seed=3, weight_rows=weight_rows)[2]
    got = v2_call(platform, dy, x, w, mean, rstd, res, segments=4, kernel=kernel)
    check(f"k{kernel}", got, dy, x, w, mean, rstd, res, dtype, wdtype, segments=4)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float32_weight_is_not_rounded(platform, dtype):
    """weight = 1 or 1 + 2^-10, alternating: both round to 1 in bfloat16 (and 1 + 2^-10 is the
    next float16 after 1, so use 1 + 2^-12 there), and dy = 1. With the weight rounded, g would be
    constant and dx = 0 up to rounding; with the float32 weight, dx = (w - mean(w)) * rstd - ...,
    about 2^-11 * rstd: clearly nonzero, and equal to the float64 reference."""
    rows, C = 5, 256
    step = 2.0 ** -10 if dtype == "bfloat16" else 2.0 ** -12
    w = np.where(np.arange(C) % 2 == 0, 1.0, 1.0 + step).astype(np.float32)[None]
    assert np.all(f64(w.astype(np_dtype(dtype))) == 1.0)   # rounded, the weight would be all ones
    rng = np.random.default_rng(4)
    x = rng.standard_normal((rows, C)).astype(np_dtype(dtype))
    dy = np.ones((rows, C), np_dtype(dtype))
    mean, rstd = reference_stats(x)
    dx, dweight, dbias = v2_call(platform, dy, x, w, mean, rstd)
    ref_dx, _, _ = reference_bwd(dy, x, w, mean, rstd)
    assert np.abs(f64(dx)).max() > 0.2 * step * f64(rstd).min()
    assert_close("dx", dx, ref_dx, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype,wdtype", [("float32", "float32"), ("bfloat16", "float32")])
def test_residual_without_aliasing(platform, dtype, wdtype):
    """A bare ffi_call that does not alias dresidual to dx gets the same result as an aliased one."""
    dy, x, w, mean, rstd, res = make(33, 264, dtype, wdtype, seed=5)
    aliased = v2_call(platform, dy, x, w, mean, rstd, res)
    bare = v2_call(platform, dy, x, w, mean, rstd, res, alias=False)
    for a, b in zip(aliased, bare):
        np.testing.assert_array_equal(f64(a), f64(b))
    check("bare", bare, dy, x, w, mean, rstd, res, dtype, wdtype)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_residual_is_donated_in_place(platform):
    """Under jit with dresidual donated, the aliased dx comes back right (XLA reuses the buffer)."""
    dy, x, w, mean, rstd, res = make(16, 128, "bfloat16", "float32", seed=6)
    ws = 256 + 16 * 2 * 128 * 4

    def f(res, dy, x, w, mean, rstd):
        return backward_op.ffi_call(dy, x, w, mean, rstd, v2=True, norm=LAYERNORM, segments=1, kernel=12, block_size=0,
                                              workspace_bytes=ws, dresidual=res, alias_residual=True)
    args = put(platform, res, dy, x, w, mean, rstd)
    donated = jax.jit(f, donate_argnums=0)
    # dx is written into dresidual's buffer: the call aliases them and nothing copies dresidual.
    # (Without donation XLA copies it first, as it must: the caller still holds it.)
    hlo = donated.lower(*args).compile().as_text()
    assert "output_to_operand_aliasing={{0}: (5, {})}" in hlo
    assert not re.search(r"= bf16\[16,128\]\S* copy\(", hlo), hlo
    got = donated(*args)
    check("donated", tuple(np.asarray(o) for o in got), dy, x, w, mean, rstd, res, "bfloat16", "float32")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype,wdtype", [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")])
def test_v2_plain_equals_v1(platform, dtype, wdtype):
    """Without residual and with x's dtype, v2 gives v1's bits (the same code runs). v1 takes no
    float32 weight beside bf16, so the mixed call is compared with the reference only."""
    dy, x, w, mean, rstd, _ = make(37, 520, dtype, wdtype, seed=7)
    v2 = v2_call(platform, dy, x, w, mean, rstd)
    if dtype == wdtype:
        ws = 256 + 37 * 2 * 520 * 4
        f = jax.jit(lambda *a: backward_op.ffi_call(*a, v2=False, norm=LAYERNORM, segments=1, kernel=12, block_size=0,
                                                           workspace_bytes=ws))
        v1 = tuple(np.asarray(o) for o in f(*put(platform, dy, x, w, mean, rstd)))
        for a, b in zip(v2, v1):
            np.testing.assert_array_equal(f64(a), f64(b))
    check("v2", v2, dy, x, w, mean, rstd, None, dtype, wdtype)


def test_both_targets_registered():
    assert TARGET == "jax_lnbwd_layernorm_bwd_v1" and TARGET_V2 == "jax_lnbwd_layernorm_bwd_v2"
    names = {(name, platform) for name, _, platform in jax_lnbwd._jax_lnbwd.registrations()}
    assert {("jax_lnbwd_layernorm_bwd_v1", "cpu"), ("jax_lnbwd_layernorm_bwd_v2", "cpu")} <= names
    if jax_lnbwd.WITH_CUDA:
        assert {("jax_lnbwd_layernorm_bwd_v1", "CUDA"), ("jax_lnbwd_layernorm_bwd_v2", "CUDA")} <= names


# --- refusals ------------------------------------------------------------------------------


def _bare(platform, dy, x, w, mean, rstd, res, *, has_residual, kernel=12, target=None, dw_dtype=None):
    rows, C = x.shape
    dw_dtype = w.dtype if dw_dtype is None else dw_dtype
    out_types = (jax.ShapeDtypeStruct((rows, C), x.dtype), jax.ShapeDtypeStruct((1, C), dw_dtype),
                 jax.ShapeDtypeStruct((1, C), dw_dtype), jax.ShapeDtypeStruct((256 + rows * 2 * C * 4,), np.uint8))
    attrs = dict(kernel=np.int32(kernel), block_size=np.int32(0))
    if target is None:
        call = jax.ffi.ffi_call(TARGET_V2, out_types)
        f = jax.jit(lambda *a: call(*a, has_residual=has_residual, **attrs))
        args = (dy, x, w, mean, rstd, res)
    else:
        call = jax.ffi.ffi_call(target, out_types)
        f = jax.jit(lambda *a: call(*a, **attrs))
        args = (dy, x, w, mean, rstd)
    return jax.block_until_ready(f(*put(platform, *args)))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_v1_refuses_float32_weight_beside_bf16(platform):
    dy, x, w, mean, rstd, res = make(4, 8, "bfloat16", "float32", seed=8)
    with pytest.raises(Exception, match="'weight' has dtype float32 but expected bfloat16"):
        _bare(platform, dy, x, w, mean, rstd, res, has_residual=False, target=TARGET)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case,match", [
    ("f64-x-f32-w", "'weight' has dtype float32 but expected float64 for x of dtype float64"),
    ("bf16-x-f16-w", "'weight' has dtype float16 but expected bfloat16 or float32"),
    ("dweight-bf16", "'dweight' has dtype bfloat16 but expected float32"),
    ("residual-shape", r"'dresidual' has shape \(4, 7\) but expected \(4, 8\)"),
    ("residual-dtype", "'dresidual' has dtype float32 but expected bfloat16"),
    ("placeholder-not-empty", "'dresidual' has shape \\(4, 8\\) but has_residual is false"),
    ("kernel10-mixed", "kernel 10 does not support a float32 weight"),
    ("kernel9-residual", "kernel 9 does not support an added residual gradient"),
])
def test_v2_refuses(platform, case, match):
    xdt, wdt = {"f64-x-f32-w": ("float64", "float32"), "bf16-x-f16-w": ("bfloat16", "float16"),
                "kernel9-residual": ("bfloat16", "bfloat16")}.get(case, ("bfloat16", "float32"))
    dy, x, w, mean, rstd, res = make(4, 8, xdt, wdt, seed=9)
    kw = dict(has_residual=True)
    if case == "dweight-bf16":
        kw["dw_dtype"] = np_dtype("bfloat16")
    elif case == "residual-shape":
        res = res[:, :7]
    elif case == "residual-dtype":
        res = res.astype(np.float32)
    elif case == "placeholder-not-empty":
        kw["has_residual"] = False
    elif case == "kernel10-mixed":
        kw.update(has_residual=False, kernel=10)
        res = res[:0]
    elif case == "kernel9-residual":
        kw["kernel"] = 9
    with pytest.raises(Exception, match=match):
        _bare(platform, dy, x, w, mean, rstd, res, **kw)


def test_python_wrapper_checks_at_trace_time():
    dy, x, w, mean, rstd, res = make(4, 8, "float32", "float32", seed=10)
    kw = dict(segments=1, kernel=12, block_size=0, workspace_bytes=1024)
    with pytest.raises(TypeError, match="'weight' has dtype bfloat16 but expected float32 for x"):
        backward_op.ffi_call(dy, x, w.astype(np_dtype("bfloat16")), mean, rstd, v2=True, norm=LAYERNORM, **kw)
    with pytest.raises(ValueError, match=r"'dresidual' has shape \(4, 7\) but x has shape \(4, 8\)"):
        backward_op.ffi_call(dy, x, w, mean, rstd, v2=True, norm=LAYERNORM, dresidual=res[:, :7], **kw)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_v2_exports_and_runs_again(platform):
    """A program calling target v2 (mixed precision, aliased residual) exports, serializes and
    runs again with the same bits; target v1 stays registered beside it."""
    from jax import export
    dy, x, w, mean, rstd, res = make(12, 264, "bfloat16", "float32", seed=11)
    ws = 256 + 12 * 2 * 264 * 4

    def f(dy, x, w, mean, rstd, res):
        return backward_op.ffi_call(dy, x, w, mean, rstd, v2=True, norm=LAYERNORM, segments=1, kernel=12, block_size=0,
                                              workspace_bytes=ws, dresidual=res, alias_residual=True)
    args = put(platform, dy, x, w, mean, rstd, res)
    exported = export.export(jax.jit(f), platforms=[{"cpu": "cpu", "gpu": "cuda"}[platform]],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(TARGET_V2)])(*args)
    assert f"@{TARGET_V2}(" in exported.mlir_module()
    restored = export.deserialize(exported.serialize())
    for got, want in zip(jax.jit(restored.call)(*args), jax.jit(f)(*args)):
        np.testing.assert_array_equal(f64(got), f64(want))
