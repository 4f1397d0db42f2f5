"""Wide rows through the default kernel: C = 12288, 12292, 16384, 32768 and 65536 in
every dtype.

On an H200 these take different paths of kernel 12 (see jax_lnbwd.KERNELS[12].constraints):
fp32, bf16 and fp16 at 12288 and 16384 and bf16/fp16 at 32768 the row ring with split rows (a
cluster of two blocks, each taking half of every row and trading its half's sums with the
other); fp32 at 12292 (a multiple of 4, not of 8, so its halves would not be 16-byte aligned)
the wide-row path (a row streamed through a chunk ring, once per pass); bf16/fp16 at 12292
(rows not 16-byte aligned) and fp64 kernel 11 (its rows in registers up to about 25000
columns); fp32 at 32768 and every dtype at 65536 kernel 11's two-pass path. Each is checked
against the float64 reference, with more rows than the GPU has SMs, and for bit-identical
results run to run.
"""
import jax
import numpy as np
import pytest

import jax_lnbwd
from conftest import DTYPES, PLATFORMS, assert_close, make_inputs, put, reference_bwd, reference_stats
from jax_lnbwd import kernels as kernels_mod

WIDTHS = (12288, 12292, 16384, 32768, 65536)


def rows_for(platform: str) -> int:
    if platform == "cpu":
        return 3   # the C++ reference is the same code at every width: a few rows keep it short
    # Two rows per SM and one more: a block (one per SM) takes a third row.
    return 2 * kernels_mod.sm_count() + 1


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", WIDTHS)
def test_default_kernel_wide_rows(platform, dtype, C):
    x, dy, w, _ = make_inputs((rows_for(platform), C), dtype, seed=C % 97)
    mean, rstd = reference_stats(x)
    want = reference_bwd(dy, x, w, mean, rstd)
    args = put(platform, dy, x, w, mean, rstd)
    f = jax.jit(jax_lnbwd.layernorm_bwd)
    got = f(*args)
    for name, g, ref in zip(("dx", "dweight", "dbias"), got, want):
        assert_close(f"C={C} {name}", g, ref, dtype)
    again = f(*args)
    for name, g, h in zip(("dx", "dweight", "dbias"), got, again):
        assert np.asarray(g).tobytes() == np.asarray(h).tobytes(), f"C={C} {name} differs between runs"
