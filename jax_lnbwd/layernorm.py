"""The public layernorm: a jax.custom_vjp whose forward is jnp and whose backward is our FFI op.

All argument checks happen here, at trace time, so a bad input raises TypeError/ValueError
before any kernel can see it.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, reference
from .kernels import DEFAULT_KERNEL, KERNELS, workspace_bytes

_SUPPORTED = {"float32", "bfloat16", "float16", "float64"}


def _dtype_name(a) -> str:
    return str(jnp.dtype(a.dtype))


def _check_float(name: str, a) -> None:
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"layernorm: '{name}' must be an array, got {type(a).__name__}")
    if _dtype_name(a) not in _SUPPORTED:
        raise TypeError(f"layernorm: '{name}' has dtype {_dtype_name(a)} but expected one of "
                        "float32, bfloat16, float16, float64")


def _check_eps(eps) -> float:
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"layernorm: eps must be a positive float, got {eps!r}") from None
    if isinstance(eps, (bool, str, bytes)) or not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"layernorm: eps must be a positive finite float, got {eps!r}")
    return value


def _check_param(name: str, p, x) -> None:
    _check_float(name, p)
    C = x.shape[-1]
    if tuple(p.shape) != (C,):
        raise ValueError(f"layernorm: '{name}' has shape {tuple(p.shape)} but expected ({C},) "
                         f"for x of shape {tuple(x.shape)}")
    if p.dtype != x.dtype:
        raise TypeError(f"layernorm: '{name}' has dtype {_dtype_name(p)} but x has dtype "
                        f"{_dtype_name(x)}; cast them to one dtype")


def _resolve_kernel(kernel, block_size, dtype: str, C: int) -> tuple[int, int]:
    if kernel is None:
        kernel = DEFAULT_KERNEL
    if isinstance(kernel, bool) or not isinstance(kernel, (int, np.integer)) or int(kernel) not in KERNELS:
        raise ValueError(f"layernorm: unknown kernel {kernel!r}; known kernels are {sorted(KERNELS)} "
                         "(see jax_lnbwd.KERNELS) or None for the default")
    info = KERNELS[int(kernel)]
    if dtype not in info.dtypes:
        raise ValueError(f"layernorm: kernel {info.id} supports dtypes {', '.join(info.dtypes)}, not {dtype}")
    if block_size is None:
        block_size = info.default_block_size
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or int(block_size) not in info.block_sizes:
        raise ValueError(f"layernorm: kernel {info.id} accepts block_size in {list(info.block_sizes)} "
                         f"or None, got {block_size!r}")
    why = info.refuse(C, dtype, int(block_size))
    if why is not None:
        raise ValueError(f"layernorm: {why}")
    return info.id, int(block_size)


def layernorm_fwd(x, weight, bias, *, eps: float = 1e-5):
    """(y, mean, rstd) of layernorm over the last axis; mean/rstd are float32 (float64 for float64)."""
    eps = _check_eps(eps)
    _check_float("x", x)
    if x.ndim < 1:
        raise ValueError("layernorm: 'x' must have rank >= 1 (normalization is over the last axis)")
    for name, p in (("weight", weight), ("bias", bias)):
        _check_param(name, p, x)
    return reference.layernorm_fwd(x, weight, bias, eps)


def layernorm_bwd(dy, x, weight, mean, rstd, *, kernel: int | None = None, block_size: int | None = None):
    """The raw backward op: (dx, dweight, dbias) given the forward's saved mean and rstd.

    dy and x have any shape (..., C); weight has shape (C,); mean and rstd have shape x.shape[:-1]
    and dtype float32 (float64 when x is float64). dweight and dbias are summed over all
    leading axes. `kernel` picks a CUDA kernel from KERNELS (None: the default); the CPU runs
    a C++ reference for every kernel.
    """
    _check_float("x", x)
    _check_float("dy", dy)
    if x.ndim < 1:
        raise ValueError("layernorm_bwd: 'x' must have rank >= 1")
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"layernorm_bwd: 'dy' has shape {tuple(dy.shape)} but x has shape {tuple(x.shape)}")
    if dy.dtype != x.dtype:
        raise TypeError(f"layernorm_bwd: 'dy' has dtype {_dtype_name(dy)} but x has dtype {_dtype_name(x)}")
    _check_param("weight", weight, x)
    stat = reference.acc_dtype(x.dtype)
    for name, s in (("mean", mean), ("rstd", rstd)):
        if not hasattr(s, "shape"):
            raise TypeError(f"layernorm_bwd: '{name}' must be an array, got {type(s).__name__}")
        if tuple(s.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"layernorm_bwd: '{name}' has shape {tuple(s.shape)} but expected "
                             f"{tuple(x.shape[:-1])} for x of shape {tuple(x.shape)}")
        if s.dtype != stat:
            raise TypeError(f"layernorm_bwd: '{name}' has dtype {_dtype_name(s)} but expected {stat} "
                            f"for x of dtype {_dtype_name(x)}")
    C = x.shape[-1]
    if C < 1:
        raise ValueError(f"layernorm_bwd: 'x' has shape {tuple(x.shape)} but the last axis must be >= 1")
    kernel, block_size = _resolve_kernel(kernel, block_size, _dtype_name(x), C)
    rows = math.prod(x.shape[:-1])
    ws = workspace_bytes(kernel, rows, C, _dtype_name(x), block_size)
    dx, dweight, dbias = _ffi.layernorm_bwd_segments(
        dy.reshape(rows, C), x.reshape(rows, C), weight.reshape(1, C), mean.reshape(rows), rstd.reshape(rows),
        segments=1, kernel=kernel, block_size=block_size, workspace_bytes=ws)
    return dx.reshape(x.shape), dweight.reshape(C), dbias.reshape(C)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layernorm(x, weight, bias, eps, kernel, block_size):
    return reference.layernorm(x, weight, bias, eps)


def _layernorm_fwd_rule(x, weight, bias, eps, kernel, block_size):
    y, mean, rstd = reference.layernorm_fwd(x, weight, bias, eps)
    return y, (x, weight, mean, rstd)


def _layernorm_bwd_rule(eps, kernel, block_size, res, dy):
    x, weight, mean, rstd = res
    dx, dweight, dbias = layernorm_bwd(dy, x, weight, mean, rstd, kernel=kernel, block_size=block_size)
    return dx, dweight, dbias


_layernorm.defvjp(_layernorm_fwd_rule, _layernorm_bwd_rule)


def layernorm(x, weight, bias, *, eps: float = 1e-5, kernel: int | None = None, block_size: int | None = None):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias.

    x has any rank >= 1 and dtype float32, bfloat16, float16 or float64; weight and bias have
    shape (C,) and x's dtype. The forward runs in jnp (statistics in float32, float64 for
    float64); the backward runs our FFI op with `kernel` (None: the default kernel).
    """
    eps = _check_eps(eps)
    _check_float("x", x)
    if x.ndim < 1:
        raise ValueError("layernorm: 'x' must have rank >= 1 (normalization is over the last axis)")
    _check_param("weight", weight, x)
    _check_param("bias", bias, x)
    kernel, block_size = _resolve_kernel(kernel, block_size, _dtype_name(x), x.shape[-1])
    return _layernorm(x, weight, bias, eps, kernel, block_size)
