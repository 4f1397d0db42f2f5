"""The e2e bench's public-style decoders (public_llama, public_gemma) and the norm variants made
for them (public_rmsnorm, jax_lnbwd_rmsnorm_jnp_fwd, jax_lnbwd_rmsnorm_jnp_bwd), on CPU.

Our variants run with the FFI forward and backward forced on (jax_lnbwd.use_ffi_forward(True),
use_ffi_backward(True): the CPU runs the C++ handler), so that a loss compared against the public
baseline comes from our kernels and not from a jnp fallback."""
from __future__ import annotations

import contextlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_lnbwd
from conftest import CHECKOUT, RTOL

sys.path.insert(0, str(CHECKOUT))  # the checkout: benchmarks/
from benchmarks.e2e import cli, config, train, variants  # noqa: E402
from e2e_shapes import shapes  # noqa: E402

PUBLIC = ("public_llama", "public_gemma")
DEFAULT = ("public_rmsnorm", "jax_lnbwd_rmsnorm", "add_rmsnorm")
DIAGNOSIS = ("jax_lnbwd_rmsnorm_jnp_fwd", "jax_lnbwd_rmsnorm_jnp_bwd")
STEPS = 3
# Every variant computes the same function; they differ in the order of float32 roundings
# (statistics, the (1 + weight) product, the residual add inside or outside a kernel), and
# those differences go through STEPS Adam steps: 10x one float32 op's tolerance.
LOSS_RTOL = 10 * RTOL["float32"]


