"""Registers our FFI handlers with XLA at import, and wraps the raw ffi_call.

The target name carries a version: exported programs refer to it by name, so a change of
signature gets a new name and old names stay registered.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _jax_lnbwd

TARGET = "jax_lnbwd_layernorm_bwd_v1"
# v2: v1 plus a float32 weight beside bfloat16/float16 data (mixed precision) and a residual
# gradient added to dx in the kernel (layernorm_bwd_segments_v2).
TARGET_V2 = "jax_lnbwd_layernorm_bwd_v2"
WITH_CUDA: bool = bool(_jax_lnbwd.with_cuda)

for _name, _capsule, _platform in _jax_lnbwd.registrations():
    jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)


def _default_platform() -> str:
    """The platform a computation traced now will run on unless told otherwise: that of
    jax.default_device (or the jax_default_device setting) when set, else the default backend's.
    Under jit the tracers carry no device, so this is the best trace time can know."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


def check_handler_for_default_platform(op: str = "layernorm_bwd"):
    """Raises at trace time if the FFI call of `op` is headed for a GPU with no handler of ours.

    A build without nvcc has only the CPU handlers (WITH_CUDA False). On a GPU XLA would fail
    only when compiling, with "No FFI handler registered ... on a platform CUDA", which says
    neither why nor what to do. The check sits at each FFI call, not in layernorm: layernorm's
    forward is jnp, so inference on the GPU still works with such a build; only the backward
    (and the optional FFI forward, forward.layernorm_fwd_op) needs the handler."""
    if WITH_CUDA or _default_platform() not in ("gpu", "cuda", "rocm"):
        return
    raise RuntimeError(
        f"{op}: this jax_lnbwd was built without its CUDA handler (jax_lnbwd.WITH_CUDA is "
        "False: no CUDA compiler, nvcc, was found when it was built), but JAX's default device "
        f"is a GPU ({_default_platform()}), where {op} cannot run. Install a jax_lnbwd wheel "
        "built with the CUDA kernels, or rebuild from source with the CUDA toolkit's nvcc on "
        "the PATH: JAX_LNBWD_CUDA=ON pip install . (ON fails loudly if nvcc is missing). To run "
        "on the CPU instead, use jax.default_device(jax.devices('cpu')[0]).")


def varying_axes(*arrays) -> frozenset:
    """The shard_map mesh axes along which any of the arrays varies (their type's "varying
    manual axes"): empty outside shard_map, and with shard_map(check_vma=False)."""
    return frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))


def vary(a, axes: frozenset):
    """`a`, typed as varying along `axes` too. A no-op at run time (the values are the same on
    every device); under autodiff its transpose is a psum over the added axes."""
    missing = tuple(axes - varying_axes(a))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


def layernorm_bwd_segments(dy, x, weight, mean, rstd, *, segments: int, kernel: int, block_size: int,
                           workspace_bytes: int):
    """The FFI op on validated inputs: (dx, dweight, dbias).

    dy, x: (rows, C); mean, rstd: (rows,); weight: (1, C) shared by all rows, or (segments, C).
    The rows form `segments` equal contiguous segments and dweight, dbias have shape
    (segments, C): the sums over each segment's rows (per-example gradients under vmap).

    This is the bare primitive: it has no batching rule (no `vmap_method`, which newer JAX
    may not accept), no derivative and no sharding rule. backward.py wraps it in a
    jax.custom_batching.custom_vmap (vmap becomes one call with more segments) and a
    jax.custom_jvp (its derivative in jnp), and sharding.py in a custom_partitioning.

    Inside shard_map JAX types every value with the mesh axes it varies along, and an FFI
    call's results have the types we declare: all inputs are brought to the same varying
    axes (a replicated weight next to sharded rows, say) and the results vary along them too.
    """
    check_handler_for_default_platform()
    axes = varying_axes(dy, x, weight, mean, rstd)
    dy, x, weight, mean, rstd = (vary(a, axes) for a in (dy, x, weight, mean, rstd))
    typed = _typed(axes)
    rows, C = x.shape
    out_types = (
        jax.ShapeDtypeStruct((rows, C), x.dtype, **typed),            # dx
        jax.ShapeDtypeStruct((segments, C), x.dtype, **typed),        # dweight
        jax.ShapeDtypeStruct((segments, C), x.dtype, **typed),        # dbias
        jax.ShapeDtypeStruct((workspace_bytes,), np.uint8, **typed),  # workspace (flags, partial sums)
    )
    dx, dweight, dbias, _ = jax.ffi.ffi_call(TARGET, out_types)(
        dy, x, weight, mean, rstd, kernel=np.int32(kernel), block_size=np.int32(block_size))
    return dx, dweight, dbias


