"""The public ops: layernorm (every JAX transformation), layernorm_fwd and layernorm_bwd.

All argument checks happen here, at trace time, so a bad input raises TypeError/ValueError
before any kernel can see it; every message starts with the name of the function called.

layernorm is a jax.custom_jvp. Its JVP rule computes the forward once (`_forward`: y, mean,
rstd) and the tangent dy by `primitive.tangent_map`, a linear primitive whose transpose rule
is our FFI backward op (jax_lnbwd/primitive.py). So:
  * forward mode (jax.jvp, jax.linearize, jacfwd) evaluates the tangent map in jnp;
  * reverse mode (jax.grad, vjp, jacrev) linearizes and transposes: one FFI call per
    layernorm, as before, with the op's own vmap, sharding and derivative rules
    (jax_lnbwd/backward.py, jax_lnbwd/sharding.py);
  * any order of either (hessian, check_grads order 2) composes the rules of both.
jax_lnbwd.use_xla_backward / JAX_LNBWD_BACKWARD=xla (jax_lnbwd/config.py) replace all of it
by the jnp reference, differentiated by JAX.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, backward, config, forward, primitive, reference
from .kernels import DEFAULT_KERNEL, KERNELS, v2_refusal

_SUPPORTED = {"float32", "bfloat16", "float16", "float64"}


def _dtype_name(a) -> str:
    return str(jnp.dtype(a.dtype))


def _check_float(fn: str, name: str, a) -> None:
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{fn}: '{name}' must be an array, got {type(a).__name__}")
    if _dtype_name(a) not in _SUPPORTED:
        raise TypeError(f"{fn}: '{name}' has dtype {_dtype_name(a)} but expected one of "
                        "float32, bfloat16, float16, float64")


def _check_eps(fn: str, eps) -> float:
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: eps must be a positive float, got {eps!r}") from None
    if isinstance(eps, (bool, str, bytes)) or not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{fn}: eps must be a positive finite float, got {eps!r}")
    return value


def _check_param(fn: str, name: str, p, x) -> None:
    """weight or bias: None (absent: scale 1, shift 0) or a (C,) array of x's dtype, or float32
    beside bfloat16/float16 x (mixed precision: the parameter is never rounded to 16 bits)."""
    if p is None:
        return
    _check_float(fn, name, p)
    C = x.shape[-1]
    if tuple(p.shape) != (C,):
        raise ValueError(f"{fn}: '{name}' has shape {tuple(p.shape)} but expected ({C},) "
                         f"for x of shape {tuple(x.shape)}")
    if p.dtype != x.dtype and not (is_mixed(x, p)):
        allowed = (f"{_dtype_name(x)} or float32" if _dtype_name(x) in ("bfloat16", "float16")
                   else _dtype_name(x))
        raise TypeError(f"{fn}: '{name}' has dtype {_dtype_name(p)} but expected {allowed} for x of "
                        f"dtype {_dtype_name(x)}")


def is_mixed(x, *params) -> bool:
    """Whether a parameter is float32 beside bfloat16/float16 x (mixed precision: target v2)."""
    return _dtype_name(x) in ("bfloat16", "float16") and any(
        p is not None and _dtype_name(p) == "float32" for p in params)


def _check_x(fn: str, x) -> None:
    """x: a float array of rank >= 1 whose last axis (C, the one normalized over) is not empty.

    Rows may be empty (a batch of none: empty results), C may not: a row of no elements has
    no mean and no variance, so C = 0 is refused rather than returning an empty result."""
    _check_float(fn, "x", x)
    if x.ndim < 1:
        raise ValueError(f"{fn}: 'x' must have rank >= 1 (normalization is over the last axis)")
    if x.shape[-1] < 1:
        raise ValueError(f"{fn}: 'x' has shape {tuple(x.shape)} but its last axis (C, the one "
                         "normalized over) must have at least 1 element: an empty row has no mean")


def _check_inputs(fn: str, x, weight, bias, eps) -> float:
    """The forward's arguments (shared by layernorm and layernorm_fwd); returns eps as a float."""
    eps = _check_eps(fn, eps)
    _check_x(fn, x)
    _check_param(fn, "weight", weight, x)
    _check_param(fn, "bias", bias, x)
    return eps