def ours_forced() -> contextlib.ExitStack:
    """Our FFI forward and backward on every platform (a variant's own switch, inside its
    module, still overrides these)."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax_lnbwd.use_ffi_forward(True))
    stack.enter_context(jax_lnbwd.use_ffi_backward(True))
    return stack


def fields(cfg, names: str) -> tuple:
    return tuple(getattr(cfg, n) for n in names.split())


def test_the_public_configs():
    llama, gemma = config.FULL["public_llama"], config.FULL["public_gemma"]
    sizes = "d_model heads layers seq batch vocab"
    for cfg in (llama, gemma):
        assert fields(cfg, "style norm dense_bias causal pre_ln") == ("public", "rmsnorm", False, True, True)
        assert fields(cfg, sizes) == (2048, 16, 6, 2048, 4, 32000)
        assert fields(config.SMALL[cfg.name], sizes) == (64, 4, 1, 32, 2, 128)
        assert cfg.hidden == config.llama_hidden(cfg.d_model)
    gemma_like = "offset epsilon mlp tied_head embed_scale"
    assert fields(llama, gemma_like) == (0.0, 1e-5, "swiglu", False, False)
    assert fields(gemma, gemma_like) == (1.0, 1e-6, "geglu", True, True)
    # the own-style models are as they were
    own = ("gpt", "bert", "vit", "llama")
    assert all(config.FULL[m].style == "own" and not config.FULL[m].embed_scale for m in own)


def test_each_model_runs_its_own_default_variants():
    a = cli.parse_args(["--small", "--models", "public_llama,public_gemma"])
    assert a.runs_of == {m: list(DEFAULT) for m in PUBLIC} and a.baselines == ("public_rmsnorm",)
    assert [(c.name, c.offset) for c in a.configs] == [("public_llama", 0.0), ("public_gemma", 1.0)]
    b = cli.parse_args(["--small", "--models", "gpt,llama,public_llama"])
    assert b.runs_of == {"gpt": ["flax", "jax_lnbwd", "add_layernorm"],
                         "llama": ["flax_rmsnorm", "jax_lnbwd_rmsnorm", "add_rmsnorm"],
                         "public_llama": list(DEFAULT)}
    assert b.baselines == ("flax", "flax_rmsnorm", "public_rmsnorm")
    # --variants: every model of a norm runs the ones listed of it, the first the baseline
    c = cli.parse_args(["--small", "--models", "llama,public_gemma", "--variants",
                        "public_rmsnorm,jax_lnbwd_rmsnorm_jnp_fwd,flax"])
    assert c.runs_of == {m: ["public_rmsnorm", "jax_lnbwd_rmsnorm_jnp_fwd"] for m in ("llama", "public_gemma")}
    assert c.baselines == ("public_rmsnorm",)
    # --offset overrides every rmsnorm model's own offset
    d = cli.parse_args(["--small", "--models", "llama,public_gemma", "--offset", "0"])
    assert [c.offset for c in d.configs] == [0.0, 0.0]
    assert all(v in variants.VARIANTS and variants.VARIANTS[v].norm == "rmsnorm" for v in DEFAULT + DIAGNOSIS)


def test_the_public_rotary_and_attention_compute_the_own_models():
    """The gathered-table rotary and the written-out attention (float32) against the own llama's
    rope.rotary and jax.nn.dot_product_attention: the same functions, built differently."""
    from benchmarks.e2e import models_public_linen as pub
    from benchmarks.e2e.rope import rotary
    b, t, h, hd = 2, 32, 4, 16
    cfg = config.ModelConfig("t", causal=True, pre_ln=True, d_model=h * hd, heads=h, layers=1, seq=t, batch=b)
    q, k, v = (jax.random.normal(key, (b, t, h, hd), jnp.float32) for key in jax.random.split(jax.random.key(0), 3))
    sin, cos = pub.gather_rotary(cfg, jnp.broadcast_to(jnp.arange(t), (b, t)))
    assert sin.shape == cos.shape == (b, t, 1, hd) and sin.dtype == cos.dtype == jnp.float32
    # the angles come from a float64-made table against float32 iota arithmetic: a few float32 ulps
    tol = {"rtol": 10 * RTOL["float32"], "atol": RTOL["float32"]}
    np.testing.assert_allclose(pub.apply_rotary(q, sin, cos, jnp.float32), rotary(q), **tol)
    bf = q.astype(jnp.bfloat16)  # bf16 x: rotated in float32 (the table promotes it), then cast back
    assert pub.apply_rotary(bf, sin, cos, jnp.bfloat16).dtype == jnp.bfloat16
    assert (bf * cos + pub.rotate_half(bf) * sin).dtype == jnp.float32
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(pub.attend(q, k, v, jnp.float32), want, **tol)


@pytest.mark.parametrize("model", PUBLIC)
def test_linen_and_nnx_build_the_same_model(model):
    cfg = config.SMALL[model]
    counts = {}
    for api in cli.APIS:
        for v in DEFAULT:
            params, logits, grads = shapes(cfg, api, v)
            assert logits.shape == (cfg.batch, cfg.seq, cfg.vocab) and logits.dtype == jnp.bfloat16
            assert jax.tree.structure(grads) == jax.tree.structure(params)
            leaves = jax.tree_util.tree_leaves_with_path(params)
            assert not any("bias" in jax.tree_util.keystr(p) for p, _ in leaves), (api, v)
            assert all(a.dtype == jnp.float32 for _, a in leaves)
            counts[api, v] = sum(a.size for _, a in leaves)
    d, f, L = cfg.d_model, cfg.hidden, cfg.layers
    heads = 1 if cfg.tied_head else 2  # the embedding, and the untied lm_head (Llama)
    # per layer q, k, v, o and gate, up, down; 2L + 1 norms of d weights
    assert set(counts.values()) == {heads * cfg.vocab * d + L * (4 * d * d + 3 * d * f) + (2 * L + 1) * d}, counts


def test_the_public_norm_is_public_codes_and_its_output_is_float32():
    """public_rmsnorm: s = x + residual in the compute dtype; y = weight * (s / rms(s)) rounded to
    the compute dtype, times the float32 weight: y float32 for bf16 compute; Gemma's (1 + weight)
    with the weight starting at zeros."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x, r = (jax.random.normal(k, (2, 5, 16), jnp.float32).astype(jnp.bfloat16) for k in (k1, k2))
    weight = jax.random.normal(k3, (16,), jnp.float32)
    v = variants.VARIANTS["public_rmsnorm"]
    for offset, eps in ((0.0, 1e-5), (1.0, 1e-6)):
        s = x + r
        s32 = np.asarray(s, np.float64)
        normed = s32 / np.sqrt(np.mean(s32 ** 2, axis=-1, keepdims=True) + eps)
        want = (offset + np.asarray(weight, np.float64)) * np.asarray(jnp.asarray(normed, jnp.float32)
                                                                       .astype(jnp.bfloat16), np.float64)
        linen = v.linen(dtype=jnp.bfloat16, epsilon=eps, offset=offset)
        params = linen.init(jax.random.key(1), x, r)["params"]
        assert set(params["norm"]) == {"weight"} and params["norm"]["weight"].dtype == jnp.float32
        assert (params["norm"]["weight"] == (0.0 if offset else 1.0)).all()
        m = v.nnx(16, dtype=jnp.bfloat16, epsilon=eps, offset=offset, rngs=nnx.Rngs(0))
        assert (m.norm.weight[...] == (0.0 if offset else 1.0)).all()
        m.norm.weight[...] = weight
        for y, s_out in (linen.apply({"params": {"norm": {"weight": weight}}}, x, r), m(x, r)):
            assert y.dtype == jnp.float32 and s_out.dtype == jnp.bfloat16
            assert (s_out == s).all()
            np.testing.assert_allclose(np.asarray(y), want, rtol=RTOL["bfloat16"], atol=RTOL["bfloat16"])
        y, s_out = linen.apply({"params": {"norm": {"weight": weight}}}, x)  # residual None
        assert y.dtype == jnp.float32 and (s_out == x).all()
    # fp32 compute: y float32 too, and as Flax's RMSNorm computes it (to float32 rounding)
    x32 = x.astype(jnp.float32)
    y, _ = v.linen(dtype=jnp.float32, epsilon=1e-5).apply({"params": {"norm": {"weight": weight}}}, x32)
    want = nn.RMSNorm(epsilon=1e-5).apply({"params": {"scale": weight}}, x32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=RTOL["float32"], atol=RTOL["float32"])


