"""The benchmark's models: six transformers at training sizes (the families below), and tiny ones.

Every model is 6 blocks of multi-head attention and an MLP, bf16 (or fp32) compute with float32
parameters. What differs is the norm, where it sits, the MLP, and what comes in and out:

  gpt   GPT-2-style decoder: causal, pre-LN (LN -> attention, LN -> MLP, a final LN), token
        and learned position embeddings, a head tied to the token embedding, next-token loss.
  bert  BERT-style encoder: bidirectional, post-LN (LN after each residual add, and one on the
        embeddings), a head tied to the token embedding, a loss at every position (as masked
        language modelling does at its masked ones).
  vit   ViT-style encoder: bidirectional, pre-LN, 16x16x3 patches of a 224x224 image through a
        Dense (the usual stride-16 convolution), a class token, 197 tokens, a 1000-class head.

  llama Llama-style decoder: causal, pre-norm with RMSNorm, a SwiGLU MLP (hidden 8/3 d rounded
        up to a multiple of 256), rotary position embeddings on q and k, no biases anywhere,
        an untied output head, next-token loss. offset 1.0 (``--offset``): Gemma's zero-centred
        scale, normalizing with (1 + scale), the scale initialized to zeros.

The four above are written in the project's own style (a fused qkv projection, rotary angles
from an iota, jax.nn.dot_product_attention, norms whose output is in the compute dtype). Two more
(style "public", models_public_linen.py / models_public_nnx.py) are built the way users' public
Flax Llama and Gemma code usually is, which makes XLA fuse differently around the norms:

  public_llama  the llama decoder at the same sizes, written out as public code writes it:
        separate q/k/v projections, rotary sin/cos gathered from a float32 table at position
        ids, attention as einsums with a float32 softmax, separate gate/up/down projections.
  public_gemma  its Gemma sibling: embeddings scaled by sqrt(d_model), a GeGLU MLP (tanh GELU),
        a head tied to the token embedding, RMSNorm with (1 + weight) (offset 1.0), eps 1e-6.

Each has 13 norms over d_model features (LayerNorm, or RMSNorm for llama and the public models).
The public models take one more option, QK-norm (``qk_norm``, ``--qk-norm``; Qwen3's): q and k,
after their projections and the reshape to heads, each RMS-normalized over head_dim (scales of
shape (head_dim,)) before rotary; 2 x layers more norms, of rows tokens x heads.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


GATED = ("swiglu", "geglu")  # the gated MLPs: down(act(gate(x)) * up(x)), hidden llama_hidden


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    causal: bool
    pre_ln: bool
    d_model: int
    heads: int
    layers: int
    seq: int          # tokens per example (vit: patches + the class token)
    batch: int
    vocab: int = 0    # gpt, bert: the token vocabulary; vit: 0
    classes: int = 0  # vit: the label count
    patch_dim: int = 0  # vit: 16 * 16 * 3
    epsilon: float = 1e-5
    mlp_ratio: int = 4
    attention: str = "xla"  # jax.nn.dot_product_attention's implementation: "xla" or "cudnn"
    # Whether the blocks' Dense layers (qkv, proj, up, down) add a bias, as GPT-2, BERT and ViT
    # do. A bias add in front of the residual add is fused by XLA into that add (and its
    # gradient into the gradient's add); a variant whose add & norm is a custom call takes the
    # bias in (variants.Variant.x_bias) or leaves XLA a bias add and a bias-gradient sum of their
    # own. Without biases (PaLM-style blocks) the residual add stands alone.
    dense_bias: bool = True
    norm: str = "layernorm"  # or "rmsnorm": which variants (variants.Variant.norm) apply
    mlp: str = "gelu"        # or "swiglu": down(silu(gate(x)) * up(x)); public only, "geglu":
                             # down(gelu_tanh(gate(x)) * up(x))
    mlp_hidden: int = 0      # the MLP's hidden width; 0: mlp_ratio * d_model (swiglu, geglu: llama_hidden)
    rope: bool = False       # rotary embeddings on q and k instead of learned positions
    tied_head: bool = True   # the head is the token embedding's transpose (gpt, bert)
    offset: float = 0.0      # rmsnorm: y = x * rstd * (offset + scale); 1.0 is Gemma's
    # "own": models_linen.py / models_nnx.py; "public": models_public_linen.py / models_public_nnx.py,
    # the structure of users' public Flax Llama/Gemma code (those take mlp "swiglu" or "geglu").
    style: str = "own"
    embed_scale: bool = False  # public: the token embeddings times sqrt(d_model) (Gemma)
    # public: q and k RMS-normalized per head over head_dim before rotary (Qwen3's QK-norm), by
    # the variant's QK-norm (registry.Variant.qk_norm)
    qk_norm: bool = False

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def hidden(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        return llama_hidden(self.d_model) if self.mlp in GATED else self.mlp_ratio * self.d_model


def llama_hidden(d_model: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4 d (the same parameters as a 4x GELU MLP), rounded up to
    a multiple of 256."""
    return -(-(8 * d_model // 3) // 256) * 256


FULL = {
    # GPT-2 XL's width and heads (d 1600, 25 heads of 64), 6 blocks; GPT-2's vocabulary padded
    # to a multiple of 128 as llm.c does (50257 -> 50304).
    "gpt": ModelConfig("gpt", causal=True, pre_ln=True, d_model=1600, heads=25, layers=6, seq=1024,
                       batch=8, vocab=50304, epsilon=1e-5),
    # BERT-large's width (d 1024, 16 heads), 6 blocks, seq 1024; BERT's vocabulary padded (30522 -> 30592).
    "bert": ModelConfig("bert", causal=False, pre_ln=False, d_model=1024, heads=16, layers=6, seq=1024,
                        batch=8, vocab=30592, epsilon=1e-12),
    # ViT-L/16's width at 224x224 (196 patches + the class token), 6 blocks.
    "vit": ModelConfig("vit", causal=False, pre_ln=True, d_model=1024, heads=16, layers=6, seq=197,
                       batch=8, classes=1000, patch_dim=768, epsilon=1e-6),
    # Llama-2/3-style at d 2048 (16 heads of 128), 6 blocks, seq 2048, batch 4; Llama-2's vocabulary.
    "llama": ModelConfig("llama", causal=True, pre_ln=True, d_model=2048, heads=16, layers=6, seq=2048,
                         batch=4, vocab=32000, epsilon=1e-5, dense_bias=False, norm="rmsnorm",
                         mlp="swiglu", rope=True, tied_head=False),
}
# The public-style decoders (config.py's docstring): llama's sizes, eps 1e-5 (Llama) and 1e-6 (Gemma).
FULL["public_llama"] = dataclasses.replace(FULL["llama"], name="public_llama", style="public")
FULL["public_gemma"] = dataclasses.replace(FULL["llama"], name="public_gemma", style="public", epsilon=1e-6,
                                           mlp="geglu", tied_head=True, embed_scale=True, offset=1.0)

# --small: the same three families at sizes a CPU runs in a fraction of a second a step.
SMALL = {
    "gpt": dataclasses.replace(FULL["gpt"], d_model=64, heads=4, layers=1, seq=32, batch=2, vocab=128),
    "bert": dataclasses.replace(FULL["bert"], d_model=64, heads=4, layers=1, seq=32, batch=2, vocab=128),
    "vit": dataclasses.replace(FULL["vit"], d_model=64, heads=4, layers=1, seq=17, batch=2, classes=10,
                               patch_dim=48),
    "llama": dataclasses.replace(FULL["llama"], d_model=64, heads=4, layers=1, seq=32, batch=2, vocab=128),
    "public_llama": dataclasses.replace(FULL["public_llama"], d_model=64, heads=4, layers=1, seq=32, batch=2,
                                        vocab=128),
    "public_gemma": dataclasses.replace(FULL["public_gemma"], d_model=64, heads=4, layers=1, seq=32, batch=2,
                                        vocab=128),
}


def make_batch(cfg: ModelConfig, dtype, seed: int = 0):
    """One fixed batch, (inputs, integer targets): the same for every variant of a model."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    if cfg.name == "vit":
        patches = jax.random.normal(k1, (cfg.batch, cfg.seq - 1, cfg.patch_dim), jnp.float32)
        return patches.astype(dtype), jax.random.randint(k2, (cfg.batch,), 0, cfg.classes)
    tokens = jax.random.randint(k1, (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    if cfg.causal:  # next-token prediction
        return tokens[:, :-1], tokens[:, 1:]
    return tokens[:, :-1], jax.random.randint(k2, (cfg.batch, cfg.seq), 0, cfg.vocab)
