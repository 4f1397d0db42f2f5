"""Every argument check of the public functions and the FFI ops, written once.

All checks run at trace time, so a bad input raises TypeError/ValueError before any kernel can
see it. `fn` is the public function called; every message starts with it and names the
argument, its shape or dtype, and what was expected, e.g.
    layernorm_bwd: 'dy' has shape (4, 9) but x has shape (4, 8)
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import reference
from . import kernels
from .kernels import DEFAULT_KERNEL, KERNELS, v2_refusal
from .norms import NORMS, NORMS_BY_NAME, Norm

SUPPORTED = ("float32", "bfloat16", "float16", "float64")
SIXTEEN_BIT = ("bfloat16", "float16")


def dtype_name(a) -> str:
    """The name of an array's dtype, as kernels.dtype_name gives it for any dtype-like."""
    return kernels.dtype_name(a.dtype)


def array(fn: str, name: str, a, *, optional: bool = False) -> None:
    """`a` is an array (or, with optional, None) of a supported float dtype."""
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        what = "an array or None" if optional else "an array"
        raise TypeError(f"{fn}: '{name}' must be {what}, got {type(a).__name__}")
    if dtype_name(a) not in SUPPORTED:
        raise TypeError(f"{fn}: '{name}' has dtype {dtype_name(a)} but expected one of {', '.join(SUPPORTED)}")


def _static(fn: str, name: str, value) -> None:
    """eps and offset are compile-time constants of the kernel call: a traced value (an argument
    of a jitted function) cannot be one. Say so, and how to pass it."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{fn}: {name} must be a static Python float, got a traced value "
                         f"({type(value).__name__} {value.dtype}{list(value.shape)}); it is fixed when the "
                         f"function is traced: close over it (functools.partial(f, {name}=...)) or mark "
                         f"it static (jax.jit(f, static_argnames='{name}'))")


def eps(fn: str, value) -> float:
    """eps as a float: a positive finite number (not a bool or a string, not traced)."""
    _static(fn, "eps", value)
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: eps must be a positive finite float, got {value!r}") from None
    if isinstance(value, (bool, str, bytes)) or not math.isfinite(f) or f <= 0.0:
        raise ValueError(f"{fn}: eps must be a positive finite float, got {value!r}")
    return f


def x(fn: str, a) -> None:
    """x: a float array of rank >= 1 whose last axis (C, the one normalized over) is not empty.

    Rows may be empty (a batch of none: empty results), C may not: a row of no elements has
    no statistics, so C = 0 is refused rather than returning an empty result."""
    array(fn, "x", a)
    if a.ndim < 1:
        raise ValueError(f"{fn}: 'x' must have rank >= 1 (normalization is over the last axis)")
    if a.shape[-1] < 1:
        raise ValueError(f"{fn}: 'x' has shape {tuple(a.shape)} but its last axis (C, the one "
                         "normalized over) must have at least 1 element: an empty row has no mean")


def is_mixed(x, *params) -> bool:
    """Whether a parameter is float32 beside bfloat16/float16 x (mixed precision: target v2)."""
    return dtype_name(x) in SIXTEEN_BIT and any(p is not None and dtype_name(p) == "float32" for p in params)


def param(fn: str, name: str, p, x) -> None:
    """A parameter (weight, bias, x_bias): None (absent) or a (C,) array of x's dtype, or float32
    beside bfloat16/float16 x (mixed precision: the parameter is never rounded to 16 bits)."""
    if p is None:
        return
    array(fn, name, p, optional=True)
    C = x.shape[-1]
    if tuple(p.shape) != (C,):
        raise ValueError(f"{fn}: '{name}' has shape {tuple(p.shape)} but expected ({C},) "
                         f"for x of shape {tuple(x.shape)}")
    if p.dtype != x.dtype and not is_mixed(x, p):
        allowed = f"{dtype_name(x)} or float32" if dtype_name(x) in SIXTEEN_BIT else dtype_name(x)
        raise TypeError(f"{fn}: '{name}' has dtype {dtype_name(p)} but expected {allowed} for x of "
                        f"dtype {dtype_name(x)}")


def forward_args(fn: str, x_, params: dict, eps_) -> float:
    """A forward's arguments: x, the named parameters (None: absent), eps; returns eps as a float."""
    eps_ = eps(fn, eps_)
    x(fn, x_)
    for name, p in params.items():
        param(fn, name, p, x_)
    return eps_


