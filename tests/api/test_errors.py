"""Bad inputs raise TypeError/ValueError at trace time, naming the function called and the argument.

Each case runs three ways: eagerly, under jax.eval_shape (abstract arguments, no data: so the
check runs while tracing) and under jax.jit(...).lower (the same, inside jit). Last, the C++
handler's own checks: a direct jax.ffi.ffi_call with bad buffers fails when it runs, with a
message naming the argument.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PLATFORMS, direct_ffi_call
from jax_lnbwd import DEFAULT_KERNEL, KERNELS, layernorm, layernorm_bwd, layernorm_fwd

S = jax.ShapeDtypeStruct
F32, F16, F64, BF16 = jnp.float32, jnp.float16, jnp.float64, jnp.bfloat16

X, W, B = S((4, 8), F32), S((8,), F32), S((8,), F32)  # a valid layernorm(x, weight, bias)
DY, MEAN, RSTD = S((4, 8), F32), S((4,), F32), S((4,), F32)  # with valid layernorm_bwd extras


def ln(x=X, w=W, b=B, **kw):
    return functools.partial(layernorm, **kw), (x, w, b)


def fwd(x=X, w=W, b=B, **kw):
    return functools.partial(layernorm_fwd, **kw), (x, w, b)


def bwd(dy=DY, x=X, w=W, mean=MEAN, rstd=RSTD, **kw):
    return functools.partial(layernorm_bwd, **kw), (dy, x, w, mean, rstd)


# id -> ((function, abstract args), exception type, regex the message must match)
CASES = {
    # x
    "x-int32": (ln(x=S((4, 8), jnp.int32)), TypeError, "'x'.*int32"),
    "x-complex": (ln(x=S((4, 8), jnp.complex64)), TypeError, "'x'.*complex64"),
    "x-rank0": (ln(x=S((), F32), w=S((), F32), b=S((), F32)), ValueError, "'x'.*rank"),
    "fwd-x-int32": (fwd(x=S((4, 8), jnp.int32)), TypeError, "'x'"),
    "fwd-x-rank0": (fwd(x=S((), F32), w=S((), F32), b=S((), F32)), ValueError, "'x'.*rank"),
    "bwd-x-int32": (bwd(x=S((4, 8), jnp.int32)), TypeError, "'x'"),
    "bwd-x-rank0": (bwd(dy=S((), F32), x=S((), F32), w=S((), F32), mean=S((), F32), rstd=S((), F32)),
                    ValueError, "'x'.*rank"),
    # a zero-width last axis (C = 0): refused, naming x's shape (rows = 0 is fine)
    "x-C0": (ln(x=S((4, 0), F32), w=S((0,), F32), b=S((0,), F32)), ValueError, r"'x'.*\(4, 0\).*last axis"),
    "x-C0-no-params": (ln(x=S((0,), F32), w=None, b=None), ValueError, r"'x'.*\(0,\).*last axis"),
    "fwd-x-C0": (fwd(x=S((2, 3, 0), F64), w=None, b=None), ValueError, r"'x'.*\(2, 3, 0\).*last axis"),
    "bwd-x-C0": (bwd(dy=S((4, 0), F32), x=S((4, 0), F32), w=S((0,), F32)), ValueError, r"'x'.*\(4, 0\).*last axis"),
    # weight and bias
    "weight-shape-C+1": (ln(w=S((9,), F32)), ValueError, r"'weight'.*\(9,\).*\(8,\)"),
    "weight-shape-2d": (ln(w=S((1, 8), F32)), ValueError, r"'weight'.*\(1, 8\)"),
    "weight-scalar": (ln(w=S((), F32)), ValueError, r"'weight'.*\(\)"),
    "bias-shape": (ln(b=S((4,), F32)), ValueError, r"'bias'.*\(4,\)"),
    "bias-shape-like-x": (ln(b=S((4, 8), F32)), ValueError, r"'bias'.*\(4, 8\)"),
    "weight-dtype": (ln(w=S((8,), F16)), TypeError, "'weight'.*float16"),
    "weight-dtype-f64": (ln(w=S((8,), F64)), TypeError, "'weight'.*float64"),
    "bias-dtype": (ln(b=S((8,), BF16)), TypeError, "'bias'.*bfloat16"),
    "bias-int": (ln(b=S((8,), jnp.int32)), TypeError, "'bias'.*int32"),
    "fwd-weight-shape": (fwd(w=S((7,), F32)), ValueError, "'weight'"),
    "fwd-bias-dtype": (fwd(b=S((8,), F64)), TypeError, "'bias'"),
    "bwd-weight-shape": (bwd(w=S((9,), F32)), ValueError, "'weight'"),
    "bwd-weight-dtype": (bwd(w=S((8,), BF16)), TypeError, "'weight'"),
    # dy
    "dy-shape": (bwd(dy=S((4, 9), F32)), ValueError, r"'dy'.*\(4, 9\)"),
    "dy-shape-transposed": (bwd(dy=S((8, 4), F32)), ValueError, "'dy'"),
    "dy-dtype": (bwd(dy=S((4, 8), BF16)), TypeError, "'dy'.*bfloat16"),
    "dy-int": (bwd(dy=S((4, 8), jnp.int32)), TypeError, "'dy'"),
    # mean and rstd
    "mean-shape": (bwd(mean=S((5,), F32)), ValueError, r"'mean'.*\(5,\)"),
    "mean-keepdims": (bwd(mean=S((4, 1), F32)), ValueError, r"'mean'.*\(4, 1\)"),
    "rstd-shape": (bwd(rstd=S((8,), F32)), ValueError, "'rstd'"),
    "mean-flat-for-rank3": (bwd(dy=S((2, 4, 8), F32), x=S((2, 4, 8), F32), mean=S((8,), F32),
                                rstd=S((2, 4), F32)), ValueError, r"'mean'.*\(2, 4\)"),
    "mean-float16": (bwd(mean=S((4,), F16)), TypeError, "'mean'.*float16"),
    "rstd-bfloat16": (bwd(rstd=S((4,), BF16)), TypeError, "'rstd'.*bfloat16"),
    "mean-f64-for-f32-x": (bwd(mean=S((4,), F64)), TypeError, "'mean'.*float64"),
    "rstd-f32-for-f64-x": (bwd(dy=S((4, 8), F64), x=S((4, 8), F64), w=S((8,), F64), mean=S((4,), F64),
                               rstd=S((4,), F32)), TypeError, "'rstd'.*float32"),
    "mean-bf16-x-stats-bf16": (bwd(dy=S((4, 8), BF16), x=S((4, 8), BF16), w=S((8,), BF16),
                                   mean=S((4,), BF16), rstd=S((4,), BF16)), TypeError, "'mean'"),
    # eps
    **{f"eps-{name}": (ln(eps=eps), ValueError, "eps")
       for name, eps in [("zero", 0.0), ("negative", -1e-5), ("nan", float("nan")),
                         ("inf", float("inf")), ("-inf", float("-inf")), ("str", "abc"),
                         ("numeric-str", "1e-5"), ("none", None), ("bool", True),
                         ("list", [1e-5])]},
    "fwd-eps-zero": (fwd(eps=0), ValueError, "eps"),
    "fwd-eps-nan": (fwd(eps=np.nan), ValueError, "eps"),
    # kernel
    **{f"kernel-{name}": (ln(kernel=k), ValueError, "kernel")
       for name, k in [("0", 0), ("99", 99), ("-1", -1), ("str-10", "10"), ("True", True),
                       ("float-10", 10.0)]},
    "bwd-kernel-99": (bwd(kernel=99), ValueError, "kernel"),
    "bwd-kernel-str": (bwd(kernel="10"), ValueError, "kernel"),
    # block_size of the default kernel (each kernel's own list is checked below): numbers
    # outside its list, and values of the wrong type
    **{f"block_size-{bs!r}": (ln(block_size=bs), ValueError, "block_size")
       for bs in (48, 2048, 0, -32) if bs not in KERNELS[DEFAULT_KERNEL].block_sizes},
    **{f"block_size-{name}": (ln(block_size=bs), ValueError, "block_size")
       for name, bs in [("True", True), ("str", str(KERNELS[DEFAULT_KERNEL].default_block_size)),
                        ("float", float(KERNELS[DEFAULT_KERNEL].default_block_size))]},
    "bwd-block_size--32": (bwd(block_size=-32), ValueError, "block_size"),
}


def _run(how, fn, args):
    if how == "eval_shape":
        return jax.eval_shape(fn, *args)
    if how == "jit_lower":
        return jax.jit(fn).lower(*args)
    # eager: real (zero) arrays
    return fn(*(None if a is None else jnp.zeros(a.shape, a.dtype) for a in args))


@pytest.mark.parametrize("how", ["eval_shape", "jit_lower", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises(case, how):
    (fn, args), exc, match = CASES[case]
    with pytest.raises(exc, match=match) as e:
        _run(how, fn, args)
    # Every message starts with the name of the function the user called.
    assert str(e.value).startswith(f"{fn.func.__name__}: "), str(e.value)


@pytest.mark.parametrize("fn", [ln, bwd], ids=["layernorm", "layernorm_bwd"])
@pytest.mark.parametrize("kernel", [k for k in sorted(KERNELS) if tuple(KERNELS[k].block_sizes) == (0,)])
def test_self_sizing_kernel_says_what_to_pass(fn, kernel):
    # Kernels 11 and 12 choose their block shape themselves: the error says so, and what to pass.
    f, args = fn(kernel=kernel, block_size=256)
    name = f.func.__name__
    with pytest.raises(ValueError, match=rf"^{name}: kernel {kernel} picks its own block size; "
                                         r"pass block_size=None \(or 0\), got 256"):
        jax.eval_shape(f, *args)
    for ok in (None, 0):
        jax.eval_shape(fn(kernel=kernel, block_size=ok)[0], *args)


def test_valid_inputs_do_not_raise():
    # The base shapes of CASES are valid: each failure above is due to its one change.
    assert jax.eval_shape(ln()[0], *ln()[1]).shape == (4, 8)
    assert len(jax.eval_shape(fwd()[0], *fwd()[1])) == 3
    assert [o.shape for o in jax.eval_shape(bwd()[0], *bwd()[1])] == [(4, 8), (8,), (8,)]


@pytest.mark.parametrize("how", ["eval_shape", "jit_lower"])
def test_errors_raise_inside_grad(how):
    # The checks also run when layernorm is traced under grad.
    fn = jax.grad(lambda x, w, b: jnp.sum(layernorm(x, w, b, kernel=99)))
    with pytest.raises(ValueError, match="kernel"):
        _run(how, fn, (X, W, B))


def test_non_array_arguments():
    x = np.zeros((4, 8), np.float32)
    w = np.ones(8, np.float32)
    with pytest.raises(TypeError, match="'x'"):
        layernorm(x.tolist(), w, w)
    with pytest.raises(TypeError, match="'weight'"):
        layernorm(x, w.tolist(), w)
    with pytest.raises(TypeError, match="'bias'"):
        layernorm(x, w, 0.0)
    with pytest.raises(TypeError, match="'mean'"):
        layernorm_bwd(x, x, w, 0.0, np.ones(4, np.float32))
    with pytest.raises(TypeError, match="'weight'"):
        layernorm_bwd(x, x, None, np.zeros(4, np.float32), np.ones(4, np.float32))


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_block_sizes_outside_each_kernels_list(kernel):
    info = KERNELS[kernel]
    dt = jnp.dtype(info.dtypes[0])   # a dtype the kernel takes, so the block size is what fails
    x, w = S(X.shape, dt), S(W.shape, dt)
    for bs in (16, 48, 96, 1024, 2048):
        if bs in info.block_sizes:
            continue
        with pytest.raises(ValueError, match="block_size"):
            jax.eval_shape(functools.partial(layernorm, kernel=kernel, block_size=bs), x, w, w)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_refusal_raises(kernel):
    # A C that a kernel refuses (too wide for it, say) is a ValueError with the kernel's
    # reason, at trace time: it must never reach the kernel. Shapes are abstract: no memory.
    info = KERNELS[kernel]
    for C in (2**16, 2**20, 2**24):
        for dtype in info.dtypes:
            why = info.refuse(C, dtype, info.default_block_size)
            if why is None:
                continue
            x, w = S((2, C), jnp.dtype(dtype)), S((C,), jnp.dtype(dtype))
            with pytest.raises(ValueError) as e:
                jax.eval_shape(functools.partial(layernorm, kernel=kernel), x, w, w)
            assert why in str(e.value)


# --- the C++ handler's own checks, reached through a direct ffi_call --------------------------

def _direct_call(platform, *, dy=(4, 8), x=(4, 8), w=(1, 8), mean=(4,), rstd=(4,), dtype=np.float32,
                 stat=np.float32, mean_dtype=None, **kw):
    """direct_ffi_call on arrays of these shapes and dtypes (valid as given)."""
    return direct_ffi_call(platform, np.ones(dy, dtype), np.ones(x, dtype), np.ones(w, dtype),
                           np.zeros(mean, mean_dtype or stat), np.ones(rstd, stat), **kw)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("bad,name", [
    (dict(dy=(4, 9)), "dy"),
    (dict(dy=(8, 4)), "dy"),
    (dict(w=(1, 9)), "weight"),
    (dict(w=(8,)), "weight"),                  # rank 1: the target takes (1, C) or (S, C)
    (dict(w=(2, 8)), "weight"),                # 2 weight rows for 1 segment
    (dict(segments=3), "dweight"),             # 3 segments do not divide 4 rows
    (dict(mean=(3,)), "mean"),
    (dict(rstd=(5,)), "rstd"),
    (dict(mean_dtype=np.float16), "mean"),
    (dict(dtype=np.float64), "mean"),          # f64 data needs f64 stats
    (dict(dx_shape=(4, 9)), "dx"),
    (dict(x=(2, 2, 8), dy=(2, 2, 8)), "x"),    # the target takes (rows, C) only
    (dict(dtype=np.int32), "x"),
    (dict(kernel=-1), "kernel"),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={v[k]}" for k in v))
def test_ffi_target_checks_its_arguments(platform, bad, name):
    with pytest.raises(Exception) as e:
        _direct_call(platform, **bad)
    message = str(e.value)
    assert "layernorm_bwd:" in message, message   # the handler's ffi::Error, not a Python check
    assert f"'{name}'" in message, message


@pytest.mark.parametrize("platform", PLATFORMS)
def test_ffi_target_accepts_valid_call(platform):
    # The same helper with nothing changed runs (so each failure above is its one change).
    dx, dweight, dbias = _direct_call(platform)
    assert dx.shape == (4, 8) and dweight.shape == dbias.shape == (1, 8)
    np.testing.assert_array_equal(dbias, np.full((1, 8), 4.0, np.float32))
