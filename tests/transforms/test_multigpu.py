"""Every norm on two devices: rows sharded under jit, the same under shard_map, and (on GPUs) two
processes of one GPU each through jax.distributed and NCCL.

The `multigpu` cases need two local GPUs and skip with fewer; the same checks run on two of the
CPU host devices that conftest.py configures, so a machine without GPUs tests the programs too.
"Correct" means: the values and the gradients equal one device's, to the usual tolerances, and the
compiled program has no all-gather, all-to-all or collective-permute (no row moves between
devices) and exactly one all-reduce (the parameter gradients' psum).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_lnbwd
from conftest import HAS_GPU, assert_close
from test_multiprocess import run_two_processes
from test_sharding import collectives


def _gpus() -> int:
    return len(jax.devices("gpu")) if HAS_GPU else 0


TWO_GPUS = [pytest.mark.multigpu, pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=TWO_GPUS)]

# Each op as a loss of (x, r, w, b): its output weighted by r (so every element's gradient differs).
OPS = {
    "layernorm": lambda x, r, w, b: jnp.sum(jax_lnbwd.layernorm(x, w, b).astype(jnp.float32) * r),
    "add_layernorm": lambda x, r, w, b: jnp.sum(jax_lnbwd.add_layernorm(x, x, w, b)[0].astype(jnp.float32) * r),
    "rmsnorm": lambda x, r, w, b: jnp.sum(jax_lnbwd.rmsnorm(x, w, offset=1.0).astype(jnp.float32) * r),
    "add_rmsnorm": lambda x, r, w, b: jnp.sum(jax_lnbwd.add_rmsnorm(x, x, w)[0].astype(jnp.float32) * r),
}
# The parameters each op differentiates: rmsnorm's have no bias.
ARGNUMS = {"layernorm": (0, 2, 3), "add_layernorm": (0, 2, 3), "rmsnorm": (0, 2), "add_rmsnorm": (0, 2)}


def _inputs(dtype: str, rows: int = 64, C: int = 1024):
    rng = np.random.default_rng(3)
    t = jnp.dtype(dtype)
    return (rng.standard_normal((rows, 8, C)).astype(t), rng.standard_normal((rows, 8, C)).astype(np.float32),
            (1 + 0.1 * rng.standard_normal(C)).astype(np.float32), rng.standard_normal(C).astype(np.float32))


def _mesh(platform: str) -> Mesh:
    return Mesh(np.array(jax.devices(platform)[:2]), ("rows",), axis_types=(AxisType.Auto,))


def _one_device(platform, grad, args):
    return jax.jit(grad)(*(jax.device_put(a, jax.devices(platform)[0]) for a in args))


def _assert_same(got, want, dtype, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(f"{what} gradient {i}", np.asarray(g, np.float32), np.asarray(w, np.float32), dtype)


def _assert_one_psum(compiled_text: str, what: str):
    ops = collectives(compiled_text)
    moved = [op for op in ops if "all-reduce" not in op]
    assert not moved, f"{what}: rows move between devices:\n" + "\n".join(moved)
    reduces = [op for op in ops if "all-reduce" in op]
    assert len(reduces) == 1, f"{what}: expected one all-reduce (the parameter gradients), got:\n" + "\n".join(reduces)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("platform", DEVICES)
def test_jit_rows_sharded(platform, op, dtype):
    """jit with x's rows sharded over two devices: one device's gradients, one psum, no gather."""
    mesh = _mesh(platform)
    rows, rep = NamedSharding(mesh, P("rows")), NamedSharding(mesh, P())
    args = _inputs(dtype)
    grad = jax.grad(OPS[op], argnums=ARGNUMS[op])
    want = _one_device(platform, grad, args)
    placed = [jax.device_put(a, s) for a, s in zip(args, (rows, rows, rep, rep))]
    jitted = jax.jit(grad, out_shardings=(rows,) + (rep,) * (len(ARGNUMS[op]) - 1))
    got = jitted(*placed)
    assert got[0].sharding.is_equivalent_to(rows, got[0].ndim)
    _assert_same(got, want, dtype, f"{op} on {platform}")
    _assert_one_psum(jitted.lower(*placed).compile().as_text(), f"{op} on {platform}")


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("platform", DEVICES)
def test_shard_map_rows(platform, op):
    """The same gradient inside a shard_map over both devices: each device's kernel sees its own
    rows, and the transpose of the replicated parameters is their psum."""
    mesh = _mesh(platform)
    args = _inputs("float32")
    grad = jax.grad(OPS[op], argnums=ARGNUMS[op])
    want = _one_device(platform, grad, args)
    n_params = len(ARGNUMS[op]) - 1
    mapped = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(P("rows"), P("rows"), P(), P()),
                                   out_specs=(P("rows"),) + (P(),) * n_params))
    rows, rep = NamedSharding(mesh, P("rows")), NamedSharding(mesh, P())
    placed = [jax.device_put(a, s) for a, s in zip(args, (rows, rows, rep, rep))]
    _assert_same(mapped(*placed), want, "float32", f"shard_map {op} on {platform}")
    _assert_one_psum(mapped.lower(*placed).compile().as_text(), f"shard_map {op} on {platform}")


@pytest.mark.slow
@pytest.mark.multigpu
@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_two_processes_one_gpu_each():
    """jax.distributed with one GPU per process (NCCL): each op's gradients, rows sharded over
    both processes' GPUs, equal one GPU's (multiprocess_worker.py)."""
    run_two_processes("gpu")