def one_param_dtype(*params):
    """The parameters (None stays None) in one dtype: a 16-bit one next to a float32 one is
    upcast to float32 (exact), as the fused forward's kernels take one parameter dtype."""
    present = [p for p in params if p is not None]
    if len({jnp.dtype(p.dtype) for p in present}) > 1:   # exact: bf16/f16 -> f32
        return tuple(None if p is None else p.astype(jnp.float32) for p in params)
    return params


def like_x(fn: str, name: str, a, x) -> None:
    """An array of x's shape and dtype (dy, residual)."""
    array(fn, name, a)
    if tuple(a.shape) != tuple(x.shape):
        raise ValueError(f"{fn}: '{name}' has shape {tuple(a.shape)} but x has shape {tuple(x.shape)}")
    if a.dtype != x.dtype:
        raise TypeError(f"{fn}: '{name}' has dtype {dtype_name(a)} but x has dtype {dtype_name(x)}; "
                        "cast them to one dtype")


def residual(fn: str, r, x) -> None:
    like_x(fn, "residual", r, x)


def stats(fn: str, x, **saved) -> None:
    """The forward's saved statistics (mean, rstd): x.shape[:-1], float32 (float64 for float64 x)."""
    stat = reference.acc_dtype(x.dtype)
    for name, s in saved.items():
        if not hasattr(s, "shape"):
            raise TypeError(f"{fn}: '{name}' must be an array, got {type(s).__name__}")
        if tuple(s.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"{fn}: '{name}' has shape {tuple(s.shape)} but expected "
                             f"{tuple(x.shape[:-1])} for x of shape {tuple(x.shape)}")
        if s.dtype != stat:
            raise TypeError(f"{fn}: '{name}' has dtype {dtype_name(s)} but expected {stat} "
                            f"for x of dtype {dtype_name(x)}")


def backward_args(fn: str, dy, x_, weight, **saved) -> None:
    """A raw backward's arguments: x, dy like x, a weight (required: for no scale pass ones) and
    the saved statistics."""
    x(fn, x_)
    like_x(fn, "dy", dy, x_)
    if weight is None:
        raise TypeError(f"{fn}: 'weight' must be an array (for no scale pass ones)")
    param(fn, "weight", weight, x_)
    stats(fn, x_, **saved)


def kernel(fn: str, kernel_, block_size, dtype: str, C: int, *, norm: Norm, mixed: bool = False,
           residual: bool = False) -> tuple[int, int]:
    """(kernel id, block size) for `norm`'s backward, checked against x's dtype and C, and against
    target v2's additions the call needs (mixed precision, a residual gradient)."""
    if kernel_ is None:
        kernel_ = DEFAULT_KERNEL
    if isinstance(kernel_, bool) or not isinstance(kernel_, (int, np.integer)) or int(kernel_) not in KERNELS:
        raise ValueError(f"{fn}: unknown kernel {kernel_!r}; known kernels are {sorted(KERNELS)} "
                         "(see jax_lnbwd.KERNELS) or None for the default")
    info = KERNELS[int(kernel_)]
    if dtype not in info.dtypes:
        raise ValueError(f"{fn}: kernel {info.id} supports dtypes {', '.join(info.dtypes)}, not {dtype}")
    if block_size is None:
        block_size = info.default_block_size
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or int(block_size) not in info.block_sizes:
        if tuple(info.block_sizes) == (0,):
            raise ValueError(f"{fn}: kernel {info.id} picks its own block size; pass block_size=None "
                             f"(or 0), got {block_size!r}")
        raise ValueError(f"{fn}: kernel {info.id} accepts block_size in {list(info.block_sizes)} "
                         f"or None, got {block_size!r}")
    # A kernel that cannot run this norm at all says so before any limit of its own.
    why = v2_refusal(info.id, mixed=False, residual=False, norm=norm) or info.refuse(C, dtype, int(block_size)) \
        or v2_refusal(info.id, mixed=mixed, residual=residual, norm=norm)
    if why is not None:
        raise ValueError(f"{fn}: {why}")
    return info.id, int(block_size)