def _resolve_kernel(fn: str, kernel, block_size, dtype: str, C: int, *, mixed: bool = False,
                    residual: bool = False) -> tuple[int, int]:
    """(kernel id, block size) for the backward, checked against x's dtype and C, and against
    target v2's additions the call needs (mixed precision, a residual gradient)."""
    if kernel is None:
        kernel = DEFAULT_KERNEL
    if isinstance(kernel, bool) or not isinstance(kernel, (int, np.integer)) or int(kernel) not in KERNELS:
        raise ValueError(f"{fn}: unknown kernel {kernel!r}; known kernels are {sorted(KERNELS)} "
                         "(see jax_lnbwd.KERNELS) or None for the default")
    info = KERNELS[int(kernel)]
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
    why = info.refuse(C, dtype, int(block_size)) or v2_refusal(info.id, mixed=mixed, residual=residual)
    if why is not None:
        raise ValueError(f"{fn}: {why}")
    return info.id, int(block_size)


def _forward(x, weight, bias, eps: float):
    """THE forward, (y, mean, rstd), for checked inputs: every path computes it here.

    The fused FFI forward (forward.layernorm_fwd_op: reads x once) on CUDA, jnp's
    (reference.layernorm_fwd) elsewhere, chosen per platform by jax.lax.platform_dependent when
    the program is lowered (so an export for cpu and cuda carries both); the switch in
    config.py (JAX_LNBWD_FORWARD, use_ffi_forward) forces either on every platform. The two
    compute the same numbers (statistics in fp32, centered variance, y rounded once)."""
    mode = config.ffi_forward_mode()
    if mode == "xla":
        return reference.layernorm_fwd(x, weight, bias, eps)
    if mode == "ffi":
        return forward.layernorm_fwd_op(x, weight, bias, eps)
    platforms = _fused_platforms()
    if not platforms or _explicitly_sharded(x, weight, bias):
        # Explicit mesh axes (sharding in types): the FFI forward's results are typed without
        # a sharding, which platform_dependent's branches must agree on; the jnp forward is.
        return reference.layernorm_fwd(x, weight, bias, eps)
    fused = lambda x, w, b: forward.layernorm_fwd_op(x, w, b, eps)  # noqa: E731
    return jax.lax.platform_dependent(
        x, weight, bias, **{p: fused for p in platforms},
        default=lambda x, w, b: reference.layernorm_fwd(x, w, b, eps))


def _add_forward(x, residual, weight, bias, eps: float, x_bias=None):
    """add_layernorm's forward, (y, s, mean, rstd) with s = x + residual in x's dtype (with
    x_bias: (x + x_bias) + residual, reference.add_residual), for checked inputs. Where
    `_forward` would run the fused forward (same switch, same platforms), the residual-fused FFI
    forward (forward.add_layernorm_fwd_op) computes all four in one kernel that reads x and
    residual once; elsewhere, and in the same fallbacks (no CUDA handler, Explicit mesh axes),
    jnp's add followed by `_forward`'s path. Both normalize the rounded s."""
    mode = config.ffi_forward_mode()
    if mode == "ffi":
        return forward.add_layernorm_fwd_op(x, residual, weight, bias, eps, x_bias)
    platforms = _fused_platforms()
    if mode == "xla" or not platforms or _explicitly_sharded(x, residual, weight, bias, x_bias):
        s = reference.add_residual(x, residual, x_bias)
        y, mean, rstd = _forward(s, weight, bias, eps)
        return y, s, mean, rstd

    def unfused(x, r, w, b, xb):
        s = reference.add_residual(x, r, xb)
        y, mean, rstd = reference.layernorm_fwd(s, w, b, eps)
        return y, s, mean, rstd

    fused = lambda x, r, w, b, xb: forward.add_layernorm_fwd_op(x, r, w, b, eps, xb)  # noqa: E731
    return jax.lax.platform_dependent(x, residual, weight, bias, x_bias, **{p: fused for p in platforms},
                                      default=unfused)


