"""KERNELS: the CUDA kernels of the backward op, what each accepts, and how to size its scratch.

The table is read from the C++ kernel registry (ffi/registry.cc, through the extension module),
which the FFI handlers and the CUDA check tools read too: every fact about a kernel is written
once. Ids 1-10 are llm.c's kernels (dev/cuda/layernorm_backward.cu), each repaired but keeping
its technique; new kernels take ids from 11. `kernel=None` everywhere means DEFAULT_KERNEL. The
CPU handler computes the same math with a C++ reference for every id and refuses what the CUDA
handler refuses, so constraints are checked the same way on every platform: a kernel is never
asked for an input it cannot handle.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping

import jax.numpy as jnp

from . import _jax_lnbwd
from .norms import Norm

# Bytes at the start of the workspace before the partial sums (ffi/kernels/backward/api.h).
WORKSPACE_HEADER_BYTES = 256

ALL_DTYPES = ("float32", "bfloat16", "float16", "float64")

# The device limits that refusals use where there is no GPU to ask: an H100/H200's opt-in
# maximum of dynamic shared memory per block (kDefaultRefusalLimits in ffi/registry.h).
DEFAULT_MAX_SMEM_BYTES: int = int(_jax_lnbwd.default_device_limits["max_smem_per_block"])


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
    # Whether it runs RMSNorm's backward, and what layernorm's target v2 adds (a float32 weight
    # beside 16-bit x, a residual gradient added to dx); the C++ refuses the others.
    rmsnorm: bool
    v2_operands: bool
    constraints: str
    # (C, dtype name, block size) -> None if accepted, else why not (on this machine's GPU, or
    # with DEFAULT_MAX_SMEM_BYTES where there is none).
    refuse: Callable[[int, str, int], str | None]
    # (rows, block size, SM count) -> number of per-block partial slots the launcher may use.
    partial_slots: Callable[[int, int, int], int]


@functools.cache
def device_limits() -> dict:
    """The limits refusals are checked against: {'max_smem_per_block': bytes, 'source': words}.

    Those of the GPUs when the extension has CUDA and finds one (the smallest over the visible
    GPUs), else the registry's defaults (an H100/H200's, DEFAULT_MAX_SMEM_BYTES)."""
    limits = _jax_lnbwd.visible_device_limits()
    return dict(limits if limits is not None else _jax_lnbwd.default_device_limits)


def max_smem_bytes() -> int:
    """Dynamic shared memory a block may opt in to, as refusals use it (see device_limits)."""
    return int(device_limits()["max_smem_per_block"])


def dtype_name(dtype) -> str:
    """The name of any dtype-like ('bfloat16', jnp.bfloat16, np.dtype('float32'), an array's
    .dtype): what the C++ registry takes."""
    return jnp.dtype(dtype).name


def _refuse(kernel: int) -> Callable[[int, object, int], str | None]:
    def refuse(C: int, dtype, block_size: int) -> str | None:
        limits = device_limits()
        return _jax_lnbwd.kernel_refusal(kernel, dtype_name(dtype), int(C), int(block_size),
                                         int(limits["max_smem_per_block"]), str(limits["source"]))
    refuse.__doc__ = (f"None if kernel {kernel} takes rows of C columns of dtype (any dtype-like) at "
                      "block_size, else why not.")
    return refuse


# --- workspace: partial slots per kernel (what each launcher's grid may use) -------------------

def _acc_bytes(dtype: str) -> int:
    return 8 if dtype == "float64" else 4


def _one_slot(rows: int, block_size: int, sms: int) -> int:
    # Kernels that add into dweight/dbias directly (1, 3, 4) need no slot, the others (2, 6, 7,
    # 8) one fp32 scratch row of 2*C; the handler asks for one slot in every workspace.
    del rows, block_size, sms
    return 1


def _persistent_slots(rows: int, block_size: int, sms: int) -> int:
    # llm.c's persistent grid (kernels 9, 10), a slot per block: 1024 / block_size blocks
    # per SM, capped by the rows' warps.
    return max(1, min((1024 // block_size) * sms, math.ceil(rows / (block_size // 32))))


def _kernel5_slots(rows: int, block_size: int, sms: int) -> int:
    # One block per SM, each with its own slot, capped by the rows' warps.
    return max(1, min(sms, math.ceil(rows / (block_size // 32))))


def _kernel11_slots(rows: int, block_size: int, sms: int) -> int:
    # Persistent grid: at most a few blocks per SM (the launcher asks the occupancy API and
    # never uses more slots than the workspace has), and never more blocks than rows.
    del block_size
    return max(1, min(rows, 4 * sms))


_PARTIAL_SLOTS = {1: _one_slot, 2: _one_slot, 3: _one_slot, 4: _one_slot, 5: _kernel5_slots, 6: _one_slot,
                  7: _one_slot, 8: _one_slot, 9: _persistent_slots, 10: _persistent_slots,
                  11: _kernel11_slots, 12: _kernel11_slots}


def _kernel_info(entry: dict) -> KernelInfo:
    kid = int(entry["id"])
    return KernelInfo(
        id=kid, name=str(entry["name"]), description=str(entry["description"]),
        dtypes=tuple(str(d) for d in entry["dtypes"]),
        block_sizes=tuple(int(b) for b in entry["block_sizes"]),
        default_block_size=int(entry["default_block_size"]),
        deterministic=bool(entry["deterministic"]), precise=bool(entry["precise"]),
        segments=bool(entry["segments"]), rmsnorm=bool(entry["rmsnorm"]),
        v2_operands=bool(entry["v2_operands"]), constraints=str(entry["constraints"]),
        refuse=_refuse(kid), partial_slots=_PARTIAL_SLOTS[kid])


KERNELS: Mapping[int, KernelInfo] = {info.id: info for info in map(_kernel_info, _jax_lnbwd.kernels())}

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
    ffi/kernels/common/device_limits.h, with JAX_LNBWD_TEST_DEVICE_LIMITS applied), or an H200's 132 when there is
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


def workspace_bytes(kernel: int, rows: int, C: int, dtype: str, block_size: int, segments: int = 1, *,
                    op: str = "workspace_bytes") -> int:
    """Scratch the kernel needs: a flag header, then 2*C accumulators per partial slot.

    Kernels 11 and 12 on a GPU: exactly what their launcher uses, asked of the C++ that plans the
    launch (norm_bwd_workspace_bytes, ffi/kernels/backward/api.h) for JAX's first GPU. Without one (a
    CPU-only build or machine, where the workspace goes unused), and for llm.c's kernels, by the
    rules of KernelInfo.partial_slots. With segments (per-example sums under vmap) every segment
    gets its own slots; a launcher never uses more slots than it finds. A launch that cannot be
    planned raises, naming `op` (the op whose workspace this is, e.g. "rmsnorm_bwd").
    """
    dev = _cuda_device() if kernel in (11, 12) else None
    if dev is not None:
        from . import _jax_lnbwd

        return int(_jax_lnbwd.launch_plan(kernel, dtype, rows, C, segments, dev, op=op)["workspace_bytes"])
    info = KERNELS[kernel]
    per_segment = info.partial_slots(max(rows // segments, 1), block_size, max(sm_count() // segments, 1))
    return WORKSPACE_HEADER_BYTES + segments * per_segment * 2 * C * _acc_bytes(dtype)


# Kernels that run target v2's additions (a float32 weight beside 16-bit data, a residual gradient
# added to dx) and RMSNorm, from the registry: the C++ refuses the others (ffi/checks/backward.h,
# CheckKernelRuns); Python refuses them at trace time with the same words.
V2_KERNELS = frozenset(k for k, info in KERNELS.items() if info.v2_operands)
RMSNORM_KERNELS = frozenset(k for k, info in KERNELS.items() if info.rmsnorm)


def _ids(kernels: frozenset) -> str:
    ids = [str(k) for k in sorted(kernels)]
    return ", ".join(ids[:-1]) + " and " + ids[-1] if len(ids) > 1 else "".join(ids)


def v2_refusal(kernel: int, *, mixed: bool, residual: bool, norm: Norm) -> str | None:
    """None if `kernel` runs `norm`'s backward and what target v2 adds that this call needs,
    else why not. The registry's rmsnorm fact is about the norm that is not centered."""
    if not norm.centered and kernel not in RMSNORM_KERNELS:
        what, able = f"{norm.name} (its backward)", RMSNORM_KERNELS
    elif (mixed or residual) and kernel not in V2_KERNELS:
        what = ("a float32 weight/bias beside 16-bit x (mixed precision)" if mixed
                else f"an added residual gradient (add_{norm.name})")
        able = V2_KERNELS
    else:
        return None
    return (f"kernel {kernel} does not support {what}; kernels {_ids(able)} do "
            f"(kernel=None picks the default, {DEFAULT_KERNEL})")
