"""The e2e bench's llama model and its RMSNorm variants, on CPU."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from conftest import CHECKOUT

sys.path.insert(0, str(CHECKOUT))  # the checkout: benchmarks/
from benchmarks.e2e import cli, report, variants_rms  # noqa: E402
from e2e_shapes import shapes  # noqa: E402
from benchmarks.e2e.trace import our_calls  # noqa: E402

RMS = ("flax_rmsnorm", "jax_lnbwd_rmsnorm", "add_rmsnorm")


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_llama_builds_in_both_apis_with_every_rms_variant(offset):
    cfg = cli.parse_args(["--small", "--models", "llama"] + (["--offset", str(offset)] if offset else [])).configs[0]
    assert cfg.norm == "rmsnorm" and cfg.offset == offset and not cfg.dense_bias and cfg.rope
    counts = {}
    for api in cli.APIS:
        for v in RMS:
            params, logits, grads = shapes(cfg, api, v)
            assert logits.shape == (cfg.batch, cfg.seq, cfg.vocab) and logits.dtype == jnp.bfloat16
            assert jax.tree.structure(grads) == jax.tree.structure(params)
            leaves = jax.tree_util.tree_leaves_with_path(params)
            assert not any("bias" in jax.tree_util.keystr(p) for p, _ in leaves), (api, v)
            counts[api, v] = sum(a.size for _, a in leaves)
    d, h, L = cfg.d_model, cfg.hidden, cfg.layers
    # embedding and untied head, per block qkv, proj, gate, up, down; 2L + 1 scales
    assert set(counts.values()) == {2 * cfg.vocab * d + L * (4 * d * d + 3 * d * h) + (2 * L + 1) * d}, counts


def test_the_offset_baseline_is_flax_rmsnorm_with_one_plus_scale():
    x = jax.random.normal(jax.random.key(0), (3, 16), jnp.float32)
    module = variants_rms.FlaxOffsetRMSNorm(epsilon=1e-5, offset=1.0)
    params = module.init(jax.random.key(1), x)
    assert not params["params"]["scale"].any()  # zero-centred: starts at zeros
    scale = jnp.linspace(-0.5, 0.5, 16, dtype=jnp.float32)
    got = module.apply({"params": {"scale": scale}}, x)
    want = nn.RMSNorm(epsilon=1e-5).apply({"params": {"scale": 1.0 + scale}}, x)
    assert jnp.allclose(got, want, rtol=1e-6, atol=1e-6)
    m = variants_rms.NnxOffsetRMSNorm(16, epsilon=1e-5, offset=1.0, rngs=nnx.Rngs(0))
    m.scale[...] = scale
    assert jnp.allclose(m(x), want, rtol=1e-6, atol=1e-6)


def test_each_model_runs_its_norms_variants_and_baseline():
    a = cli.parse_args(["--small", "--models", "gpt,llama"])
    assert a.runs_of == {"gpt": ["flax", "jax_lnbwd", "add_layernorm"], "llama": list(RMS)}
    assert a.baselines == ("flax", "flax_rmsnorm")
    with pytest.raises(SystemExit):
        cli.parse_args(["--small", "--models", "llama", "--variants", "flax,jax_lnbwd"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--small", "--models", "gpt", "--offset", "1"])


def test_our_rmsnorm_calls_count_as_ours():
    hlo = '  %custom-call.3 = f32[4,8]{1,0} custom-call(f32[4,8]{1,0} %x), custom_call_target="jax_lnbwd_rmsnorm_bwd_v1"'
    assert our_calls(hlo) == frozenset({"custom_call_3"})


def test_a_small_llama_run_in_linen_and_nnx(tmp_path, capsys):
    names = list(RMS)
    table = cli.main(["--small", "--models", "llama", "--apis", "linen,nnx", "--variants", ",".join(names),
                      "--rounds", "2", "--steps", "1", "--warmup", "1", "--trace-steps", "1",
                      "--no-progress", "--out", str(tmp_path)])
    got = {(r["api"], r["variant"]) for r in table}
    assert got == {(api, v) for api in cli.APIS for v in names}
    assert all(r["loss_last"] == r["loss_last"] for r in table)  # not NaN
    base = [r for r in table if r["baseline"]]
    assert len(base) == 2 and all(r["trace"] for r in base)  # the jax trace attributes the scope
    assert all(report.ln_mixed_ms(r["trace"]) > 0 for r in base)
