"""Exports a fixed set of programs (layernorm grad with targets v1 and v2, add_layernorm with
x_bias, the fused forward) for cpu and cuda, with their inputs and CPU results, for
tests/api/test_exported_compat.py: programs exported by an earlier jax_lnbwd must load and run
on this one (target names are baked into exported programs).

    python tools/export_compat.py OUT_DIR
"""
import os, sys
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
import jax, jax.numpy as jnp, numpy as np
from jax import export
import jax_lnbwd
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
r = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
w = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
b = jnp.asarray(rng.standard_normal(64), jnp.float32)
progs = {
  "layernorm_grad_v1": (lambda x, w, b: jax.grad(lambda x, w, b: jnp.sum(jax_lnbwd.layernorm(x, w, b) ** 2), argnums=(0, 1, 2))(x, w, b), (x, w, b)),
  "layernorm_grad_mixed_v2": (lambda x, w, b: jax.grad(lambda x, w, b: jnp.sum(jax_lnbwd.layernorm(x, w, b).astype(jnp.float32) ** 2), argnums=(0, 1, 2))(x, w, b), (x.astype(jnp.bfloat16), w, b)),
  "add_layernorm_x_bias_grad": (lambda x, r, w, b: jax.grad(lambda x, r, w, b: (lambda y, s: jnp.sum(y ** 2) + jnp.sum(s * r))(*jax_lnbwd.add_layernorm(x, r, w, b, x_bias=b)), argnums=(0, 1, 2, 3))(x, r, w, b), (x, r, w, b)),
  "layernorm_fused_forward": (lambda x, w, b: jax_lnbwd.layernorm_fwd(x, w, b), (x, w, b)),
}
out = sys.argv[1]
for name, (f, args) in progs.items():
    with jax_lnbwd.use_ffi_forward(True):
        exp = export.export(jax.jit(f), platforms=["cpu", "cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(t) for t in jax_lnbwd.TARGETS])(*args)
    open(f"{out}/{name}.bin", "wb").write(exp.serialize())
    res = exp.call(*args)
    np.savez(f"{out}/{name}.npz", *[np.asarray(a.astype(jnp.float32)) for a in args], *[np.asarray(jnp.asarray(o).astype(jnp.float32)) for o in jax.tree.leaves(res)])
    print(name, [t for t in jax_lnbwd.TARGETS if t in exp.mlir_module()])
