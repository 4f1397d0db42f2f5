"""One process of a 2-process run: JAX's distributed runtime on this machine. Every op's
gradients with rows sharded over all devices of the 2 processes must equal this process's own
single-device run. Prints 'ok <op>' per op.

    multiprocess_worker.py PORT PROCESS_ID cpu   # 4 CPU devices per process, gloo collectives
    multiprocess_worker.py PORT PROCESS_ID gpu   # 1 GPU per process (GPU PROCESS_ID), NCCL
"""
from __future__ import annotations

import os
import sys

port, pid = sys.argv[1], int(sys.argv[2])
platform = sys.argv[3] if len(sys.argv) > 3 else "cpu"
if platform == "cpu":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
else:   # this process's one GPU; XLA's GPU collectives are NCCL's
    os.environ["CUDA_VISIBLE_DEVICES"] = str(pid)
import jax  # noqa: E402

if platform == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_lnbwd  # noqa: E402

per_process = 4 if platform == "cpu" else 1
assert jax.device_count() == 2 * per_process and jax.local_device_count() == per_process, jax.devices()
assert jax.devices()[0].platform == platform, jax.devices()
rng = np.random.default_rng(0)   # the same inputs in both processes
x = rng.standard_normal((16, 8, 96)).astype(np.float32)
r = rng.standard_normal((16, 8, 96)).astype(np.float32)
w = (1 + 0.1 * rng.standard_normal(96)).astype(np.float32)
b = rng.standard_normal(96).astype(np.float32)

OPS = {
    "rmsnorm": lambda x, r, w, b: jnp.sum(jax_lnbwd.rmsnorm(x, w, offset=1.0) * r),
    "add_rmsnorm": lambda x, r, w, b: jnp.sum(jax_lnbwd.add_rmsnorm(x, r, w)[0] * r),
    "layernorm": lambda x, r, w, b: jnp.sum(jax_lnbwd.layernorm(x, w, b) * r),
    "add_layernorm": lambda x, r, w, b: jnp.sum(jax_lnbwd.add_layernorm(x, r, w, b)[0] * r),
}
mesh = jax.make_mesh((jax.device_count(),), ("rows",))
rows, rep = NamedSharding(mesh, P("rows")), NamedSharding(mesh, P())


def global_array(a, sharding):
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


for name, loss in OPS.items():
    grad = jax.grad(loss, argnums=(0, 2, 3))
    local = jax.jit(grad)(*(jax.device_put(a, jax.local_devices()[0]) for a in (x, r, w, b)))
    args = (global_array(x, rows), global_array(r, rows), global_array(w, rep), global_array(b, rep))
    got = jax.jit(grad, out_shardings=(rows, rep, rep))(*args)
    for shard in got[0].addressable_shards:   # dx: this process's rows
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(local[0])[shard.index], rtol=2e-5, atol=2e-6)
    for g, want in zip(got[1:], local[1:]):   # dweight, dbias: replicated sums over all rows
        np.testing.assert_allclose(np.asarray(g.addressable_data(0)), np.asarray(want), rtol=2e-5, atol=2e-5)
    print("ok", name, flush=True)
jax.distributed.shutdown()
