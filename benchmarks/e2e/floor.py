"""The byte floor: the least time the layernorm work of a training step can take on this GPU.

That work is memory bound: it reads and writes activations and does a few flops per element.
So it cannot take less time than moving its minimal bytes at the speed of a plain copy,
measured here, in the same process as the step's timings. Set against the baseline's ``+mix``
column, the floor tells how much any implementation could still take away.

The unit is T = tokens x d_model x itemsize(compute dtype), one activation tensor (tokens =
batch x seq, per device). The work counted is what the layernorm scope of the step holds
(every "add & norm" of models_linen.py and models_nnx.py runs under
``jax.named_scope(LN_SCOPE)``): the residual add, the norm, their backward, and the gradient
add where the residual stream's gradient meets the norm's. Counting rule: every tensor an
operation needs is read once and every tensor it produces is written once; per-row statistics
(mean, rstd) and the parameter vectors (scale, bias, their gradients) are a few bytes per row
or per step and are left out. Two forms of a block:

  unfused  XLA's add, then the norm; in the backward the norm, then XLA's gradient add (what
           Flax's LayerNorm and the drop-in jax_lnbwd.flax.LayerNorm can at best do):
             residual add   s = x + r               forward  read 2, write 1     3T
             norm           y = LN(s)               forward  read 1, write 1     2T
             norm backward  g = dLN(dy, s)          backward read 2, write 1     3T
             gradient add   ds = g + ds_stream      backward read 2, write 1     3T
  fused    one kernel each way (jax_lnbwd.add_layernorm): the add's operands are read and s is
           written by the norm's kernel, and the stream's gradient is read by the backward's
           (also where there is no residual: the first add & norm of a pre-LN model):
             norm           y = LN(s)               2T forward, 3T backward
             + residual     read r, write s         2T forward
             + stream       read ds_stream          1T backward

Where the add & norms sit (2 x layers + 1 of them: 13 for 6 layers):
  pre-LN (gpt, vit)  the first (on the embeddings) starts the residual stream: the stream's
                     gradient is added to its norm's (no residual add); 2 x layers - 1 in the
                     middle: residual add and gradient add; the last (the final LayerNorm):
                     residual add, and the stream ends there (no gradient add).
  post-LN (bert)     the first, on the embeddings: the norm only; after each of the 2 x layers
                     sublayers: residual add, then the norm. The norm's output is the stream,
                     used by the next sublayer and the next residual add: JAX adds those two
                     gradients in the sublayer's scope (its first Dense), outside layernorm's.
Which gradient adds are in the scope is a fact of the models, checked by tests/test_e2e_floor.py
on the step's jaxpr. gpt and vit at 6 layers: fused 6 + 11 x 8 + 7 = 101 T, unfused 8 + 11 x 11
+ 8 = 137 T; bert: fused 5 + 12 x 7 = 89 T, unfused 5 + 12 x 8 = 101 T.

Limits: the rule normalizes every token; vit's head reads only the class token of the final
LayerNorm, which an implementation could exploit (its final add & norm is 7-8 T of 101-137).

The copy speed: a jitted bitwise NOT over T bytes (uint32 words; XLA can elide a plain copy or
``x * 1``, not a NOT), reading T and writing T, chained as the kernel bench times its copy
(benchmarks/kernels/timing.py: steps behind optimization barriers, the median of several runs).
GB/s = 2T / seconds, and the floor of a form is its T per step / that speed. For vit (T is
3 MB in bf16) the copy runs in L2, as an ideal kernel at that size could.

Against the baseline (the first --variants, Flax's LayerNorm), per form:
  +mix/floor  base +mix / floor: the most any implementation of that form could cut the GPU
              time in layernorm's kernels by (+mix is an upper bound of Flax's layernorm time);
              a target of cutting it 2x is reachable only if this is >= 2.
  ceiling     base ms/step / (base ms/step - (base +mix - floor)): the step ratio against the
              baseline of an implementation of that form that ran at the floor and changed
              nothing else; optimistic, since +mix counts the fused neighbours' time as well.

Our own kernels at the floor, per traced variant: what its layernorm-only kernels (the ln
column) must move at least, and the step ratio the variant would reach if they ran at the floor
and the rest of its step stayed as measured. A drop-in LayerNorm after XLA's add (unfused
variants) owns only the norm and its backward, 5 T per add & norm: XLA's adds are its
neighbours' work, which the drop-in cannot change. A fused variant (variants.Variant.fused)
owns the whole fused form. So this ceiling bounds what any kernel of ours could give that
variant:
  ceiling     ×base * ms / (ms - (ln - floor)), from the variant's own row.
The same from the GPU's timeline instead of the timed rounds: a second measurement, without the
host's time (a traced step's span: its kernels and the idle gaps between them):
  ×gpu        the baseline's traced step span / the variant's (the traces' median step each)
  gpu ceiling base span / (span - (ln - floor)): that ratio with the variant's own kernels at
              the floor and the rest of its timeline as traced
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .._term import aligner
from . import config
from .report import ln_mixed_ms, ln_ms
from .trace import step_span_ms
from .variants import VARIANTS

FORMS = ("unfused", "fused")

# T read + written by each piece of one add & norm, per form: (forward, backward).
PIECES = {
    "norm":         {"unfused": (2, 3), "fused": (2, 3)},
    "residual add": {"unfused": (3, 0), "fused": (2, 0)},
    "gradient add": {"unfused": (0, 3), "fused": (0, 1)},
}

# The add & norms of a model: (where, how many for `layers` blocks, its pieces).
PLACES = {
    "pre-LN": (("first: the stream begins", lambda layers: 1, ("norm", "gradient add")),
               ("middle", lambda layers: 2 * layers - 1, ("norm", "residual add", "gradient add")),
               ("last: the stream ends", lambda layers: 1, ("norm", "residual add"))),
    "post-LN": (("first: embeddings", lambda layers: 1, ("norm",)),
                ("after a sublayer", lambda layers: 2 * layers, ("norm", "residual add"))),
}


def places(cfg) -> list[dict]:
    """The add & norms of cfg's model: where, how many, their pieces and T per step of each form."""
    out = []
    for where, count, pieces in PLACES["pre-LN" if cfg.pre_ln else "post-LN"]:
        n = count(cfg.layers)
        out.append({"where": where, "count": n, "pieces": pieces,
                    **{form: n * sum(sum(PIECES[p][form]) for p in pieces) for form in FORMS}})
    return out


