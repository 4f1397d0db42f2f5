"""llm.c's kernels 1-9 (its dev/cuda/layernorm_backward.cu, repaired): their table entries,
the rules by which they refuse inputs, their workspace, and (on a GPU) the C++ handler's own
refusals and the cases that broke llm.c's originals.

test_kernels_table.py runs every kernel over its dtypes and shapes; this file checks what is
particular to the llm.c kernels. Everything here is cheap on the CPU: the trace-time checks run
on abstract shapes, and the GPU cases are skipped.
"""
from __future__ import annotations

import functools
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (IMPRECISE_MANY_BLOCKS_RTOL, PLATFORMS, RTOL, assert_close, direct_ffi_call, kernel_rtol,
                      make_inputs, put, reference_bwd, reference_stats)
from jax_lnbwd import KERNELS, layernorm, layernorm_bwd
from jax_lnbwd import kernels as kernels_mod

LLMC_IDS = list(range(1, 10))
ALL_THREE = ("float32", "bfloat16", "float16")
GPU = [pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def _abstract(shape, dtype):
    """(dy, x, weight, mean, rstd) of layernorm_bwd as shapes only, for jax.eval_shape."""
    data = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    stat = jax.ShapeDtypeStruct(shape[:-1], jnp.float64 if dtype == "float64" else jnp.float32)
    return data, data, jax.ShapeDtypeStruct(shape[-1:], jnp.dtype(dtype)), stat, stat


def _trace(kernel, shape, dtype, block_size=None):
    return jax.eval_shape(functools.partial(layernorm_bwd, kernel=kernel, block_size=block_size),
                          *_abstract(shape, dtype))


# --- the table ------------------------------------------------------------------------------

def test_llmc_entries():
    names = {1: "naive", 2: "smem_reduce", 3: "persistent_atomics", 4: "atomic_cas_bf16",
             5: "block_scratch", 6: "shared_scratch", 7: "no_cooperative_groups", 8: "x128",
             9: "block_reduce"}
    for k in LLMC_IDS:
        info = KERNELS[k]
        assert info.name == names[k]
        # At least the dtypes llm.c built each kernel for; no float64.
        assert info.dtypes == {1: ("float32",), 4: ("bfloat16",)}.get(k, ALL_THREE)
        assert info.block_sizes == (32, 64, 128, 256, 512, 1024)
        assert info.default_block_size in info.block_sizes
        assert info.segments is False
        # Only kernel 9 avoids float atomics; kernels 3 and 4 accumulate in the output dtype.
        assert info.deterministic is (k == 9)
        assert info.precise is (k not in (3, 4))


def test_launcher_facts_are_the_registrys():
    # The launchers' defaults, largest block sizes and dtypes are written once, in
    # ffi/kernels/backward/llmc/llmc_limits.h, which the registry (hence KERNELS) reads too: no launcher
    # keeps a default of its own, and the header's table is what KERNELS shows.
    llmc = pathlib.Path(__file__).resolve().parents[2] / "ffi" / "kernels" / "llmc"
    if not llmc.is_dir():
        pytest.skip("the CUDA sources are not beside the tests")
    for src in sorted(llmc.glob("kernel*.cu")):
        assert "kDefaultBlockSize" not in src.read_text(), src.name
    rows = re.findall(r"\{([^{}]*), (\d+), (\d+)\},\s*// (\d+):", (llmc / "llmc_limits.h").read_text())
    assert [int(r[3]) for r in rows] == LLMC_IDS + [10]
    for _, default, largest, k in rows:
        info = KERNELS[int(k)]
        assert info.default_block_size == int(default) and max(info.block_sizes) == int(largest), k


# --- what they refuse, and that refusing is a ValueError at trace time -------------------------

@pytest.mark.parametrize("kernel", [8, 9], ids=lambda k: f"k{k}")
def test_whole_x128_steps(kernel):
    # Kernels 8 and 9 step over a row in whole warps of 16-byte vectors: 32 * 4 floats, or
    # 32 * 8 bf16/f16. llm.c's kernel 9 trapped on C=1600 and kernel 8 silently skipped the
    # last columns; both refuse such C instead.
    info = KERNELS[kernel]
    for dtype, multiple in (("float32", 128), ("bfloat16", 256), ("float16", 256)):
        for C in (multiple, 768, 1536, 4096, 8192):
            assert info.refuse(C, dtype, 512) is None, (C, dtype)
        for C in (1, 3, 8, 100, 1600, 1601, multiple + 64):
            why = info.refuse(C, dtype, 512)
            assert why is not None and f"multiple of {multiple}" in why, (C, dtype)


@pytest.mark.parametrize("kernel", [1, 2, 3, 4, 5, 6, 7], ids=lambda k: f"k{k}")
def test_any_c(kernel):
    info = KERNELS[kernel]
    for dtype in info.dtypes:
        for C in (1, 2, 3, 31, 33, 1600, 1601, 4096, 8191):
            for bs in info.block_sizes:
                assert info.refuse(C, dtype, bs) is None, (C, dtype, bs)


def test_shared_memory_limits():
    # The fp32 sums of dbias and dweight for all C columns must fit a Hopper block's 232448
    # bytes: 2*C floats (kernels 2-4), plus a flag (5-8), plus kernel 9's staging area of two
    # floats per thread. Kernel 1 keeps nothing in shared memory.
    assert KERNELS[1].refuse(2**20, "float32", 1024) is None
    for k in (2, 3, 4):
        dtype = KERNELS[k].dtypes[0]
        assert KERNELS[k].refuse(29056, dtype, 1024) is None
        assert "shared memory" in KERNELS[k].refuse(29057, dtype, 32)
    for k in (5, 6, 7):
        assert KERNELS[k].refuse(29055, "float32", 1024) is None
        assert "shared memory" in KERNELS[k].refuse(29056, "float32", 32)
    assert KERNELS[8].refuse(28928, "bfloat16", 512) is None          # 113 * 256
    assert "shared memory" in KERNELS[8].refuse(29184, "bfloat16", 512)   # 114 * 256
    # Kernel 9: C + block_size up to 29055.
    assert KERNELS[9].refuse(28928, "bfloat16", 32) is None
    assert "shared memory" in KERNELS[9].refuse(28928, "bfloat16", 256)
    assert KERNELS[9].refuse(27904, "bfloat16", 1024) is None
    assert "shared memory" in KERNELS[9].refuse(28160, "bfloat16", 1024)


@pytest.mark.parametrize("kernel,dtype,C,block_size,match", [
    (9, "bfloat16", 1600, None, "multiple of 256"),
    (9, "float32", 1600, None, "multiple of 128"),
    (8, "float16", 1601, None, "multiple of 256"),
    (1, "bfloat16", 768, None, "kernel 1 supports dtypes float32"),
    (4, "float32", 768, None, "kernel 4 supports dtypes bfloat16"),
    (3, "float64", 768, None, "kernel 3 supports dtypes"),
    (2, "float32", 40000, None, "shared memory"),
    (9, "bfloat16", 28160, 1024, "shared memory"),
    (5, "float32", 768, 48, "block_size"),
    (6, "float32", 768, 16, "block_size"),
    (7, "float32", 768, 2048, "block_size"),
], ids=lambda v: str(v))
def test_refusals_raise_at_trace_time(kernel, dtype, C, block_size, match):
    with pytest.raises(ValueError, match=match):
        _trace(kernel, (4, C), dtype, block_size)
    # The public layernorm refuses the same when its backward is traced.
    x = jax.ShapeDtypeStruct((4, C), jnp.dtype(dtype))
    w = jax.ShapeDtypeStruct((C,), jnp.dtype(dtype))
    loss = lambda x, w, b: jnp.sum(layernorm(x, w, b, kernel=kernel, block_size=block_size))  # noqa: E731
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), x, w, w)