def _fused_platforms() -> list[str]:
    """The platforms of FFI_FORWARD_PLATFORMS where this build has the fused forward. A build
    without the CUDA handler has none for CUDA; the jnp forward needs no handler, so inference
    still runs there (only the backward raises, _ffi.py)."""
    return [p for p in FFI_FORWARD_PLATFORMS if p != "cuda" or _ffi.WITH_CUDA]


def _explicitly_sharded(*arrays) -> bool:
    """Whether any array's type names mesh axes (jax.sharding.AxisType.Explicit)."""
    for a in arrays:
        sharding = None if a is None else jax.typeof(a).sharding
        if sharding is not None and any(e is not None for e in getattr(sharding, "spec", ())):
            return True
    return False


# Where the default forward is the fused FFI op (jax.lax.platform_dependent's platform names).
FFI_FORWARD_PLATFORMS = ("cuda",)


def layernorm_fwd(x, weight, bias, *, eps: float = 1e-5):
    """(y, mean, rstd) of layernorm over the last axis; mean/rstd are float32 (float64 for float64).

    weight and/or bias may be None (no scale, no shift)."""
    eps = _check_inputs("layernorm_fwd", x, weight, bias, eps)
    return _forward(x, weight, bias, eps)


def layernorm_bwd(dy, x, weight, mean, rstd, *, kernel: int | None = None, block_size: int | None = None):
    """The raw backward op: (dx, dweight, dbias) given the forward's saved mean and rstd.

    dy and x have any shape (..., C) with C >= 1; weight has shape (C,) and x's dtype, or
    float32 beside bfloat16/float16 x (mixed precision: target v2, float32 dweight/dbias; kernels
    11 and 12); mean and rstd have
    shape x.shape[:-1] and dtype float32 (float64 when x is float64). dweight and dbias are
    summed over all leading axes (under vmap: per example). `kernel` picks a CUDA kernel from
    KERNELS (None: the default); the CPU runs a C++ reference for every kernel.
    Differentiable (both modes, any order), and batchable.
    """
    fn = "layernorm_bwd"
    _check_x(fn, x)
    _check_float(fn, "dy", dy)
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"{fn}: 'dy' has shape {tuple(dy.shape)} but x has shape {tuple(x.shape)}")
    if dy.dtype != x.dtype:
        raise TypeError(f"{fn}: 'dy' has dtype {_dtype_name(dy)} but x has dtype {_dtype_name(x)}")
    if weight is None:
        raise TypeError(f"{fn}: 'weight' must be an array (for no scale pass ones)")
    _check_param(fn, "weight", weight, x)
    stat = reference.acc_dtype(x.dtype)
    for name, s in (("mean", mean), ("rstd", rstd)):
        if not hasattr(s, "shape"):
            raise TypeError(f"{fn}: '{name}' must be an array, got {type(s).__name__}")
        if tuple(s.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"{fn}: '{name}' has shape {tuple(s.shape)} but expected "
                             f"{tuple(x.shape[:-1])} for x of shape {tuple(x.shape)}")
        if s.dtype != stat:
            raise TypeError(f"{fn}: '{name}' has dtype {_dtype_name(s)} but expected {stat} "
                            f"for x of dtype {_dtype_name(x)}")
    kernel, block_size = _resolve_kernel(fn, kernel, block_size, _dtype_name(x), x.shape[-1],
                                         mixed=is_mixed(x, weight))
    if config.xla_backward_enabled():
        return reference.layernorm_bwd(dy, x, weight, mean, rstd)
    return backward.backward(dy, x, weight, mean, rstd, seg_dims=0, kernel=kernel, block_size=block_size,
                             caller=fn)


# --- layernorm --------------------------------------------------------------------------------