@pytest.mark.parametrize("model", PUBLIC)
def test_in_the_bf16_model_the_public_norms_output_is_float32(model):
    """In the bf16 model every public_rmsnorm hands the next layer float32 (the projections
    cast it to bf16) and the residual stream stays bf16; the drop-in's output is bf16: the
    difference in the graph that these models exist for."""
    cfg = config.SMALL[model]
    tokens = config.make_batch(cfg, jnp.bfloat16)[0]
    for v, want in (("public_rmsnorm", jnp.float32), ("jax_lnbwd_rmsnorm", jnp.bfloat16)):
        module = train.models_public_linen.PublicDecoder(cfg, variants.VARIANTS[v].linen, jnp.bfloat16)
        params = module.init(jax.random.key(0), tokens)
        _, state = module.apply(params, tokens, capture_intermediates=True)
        inter = state["intermediates"]  # each module's __call__ outputs, by module path
        outs = [inter[f"layers_{i}"][n]["__call__"][0] for i in range(cfg.layers)
                for n in ("input_norm", "post_attention_norm")] + [inter["norm"]["__call__"][0]]
        assert len(outs) == 2 * cfg.layers + 1, (v, len(outs))
        for y, s in outs:
            assert y.dtype == want and s.dtype == jnp.bfloat16, (v, y.dtype, s.dtype)


@pytest.mark.parametrize("api", cli.APIS)
@pytest.mark.parametrize("model", PUBLIC)
def test_the_default_variants_step_to_the_same_loss(model, api):
    """float32 compute: every default variant trains the same model from the same weights, so
    the losses of STEPS steps agree to rounding."""
    cfg = config.SMALL[model]
    losses = {}
    with ours_forced():
        for v in DEFAULT:
            run = train.build(cfg, api, variants.VARIANTS[v], "float32")
            train.run_steps(run, 1)
            train.run_steps(run, STEPS - 1)
            losses[v] = run.losses
    for v, got in losses.items():
        assert all(np.isfinite(got)), (v, got)
        np.testing.assert_allclose(got, losses["public_rmsnorm"], rtol=LOSS_RTOL, err_msg=v)
    assert losses["public_rmsnorm"][-1] < losses["public_rmsnorm"][0]  # it trains


@pytest.mark.slow
@pytest.mark.parametrize("model", PUBLIC)
def test_every_rmsnorm_variant_steps_to_the_same_loss(model):
    """The rest of the rmsnorm variants (Flax's, the two diagnosis ones) in both APIs, against
    the public baseline, and the bf16 step of each default variant trains (finite losses)."""
    cfg = config.SMALL[model]
    # (the QK-norm variants, public_rmsnorm's add & norms, are test_e2e_qk.py's)
    rest = [v for v, var in variants.VARIANTS.items()
            if var.norm == "rmsnorm" and v not in DEFAULT[1:] and var.qk_norm is None]
    for api in cli.APIS:
        losses = {}
        with ours_forced():
            for v in rest:
                run = train.build(cfg, api, variants.VARIANTS[v], "float32")
                train.run_steps(run, STEPS)
                losses[v] = run.losses[-1]
            for v in DEFAULT:
                run = train.build(cfg, api, variants.VARIANTS[v], "bfloat16")
                train.run_steps(run, STEPS)
                assert np.isfinite(run.losses[-1]), (api, v, run.losses)
        for v, got in losses.items():
            np.testing.assert_allclose(got, losses["public_rmsnorm"], rtol=LOSS_RTOL, err_msg=f"{api} {v}")