@pytest.mark.parametrize("kernel", LLMC_IDS, ids=lambda k: f"k{k}")
def test_vmap_is_refused(kernel):
    # The llm.c kernels sum over all rows: per-example dweight/dbias under vmap are refused.
    dtype = KERNELS[kernel].dtypes[0]
    dy, x, w, mean, rstd = _abstract((3, 4, 256), dtype)
    f = jax.vmap(functools.partial(layernorm_bwd, kernel=kernel), in_axes=(0, 0, None, 0, 0))
    with pytest.raises(ValueError, match=f"kernel {kernel}"):
        jax.eval_shape(f, dy, x, w, mean, rstd)


# --- workspace --------------------------------------------------------------------------------

def test_workspace_slots():
    # Partial slots of 2*C fp32 mirror each launcher's grid: one per block for kernels 5 (one
    # block per SM) and 9 (1024 / block_size blocks per SM), capped by the rows' warps; one
    # scratch row (or none, but the handler wants one) for the others.
    sms = kernels_mod.sm_count()
    C = 768
    slot = 2 * C * 4
    for k in (1, 2, 3, 4, 6, 7, 8):
        for rows in (1, 7, 10**6):
            info = KERNELS[k]
            assert kernels_mod.workspace_bytes(k, rows, C, info.dtypes[0], 512) == 256 + slot
    assert kernels_mod.workspace_bytes(5, 1, C, "float32", 1024) == 256 + slot
    assert kernels_mod.workspace_bytes(5, 33, C, "float32", 1024) == 256 + 2 * slot
    assert kernels_mod.workspace_bytes(5, 10**6, C, "float32", 1024) == 256 + sms * slot
    assert kernels_mod.workspace_bytes(9, 7, C, "float32", 32) == 256 + 7 * slot
    assert kernels_mod.workspace_bytes(9, 10**6, C, "float32", 512) == 256 + 2 * sms * slot
    assert kernels_mod.workspace_bytes(9, 10**6, C, "float32", 32) == 256 + 32 * sms * slot
    rows = 32 * sms + 1
    assert kernels_mod.workspace_bytes(9, rows, C, "float32", 1024) == 256 + sms * slot
    assert KERNELS[9].partial_slots(rows, 64, sms) == min(16 * sms, math.ceil(rows / 2))