@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def _layernorm(x, weight, bias, eps, kernel, block_size):
    return _forward(x, weight, bias, eps)[0]


@_layernorm.defjvp
def _layernorm_jvp(eps, kernel, block_size, primals, tangents):
    """y and its tangent dy = tangent_map(x, weight, mean, rstd; dx, dweight, dbias).

    An absent weight is a scale of ones with a zero tangent, an absent bias a zero tangent:
    both are constants here, not tangents, so reverse mode returns no gradient for them."""
    x, weight, bias = primals
    dx, dweight, dbias = tangents
    y, mean, rstd = _forward(x, weight, bias, eps)
    weight, dweight, dbias = fill_params(x, weight, bias, dweight, dbias)
    dy = primitive.tangent_map(x, weight, mean, rstd, dx, dweight, dbias,
                               seg_dims=0, kernel=kernel, block_size=block_size)
    return y, dy


def fill_params(x, weight, bias, dweight, dbias):
    """(weight, dweight, dbias) with an absent weight as ones and absent tangents as zeros, in the
    parameters' dtype (float32 beside 16-bit x when either present parameter is: then the
    backward runs target v2 and the other parameter's gradient is summed in float32 too)."""
    C = x.shape[-1]
    dtype = jnp.float32 if is_mixed(x, weight, bias) else x.dtype
    if weight is None:
        weight, dweight = jnp.ones((C,), dtype), jnp.zeros((C,), dtype)
    elif weight.dtype != dtype:   # a 16-bit weight beside a float32 bias: exact upcast
        weight, dweight = weight.astype(dtype), dweight.astype(dtype)
    if bias is None:
        dbias = jnp.zeros((C,), dtype)
    return weight, dweight, dbias


def layernorm(x, weight, bias, *, eps: float = 1e-5, kernel: int | None = None, block_size: int | None = None):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias.

    x has any rank >= 1, a last axis (C) of at least 1 element, and dtype float32, bfloat16,
    float16 or float64 (float64 needs jax_enable_x64); weight and bias have shape (C,) and x's
    dtype, or are None (no scale / no shift, like Flax's use_scale=False / use_bias=False; no
    gradient is returned for them). Mixed precision: beside bfloat16/float16 x, weight and bias
    may be float32. They are then never rounded: y is computed in fp32 and rounded once to x's
    dtype, and their gradients are float32 sums from one kernel pass (target v2; kernels 11
    and 12). y always has x's dtype; statistics are float32 (float64 for float64). The forward
    is the fused FFI op on CUDA and jnp elsewhere (jax_lnbwd.use_ffi_forward,
    JAX_LNBWD_FORWARD); the backward (reverse mode) runs our FFI op with `kernel` (None: the
    default kernel). Works under jit, grad and jvp (to any order: jacfwd, jacrev, hessian,
    linearize), vmap, scan, checkpoint and jax.export, and on sharded inputs: jit with
    shardings, and shard_map (see jax_lnbwd/sharding.py).
    """
    fn = "layernorm"
    eps = _check_inputs(fn, x, weight, bias, eps)
    kernel, block_size = _resolve_kernel(fn, kernel, block_size, _dtype_name(x), x.shape[-1],
                                         mixed=is_mixed(x, weight, bias))
    if config.xla_backward_enabled():
        return reference.layernorm(x, weight, bias, eps)
    # Inside shard_map, x usually varies along mesh axes along which a replicated weight and
    # bias do not. jnp's `x * weight` would cast weight to varying; so do we, before the
    # custom_jvp, so that its tangents and cotangents have matching types. The cast's
    # transpose is a psum: the gradient of a replicated weight is summed over the shards,
    # exactly as for jnp code.
    axes = _ffi.varying_axes(*(a for a in (x, weight, bias) if a is not None))
    x, weight, bias = (None if a is None else _ffi.vary(a, axes) for a in (x, weight, bias))
    return _layernorm(x, weight, bias, eps, kernel, block_size)
