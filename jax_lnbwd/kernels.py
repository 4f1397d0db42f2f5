"""KERNELS: the CUDA kernels of the backward op, what each accepts, and how to size its scratch.

Ids 1-10 are the seed's kernels (llm.c dev/cuda/layernorm_backward.cu), each repaired but
keeping its technique; new kernels take ids from 11. `kernel=None` everywhere means
DEFAULT_KERNEL. The CPU handler computes the same math with a C++ reference for every id, so
constraints are checked the same way on every platform: a kernel is never asked for an input
it cannot handle.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping

import numpy as np

# Per-block dynamic shared memory on Hopper (H100/H200) with the opt-in attribute set.
HOPPER_MAX_SMEM_BYTES = 232448
# Bytes at the start of the workspace before the partial sums (ffi/kernels/api.h).
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
    # Whether the kernel keeps one dweight/dbias sum per segment of rows (needed under vmap);
    # the others sum over all rows and the C++ refuses segments > 1 for them.
    segments: bool
    constraints: str
    # (C, dtype name, block size) -> None if accepted, else why not.
    refuse: Callable[[int, str, int], str | None]
    # (rows, block size, SM count) -> number of per-block partial slots the launcher may use.
    partial_slots: Callable[[int, int, int], int]


def _acc_bytes(dtype: str) -> int:
    return 8 if dtype == "float64" else 4


def _kernel10_smem(C: int, dtype: str, block_size: int) -> int:
    # Mirrors layernorm_bwd_kernel10_limits' smem_bytes: the larger of the scalar and 16-byte paths.
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


# --- seed kernels 1-9 (ffi/kernels/kernel0N_*.cu) ----------------------------------------------
# Each launcher checks the same rules (layernorm_bwd_kernelN_limits) and the glue refuses with
# a message; these refuse first, at trace time.

_SEED_DTYPES = ("float32", "bfloat16", "float16")
# The seed's block sizes: powers of two from one warp to 1024 threads. Each kernel's default is
# the fastest one measured on the H200 at the seed's shape, 8192x1600 in bf16 and fp32 (8192x1536
# for kernels 8-9, which need whole x128 steps): `tests/cuda/harness.cu blocks`, whose output
# is docs/harness_blocks_h200.txt. The same constants are in the launchers (kDefaultBlockSize).
_SEED_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024)


def _seed_smem(kernel: int, C: int, block_size: int) -> int:
    """Dynamic shared memory (bytes) of seed kernel `kernel` per block: fp32 sums of dbias and
    dweight (2*C floats), plus a flag (kernels 5-9) and kernel 9's staging area."""
    if kernel == 1:
        return 0
    if kernel in (2, 3, 4):
        return 2 * C * 4
    if kernel in (5, 6, 7, 8):
        return (2 * C + 1) * 4
    return (2 * C + 2 * block_size + 1) * 4


