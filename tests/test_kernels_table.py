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
from conftest import (DTYPES, PLATFORMS, RTOL, assert_close, make_inputs, put, reference_bwd,
                      reference_stats, shape_id)
from jax_lnbwd import DEFAULT_KERNEL, KERNELS, KernelInfo, layernorm, layernorm_bwd
from jax_lnbwd import kernels as kernels_mod

KERNEL_IDS = sorted(KERNELS)

# A kernel with precise=False may accumulate in lower precision than fp32 (bf16/f16 atomics on
# dweight/dbias, say): it gets this looser tolerance. Provisional: tighten it to what such a
# kernel really gives once one is in the table.
IMPRECISE_RTOL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


def rtol(info: KernelInfo, dtype: str) -> float:
    return RTOL[dtype] if info.precise else IMPRECISE_RTOL[dtype]


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
    # refuse() answers None or a reason, and accepts a small row in every dtype it lists.
    for dtype in info.dtypes:
        for bs in info.block_sizes:
            assert info.refuse(8, dtype, bs) is None, f"kernel {kernel} refuses C=8 {dtype} bs={bs}"


def test_names_are_unique():
    names = [info.name for info in KERNELS.values()]
    assert len(set(names)) == len(names), names


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


# --- every kernel computes the backward -------------------------------------------------------

@functools.cache
def _bwd(kernel, block_size):
    return jax.jit(functools.partial(layernorm_bwd, kernel=kernel, block_size=block_size))


def _check_kernel(platform, kernel, dtype, shape, block_size, seed):
    info = KERNELS[kernel]
    bs = info.default_block_size if block_size is None else block_size
    why = info.refuse(shape[-1], dtype, bs)
    if why is not None:
        pytest.skip(why)
    x, dy, w, _ = make_inputs(shape, dtype, seed=seed)
    mean, rstd = reference_stats(x)
    got = _bwd(kernel, block_size)(*put(platform, dy, x, w, mean, rstd))
    want = reference_bwd(dy, x, w, mean, rstd)
    for name, g, ref in zip(("dx", "dweight", "dbias"), got, want):
        assert g.dtype == jnp.dtype(dtype)
        assert_close(f"kernel {kernel} {name}", g, ref, dtype, rtol(info, dtype))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (5, 1601), (65, 768)], ids=shape_id)
@pytest.mark.parametrize("kernel,dtype", kernel_dtype_params())
def test_kernel_matches_reference(platform, kernel, dtype, shape):
    _check_kernel(platform, kernel, dtype, shape, None, seed=20)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel,block_size",
                         [(k, bs) for k in KERNEL_IDS for bs in KERNELS[k].block_sizes],
                         ids=lambda v: str(v))
def test_kernel_every_block_size(platform, kernel, block_size, dtype):
    if dtype not in KERNELS[kernel].dtypes:
        pytest.skip(f"kernel {kernel} does not take {dtype}")
    _check_kernel(platform, kernel, dtype, (65, 768), block_size, seed=21)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_kernel_through_layernorm_grad(platform, kernel):
    # The kernel choice also works through the public layernorm's custom VJP.
    dtype = KERNELS[kernel].dtypes[0]
    x, r, w, b = make_inputs((9, 130), dtype, seed=22)
    loss = lambda x, w, b, r: jnp.sum(layernorm(x, w, b, kernel=kernel) * r)  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*put(platform, x, w, b, r))
    default = jax.jit(jax.grad(lambda x, w, b, r: jnp.sum(layernorm(x, w, b) * r),
                               argnums=(0, 1, 2)))(*put(platform, x, w, b, r))
    for name, g, ref in zip(("dx", "dweight", "dbias"), got, default):
        # Both are within RTOL of the exact gradient, so within twice it of each other.
        assert_close(f"kernel {kernel} {name}", g, ref, dtype, 2 * rtol(KERNELS[kernel], dtype))


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
                         rtol(KERNELS[kernel], dtype))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_deterministic_kernels_are_bitwise_reproducible(platform, kernel, dtype):
    info = KERNELS[kernel]
    if not info.deterministic:
        pytest.skip(f"kernel {kernel} is not declared deterministic")
    if dtype not in info.dtypes:
        pytest.skip(f"kernel {kernel} does not take {dtype}")
    shape = (333, 1600)
    if info.refuse(shape[-1], dtype, info.default_block_size) is not None:
        pytest.skip(f"kernel {kernel} refuses {shape} {dtype}")
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
def test_gpu_build_has_cuda():
    # On a GPU machine the extension must have been built with the CUDA handler, or every
    # GPU test above would be testing nothing but an error.
    assert jax_lnbwd.WITH_CUDA