@pytest.mark.parametrize("api", cli.APIS)
def test_the_diagnosis_variants_swap_one_half(api):
    """jax_lnbwd_rmsnorm_jnp_fwd traces the jnp forward and our backward; jax_lnbwd_rmsnorm_jnp_bwd
    our forward and the jnp backward; each whatever the switches are outside the norm."""
    fwd, bwd = jax_lnbwd.TARGET_RMS_FWD, jax_lnbwd.TARGET_RMS_BWD
    cfg = config.SMALL["public_llama"]
    x = config.make_batch(cfg, jnp.float32)[0]
    texts = {}
    with ours_forced():
        for v in ("jax_lnbwd_rmsnorm",) + DIAGNOSIS:
            apply, params = train.init(cfg, api, variants.VARIANTS[v], jnp.float32, x, 0)
            loss = lambda p: apply(p, x).astype(jnp.float32).sum()  # noqa: E731
            texts[v] = jax.jit(jax.grad(loss)).lower(params).as_text()
    assert f"@{fwd}(" in texts["jax_lnbwd_rmsnorm"] and bwd in texts["jax_lnbwd_rmsnorm"]
    assert f"@{fwd}(" not in texts["jax_lnbwd_rmsnorm_jnp_fwd"] and bwd in texts["jax_lnbwd_rmsnorm_jnp_fwd"]
    assert f"@{fwd}(" in texts["jax_lnbwd_rmsnorm_jnp_bwd"]
    assert bwd not in texts["jax_lnbwd_rmsnorm_jnp_bwd"], (
        "use_ffi_backward(False) around the norm's call did not reach its backward: this jax_lnbwd "
        "reads the backward switch when the backward is transposed, not when the norm is traced")


def test_dump_hlo_writes_each_runs_hlo(tmp_path):
    run = train.Run("public_gemma", "nnx", "bfloat16", "public_rmsnorm", None, (), (), "HloModule m\n", 0.0)
    path = cli.dump_hlo(run, str(tmp_path / "hlo"))
    assert path == str(tmp_path / "hlo" / "public_gemma_nnx_bfloat16_public_rmsnorm.hlo.txt")
    assert (tmp_path / "hlo" / "public_gemma_nnx_bfloat16_public_rmsnorm.hlo.txt").read_text() == "HloModule m\n"
    assert cli.parse_args(["--small", "--dump-hlo", str(tmp_path)]).dump_hlo == str(tmp_path)
    assert cli.parse_args(["--small"]).dump_hlo is None


@pytest.mark.slow
def test_a_small_public_run_in_linen_and_nnx(tmp_path):
    """The command with both public models in both APIs, their default variants, --dump-hlo."""
    hlo = tmp_path / "hlo"
    table = cli.main(["--small", "--models", ",".join(PUBLIC), "--apis", "linen,nnx", "--rounds", "2",
                      "--steps", "1", "--warmup", "1", "--trace-steps", "1", "--no-progress",
                      "--out", str(tmp_path), "--dump-hlo", str(hlo)])
    got = {(r["model"], r["api"], r["variant"]) for r in table}
    assert got == {(m, api, v) for m in PUBLIC for api in cli.APIS for v in DEFAULT}
    assert all(np.isfinite(r["loss_last"]) for r in table)
    assert {(r["model"], r["api"]) for r in table if r["baseline"]} == {(m, api) for m in PUBLIC for api in cli.APIS}
    assert all(r["variant"] == "public_rmsnorm" for r in table if r["baseline"])
    files = sorted(p.name for p in hlo.iterdir())
    assert files == sorted(f"{m}_{api}_bfloat16_{v}.hlo.txt" for m in PUBLIC for api in cli.APIS for v in DEFAULT)
    assert all((hlo / f).read_text().startswith("HloModule") for f in files)
