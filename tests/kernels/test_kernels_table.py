"""KERNELS: the table is complete and consistent, and every kernel computes the backward.

Tests iterate over KERNELS, so a kernel added to the table is tested without editing this
file, within what its entry declares: its dtypes, block sizes, refuse() and flags. On the CPU
every id runs the C++ reference (so these check the table and the plumbing); on a GPU each runs
its own CUDA kernel.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lnbwd
from conftest import (DTYPES, HAS_GPU, PLATFORMS, assert_close, direct_ffi_call, f64, kernel_rtol, make_inputs,
                      put, reference_bwd, reference_stats, shape_id)
from jax_lnbwd import DEFAULT_KERNEL, KERNELS, KernelInfo, layernorm, layernorm_bwd
from jax_lnbwd import kernels as kernels_mod

KERNEL_IDS = sorted(KERNELS)


def rows_above_grid() -> int:
    """One row more than the 32 * SMs warps of the llm.c kernels' persistent grids (kernels 3-10
    at their defaults): one warp gets a second row while every other warp has none, the case that
    broke the barriers of llm.c's kernels 9 and 10 (on the CPU: an H200's 132 SMs)."""
    return 32 * kernels_mod.sm_count() + 1


# Every kernel x dtype runs these: C from 1 to 8192 (odd and misaligned ones, llm.c's 1600
# that kernels 8 and 9 could not do, and wider than a 48 KB shared-memory block holds) with 1
# and 7 rows, and more rows than the persistent grids have warps.
SHAPES = [(rows, C) for C in (1, 3, 768, 1600, 1601, 4096, 8192) for rows in (1, 7)] + [(rows_above_grid(), 768)]
# On the CPU every kernel id runs the same C++ reference and ignores block_size, so there every
# kernel x dtype runs these few shapes and only the default kernel in float32 runs all SHAPES
# (each case costs a compile); the GPU, where each id is its own CUDA kernel, runs them all.
# Refusals are checked everywhere.
CPU_SHAPES = {(1, 1), (7, 3), (7, 1601), (1, 8192)}

def kernel_dtype_params():
    return [pytest.param(k, d, id=f"k{k}-{d}") for k in KERNEL_IDS for d in KERNELS[k].dtypes]


# --- the table ------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_entry_is_consistent(kernel):
    info = KERNELS[kernel]
    assert isinstance(info, KernelInfo)
    assert type(info.id) is int and info.id == kernel and info.id >= 1
    assert isinstance(info.name, str) and info.name
    assert isinstance(info.description, str) and info.description.strip()
    assert isinstance(info.constraints, str)
    assert isinstance(info.dtypes, tuple) and info.dtypes
    assert set(info.dtypes) <= set(DTYPES) and len(set(info.dtypes)) == len(info.dtypes)
    assert isinstance(info.block_sizes, tuple) and info.block_sizes
    # 0 means "the kernel picks" (a kernel that sizes its blocks from C lists only 0).
    assert all(type(b) is int and b >= 0 for b in info.block_sizes)
    assert len(set(info.block_sizes)) == len(info.block_sizes)
    assert info.default_block_size in info.block_sizes
    assert type(info.deterministic) is bool and type(info.precise) is bool
    assert type(info.segments) is bool
    # refuse() answers None or a reason, and accepts a small row in every dtype it lists: C=8,
    # or C=256 for a kernel that steps over rows in whole warps of 16-byte vectors.
    for dtype in info.dtypes:
        for bs in info.block_sizes:
            accepted = [C for C in (8, 256) if info.refuse(C, dtype, bs) is None]
            assert accepted, f"kernel {kernel} refuses C=8 and C=256 {dtype} bs={bs}"
            for C in (1, 8, 256, 1600, 2**20):
                why = info.refuse(C, dtype, bs)
                assert why is None or (isinstance(why, str) and f"kernel {kernel}" in why)


def test_names_are_unique():
    names = [info.name for info in KERNELS.values()]
    assert len(set(names)) == len(names), names


def test_segments_field():
    # Only kernels 11 and 12 keep one dweight/dbias sum per segment (per example under vmap).
    assert {k for k, info in KERNELS.items() if info.segments} == {11, 12}


def test_rmsnorm_and_v2_fields():
    # Only kernels 11 and 12 run RMSNorm and what target v2 adds; the Python refusals read the
    # same facts.
    assert {k for k, info in KERNELS.items() if info.rmsnorm} == kernels_mod.RMSNORM_KERNELS == {11, 12}
    assert {k for k, info in KERNELS.items() if info.v2_operands} == kernels_mod.V2_KERNELS == {11, 12}


@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_unsupported_dtypes_raise(kernel):
    # A dtype a kernel is not built for is a ValueError at trace time (kernel 1 takes only
    # float32, kernel 4 only bfloat16, ...). Shapes are abstract: nothing runs.
    info = KERNELS[kernel]
    for dtype in DTYPES:
        if dtype in info.dtypes:
            continue
        with pytest.raises(ValueError, match=f"kernel {kernel}"):
            jax.eval_shape(functools.partial(layernorm_bwd, kernel=kernel), *_abstract_args((4, 256), dtype))


def test_default_kernel():
    assert DEFAULT_KERNEL in KERNELS
    assert set(KERNELS[DEFAULT_KERNEL].dtypes) == set(DTYPES)


@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_workspace_holds_a_partial_slot(kernel):
    # The CUDA handler rejects a workspace without the header and one slot of 2*C sums.
    info = KERNELS[kernel]
    for dtype in info.dtypes:
        acc = 8 if dtype == "float64" else 4
        for rows in (0, 1, 7, 100_000):
            for C in (1, 768, 4100):
                n = kernels_mod.workspace_bytes(kernel, rows, C, dtype, info.default_block_size)
                assert n >= kernels_mod.WORKSPACE_HEADER_BYTES + 2 * C * acc


def test_kernel_info_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KERNELS[DEFAULT_KERNEL].default_block_size = 1


# --- the table is the C++ registry's -----------------------------------------------------------

def test_table_is_read_from_the_registry():
    # ffi/registry.cc is the one place the facts are written; KERNELS shows each of its entries.
    from jax_lnbwd import _jax_lnbwd
    entries = _jax_lnbwd.kernels()
    assert [e["id"] for e in entries] == KERNEL_IDS
    for e in entries:
        info = KERNELS[e["id"]]
        for field in ("name", "description", "dtypes", "block_sizes", "default_block_size", "deterministic",
                      "precise", "segments", "rmsnorm", "v2_operands", "constraints"):
            assert getattr(info, field) == e[field], (e["id"], field)


def test_refusals_use_the_device_limits(monkeypatch):
    # Shared memory comes from the GPU when there is one, else from the registry's documented
    # default (an H100/H200's opt-in maximum); a smaller GPU refuses a narrower C.
    limits = kernels_mod.device_limits()
    assert limits["max_smem_per_block"] > 48 * 1024 and limits["source"]
    if not HAS_GPU:
        assert kernels_mod.max_smem_bytes() == kernels_mod.DEFAULT_MAX_SMEM_BYTES == 232448
    assert KERNELS[2].refuse(20000, "float32", 1024) is None
    monkeypatch.setattr(kernels_mod, "device_limits", lambda: {"max_smem_per_block": 101376, "source": "a small GPU"})
    why = KERNELS[2].refuse(20000, "float32", 1024)
    assert why == ("kernel 2 keeps dweight/dbias sums for all C columns in shared memory: C=20000 (float32, "
                   "block_size 1024) needs 160000 bytes, more than the 101376 a block may have on a small GPU")
    assert KERNELS[12].refuse(20000, "float32", 0) is None   # its limits do not depend on the device


@pytest.mark.parametrize("kernel,dtype,C,block_size,match", [
    (1, "bfloat16", 8, 32, "kernel 1 does not support dtype bfloat16 (it takes float32)"),
    (2, "float32", 8, 48, "kernel 2 got block_size 48 but expected 0 (its default, 1024) or a power of two "
                          "from 32 to 1024"),
    (10, "float32", 8, 1024, "kernel 10 got block_size 1024 but expected 0 (its default, 512)"),
    (12, "float32", 8, 256, "kernel 12 got block_size 256 but expected 0: it chooses its block shape from C"),
    (9, "float16", 1600, 512, "kernel 9 steps over rows in whole warps of 16-byte vectors: C must be a "
                              "multiple of 256 for float16, got C=1600"),
    (5, "float32", 29056, 32, "kernel 5 keeps dweight/dbias sums for all C columns in shared memory: C=29056"),
])
def test_refusal_names_kernel_setting_and_limit(kernel, dtype, C, block_size, match):
    why = KERNELS[kernel].refuse(C, dtype, block_size)
    assert why is not None and why.startswith(match), why


@pytest.mark.parametrize("kernel,dtype,C,block_size,segments", [
    (9, np.float32, 1600, 0, 1),     # C not whole x128 steps
    (2, np.float32, 40000, 0, 1),    # shared memory
    (1, np.float16, 8, 0, 1),        # dtype
    (6, np.float32, 8, 48, 1),       # block size
    (12, np.float32, 8, 64, 1),      # kernel 12 picks its own block shape
    (3, np.float32, 8, 0, 2),        # segments
])
def test_cpu_handler_refuses_as_the_registry(kernel, dtype, C, block_size, segments):
    # The CPU handler checks a direct call against the same registry as the CUDA handler (with
    # the default device limits), and says what KernelInfo.refuse says.
    rows = 2 * segments
    ones = np.ones((rows, C), dtype)
    with pytest.raises(Exception) as e:
        direct_ffi_call("cpu", ones, ones, np.ones((1, C), dtype), np.zeros(rows, np.float32),
                        np.ones(rows, np.float32), segments=segments, kernel=kernel, block_size=block_size)
    message = str(e.value)
    assert "layernorm_bwd: kernel " + str(kernel) in message, message
    why = KERNELS[kernel].refuse(C, np.dtype(dtype).name, block_size)
    if segments == 1:
        assert why is not None and why in message, (why, message)
    else:
        assert "'dweight'" in message


def test_cpu_handler_refuses_unknown_kernels():
    ones = np.ones((2, 8), np.float32)
    for kernel in (0, 13, -1):
        with pytest.raises(Exception, match="'kernel' is"):
            direct_ffi_call("cpu", ones, ones, np.ones((1, 8), np.float32), np.zeros(2, np.float32),
                            np.ones(2, np.float32), kernel=kernel)


# --- every kernel computes the backward -------------------------------------------------------

@functools.cache
def _bwd(kernel, block_size):
    return jax.jit(functools.partial(layernorm_bwd, kernel=kernel, block_size=block_size))


def _abstract_args(shape, dtype):
    """(dy, x, weight, mean, rstd) of layernorm_bwd as shapes only, for jax.eval_shape."""
    stat = jnp.float64 if dtype == "float64" else jnp.float32
    data = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    return (data, data, jax.ShapeDtypeStruct(shape[-1:], jnp.dtype(dtype)),
            jax.ShapeDtypeStruct(shape[:-1], stat), jax.ShapeDtypeStruct(shape[:-1], stat))


def _reference_bwd_np(dy, x, weight, mean, rstd):
    """jax_lnbwd.reference.layernorm_bwd's formulas in numpy float64: the same oracle without a
    compile for every new shape (test_numpy_reference_is_the_reference checks they agree)."""
    dy, x, weight, mean, rstd = (f64(a) for a in (dy, x, weight, mean, rstd))
    xhat = (x - mean[:, None]) * rstd[:, None]
    g = weight * dy
    a = g.mean(axis=-1, keepdims=True)
    b = (g * xhat).mean(axis=-1, keepdims=True)
    return (g - a - xhat * b) * rstd[:, None], (dy * xhat).sum(axis=0), dy.sum(axis=0)


def test_numpy_reference_is_the_reference():
    for shape in ((1, 1), (7, 1601)):
        x, dy, w, _ = make_inputs(shape, "float32", seed=19)
        mean, rstd = reference_stats(x)
        for got, want in zip(_reference_bwd_np(dy, x, w, mean, rstd), reference_bwd(dy, x, w, mean, rstd)):
            assert_close("numpy reference", got, want, "float64")


@functools.cache
def _case(shape, dtype, seed):
    """Inputs (dy, x, weight, mean, rstd) and the float64 reference (dx, dweight, dbias),
    shared by every kernel that runs this case."""
    x, dy, w, _ = make_inputs(shape, dtype, seed=seed)
    mean, rstd = reference_stats(x)
    return (dy, x, w, mean, rstd), _reference_bwd_np(dy, x, w, mean, rstd)


def _check_kernel(platform, kernel, dtype, shape, block_size, seed, *, cpu_runs=True):
    """Runs `kernel` on `shape` against the float64 reference, or, for a C it refuses, checks
    that it raises. cpu_runs=False: on the CPU only the refusal is checked."""
    info = KERNELS[kernel]
    bs = info.default_block_size if block_size is None else block_size
    why = info.refuse(shape[-1], dtype, bs)
    if why is not None:
        # A refused C never reaches the kernel: a ValueError with the kernel's reason at trace time.
        with pytest.raises(ValueError) as e:
            jax.eval_shape(functools.partial(layernorm_bwd, kernel=kernel, block_size=block_size),
                           *_abstract_args(shape, dtype))
        assert why in str(e.value)
        return
    if platform == "cpu" and not cpu_runs:
        pytest.skip("the CPU runs the same C++ reference for every kernel id; see CPU_SHAPES")
    args, want = _case(shape, dtype, seed)
    got = _bwd(kernel, block_size)(*put(platform, *args))
    for name, g, ref in zip(("dx", "dweight", "dbias"), got, want):
        assert g.dtype == jnp.dtype(dtype)
        assert_close(f"kernel {kernel} {name}", g, ref, dtype, kernel_rtol(info, dtype))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel,dtype", kernel_dtype_params())
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_kernel_matches_reference(platform, kernel, dtype, shape):
    _check_kernel(platform, kernel, dtype, shape, None, seed=20,
                  cpu_runs=shape in CPU_SHAPES or (kernel == DEFAULT_KERNEL and dtype == "float32"))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel,block_size",
                         [(k, bs) for k in KERNEL_IDS for bs in KERNELS[k].block_sizes],
                         ids=lambda v: str(v))
def test_kernel_every_block_size(platform, kernel, block_size, dtype):
    info = KERNELS[kernel]
    if dtype not in info.dtypes:
        pytest.skip(f"kernel {kernel} does not take {dtype}")
    # The CPU ignores block_size (test_lowering checks that it reaches the call).
    _check_kernel(platform, kernel, dtype, (65, 768), block_size, seed=21,
                  cpu_runs=block_size == info.default_block_size)


@functools.cache
def _default_grad(platform, dtype, C):
    """Gradients of sum(layernorm(x, w, b) * r) with the default kernel (inputs as below)."""
    x, r, w, b = make_inputs((9, C), dtype, seed=22)
    grad = jax.jit(jax.grad(lambda x, w, b, r: jnp.sum(layernorm(x, w, b) * r), argnums=(0, 1, 2)))
    return grad(*put(platform, x, w, b, r))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_kernel_through_layernorm_grad(platform, kernel):
    # The kernel choice also works through the public layernorm's custom VJP.
    info = KERNELS[kernel]
    dtype = info.dtypes[0]
    C = 130 if info.refuse(130, dtype, info.default_block_size) is None else 256
    x, r, w, b = make_inputs((9, C), dtype, seed=22)
    loss = lambda x, w, b, r: jnp.sum(layernorm(x, w, b, kernel=kernel) * r)  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*put(platform, x, w, b, r))
    for name, g, ref in zip(("dx", "dweight", "dbias"), got, _default_grad(platform, dtype, C)):
        # Both are within their tolerance of the exact gradient, so within twice it of each other.
        assert_close(f"kernel {kernel} {name}", g, ref, dtype, 2 * kernel_rtol(KERNELS[kernel], dtype))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_kernel_under_vmap(platform, kernel):
    # vmap of the backward needs per-example dweight/dbias. A kernel either gives them (one
    # sum per example, as the reference example by example) or refuses with a ValueError
    # naming the kernel while tracing; it must never return sums over the whole batch.
    dtype = KERNELS[kernel].dtypes[0]
    batch = [make_inputs((5, 48), dtype, seed=24 + i) for i in range(3)]
    x, dy, w, _ = (np.stack(a) for a in zip(*batch))
    stats = [reference_stats(xi) for xi in x]
    mean, rstd = np.stack([m for m, _ in stats]), np.stack([s for _, s in stats])
    f = jax.jit(jax.vmap(functools.partial(layernorm_bwd, kernel=kernel)))
    args = put(platform, dy, x, w, mean, rstd)
    try:
        jax.eval_shape(f, *args)
    except ValueError as e:
        assert "kernel" in str(e)
        return
    got = f(*args)
    for i in range(len(batch)):
        want = reference_bwd(dy[i], x[i], w[i], mean[i], rstd[i])
        for name, g, ref in zip(("dx", "dweight", "dbias"), got, want):
            assert_close(f"kernel {kernel} example {i} {name}", g[i], ref, dtype,
                         kernel_rtol(KERNELS[kernel], dtype))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_deterministic_kernels_are_bitwise_reproducible(platform, kernel, dtype):
    info = KERNELS[kernel]
    if not info.deterministic:
        pytest.skip(f"kernel {kernel} is not declared deterministic")
    if dtype not in info.dtypes:
        pytest.skip(f"kernel {kernel} does not take {dtype}")
    # llm.c's C=1600, or 1536 for a kernel that needs whole warp steps of 16-byte vectors.
    shape = (333, 1600 if info.refuse(1600, dtype, info.default_block_size) is None else 1536)
    x, dy, w, _ = make_inputs(shape, dtype, seed=23)
    mean, rstd = reference_stats(x)
    args = put(platform, dy, x, w, mean, rstd)
    f = _bwd(kernel, None)
    first = [np.asarray(a) for a in f(*args)]
    second = [np.asarray(a) for a in f(*args)]
    for name, a, b in zip(("dx", "dweight", "dbias"), first, second):
        # Compare bit patterns: equal values, and NaNs or signed zeros would not hide a change.
        assert a.tobytes() == b.tobytes(), f"kernel {kernel} {name} differs between two runs"


@pytest.mark.gpu
def test_refusals_use_the_gpus_shared_memory():
    # With a GPU, the trace-time refusals use its opt-in shared memory per block (an H100/H200:
    # 232448 bytes, the same as the default), asked of the CUDA runtime by the extension.
    limits = kernels_mod.device_limits()
    assert limits["source"] == "this GPU"
    assert 48 * 1024 < limits["max_smem_per_block"] <= 256 * 1024
    C = limits["max_smem_per_block"] // 8   # kernel 2 needs 2*C floats: exactly the limit
    assert KERNELS[2].refuse(C, "float32", 1024) is None
    assert "shared memory" in KERNELS[2].refuse(C + 1, "float32", 1024)


@pytest.mark.gpu
def test_gpu_build_has_cuda():
    # On a GPU machine the extension must have been built with the CUDA handler, or every
    # GPU test above would be testing nothing but an error.
    assert jax_lnbwd.WITH_CUDA


def test_refuse_takes_any_dtype_like():
    """refuse() takes a name, a jnp scalar type or a numpy dtype alike."""
    import jax.numpy as jnp
    import numpy as np
    from jax_lnbwd import KERNELS
    for like in ("float32", jnp.float32, np.dtype("float32")):
        assert "C must be a multiple of 128" in KERNELS[8].refuse(16, like, 256)
        assert KERNELS[8].refuse(128, like, 256) is None
