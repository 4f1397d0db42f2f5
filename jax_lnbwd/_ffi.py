"""Registers our FFI handlers with XLA at import, and wraps the raw ffi_call.

The target name carries a version: exported programs refer to it by name, so a change of
signature gets a new name and old names stay registered.
"""
from __future__ import annotations

import jax
import numpy as np

from . import _jax_lnbwd

TARGET = "jax_lnbwd_layernorm_bwd_v1"
WITH_CUDA: bool = bool(_jax_lnbwd.with_cuda)

for _name, _capsule, _platform in _jax_lnbwd.registrations():
    jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)


def layernorm_bwd_segments(dy, x, weight, mean, rstd, *, segments: int, kernel: int, block_size: int,
                           workspace_bytes: int):
    """The FFI op on validated inputs: (dx, dweight, dbias).

    dy, x: (rows, C); mean, rstd: (rows,); weight: (1, C) shared by all rows, or (segments, C).
    The rows form `segments` equal contiguous segments and dweight, dbias have shape
    (segments, C): the sums over each segment's rows (per-example gradients under vmap).

    This is the bare primitive: it has no batching rule (no `vmap_method`, which newer JAX
    may not accept) and no derivative. layernorm.py wraps it in a jax.custom_batching.custom_vmap
    (vmap becomes one call with more segments) and a jax.custom_vjp (its derivative in jnp).
    """
    rows, C = x.shape
    out_types = (
        jax.ShapeDtypeStruct((rows, C), x.dtype),            # dx
        jax.ShapeDtypeStruct((segments, C), x.dtype),        # dweight
        jax.ShapeDtypeStruct((segments, C), x.dtype),        # dbias
        jax.ShapeDtypeStruct((workspace_bytes,), np.uint8),  # workspace (flags, partial sums)
    )
    dx, dweight, dbias, _ = jax.ffi.ffi_call(TARGET, out_types)(
        dy, x, weight, mean, rstd, kernel=np.int32(kernel), block_size=np.int32(block_size))
    return dx, dweight, dbias
