"""The FFI target's segments, called directly: rows in S equal segments, one sum each.

jax_lnbwd.TARGET takes weight (1, C) or (S, C) and returns dweight/dbias of shape (S, C): the
sums over each of S equal, contiguous segments of rows, each segment with its own weight row
when weight has S rows (per-example gradients under vmap). layernorm_bwd uses S = 1; these
tests check S > 1 for every kernel against the reference applied segment by segment.
"""
from __future__ import annotations


import numpy as np
import pytest

from conftest import (PLATFORMS, assert_close, direct_ffi_call, make_inputs, reference_bwd,
                      reference_stats)
from jax_lnbwd import KERNELS

KERNEL_IDS = sorted(KERNELS)


def sums_per_segment(kernel: int) -> bool:
    """Whether `kernel` keeps one dweight/dbias sum per segment. The CPU handler refuses what the
    CUDA handler refuses (the same registry), although its C++ reference could do any id."""
    return KERNELS[kernel].segments


def _segments_case(platform, kernel, dtype, rows, C, segments, per_segment_weight, seed):
    info = KERNELS[kernel]
    if dtype not in info.dtypes:
        pytest.skip(f"kernel {kernel} does not take {dtype}")
    if info.refuse(C, dtype, info.default_block_size) is not None:
        pytest.skip(f"kernel {kernel} refuses C={C}")
    x, dy, _, _ = make_inputs((rows, C), dtype, seed=seed)
    weights = np.stack([make_inputs((1, C), dtype, seed=seed + 1 + s)[2]
                        for s in range(segments if per_segment_weight else 1)])
    mean, rstd = reference_stats(x)
    call = lambda: direct_ffi_call(platform, dy, x, weights, mean, rstd, segments=segments,  # noqa: E731
                                   kernel=kernel, block_size=info.default_block_size)
    if (segments > 1 or len(weights) > 1) and not sums_per_segment(kernel):
        # A kernel that sums over all rows only must refuse, not compute one sum for all.
        with pytest.raises(Exception, match="'dweight'|'weight'"):
            call()
        return
    dx, dweight, dbias = call()
    assert dx.shape == (rows, C) and dweight.shape == dbias.shape == (segments, C)
    n = rows // segments
    for s in range(segments):
        rs = slice(s * n, (s + 1) * n)
        w = weights[s if per_segment_weight else 0]
        want = reference_bwd(dy[rs], x[rs], w, mean[rs], rstd[rs])
        for name, got, ref in zip(("dx", "dweight", "dbias"), (dx[rs], dweight[s], dbias[s]), want):
            assert_close(f"kernel {kernel} segment {s} {name}", got, ref, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("per_segment_weight", [False, True], ids=["shared-weight", "weight-per-segment"])
@pytest.mark.parametrize("rows,C,segments", [
    pytest.param(rows, C, S, id=f"{rows}x{C}-S{S}")
    for rows, C, S in [(6, 40, 1), (6, 40, 2), (12, 768, 3), (8, 1601, 8)]
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_segments_match_reference(platform, kernel, dtype, rows, C, segments, per_segment_weight):
    _segments_case(platform, kernel, dtype, rows, C, segments, per_segment_weight, seed=30)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kernel", KERNEL_IDS, ids=lambda k: f"k{k}")
def test_segments_of_zero_rows_are_zero(platform, kernel):
    if platform == "gpu" and not sums_per_segment(kernel):
        pytest.skip(f"kernel {kernel} sums over all rows only")
    x, dy, w, _ = make_inputs((0, 8), "float32", seed=31)
    mean, rstd = reference_stats(x)
    dx, dweight, dbias = direct_ffi_call(platform, dy, x, w[None], mean, rstd, segments=2, kernel=kernel,
                                         block_size=KERNELS[kernel].default_block_size)
    assert dx.shape == (0, 8)
    np.testing.assert_array_equal(dweight, np.zeros((2, 8), np.float32))
    np.testing.assert_array_equal(dbias, np.zeros((2, 8), np.float32))


def test_target_names_come_from_the_extension():
    # ffi/targets.h is the one place a target's name is written: the registrations, targets()
    # and the norms' rows (jax_lnbwd.TARGETS) all show the same names, each registered once per
    # platform the build has.
    from jax_lnbwd import TARGETS, _jax_lnbwd
    names = set(_jax_lnbwd.targets().values())
    assert names == set(TARGETS)
    regs = _jax_lnbwd.registrations()
    platforms = {"cpu", "CUDA"} if _jax_lnbwd.with_cuda else {"cpu"}
    assert sorted((n, p) for n, _, p in regs) == sorted((n, p) for n in names for p in platforms)
