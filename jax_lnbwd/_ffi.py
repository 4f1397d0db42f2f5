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