def norm_count(cfg) -> int:
    return sum(p["count"] for p in places(cfg))


def units(cfg, form: str) -> int:
    """Minimal DRAM traffic of the layernorm scope per step, in T."""
    return sum(p[form] for p in places(cfg))


def own_units(cfg, fused: bool) -> int:
    """T per step that a variant's own layernorm-only kernels move at least: the whole fused form
    (fused), or the norm and its backward alone (a drop-in LayerNorm: the adds are XLA's)."""
    return units(cfg, "fused") if fused else norm_count(cfg) * sum(PIECES["norm"]["unfused"])


def t_bytes(cfg, dtype) -> int:
    return cfg.tokens * cfg.d_model * jnp.dtype(dtype).itemsize


def copy_seconds(nbytes: int, chain: int, reps: int, min_run_s: float) -> float:
    """Seconds of one pass that reads and writes nbytes, timed as the kernel bench times its copy."""
    from ..kernels.timing import copy_step, time_jax
    words = jnp.zeros((max(1, nbytes // 4),), jnp.uint32)
    return time_jax(copy_step, words, (), chain, reps, min_run_s)


def measure(configs, dtypes) -> list[dict]:
    """One entry per (model, dtype): T, the copy speed and the floor of each form."""
    on_gpu = jax.default_backend() == "gpu"
    out = []
    for cfg in configs:
        for dtype in dtypes:
            t = t_bytes(cfg, dtype)
            sec = copy_seconds(t, chain=50 if on_gpu else 3, reps=7 if on_gpu else 3,
                               min_run_s=0.02 if on_gpu else 0.0)
            gbps = 2 * t / sec / 1e9

            def at_copy_speed(n_t: int) -> dict:   # n_t T per step: itself and its ms at gbps
                return {"t": n_t, "ms": n_t * t / (gbps * 1e9) * 1e3}
            out.append({"model": cfg.name, "dtype": dtype, "tokens": cfg.tokens, "d_model": cfg.d_model,
                        "t_bytes": t, "norms": norm_count(cfg), "copy_us": sec * 1e6, "copy_gbps": gbps,
                        "places": places(cfg),
                        "forms": {f: at_copy_speed(units(cfg, f)) for f in FORMS},
                        "own": {f: at_copy_speed(own_units(cfg, f == "fused")) for f in FORMS}})
    return out


def ceiling(base_ms: float, mix_ms: float, floor_ms: float) -> float | None:
    """The step ratio against the baseline if its layernorm time (mix_ms) became floor_ms."""
    left = base_ms - (mix_ms - floor_ms)
    return base_ms / left if left > 0 else None


def against(entries: list[dict], table: list[dict]) -> list[dict]:
    """entries with, under "baseline", one dict per traced baseline row of the same model and
    dtype (one per api): its ms/step, +mix, and per form +mix/floor and the ceiling."""
    for e in entries:
        e["baseline"] = []
        for r in table:
            if r["baseline"] and r["trace"] and (r["model"], r["dtype"]) == (e["model"], e["dtype"]):
                mix = ln_mixed_ms(r["trace"])
                e["baseline"].append({
                    "api": r["api"], "variant": r["variant"], "ms": r["ms"], "mix_ms": mix,
                    "span_ms": step_span_ms(r["trace"]),
                    "forms": {f: {"mix_over_floor": mix / e["forms"][f]["ms"],
                                  "ceiling": ceiling(r["ms"], mix, e["forms"][f]["ms"])} for f in FORMS}})
        e["ours"] = [own_ceiling(e, r) for r in table
                     if not r["baseline"] and r["trace"] and "speedup" in r and r["variant"] in VARIANTS
                     and (r["model"], r["dtype"]) == (e["model"], e["dtype"]) and "own" in e]
    return entries


def own_ceiling(entry: dict, row: dict) -> dict:
    """A traced variant's row against the floor of what its own kernels move (the module doc)."""
    own = entry["own"]["fused" if VARIANTS[row["variant"]].fused else "unfused"]
    ln = ln_ms(row["trace"])

    def scaled(ratio: float | None, ms: float | None) -> float | None:
        """ratio * ceiling(ms, ln, floor): a step of ms whose own kernels' ln became the floor."""
        c = None if ratio is None else ceiling(ms, ln, own["ms"])
        return None if c is None else ratio * c
    base = next((b["span_ms"] for b in entry.get("baseline", []) if b["api"] == row["api"]), None)
    span = step_span_ms(row["trace"])
    gpu = base / span if base is not None and span is not None else None
    return {"api": row["api"], "variant": row["variant"], "speedup": row["speedup"], "ln_ms": ln,
            "t": own["t"], "floor_ms": own["ms"], "ceiling": scaled(row["speedup"], row["ms"]),
            "gpu_speedup": gpu, "gpu_ceiling": scaled(gpu, span)}


LEGEND = """\
  norms     the add & norms of a step (each LayerNorm and the residual add in front of it)
  T MB      T = tokens x d_model x itemsize: one activation tensor of the compute dtype (per device)
  copy GB/s 2T / the time of a same-size copy (a bitwise NOT reading T and writing T), measured in this run
  form      unfused: XLA's add, then the norm (Flax, the drop-in); fused: add & norm in one kernel each
            way (add_layernorm)
  T/step    the layernorm scope's minimal DRAM traffic per step, in T (floor.py: each input read once,
            each output written once); floor: that at copy GB/s, in ms per step
  api, base, +mix   the baseline's traced row(s) of that model and dtype: its ms/step and +mix
  +mix/fl   +mix / floor: the most any implementation of the form could cut +mix by (a 2x cut is
            reachable only where this is >= 2)
  ceiling   base / (base - (+mix - floor)): the best step ratio against the baseline of an
            implementation of the form running at the floor (optimistic: +mix is an upper bound)
our kernels at the floor, per traced variant:
  ln        the variant's layernorm-only kernels (ms per step); T/step: the least they move (a drop-in
            after XLA's add: the norm and its backward, 5 T per add & norm; a fused variant: the fused
            form); floor: that at copy GB/s
  ceiling   ×base * ms / (ms - (ln - floor)): the variant's step ratio if its own kernels ran at the
            floor and the rest of its step stayed as measured: the most any kernel of ours could give
  ×gpu      the baseline's traced GPU span per step / the variant's (span: kernels and idle gaps)
  gpu ceil  base span / (span - (ln - floor)): ×gpu with the variant's own kernels at the floor"""


def ratio(v: float | None) -> str:
    """A step ratio as the tables print it, or n/a."""
    return "n/a" if v is None else f"{v:.4f}x"


def format_block(entries: list[dict]) -> str:
    """The floor table: one line per (model, dtype, form), and per traced baseline api."""
    head = ("model", "dtype", "norms", "T MB", "copy GB/s", "form", "T/step", "floor", "api", "base",
            "+mix", "+mix/fl", "ceiling")
    cells = []
    for e in entries:
        for f in FORMS:
            fixed = (e["model"], e["dtype"], str(e["norms"]), f"{e['t_bytes'] / 1e6:.4g}",
                     f"{e['copy_gbps']:.4g}", f, str(e["forms"][f]["t"]), f"{e['forms'][f]['ms']:.3f}")
            for b in e.get("baseline") or [None]:
                if b is None:
                    cells.append(fixed + ("-", "n/a", "n/a", "n/a", "n/a"))
                    continue
                cells.append(fixed + (b["api"], f"{b['ms']:.3f}", f"{b['mix_ms']:.3f}",
                                      f"{b['forms'][f]['mix_over_floor']:.2f}x", ratio(b["forms"][f]["ceiling"])))
    aligned = aligner(head, cells, left=(0, 1, 5, 8))   # model, dtype, form, api: text

    def line(c):
        return aligned(c).rstrip()
    norms = sorted({config.FULL[e["model"]].norm for e in entries if e["model"] in config.FULL}) or ["norm"]
    out = [f"byte floor of the {' and '.join(norms)} work (ms per step; base: the baseline's ms/step and +mix):",
           line(head), "-" * len(line(head))] + [line(c) for c in cells]
    ours = [(e["model"], e["dtype"], o["api"], o["variant"], f"{o['speedup']:.3f}", f"{o['ln_ms']:.3f}", str(o["t"]),
             f"{o['floor_ms']:.3f}", ratio(o["ceiling"]), ratio(o.get("gpu_speedup")), ratio(o.get("gpu_ceiling")))
            for e in entries for o in e.get("ours", [])]
    if ours:
        head2 = ("model", "dtype", "api", "variant", "×base", "ln", "T/step", "floor", "ceiling", "×gpu", "gpu ceil")
        al2 = aligner(head2, ours, left=(0, 1, 2, 3))
        out += ["", "our kernels at the floor (ms per step; the variant's ln against the floor of what they move):",
                al2(head2).rstrip(), "-" * len(al2(head2).rstrip())] + [al2(c).rstrip() for c in ours]
    return "\n".join(out)
