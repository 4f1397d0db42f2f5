"""A Llama-style model (pre-norm blocks: RMSNorm, causal attention, SwiGLU MLP) trained with
jax_lnbwd's RMSNorm in flax.nnx: the one change is the import. `python examples/llama_nnx.py`."""
import sys

import jax
import optax
from flax import nnx

from jax_lnbwd.flax import nnx as lnbwd_nnx   # lnbwd_nnx.RMSNorm instead of nnx.RMSNorm

D, HEADS, LAYERS, VOCAB, SEQ, BATCH = 64, 4, 2, 256, 32, 8


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attn_norm, self.mlp_norm = lnbwd_nnx.RMSNorm(D, rngs=rngs), lnbwd_nnx.RMSNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, use_bias=False, decode=False, rngs=rngs)
        self.gate, self.up = nnx.Linear(D, 4 * D, use_bias=False, rngs=rngs), nnx.Linear(D, 4 * D, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, use_bias=False, rngs=rngs)

    def __call__(self, h):
        h = h + self.attn(self.attn_norm(h), mask=nnx.make_causal_mask(h[..., 0]))
        y = self.mlp_norm(h)
        return h + self.down(nnx.silu(self.gate(y)) * self.up(y))


class Llama(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = lnbwd_nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.embed.attend(self.norm(h))


def main(steps: int = 20) -> list[float]:
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, VOCAB)
    model = Llama(nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(steps)]
    print(f"nnx Llama-style, {steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
