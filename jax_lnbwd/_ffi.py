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


def layernorm_bwd_call(dy, x, weight, mean, rstd, *, kernel: int, block_size: int, workspace_bytes: int):
    """The FFI op on 2-D (rows, C) inputs, already validated. Returns (dx, dweight, dbias)."""
    rows, C = x.shape
    out_types = (
        jax.ShapeDtypeStruct((rows, C), x.dtype),          # dx
        jax.ShapeDtypeStruct((C,), x.dtype),               # dweight
        jax.ShapeDtypeStruct((C,), x.dtype),               # dbias
        jax.ShapeDtypeStruct((workspace_bytes,), np.uint8),  # workspace (flags, partial sums)
    )
    dx, dweight, dbias, _ = jax.ffi.ffi_call(TARGET, out_types, vmap_method="sequential")(
        dy, x, weight, mean, rstd, kernel=np.int32(kernel), block_size=np.int32(block_size))
    return dx, dweight, dbias