def _typed(axes: frozenset) -> dict:
    """ShapeDtypeStruct keywords for results varying along `axes`: outside shard_map the results
    are plain; inside, typed on the (manual) mesh in effect."""
    if not axes:
        return {}
    return dict(sharding=jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), P()),
                manual_axis_type=jax.sharding.ManualAxisType(varying=axes))


def check_v2_args(x, weight, dresidual) -> None:
    """Trace-time checks of what target v2 adds: the weight's dtype and dresidual's shape/dtype."""
    x_dtype, w_dtype = np.dtype(x.dtype), np.dtype(weight.dtype)
    sixteen = x_dtype in (np.dtype(jax.numpy.bfloat16), np.dtype(np.float16))
    if w_dtype != x_dtype and not (sixteen and w_dtype == np.float32):
        allowed = f"{x_dtype} or float32" if sixteen else str(x_dtype)
        raise TypeError(f"layernorm_bwd: 'weight' has dtype {w_dtype} but expected {allowed} "
                        f"for x of dtype {x_dtype}")
    if dresidual is not None:
        if tuple(dresidual.shape) != tuple(x.shape):
            raise ValueError(f"layernorm_bwd: 'dresidual' has shape {tuple(dresidual.shape)} but x has "
                             f"shape {tuple(x.shape)}")
        if np.dtype(dresidual.dtype) != x_dtype:
            raise TypeError(f"layernorm_bwd: 'dresidual' has dtype {np.dtype(dresidual.dtype)} but x has "
                            f"dtype {x_dtype}")


def layernorm_bwd_segments_v2(dy, x, weight, mean, rstd, *, segments: int, kernel: int, block_size: int,
                              workspace_bytes: int, dresidual=None, alias_residual: bool = False):
    """Target v2 on validated inputs: (dx, dweight, dbias), as layernorm_bwd_segments, plus:

    * mixed precision: weight may be float32 beside bfloat16/float16 dy and x. g = weight * dy
      is then formed in fp32 from the float32 weight (never rounded to 16 bits), and dweight,
      dbias have weight's dtype: the fp32 sums, stored as float32. One kernel pass, no cast of x.
    * dresidual (rows, C) of x's dtype: a gradient added to dx inside the kernel,
      dx = layernorm's dx + dresidual, summed in fp32 and rounded once. It is the residual
      stream's gradient of a fused add + layernorm. The kernel reads each element of it once and
      writes dx once. By default dx is a buffer of its own: in a transformer block the residual
      stream's gradient is also read by the matmuls and the bias gradient of the branch it came
      through, so XLA would have to copy it first to write dx into it (a copy of a whole
      activation per block, as slow as the add that the fusion saves). alias_residual=True
      passes it aliased to dx (input_output_aliases) instead: dx is written into dresidual's
      buffer, which saves that buffer where dresidual is dead after the call. The kernels take
      either (each element of dresidual is read by the thread that then writes it as dx).

    Absent dresidual is a zero-size placeholder with the attribute has_residual=False (one target,
    no aliasing then). Kernels 1-10 refuse both additions. Same shard_map typing as v1.
    """
    check_handler_for_default_platform()
    check_v2_args(x, weight, dresidual)
    has_residual = dresidual is not None
    if dresidual is None:
        dresidual = jax.numpy.zeros((0,), x.dtype)
    axes = varying_axes(dy, x, weight, mean, rstd, dresidual)
    dy, x, weight, mean, rstd, dresidual = (vary(a, axes) for a in (dy, x, weight, mean, rstd, dresidual))
    typed = _typed(axes)
    rows, C = x.shape
    out_types = (
        jax.ShapeDtypeStruct((rows, C), x.dtype, **typed),            # dx
        jax.ShapeDtypeStruct((segments, C), weight.dtype, **typed),   # dweight
        jax.ShapeDtypeStruct((segments, C), weight.dtype, **typed),   # dbias
        jax.ShapeDtypeStruct((workspace_bytes,), np.uint8, **typed),  # workspace (flags, partial sums)
    )
    aliases = {5: 0} if has_residual and alias_residual else None
    call = jax.ffi.ffi_call(TARGET_V2, out_types, input_output_aliases=aliases)
    dx, dweight, dbias, _ = call(dy, x, weight, mean, rstd, dresidual, kernel=np.int32(kernel),
                                 block_size=np.int32(block_size), has_residual=has_residual)
    return dx, dweight, dbias
