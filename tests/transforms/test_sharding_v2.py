"""The backward op on several devices with the older GSPMD partitioner, and target v2 (mixed
precision, a residual gradient) sharded: the same checks as test_sharding.py, whose devices,
meshes and helpers these tests use."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_lnbwd
from conftest import assert_close
from jax_lnbwd import LAYERNORM, reference
from test_sharding import assert_grads_close, assert_one_psum_no_gather, env, grads, inputs  # noqa: F401 (env: the fixture)


def test_gspmd_partitioner(env):
    """The older GSPMD partitioner (jax_use_shardy_partitioner=False) uses the same partition
    and infer_sharding_from_operands: same results, same single psum."""
    args = inputs(env.grid(128))
    f = grads(jax_lnbwd.layernorm)
    want = env.one_device(f, *args)
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        jitted, got = env.sharded(f, env.mesh2, P("a", "b"), *args)
        assert_grads_close(got, want)
        assert_one_psum_no_gather(jitted, args, 128)
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)


@pytest.mark.parametrize("residual", [False, True], ids=["no-residual", "residual"])
@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_v2_mixed_precision_and_residual_rows_sharded(env, residual, shardy):
    """Target v2 (ops.backward.partitioned_call) with bf16 data, a float32 weight and a
    residual gradient, rows over both mesh axes: equal to one device's, dx keeps x's sharding,
    dweight/dbias are float32, and the one psum is f32[2, C]; with both partitioners."""
    from jax_lnbwd.ops import backward as backward_op

    rng = np.random.default_rng(3)
    shape, C = env.grid(128), 128
    x, dy, res = (rng.standard_normal(shape).astype(jnp.bfloat16) for _ in range(3))
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    _, mean, rstd = reference.layernorm_fwd(jnp.asarray(x), None, None)

    def f(dy, x, w, mean, rstd, res):
        return backward_op.partitioned_call(dy, x, w, mean, rstd, *((res,) if residual else ()), seg_dims=0,
                                            kernel=12, block_size=0, v2=True, norm=LAYERNORM)
    args = (dy, x, w, mean, rstd, res)
    want = env.one_device(f, *args)
    rows, rep = NamedSharding(env.mesh2, P("a", "b")), NamedSharding(env.mesh2, P())
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        jitted = jax.jit(f, in_shardings=(rows, rows, rep, rows, rows, rows))
        got = jitted(*args)
        assert got[1].dtype == got[2].dtype == jnp.float32
        for name, g, w_ in zip(("dx", "dweight", "dbias"), got, want):
            assert_close(name, g, w_, "bfloat16" if name == "dx" else "float32")
        assert got[0].sharding.is_equivalent_to(rows, 3), got[0].sharding
        assert_one_psum_no_gather(jitted, args, C)
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)