def v2_args(fn: str, x, weight, dresidual) -> None:
    """What backward target v2 adds, checked where the FFI call is made: the weight's dtype and
    dresidual's shape and dtype (the public functions have checked them already)."""
    x_dtype, w_dtype = np.dtype(x.dtype), np.dtype(weight.dtype)
    sixteen = str(jnp.dtype(x_dtype)) in SIXTEEN_BIT
    if w_dtype != x_dtype and not (sixteen and w_dtype == np.float32):
        allowed = f"{x_dtype} or float32" if sixteen else str(x_dtype)
        raise TypeError(f"{fn}: 'weight' has dtype {w_dtype} but expected {allowed} for x of dtype {x_dtype}")
    if dresidual is not None:
        if tuple(dresidual.shape) != tuple(x.shape):
            raise ValueError(f"{fn}: 'dresidual' has shape {tuple(dresidual.shape)} but x has shape {tuple(x.shape)}")
        if np.dtype(dresidual.dtype) != x_dtype:
            raise TypeError(f"{fn}: 'dresidual' has dtype {np.dtype(dresidual.dtype)} but x has dtype {x_dtype}")


def offset(fn: str, value, weight, name: str = "weight") -> float:
    """rmsnorm's offset (added to the weight: Gemma's zero-centred scale is offset=1.0) as a
    float: finite, and 0 when there is no weight (there is no scale to shift); not traced.
    `name` is the weight's argument name in `fn`."""
    _static(fn, "offset", value)
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: offset must be a finite float, got {value!r}") from None
    if isinstance(value, (bool, str, bytes)) or not math.isfinite(f):
        raise ValueError(f"{fn}: offset must be a finite float, got {value!r}")
    if weight is None and f != 0.0:
        raise ValueError(f"{fn}: offset={value!r} shifts the weight, but {name} is None (no scale); "
                         "pass a weight or offset=0")
    return f


# --- QK-norm (qk_norm.py): the norm kind, heads of head_dim elements -------------------------------

def norm_kind(fn: str, value) -> Norm:
    """The `norm` keyword: a norm's public name ("rmsnorm", "layernorm") or its row, as the row."""
    if isinstance(value, Norm) and value in NORMS:
        return value
    if isinstance(value, str) and value in NORMS_BY_NAME:
        return NORMS_BY_NAME[value]
    raise ValueError(f"{fn}: norm must be one of {', '.join(map(repr, NORMS_BY_NAME))}, got {value!r}")


def heads(fn: str, name: str, a) -> None:
    """q or k: a float array [..., heads, head_dim] (rank >= 2) with head_dim >= 1."""
    array(fn, name, a)
    if a.ndim < 2:
        raise ValueError(f"{fn}: '{name}' has shape {tuple(a.shape)} but expected [..., heads, head_dim] "
                         "(rank >= 2)")
    if a.shape[-1] < 1:
        raise ValueError(f"{fn}: '{name}' has shape {tuple(a.shape)} but its last axis (head_dim, the one "
                         "normalized over) must have at least 1 element")


def same_head_dim(fn: str, q, k) -> None:
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{fn}: 'q' has head_dim {q.shape[-1]} (shape {tuple(q.shape)}) but 'k' has head_dim "
                         f"{k.shape[-1]} (shape {tuple(k.shape)}); they must match")


def head_count(fn: str, name: str, value) -> int:
    """q_heads or kv_heads: a positive Python int (static: it fixes shapes)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{fn}: {name} must be a positive int, got {value!r}")
    return int(value)


def fused_head_dim(fn: str, qkv, q_heads: int, kv_heads: int) -> int:
    """head_dim D of a fused projection [..., (q_heads + 2 * kv_heads) * D]: the last axis must
    split into that many heads of at least 1 element."""
    array(fn, "qkv", qkv)
    heads_ = q_heads + 2 * kv_heads
    last = qkv.shape[-1] if qkv.ndim >= 1 else None
    if last is None or last < heads_ or last % heads_:
        raise ValueError(f"{fn}: 'qkv' has shape {tuple(qkv.shape)} but its last axis must be "
                         f"(q_heads + 2 * kv_heads) * head_dim = ({q_heads} + 2 * {kv_heads}) * head_dim, "
                         f"a positive multiple of {heads_}")
    return last // heads_
