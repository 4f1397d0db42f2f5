"""A Llama-style model (pre-norm blocks: RMSNorm, causal attention, SwiGLU MLP) trained with
jax_lnbwd's RMSNorm in flax.linen: the one change is the import. `python examples/llama_linen.py`."""
import sys

import flax.linen as nn
import jax
import optax

from jax_lnbwd.flax import RMSNorm   # instead of: from flax.linen import RMSNorm

D, HEADS, LAYERS, VOCAB, SEQ, BATCH = 64, 4, 2, 256, 32, 8


class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
        h = h + nn.SelfAttention(HEADS, use_bias=False)(RMSNorm()(h), mask=nn.make_causal_mask(h[..., 0]))
        y = RMSNorm()(h)
        gate, up = nn.Dense(4 * D, use_bias=False)(y), nn.Dense(4 * D, use_bias=False)(y)
        return h + nn.Dense(D, use_bias=False)(nn.silu(gate) * up)


class Llama(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, D)
        h = embed(tokens)
        for _ in range(LAYERS):
            h = Block()(h)
        return embed.attend(RMSNorm()(h))


def main(steps: int = 20) -> list[float]:
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, VOCAB)
    model, tx = Llama(), optax.adam(3e-3)
    params = model.init(jax.random.key(1), tokens[:, :-1])
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        def loss_fn(p):
            logits = model.apply(p, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    print(f"linen Llama-style, {steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
