"""The e2e bench's QK-norm option (--qk-norm: the public-style models normalize q and k per head
before rotary) and its two variants, qk_flax (Flax's two RMSNorms, the baseline) and
qk_jax_lnbwd (jax_lnbwd.flax.QKNorm), on CPU.

Our variant runs with the FFI forward and backward forced on (as test_e2e_public.py's do), so a
loss compared against Flax's comes from our kernels' C++ handlers and not from a jnp fallback."""
from __future__ import annotations

import dataclasses
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CHECKOUT, RTOL

sys.path.insert(0, str(CHECKOUT))  # the checkout: benchmarks/
from benchmarks.e2e import cli, config, train, variants  # noqa: E402
from e2e_shapes import shapes  # noqa: E402
from test_e2e_public import DEFAULT, LOSS_RTOL, PUBLIC, ours_forced  # noqa: E402

QK = ("qk_flax", "qk_jax_lnbwd")


def qk_config(model: str):
    return dataclasses.replace(config.SMALL[model], qk_norm=True)


def test_the_flag_gives_the_public_models_a_qk_norm_and_its_two_variants():
    plain = cli.parse_args(["--small", "--models", "public_llama,public_gemma"])   # no flag: as before
    assert not any(c.qk_norm for c in plain.configs) and plain.runs_of == {m: list(DEFAULT) for m in PUBLIC}
    a = cli.parse_args(["--small", "--models", "llama,public_llama,public_gemma", "--qk-norm"])
    assert [(c.name, c.qk_norm) for c in a.configs] == [("llama", False), ("public_llama", True),
                                                        ("public_gemma", True)]
    assert a.runs_of == {"llama": ["flax_rmsnorm", "jax_lnbwd_rmsnorm", "add_rmsnorm"],
                         "public_llama": list(QK), "public_gemma": list(QK)}
    assert a.baselines == ("flax_rmsnorm", "qk_flax")
    assert "QK-norm" in cli.describe(a.configs[1], 1) and "QK-norm" not in cli.describe(a.configs[0], 1)
    # --variants: the QK-norm variants run only in a model with one; any other runs Flax's QK-norm
    b = cli.parse_args(["--small", "--models", "llama,public_llama", "--qk-norm", "--variants",
                        "public_rmsnorm,qk_jax_lnbwd"])
    assert b.runs_of == {"llama": ["public_rmsnorm"], "public_llama": ["public_rmsnorm", "qk_jax_lnbwd"]}
    assert [variants.VARIANTS[v].qk_norm for v in QK] == ["flax", "ours"]
    assert variants.VARIANTS["public_rmsnorm"].qk_norm is None
    for argv in (["--models", "gpt,llama", "--qk-norm"],            # no public model
                 ["--models", "public_llama", "--variants", "qk_flax,qk_jax_lnbwd"]):   # no --qk-norm
        with pytest.raises(SystemExit):
            cli.parse_args(["--small", *argv])


def with_random_qk_scales(params):
    """params with every QK-norm scale random (around 1; Gemma's offset ones around 0): each
    variant must apply them, and apply them alike."""
    def perturb(path, a):
        name = jax.tree_util.keystr(path)
        if "qk_norm" not in name:
            return a
        return a + 0.3 * jax.random.normal(jax.random.key(zlib.crc32(name.encode())), a.shape, a.dtype)
    return jax.tree_util.tree_map_with_path(perturb, params)


@pytest.mark.parametrize("api", cli.APIS)
@pytest.mark.parametrize("model", PUBLIC)
def test_the_two_qk_variants_share_their_parameters_and_their_loss(model, api):
    """The same parameter tree (QKNorm's names: self_attn/qk_norm/{q_norm,k_norm}/scale of
    (head_dim,)) with the same initial values; with the same parameters (the QK scales made
    random) the same loss in the bf16 model (fp32: test_a_qk_norm_training_step_in_each_variant)."""
    cfg = qk_config(model)
    head_dim = cfg.d_model // cfg.heads
    tokens, targets = config.make_batch(cfg, jnp.bfloat16)
    with ours_forced():
        made = {v: train.init(cfg, api, variants.VARIANTS[v], jnp.bfloat16, tokens, 0) for v in QK}
    params = made["qk_flax"][1]
    assert jax.tree.structure(made["qk_jax_lnbwd"][1]) == jax.tree.structure(params)
    assert all((a == b).all() for a, b in zip(jax.tree.leaves(made["qk_jax_lnbwd"][1]), jax.tree.leaves(params)))
    layer = params["layers_0"] if api == "linen" else params["layers"][0]
    qk_scales = jax.tree_util.tree_leaves_with_path(layer["self_attn"]["qk_norm"])
    assert sorted(jax.tree_util.keystr(p).split("'")[1] for p, _ in qk_scales) == ["k_norm", "q_norm"]
    assert all(a.shape == (head_dim,) and a.dtype == jnp.float32 for _, a in qk_scales)
    assert all((np.asarray(a) == (0.0 if cfg.offset else 1.0)).all() for _, a in qk_scales)  # Gemma: (1 + scale)
    plain = shapes(config.SMALL[model], api, "public_rmsnorm")[0]   # the model without QK-norm
    assert sum(a.size for a in jax.tree.leaves(params)) == (sum(a.size for a in jax.tree.leaves(plain))
                                                            + 2 * cfg.layers * head_dim)
    params = with_random_qk_scales(params)
    losses = {}
    with ours_forced():
        for v, (apply, _) in made.items():
            logits = jax.jit(apply)(params, tokens).astype(jnp.float32)
            losses[v] = float(-jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1).mean())
    assert np.isfinite(losses["qk_flax"])
    np.testing.assert_allclose(losses["qk_jax_lnbwd"], losses["qk_flax"], rtol=RTOL["bfloat16"])


@pytest.mark.parametrize("api", cli.APIS)
def test_a_qk_norm_training_step_in_each_variant(api):
    """Each variant compiles and takes two fp32 training steps: the first's loss (the initial
    parameters') the same in both, finite after; ours runs 2 x layers jax_lnbwd norms (the QK-norm's
    q and k), the baseline none (public_rmsnorm's add & norms are Flax-style code)."""
    cfg = qk_config("public_llama")
    runs = {}
    with ours_forced():
        for v in QK:
            runs[v] = train.build(cfg, api, variants.VARIANTS[v], "float32")
            train.run_steps(runs[v], 1)
            train.run_steps(runs[v], 1)
    for v, run in runs.items():
        assert all(np.isfinite(run.losses)), (v, run.losses)
    np.testing.assert_allclose(runs["qk_jax_lnbwd"].losses[0], runs["qk_flax"].losses[0], rtol=LOSS_RTOL)
    assert runs["qk_flax"].paths == "none"
    assert f"x{2 * cfg.layers}" in runs["qk_jax_lnbwd"].paths and "ffi" in runs["qk_jax_lnbwd"].paths