# --- the C++ handler (GPU): its own refusals, and the cases that broke llm.c's originals ----------

@pytest.mark.parametrize("platform", GPU)
@pytest.mark.parametrize("kernel,dtype,C,block_size,segments,match", [
    (2, np.float32, 256, 48, 1, "kernel 2 got block_size 48"),
    (5, np.float32, 256, 2048, 1, "kernel 5 got block_size 2048"),
    (9, jnp.bfloat16, 1600, 0, 1, "multiple of 256"),
    (8, np.float32, 1600, 0, 1, "multiple of 128"),
    (1, jnp.bfloat16, 256, 0, 1, "kernel 1 does not support dtype bfloat16"),
    (4, np.float32, 256, 0, 1, "kernel 4 does not support dtype float32"),
    (2, np.float32, 40000, 0, 1, "shared memory"),
    (3, np.float32, 256, 0, 2, "'dweight'"),
], ids=lambda v: str(v))
def test_handler_refuses(platform, kernel, dtype, C, block_size, segments, match):
    # Called directly (no Python checks), the CUDA handler refuses with a message naming the
    # kernel and the setting, before anything is launched.
    rows = 4
    ones = np.ones((rows, C), dtype)
    with pytest.raises(Exception, match=match) as e:
        direct_ffi_call(platform, ones, ones, np.ones((1, C), dtype), np.zeros(rows, np.float32),
                        np.ones(rows, np.float32), segments=segments, kernel=kernel, block_size=block_size)
    assert "layernorm_bwd:" in str(e.value)


