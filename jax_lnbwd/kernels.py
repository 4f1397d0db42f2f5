"""KERNELS: the CUDA kernels of the backward op, what each accepts, and how to size its scratch.

Ids 1-10 are the seed's kernels (llm.c dev/cuda/layernorm_backward.cu); new kernels take ids
from 11. `kernel=None` everywhere means DEFAULT_KERNEL. The CPU handler computes the same math
with a C++ reference for every id, so constraints are checked the same way on every platform:
a kernel is never asked for an input it cannot handle.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping

import numpy as np

# Per-block dynamic shared memory on Hopper (H100/H200) with the opt-in attribute set.
HOPPER_MAX_SMEM_BYTES = 232448
# Bytes at the start of the workspace before the partial sums (ffi/kernels/layernorm_bwd.h).
WORKSPACE_HEADER_BYTES = 256

ALL_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class KernelInfo:
    id: int
    name: str
    description: str
    dtypes: tuple[str, ...]
    block_sizes: tuple[int, ...]
    default_block_size: int
    deterministic: bool
    precise: bool
    constraints: str
    # (C, dtype name, block size) -> None if accepted, else why not.
    refuse: Callable[[int, str, int], str | None]
    # (rows, block size, SM count) -> number of per-block partial slots the launcher may use.
    partial_slots: Callable[[int, int, int], int]


def _acc_bytes(dtype: str) -> int:
    return 8 if dtype == "float64" else 4


def _kernel10_smem(C: int, dtype: str, block_size: int) -> int:
    # Mirrors layernorm_bwd_kernel10_smem_bytes: the larger of the scalar and 16-byte paths.
    acc = _acc_bytes(dtype)
    need = 0
    for vec in (1, 16 // np.dtype(_np_name(dtype)).itemsize):
        per_iter = 32 * vec
        rounded = math.ceil(C / per_iter) * per_iter
        need = max(need, (2 * rounded + 2 * (block_size // 32 - 1) * per_iter) * acc)
    return need


def _np_name(dtype: str) -> str:
    return "uint16" if dtype in ("bfloat16", "float16") else dtype


def _kernel10_refuse(C: int, dtype: str, block_size: int) -> str | None:
    need = _kernel10_smem(C, dtype, block_size)
    if need > HOPPER_MAX_SMEM_BYTES:
        return (f"kernel 10 keeps dweight/dbias sums for all C columns in shared memory: C={C} "
                f"({dtype}, block_size={block_size}) needs {need} bytes, more than the "
                f"{HOPPER_MAX_SMEM_BYTES} a Hopper block can have")
    return None


def _kernel10_slots(rows: int, block_size: int, sms: int) -> int:
    # The seed's grid, 1024 / block_size blocks per SM, capped by the rows' warps.
    return max(1, min((1024 // block_size) * sms, math.ceil(rows / (block_size // 32))))


def _kernel11_slots(rows: int, block_size: int, sms: int) -> int:
    # Persistent grid: at most a few blocks per SM (the launcher asks the occupancy API and
    # never uses more slots than the workspace has), and never more blocks than rows.
    del block_size
    return max(1, min(rows, 4 * sms))


KERNELS: Mapping[int, KernelInfo] = {
    10: KernelInfo(
        id=10,
        name="vector_smem",
        description=("seed kernel 10: a warp per row, 16-byte loads, block sums of dweight/dbias "
                     "in shared memory, last block adds per-block fp32 slots (repaired)"),
        dtypes=ALL_DTYPES,
        block_sizes=(32, 64, 128, 256, 512),
        default_block_size=512,
        deterministic=True,
        precise=True,
        constraints="2*C fp32 sums in shared memory: C up to about 25000 (bf16) / 27000 (fp32) on Hopper",
        refuse=_kernel10_refuse,
        partial_slots=_kernel10_slots,
    ),
    11: KernelInfo(
        id=11,
        name="rows_in_registers",
        description=("default: each row read once and kept in registers for both passes, 16-byte "
                     "streaming loads, persistent grid, per-block fp32 partials + finalize kernel"),
        dtypes=ALL_DTYPES,
        block_sizes=(0,),
        default_block_size=0,
        deterministic=True,
        precise=True,
        constraints=("any C >= 1; block shape chosen from C (block_size 0 = auto); rows up to "
                     "about 25000 columns stay in registers, wider rows take two streaming passes"),
        refuse=lambda C, dtype, block_size: None,
        partial_slots=_kernel11_slots,
    ),
    12: KernelInfo(
        id=12,
        name="bulk_copy_ring",
        description=("default on Hopper: rows streamed into a shared-memory ring by the bulk copy "
                     "engine (cp.async.bulk), several rows ahead; sums in registers; per-block "
                     "fp32 partials + finalize"),
        dtypes=ALL_DTYPES,
        block_sizes=(0,),
        default_block_size=0,
        deterministic=True,
        precise=True,
        constraints=("any C >= 1; the ring needs sm_90 and C*itemsize % 16 == 0 with two rows "
                     "of dy and x per buffer in ~200 KB of shared memory; otherwise it runs kernel 11"),
        refuse=lambda C, dtype, block_size: None,
        partial_slots=_kernel11_slots,
    ),
}

DEFAULT_KERNEL = 12


@functools.cache
def sm_count() -> int:
    """Multiprocessors of the first local CUDA GPU, or an H200's 132 when there is none."""
    try:
        import jax

        return int(jax.devices("gpu")[0].core_count)
    except Exception:  # no GPU backend here: the count only sizes scratch
        return 132


def workspace_bytes(kernel: int, rows: int, C: int, dtype: str, block_size: int, segments: int = 1) -> int:
    """Scratch the kernel needs: a flag header, then 2*C accumulators per partial slot.

    With segments (per-example sums under vmap) every segment gets its own slots; the launcher
    never uses more slots than it finds, so this only has to be an upper bound of what helps.
    """
    info = KERNELS[kernel]
    per_segment = info.partial_slots(max(rows // segments, 1), block_size, max(sm_count() // segments, 1))
    return WORKSPACE_HEADER_BYTES + segments * per_segment * 2 * C * _acc_bytes(dtype)
