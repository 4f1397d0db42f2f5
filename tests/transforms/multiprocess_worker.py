"""One process of test_multiprocess.py: JAX's distributed runtime on this machine, 4 CPU devices
per process, gloo collectives. Every op's gradients with rows sharded over all 8 devices of the
2 processes must equal this process's own single-device run. Prints 'ok <op>' per op."""
from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)
port, pid = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_lnbwd  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
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
mesh = jax.make_mesh((8,), ("rows",))
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