@pytest.mark.parametrize("platform", GPU)
@pytest.mark.parametrize("kernel", LLMC_IDS, ids=lambda k: f"k{k}")
def test_block_size_zero_is_the_default(platform, kernel):
    # block_size 0 (a direct call's "kernel's choice") runs the kernel's default block size.
    dtype = KERNELS[kernel].dtypes[0]
    x, dy, w, _ = make_inputs((9, 256), dtype, seed=40)
    mean, rstd = reference_stats(x)
    got = direct_ffi_call(platform, dy, x, w[None], mean, rstd, kernel=kernel, block_size=0)
    want = reference_bwd(dy, x, w, mean, rstd)
    for name, g, ref in zip(("dx", "dweight", "dbias"), got, want):
        assert_close(f"kernel {kernel} {name}", g.reshape(ref.shape), ref, dtype, kernel_rtol(KERNELS[kernel], dtype))


@functools.cache
def _many_rows_case(dtype):
    """Inputs and float64 reference for 32 * SMs + 1 rows of 768 (shared by all cases below)."""
    x, dy, w, _ = make_inputs((32 * kernels_mod.sm_count() + 1, 768), dtype, seed=41)
    mean, rstd = reference_stats(x)
    return (dy, x, w, mean, rstd), reference_bwd(dy, x, w, mean, rstd)


@pytest.mark.parametrize("platform", GPU)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel,block_size",
                         [(k, bs) for k in LLMC_IDS for bs in KERNELS[k].block_sizes], ids=lambda v: str(v))
def test_every_block_size_with_more_rows_than_warps(platform, kernel, block_size, dtype):
    # One row more than the 32 * SMs warps of the persistent grids: one warp of one block gets a
    # second row, all others none. llm.c's kernel 9 (and 10) had barriers inside the row loop
    # that such warps skipped; kernel 2 dropped the shared sums of warps without a row.
    info = KERNELS[kernel]
    if dtype not in info.dtypes:
        pytest.skip(f"kernel {kernel} does not take {dtype}")
    args, want = _many_rows_case(dtype)
    f = jax.jit(functools.partial(layernorm_bwd, kernel=kernel, block_size=block_size))
    got = f(*put(platform, *args))
    # dx is computed row by row in fp32 by every kernel: RTOL. Only the sums may be imprecise.
    sums_tol = RTOL[dtype] if info.precise else IMPRECISE_MANY_BLOCKS_RTOL[dtype]
    for name, g, ref in zip(("dx", "dweight", "dbias"), got, want):
        assert_close(f"kernel {kernel} {name}", g, ref, dtype, RTOL[dtype] if name == "dx" else sums_tol)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", LLMC_IDS, ids=lambda k: f"k{k}")
def test_outputs_are_written_not_accumulated(platform, kernel):
    # XLA's output buffers are uninitialized (often the previous call's results): two calls in
    # one program whose outputs XLA may place in the same buffers must each give the reference.
    info = KERNELS[kernel]
    dtype = info.dtypes[0]
    x, dy, w, _ = make_inputs((7, 256), dtype, seed=42)
    mean, rstd = reference_stats(x)
    bwd = functools.partial(layernorm_bwd, kernel=kernel)

    @jax.jit
    def twice(dy, x, w, mean, rstd):
        first = bwd(dy, x, w, mean, rstd)
        second = bwd(2 * dy, x, w, mean, rstd)
        return first, second

    first, second = twice(*put(platform, dy, x, w, mean, rstd))
    tol = kernel_rtol(info, dtype)
    for scale, got in ((1, first), (2, second)):
        want = reference_bwd((scale * dy.astype(np.float64)).astype(dy.dtype), x, w, mean, rstd)
        for name, g, ref in zip(("dx", "dweight", "dbias"), got, want):
            assert_close(f"kernel {kernel} call {scale} {name}", g, ref, dtype, tol)
