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


def check_handler_for_default_platform():
    """Raises at trace time if the backward is headed for a GPU that has no handler of ours.

    A build without nvcc has only the CPU handler (WITH_CUDA False). On a GPU XLA would fail
    only when compiling, with "No FFI handler registered ... on a platform CUDA", which says
    neither why nor what to do. Only the backward needs the handler (the forward is jnp), so
    the check sits at the FFI call: inference on the GPU still works with such a build."""
    if WITH_CUDA or _default_platform() not in ("gpu", "cuda", "rocm"):
        return
    raise RuntimeError(
        "layernorm_bwd: this jax_lnbwd was built without its CUDA handler (jax_lnbwd.WITH_CUDA "
        "is False: no CUDA compiler, nvcc, was found when it was built), but JAX's default "
        f"device is a GPU ({_default_platform()}), where the backward pass cannot run. Install "
        "a jax_lnbwd wheel built with the CUDA kernels, or rebuild from source with the CUDA "
        "toolkit's nvcc on the PATH: JAX_LNBWD_CUDA=ON pip install . (ON fails loudly if nvcc "
        "is missing). To run on the CPU instead, use jax.default_device(jax.devices('cpu')[0]).")


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
    may not accept), no derivative and no sharding rule. layernorm.py wraps it in a
    jax.custom_batching.custom_vmap (vmap becomes one call with more segments) and a
    jax.custom_jvp (its derivative in jnp), and sharding.py in a custom_partitioning.

    Inside shard_map JAX types every value with the mesh axes it varies along, and an FFI
    call's results have the types we declare: all inputs are brought to the same varying
    axes (a replicated weight next to sharded rows, say) and the results vary along them too.
    """
    check_handler_for_default_platform()
    axes = varying_axes(dy, x, weight, mean, rstd)
    dy, x, weight, mean, rstd = (vary(a, axes) for a in (dy, x, weight, mean, rstd))
    # Outside shard_map the results are plain; inside, typed on the (manual) mesh in effect.
    typed = dict(sharding=jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), P()),
                 manual_axis_type=jax.sharding.ManualAxisType(varying=axes)) if axes else {}
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
