"""jax_lnbwd's Flax drop-ins in a training step: a pre-LN residual block trained with adam, its
norms taken from jax_lnbwd.flax in place of flax.linen's (same names, same parameters).

    python examples/flax_drop_in.py              # a few seconds on a CPU
    python examples/flax_drop_in.py --rmsnorm    # RMSNorm, and AddRMSNorm for the residual add

The step is jitted as usual; on a GPU the norms' passes run jax_lnbwd's kernels where they beat
XLA's (jax_lnbwd.dispatch). For the time of a training step, use `python -m benchmarks.e2e`.
"""
from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jax_lnbwd import flax as lnbwd_flax   # LayerNorm, AddLayerNorm, RMSNorm, AddRMSNorm


class Block(nn.Module):
    """h -> h + MLP(norm(h)), the residual add fused into the next norm: the add & norm
    returns (norm(h + r), h + r)."""
    rmsnorm: bool

    @nn.compact
    def __call__(self, h):
        norm = lnbwd_flax.RMSNorm if self.rmsnorm else lnbwd_flax.LayerNorm
        add_norm = lnbwd_flax.AddRMSNorm if self.rmsnorm else lnbwd_flax.AddLayerNorm
        d = h.shape[-1]
        m = nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(norm()(h))))
        y, h = add_norm()(m, h)          # y = norm(m + h), h = m + h
        return nn.Dense(d)(y) + h


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rmsnorm", action="store_true", help="RMSNorm and AddRMSNorm")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (8, 32, 64))
    target = jax.random.normal(ky, (8, 32, 64))
    model = Block(args.rmsnorm)
    params = model.init(kp, x)
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - target) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state)
        if i % 5 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