def _seed_c_multiple(kernel: int, dtype: str) -> int:
    """Kernels 8 and 9 step over a row in whole warps of 16-byte vectors: 32 * (16 / itemsize)."""
    if kernel in (8, 9):
        return 32 * (16 // np.dtype(_np_name(dtype)).itemsize)
    return 1


def _seed_refuse(kernel: int) -> Callable[[int, str, int], str | None]:
    def refuse(C: int, dtype: str, block_size: int) -> str | None:
        m = _seed_c_multiple(kernel, dtype)
        if C % m:
            return (f"kernel {kernel} steps over rows in whole warps of 16-byte vectors: C must be a "
                    f"multiple of {m} for {dtype}, got C={C}")
        need = _seed_smem(kernel, C, block_size)
        if need > HOPPER_MAX_SMEM_BYTES:
            return (f"kernel {kernel} keeps dweight/dbias sums for all C columns in shared memory: "
                    f"C={C} (block_size={block_size}) needs {need} bytes, more than the "
                    f"{HOPPER_MAX_SMEM_BYTES} a Hopper block can have")
        return None
    return refuse


def _one_slot(rows: int, block_size: int, sms: int) -> int:
    # Kernels that add into dweight/dbias directly (1, 3, 4) need no slot, the others (2, 6, 7,
    # 8) one fp32 scratch row of 2*C; the handler asks for one slot in every workspace.
    del rows, block_size, sms
    return 1


def _persistent_slots(rows: int, block_size: int, sms: int) -> int:
    # The seed's persistent grid (kernels 9, 10), a slot per block: 1024 / block_size blocks
    # per SM, capped by the rows' warps.
    return max(1, min((1024 // block_size) * sms, math.ceil(rows / (block_size // 32))))


def _kernel5_slots(rows: int, block_size: int, sms: int) -> int:
    # One block per SM, each with its own slot, capped by the rows' warps.
    return max(1, min(sms, math.ceil(rows / (block_size // 32))))


def _seed_kernel(id: int, name: str, description: str, *, dtypes=_SEED_DTYPES, default_block_size: int,
                 deterministic: bool = False, precise: bool = True, constraints: str,
                 partial_slots=_one_slot) -> KernelInfo:
    return KernelInfo(id=id, name=name, description=description, dtypes=dtypes,
                      block_sizes=_SEED_BLOCK_SIZES, default_block_size=default_block_size,
                      deterministic=deterministic, precise=precise, segments=False,
                      constraints=constraints, refuse=_seed_refuse(id), partial_slots=partial_slots)


# What limits C for the kernels that keep all C columns' sums in shared memory.
_SMEM_2C = "2*C fp32 sums in shared memory: C up to 29056 on Hopper"
_SMEM_2C_FLAG = "2*C fp32 sums and a flag in shared memory: C up to 29055 on Hopper"


def _kernel11_slots(rows: int, block_size: int, sms: int) -> int:
    # Persistent grid: at most a few blocks per SM (the launcher asks the occupancy API and
    # never uses more slots than the workspace has), and never more blocks than rows.
    del block_size
    return max(1, min(rows, 4 * sms))


KERNELS: Mapping[int, KernelInfo] = {
    1: _seed_kernel(
        1, "naive",
        ("seed kernel 1: a thread per row loops over C (uncoalesced), global fp32 atomicAdd "
         "into dweight/dbias (zeroed first)"),
        dtypes=("float32",), default_block_size=32,
        constraints="float32 only; any C >= 1"),
    2: _seed_kernel(
        2, "smem_reduce",
        ("seed kernel 2: a warp per row (cooperative groups), block sums in shared memory with "
         "shared atomics, global atomics into one fp32 scratch row, then a conversion kernel"),
        default_block_size=1024,
        constraints="any C >= 1; " + _SMEM_2C),
    3: _seed_kernel(
        3, "persistent_atomics",
        ("seed kernel 3: persistent grid of warps, shared-memory sums, each block adds them "
         "into dweight/dbias with atomics in the output dtype (bf16/f16 atomics lose precision)"),
        default_block_size=1024, precise=False,
        constraints="any C >= 1; " + _SMEM_2C),
    4: _seed_kernel(
        4, "atomic_cas_bf16",
        ("seed kernel 4: kernel 3 with the final bf16 adds as atomicCAS loops on bf16 pairs "
         "(bf16 running sums lose precision)"),
        dtypes=("bfloat16",), default_block_size=1024, precise=False,
        constraints="bfloat16 only; any C >= 1; " + _SMEM_2C),
    5: _seed_kernel(
        5, "block_scratch",
        ("seed kernel 5: one persistent block per SM, shared-memory sums written to per-block "
         "fp32 slots, the last block adds the slots"),
        default_block_size=1024, partial_slots=_kernel5_slots,
        constraints="any C >= 1; " + _SMEM_2C_FLAG),
    6: _seed_kernel(
        6, "shared_scratch",
        ("seed kernel 6: persistent warps, shared-memory sums added with global fp32 atomics "
         "into one scratch row, the last block converts it"),
        default_block_size=1024,
        constraints="any C >= 1; " + _SMEM_2C_FLAG),
    7: _seed_kernel(
        7, "no_cooperative_groups",
        "seed kernel 7: kernel 6 written with plain warp shuffles instead of cooperative groups",
        default_block_size=1024,
        constraints="any C >= 1; " + _SMEM_2C_FLAG),
    8: _seed_kernel(
        8, "x128",
        ("seed kernel 8: kernel 7 with 16-byte loads and stores, shared sums in a "
         "bank-conflict-free transposed order"),
        default_block_size=1024,
        constraints=("C a multiple of 128 (float32) or 256 (bfloat16, float16): whole warp "
                     "steps of 16-byte vectors; " + _SMEM_2C_FLAG)),
    9: _seed_kernel(
        9, "block_reduce",
        ("seed kernel 9: kernel 8 with a cross-warp reduction through shared memory instead of "
         "atomics, per-block fp32 slots added in order by the last block"),
        default_block_size=512, deterministic=True, partial_slots=_persistent_slots,
        constraints=("C a multiple of 128 (float32) or 256 (bfloat16, float16): whole warp "
                     "steps of 16-byte vectors; 2*C + 2*block_size fp32 in shared memory: "
                     "C + block_size up to 29055 on Hopper")),
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
        segments=False,
        constraints="2*C fp32 sums in shared memory: C up to about 25000 (bf16) / 27000 (fp32) on Hopper",
        refuse=_kernel10_refuse,
        partial_slots=_persistent_slots,
    ),
    11: KernelInfo(
        id=11,
        name="rows_in_registers",
        description=("kernel 12's fallback: each row read once and kept in registers for both "
                     "passes, 16-byte streaming loads, persistent grid, per-block fp32 partials "
                     "summed by the grid itself after a grid-wide barrier"),
        dtypes=ALL_DTYPES,
        block_sizes=(0,),
        default_block_size=0,
        deterministic=True,
        precise=True,
        segments=True,
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
                     "fp32 partials summed by the grid itself after a grid-wide barrier"),
        dtypes=ALL_DTYPES,
        block_sizes=(0,),
        default_block_size=0,
        deterministic=True,
        precise=True,
        segments=True,
        constraints=("any C >= 1; the ring needs sm_90 and C*itemsize % 16 == 0 with two rows "
                     "of dy and x per buffer in 227 KB of shared memory; fp32/bf16/fp16 rows are "
                     "split over a cluster of two blocks (half a row each) from C = 4096 in 16-bit "
                     "and where a whole row does not fit, up to C = 16384 fp32 and 32768 16-bit "
                     "(halves 16-byte aligned); other fp32 rows up to C = 16384 stream in chunks, "
                     "twice (wide-row path); otherwise kernel 11"),
        refuse=lambda C, dtype, block_size: None,
        partial_slots=_kernel11_slots,
    ),
}

DEFAULT_KERNEL = 12


@functools.cache
def _cuda_device() -> int | None:
    """CUDA ordinal of JAX's first GPU, when this build has the CUDA handler and JAX a GPU."""
    from . import _jax_lnbwd

    if not _jax_lnbwd.with_cuda:
        return None
    try:
        import jax

        gpus = jax.devices("gpu")
    except Exception:  # no GPU backend here
        return None
    if not gpus:
        return None
    hw = getattr(gpus[0], "local_hardware_id", None)
    return int(hw if hw is not None else gpus[0].id)


@functools.cache
def sm_count() -> int:
    """Multiprocessors of the first local CUDA GPU, as the launchers see them (the device's limits,
    ffi/kernels/api.h, with JAX_LNBWD_TEST_DEVICE_LIMITS applied), or an H200's 132 when there is
    no GPU."""
    dev = _cuda_device()
    if dev is not None:
        from . import _jax_lnbwd

        return int(_jax_lnbwd.device_limits(dev)["sms"])
    try:
        import jax

        return int(jax.devices("gpu")[0].core_count)
    except Exception:  # no GPU backend here: the count only sizes scratch
        return 132


def workspace_bytes(kernel: int, rows: int, C: int, dtype: str, block_size: int, segments: int = 1) -> int:
    """Scratch the kernel needs: a flag header, then 2*C accumulators per partial slot.

    Kernels 11 and 12 on a GPU: exactly what their launcher uses, asked of the C++ that plans the
    launch (layernorm_bwd_workspace_bytes, ffi/kernels/api.h) for JAX's first GPU. Without one (a
    CPU-only build or machine, where the workspace goes unused), and for the seed kernels, by the
    rules of KernelInfo.partial_slots. With segments (per-example sums under vmap) every segment
    gets its own slots; a launcher never uses more slots than it finds.
    """
    dev = _cuda_device() if kernel in (11, 12) else None
    if dev is not None:
        from . import _jax_lnbwd

        return int(_jax_lnbwd.launch_plan(kernel, dtype, rows, C, segments, dev)["workspace_bytes"])
    info = KERNELS[kernel]
    per_segment = info.partial_slots(max(rows // segments, 1), block_size, max(sm_count() // segments, 1))
    return WORKSPACE_HEADER_BYTES + segments * per_segment * 2 * C * _acc_bytes(dtype)
