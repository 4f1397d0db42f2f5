"""The e2e bench's byte floor (benchmarks/e2e/floor.py), on CPU: no timing is asserted.

It checks the counting rule's totals for the models, that the rule's add & norms are the
models' (their number, and which of them hold a residual add and a gradient add inside the
layernorm scope, read from the step's jaxpr), the +mix/floor and ceiling arithmetic on made-up
rows, and that the command writes the floor block to e2e.txt and e2e.json (a GPU run also prints it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from conftest import CHECKOUT, bench_cwd  # noqa: E402

sys.path.insert(0, str(CHECKOUT))  # the checkout: benchmarks/
from benchmarks.e2e import (config, floor, models_linen, models_nnx, models_public_linen,  # noqa: E402
                            models_public_nnx, train, variants)


@pytest.mark.parametrize("name, fused, unfused", [
    ("gpt", 6 + 11 * 8 + 7, 8 + 11 * 11 + 8),   # pre-LN: first, 2 x 6 - 1 middle, last
    ("vit", 6 + 11 * 8 + 7, 8 + 11 * 11 + 8),
    ("bert", 5 + 12 * 7, 5 + 12 * 8),           # post-LN: first, then 2 x 6 after a sublayer
    ("llama", 6 + 11 * 8 + 7, 8 + 11 * 11 + 8),  # pre-norm, RMSNorm
    ("public_llama", 6 + 11 * 8 + 7, 8 + 11 * 11 + 8),  # the same decoder, public-style
    ("public_gemma", 6 + 11 * 8 + 7, 8 + 11 * 11 + 8),
])
def test_the_counts_of_the_full_models(name, fused, unfused):
    cfg = config.FULL[name]
    assert floor.norm_count(cfg) == 13
    assert (floor.units(cfg, "fused"), floor.units(cfg, "unfused")) == (fused, unfused)
    assert floor.t_bytes(cfg, "bfloat16") == cfg.batch * cfg.seq * cfg.d_model * 2
    assert floor.t_bytes(cfg, "float32") == 2 * floor.t_bytes(cfg, "bfloat16")


def test_the_pieces_per_add_and_norm():
    per = {p["where"]: (p["fused"] // p["count"], p["unfused"] // p["count"])
           for p in floor.places(config.FULL["gpt"]) + floor.places(config.FULL["bert"])}
    assert per == {"first: the stream begins": (6, 8), "middle": (8, 11), "last: the stream ends": (7, 8),
                   "first: embeddings": (5, 5), "after a sublayer": (7, 8)}


@pytest.mark.parametrize("name", sorted(config.FULL))
def test_the_rule_counts_the_models_norms(name):
    """As many add & norms as the linen model's (full size, shapes only) and the nnx model's."""
    cfg = config.FULL[name]
    v = variants.VARIANTS["flax" if cfg.norm == "layernorm" else "flax_rmsnorm"]
    batch = jax.eval_shape(lambda: config.make_batch(cfg, jnp.bfloat16))
    small = config.SMALL[name]
    if cfg.style == "public":  # its add & norms: each layer's input_norm, post_attention_norm; norm
        model = models_public_linen.PublicDecoder(cfg, v.linen, jnp.bfloat16)
        params = jax.eval_shape(model.init, jax.random.key(0), batch[0])["params"]
        assert sum(k.endswith("_norm") for i in range(cfg.layers) for k in params[f"layers_{i}"]) + (
            "norm" in params) == floor.norm_count(cfg)
        net = nnx.eval_shape(lambda: models_public_nnx.PublicDecoder(small, v.nnx, jnp.bfloat16, rngs=nnx.Rngs(0)))
        assert sum(isinstance(m, v.nnx) for _, m in nnx.iter_graph(net)) == floor.norm_count(small)
        return
    model = models_linen.Transformer(cfg, v.linen, jnp.bfloat16)
    params = jax.eval_shape(model.init, jax.random.key(0), batch[0])["params"]
    assert sum(k.startswith("AddNorm") for k in params) == floor.norm_count(cfg)
    net = nnx.eval_shape(lambda: models_nnx.Transformer(small, v.nnx, jnp.bfloat16, rngs=nnx.Rngs(0)))
    assert len(net.norms) == floor.norm_count(small)


SCOPED = re.compile(models_linen.LN_SCOPE + r"/AddNorm_\w+?_(\d+)(/.*)?$")
# The public-style models name their add & norms (models_public_linen.py): layers_<i>/input_norm,
# layers_<i>/post_attention_norm, and the final one norm.
PUBLIC_SCOPED = re.compile(r"(?:layers_(\d+)/)?" + models_linen.LN_SCOPE +
                           r"/(input_norm|post_attention_norm|norm)(/.*)?$")


def scoped(cfg, name_stack: str):
    """(the index of the add & norm an operation is in, in the step's order, and the name stack
    below that add & norm, None for its own operations), or None outside the layernorm scope."""
    if cfg.style == "own":
        m = SCOPED.search(name_stack)
        return m and (int(m.group(1)), m.group(2))
    m = PUBLIC_SCOPED.search(name_stack)
    if not m:
        return None
    index = 2 * cfg.layers if m.group(1) is None else 2 * int(m.group(1)) + (m.group(2) == "post_attention_norm")
    return index, m.group(3)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(config.SMALL))
def test_the_adds_in_the_layernorm_scope_are_the_rules(name):
    """In the step's jaxpr (jax_lnbwd's variant: its backward is one call, so every
    activation-sized add_any in the scope is the block's), each add & norm holds a residual add
    (an add in the add & norm itself, outside its norm) where the rule counts one, and a
    gradient add (add_any, in the transpose) where it counts one: the stream's gradient is added
    in layernorm's scope in pre-LN models, in the next sublayer's (outside) in post-LN ones."""
    cfg = dataclasses.replace(config.SMALL[name], layers=2)
    batch = config.make_batch(cfg, jnp.bfloat16)
    ours = "jax_lnbwd" if cfg.norm == "layernorm" else "jax_lnbwd_rmsnorm"
    apply, params = train.init(cfg, "linen", variants.VARIANTS[ours], jnp.bfloat16, batch[0], 0)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: apply(p, batch[0]).astype(jnp.float32).sum()))(params)
    act = (cfg.batch, cfg.seq, cfg.d_model)
    found = {}
    for e in jaxpr.jaxpr.eqns:
        m = scoped(cfg, str(e.source_info.name_stack))
        if not m or e.outvars[0].aval.shape != act:
            continue
        index, below = m
        if e.primitive.name == "add_any":
            found.setdefault(index, []).append("gradient add")
        elif e.primitive.name == "add" and not below:  # not inside the norm (its bias add)
            found.setdefault(index, []).append("residual add")
    expected = {}
    i = 0
    for p in floor.places(cfg):
        for _ in range(p["count"]):
            expected[i] = sorted(k for k in p["pieces"] if k != "norm")
            i += 1
    assert {k: sorted(v) for k, v in found.items() if v} == {k: v for k, v in expected.items() if v}


def entry(ms_unfused=1.0, ms_fused=0.75):
    return {"model": "gpt", "dtype": "bfloat16", "norms": 13, "t_bytes": 26_214_400, "copy_gbps": 3500.0,
            "forms": {"unfused": {"t": 137, "ms": ms_unfused}, "fused": {"t": 101, "ms": ms_fused}}}


def row(api, variant, ms, mix, baseline):
    trace = None if mix is None else {"ln_busy_ms": mix / 2, "ln_mixed_busy_ms": mix, "ln_ms": mix / 2,
                                      "mixed_ms": mix}  # the sums count overlaps twice: not used
    return {"model": "gpt", "api": api, "dtype": "bfloat16", "variant": variant, "baseline": baseline,
            "ms": ms, "trace": trace}


def test_the_ratio_and_the_ceiling_on_made_up_rows():
    table = [row("linen", "flax", 40.0, 1.5, True), row("linen", "jax_lnbwd", 39.9, 1.3, False),
             row("nnx", "flax", 41.0, None, True)]  # nnx untraced: no ratios for it
    (e,) = floor.against([entry()], table)
    (b,) = e["baseline"]
    assert (b["api"], b["ms"], b["mix_ms"]) == ("linen", 40.0, 1.5)
    assert b["forms"]["unfused"]["mix_over_floor"] == pytest.approx(1.5)
    assert b["forms"]["fused"]["mix_over_floor"] == pytest.approx(2.0)
    assert b["forms"]["unfused"]["ceiling"] == pytest.approx(40 / 39.5)
    assert b["forms"]["fused"]["ceiling"] == pytest.approx(40 / 39.25)
    assert floor.ceiling(1.0, 2.0, 0.5) is None  # no step left: no ceiling
    text = floor.format_block([e])
    assert "2.00x" in text and "1.0191x" in text and "n/a" not in text
    assert all(len(line) <= 120 for line in (text + "\n" + floor.LEGEND).splitlines())
    untraced = floor.format_block(floor.against([entry()], [row("linen", "flax", 40.0, None, True)]))
    assert untraced.count("n/a") == 2 * 4  # per form: base, +mix, +mix/fl, ceiling


def test_our_kernels_at_the_floor_on_made_up_rows():
    cfg = config.FULL["gpt"]
    assert floor.own_units(cfg, fused=False) == 13 * 5   # the norm and its backward, per add & norm
    assert floor.own_units(cfg, fused=True) == floor.units(cfg, "fused")
    assert variants.VARIANTS["add_layernorm"].fused and variants.VARIANTS["add_layernorm_dense_bias"].fused
    assert not variants.VARIANTS["jax_lnbwd"].fused
    e = entry()
    e["own"] = {"unfused": {"t": 65, "ms": 0.4}, "fused": {"t": 101, "ms": 0.75}}
    drop_in = {**row("linen", "jax_lnbwd", 39.9, 1.3, False), "speedup": 1.002}
    drop_in["trace"]["ln_busy_ms"] = 0.65
    fused = {**row("linen", "add_layernorm", 39.8, 1.2, False), "speedup": 1.004}
    fused["trace"]["ln_busy_ms"] = 1.05
    untraced = {**row("nnx", "jax_lnbwd", 39.0, None, False), "speedup": 1.1}
    base = row("linen", "flax", 40.0, 1.5, True)
    # The traced step spans (kernels' union + idle): 39.0 + 0.4 for Flax, 38.9 + 0.4 for the drop-in;
    # the fused variant's trace predates the spans (no busy_ms): its GPU columns are n/a.
    base["trace"].update(busy_ms=39.0, idle_ms=0.4)
    drop_in["trace"].update(busy_ms=38.9, idle_ms=0.4)
    (e,) = floor.against([e], [base, drop_in, fused, untraced])
    a, b = e["ours"]
    assert (a["variant"], a["t"], a["floor_ms"], a["ln_ms"]) == ("jax_lnbwd", 65, 0.4, 0.65)
    assert a["ceiling"] == pytest.approx(1.002 * 39.9 / (39.9 - 0.25))
    assert a["gpu_speedup"] == pytest.approx(39.4 / 39.3)
    assert a["gpu_ceiling"] == pytest.approx(39.4 / (39.3 - 0.25))
    assert (b["variant"], b["t"]) == ("add_layernorm", 101)
    assert b["ceiling"] == pytest.approx(1.004 * 39.8 / (39.8 - 0.3))
    assert b["gpu_speedup"] is None and b["gpu_ceiling"] is None
    text = floor.format_block([e])
    assert "our kernels at the floor" in text
    assert re.search(r"^gpt +bfloat16 +linen +jax_lnbwd +1\.002 +0\.650 +65 +0\.400 +1\.0083x +1\.0025x +1\.0090x$",
                     text, re.M), text
    assert re.search(r"^gpt +bfloat16 +linen +add_layernorm .* n/a +n/a$", text, re.M), text
    assert all(len(line) <= 120 for line in (text + "\n" + floor.LEGEND).splitlines())
    old = entry()   # a results file written before the own floors: no such block
    assert "our kernels" not in floor.format_block(floor.against([old], [row("linen", "flax", 40.0, 1.5, True),
                                                                          drop_in]))


@pytest.mark.slow
def test_the_command_writes_the_floor(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0", NO_COLOR="", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "benchmarks.e2e", "--small", "--models", "gpt", "--apis", "linen", "--layers", "2",
           "--variants", "flax,jax_lnbwd", "--rounds", "2", "--steps", "2", "--round-seconds", "0",
           "--trace-steps", "1", "--trace-repeats", "1", "--no-progress", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=bench_cwd(tmp_path), env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    text = (tmp_path / "e2e.txt").read_text()
    assert "byte floor of the layernorm work" in text and "+mix/fl" in text and "ceiling" in text
    assert re.search(r"^gpt +bfloat16 +5 .* fused +37 .* linen ", text, re.M), text
    (e,) = json.loads((tmp_path / "e2e.json").read_text())["floor"]
    cfg = dataclasses.replace(config.SMALL["gpt"], layers=2)
    assert (e["model"], e["dtype"], e["norms"], e["t_bytes"]) == ("gpt", "bfloat16", 5, floor.t_bytes(cfg, "bfloat16"))
    assert {f: v["t"] for f, v in e["forms"].items()} == {"unfused": 49, "fused": 37}
    assert e["copy_gbps"] > 0 and all(v["ms"] > 0 for v in e["forms"].values())
    (b,) = e["baseline"]
    assert b["api"] == "linen" and b["variant"] == "flax" and b["forms"]["fused"]["mix_over_floor"] > 0
    assert "byte floor" not in done.stdout   # on the CPU: in e2e.txt only, the printout is one short table
    (o,) = e["ours"]
    assert (o["variant"], o["t"]) == ("jax_lnbwd", 5 * 5) and "our kernels at the floor" in text
    assert o["gpu_speedup"] > 0 and b["span_ms"] > 0   # the CPU trace has spans too
