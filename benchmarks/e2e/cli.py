"""The e2e bench's command line: ``python -m benchmarks.e2e [options]`` (``--help``)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import sys
import time

import jax

from .. import _term
from .._term import Progress, paint
from . import __doc__ as METHOD
from . import breakdown, floor, report, scaling, trace
from .config import FULL, SMALL
from .models_public_linen import QK_SCOPE
from .output import emit, seconds
from .train import PROBE_STEPS, ROUND_STEPS_CAP, build, probe, round_steps, run_steps
from .variants import VARIANTS

APIS = ("linen", "nnx")
DTYPES = ("bfloat16", "float32")
SIZE_FIELDS = ("layers", "batch", "seq", "d_model", "heads", "vocab")
DEFAULT_VARIANTS = {"layernorm": "flax,jax_lnbwd,add_layernorm",
                    "rmsnorm": "flax_rmsnorm,jax_lnbwd_rmsnorm,add_rmsnorm"}
# A model whose default variants are not its norm's: the public-style models (config.py) run
# against the norm as public code writes it (variants_rms.public_rmsnorm), then our drop-in and
# our fused add & norm.
MODEL_VARIANTS = {"public_llama": "public_rmsnorm,jax_lnbwd_rmsnorm,add_rmsnorm",
                  "public_gemma": "public_rmsnorm,jax_lnbwd_rmsnorm,add_rmsnorm"}
# With --qk-norm a public-style model runs its QK-norm's two implementations instead (the same add &
# norms in both, variants_rms.py): Flax's two RMSNorms, the baseline, and jax_lnbwd's QKNorm.
QK_VARIANTS = "qk_flax,qk_jax_lnbwd"
# The run's defaults, and --small's: a smoke test of the whole command that a 2-core CPU runs in
# under a minute (one model in one API at its config.SMALL size, a few steps and rounds, one short
# trace; each run's compilation is most of it).
DEFAULTS = {"models": "gpt,bert,vit", "apis": "linen,nnx", "steps": 10, "round_seconds": 0.5, "rounds": 7, "warmup": 2,
            "trace_steps": 10, "trace_repeats": 3}
SMALL_DEFAULTS = {"models": "gpt", "apis": "linen", "steps": 3, "round_seconds": 0.0, "rounds": 3, "warmup": 1,
                  "trace_steps": 2, "trace_repeats": 1}


def csv(s: str) -> list[str]:
    return [t.strip() for t in s.split(",") if t.strip()]


def has_qk_norm(model: str, qk_norm: bool) -> bool:
    """Whether the model runs with a QK-norm under --qk-norm (qk_norm): the public-style ones do."""
    return qk_norm and FULL[model].style == "public"


def default_variants(model: str, qk_norm: bool = False) -> list[str]:
    """The variants a model runs when --variants is not given, its baseline first; qk_norm: with
    --qk-norm."""
    if has_qk_norm(model, qk_norm):
        return csv(QK_VARIANTS)
    return csv(MODEL_VARIANTS.get(model) or DEFAULT_VARIANTS[FULL[model].norm])


def parse_args(argv):
    intro, method = METHOD.split("\n\n", 1)
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=intro, epilog=method,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None,
                   help="comma list from " + ",".join(FULL) + " (default gpt,bert,vit; --small: gpt); "
                        "public_llama and public_gemma are llama written as public Flax Llama/Gemma "
                        "code is (benchmarks/e2e/config.py)")
    p.add_argument("--apis", default=None, help="comma list from linen,nnx (default both; --small: linen)")
    p.add_argument("--dtypes", default="bfloat16",
                   help="compute dtypes, comma list from bfloat16,float32 (default bfloat16)")
    p.add_argument("--variants", default=None,
                   help="comma list of norm variants; each model runs those of its norm, the first "
                        "of them its baseline (default: " +
                        "; ".join(f"{n} models {v}" for n, v in DEFAULT_VARIANTS.items()) + "; but " +
                        "; ".join(f"{m} {v}" for m, v in MODEL_VARIANTS.items()) + "). Also registered: "
                        "jax_lnbwd_rmsnorm_jnp_fwd and jax_lnbwd_rmsnorm_jnp_bwd, the drop-in with the jnp "
                        "forward or the jnp backward (which half of it a difference comes from)")
    p.add_argument("--offset", type=float, default=None,
                   help="rmsnorm models: normalize with (offset + scale), the scale starting at "
                        "zeros; 1.0 is Gemma's zero-centred scale (default: each model's own, 0 but "
                        "public_gemma's 1)")
    p.add_argument("--qk-norm", action="store_true",
                   help="public-style models (public_llama, public_gemma): QK-norm, as Qwen3's: q and k, "
                        "after their projections and the reshape to heads, each RMS-normalized over head_dim "
                        f"(scales (head_dim,)) before rotary; their default variants are then {QK_VARIANTS} "
                        "(Flax's two nn.RMSNorm, the baseline, against jax_lnbwd.flax.QKNorm, both with "
                        "public_rmsnorm's add & norms); other variants run Flax's QK-norm")
    p.add_argument("--variant-module", action="append", default=[], metavar="MODULE",
                   help="import MODULE first: it registers more variants (see benchmarks/e2e/variants.py)")
    p.add_argument("--small", action="store_true",
                   help="a CPU smoke test: tiny models, and unless given otherwise " +
                        ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMALL_DEFAULTS.items()))
    for field in SIZE_FIELDS:
        p.add_argument("--" + field.replace("_", "-"), type=int, default=None,
                       help=f"override every model's {field}")
    p.add_argument("--devices", type=int, default=1, metavar="N",
                   help="data parallel over the first N devices: the batch (per device) is split "
                        "over a mesh axis, parameters replicated, gradients all-reduced; adds the "
                        "comm, overlap and exposed columns (default 1: one device)")
    p.add_argument("--scaling", action="store_true",
                   help="with --devices N: also time each run on one device (same batch per device) and "
                        "report the weak-scaling efficiency t1/tN (scaling.py)")
    p.add_argument("--steps", type=int, default=None, help="steps per round per run, at least (default 10)")
    p.add_argument("--round-seconds", type=float, default=None, metavar="S",
                   help="each round runs a run's steps for at least S seconds, as estimated from "
                        f"2 x {PROBE_STEPS} steps after its warm-up (at most {ROUND_STEPS_CAP} steps; "
                        "default 0.5; 0: --steps steps)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per run after compiling (default 2)")
    p.add_argument("--trace", default="auto", choices=("auto", "torch", "jax", "none"),
                   help="kernel trace collector (default auto: torch on a GPU, else jax)")
    p.add_argument("--trace-steps", type=int, default=None,
                   help="steps per trace (default 10)")
    p.add_argument("--trace-repeats", type=int, default=None,
                   help="traces per run; the one whose traced step (busy + idle) is the median counts "
                        "(default 3)")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="after the table, list each run's N costliest layernorm and mixed kernels "
                        "(also in e2e.json under trace.top; default 0: none)")
    p.add_argument("--attention", default="xla", choices=("xla", "cudnn"),
                   help="jax.nn.dot_product_attention's implementation (default xla; cudnn: bf16 only)")
    p.add_argument("--no-dense-bias", action="store_true",
                   help="the blocks' Dense layers without biases (PaLM-style; default: with, as GPT-2, "
                        "BERT and ViT): the residual add then stands alone, see config.py")
    p.add_argument("--matmul-precision", default="default", choices=("default", "high", "highest"),
                   help="jax.default_matmul_precision for the run (default: JAX's, TF32 for fp32 on GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for e2e.txt, e2e.json and e2e.png")
    p.add_argument("--dump-hlo", default=None, metavar="DIR",
                   help="write each run's optimized HLO (the compiled step, as the trace attribution "
                        "reads it) to DIR/<model>_<api>_<dtype>_<variant>.hlo.txt as soon as it compiles")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    a = p.parse_args(argv)
    for name, value in (SMALL_DEFAULTS if a.small else DEFAULTS).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    for mod in a.variant_module:
        importlib.import_module(mod)
    a.models, a.apis, a.dtypes = csv(a.models), csv(a.apis), csv(a.dtypes)
    # Not given: each model runs its own defaults (default_variants), the union listed here.
    a.variants_given = a.variants is not None
    a.variants = (csv(a.variants) if a.variants_given
                  else list(dict.fromkeys(v for m in a.models if m in FULL for v in default_variants(m, a.qk_norm))))
    for name, got, allowed in (("models", a.models, tuple(FULL)), ("apis", a.apis, APIS),
                               ("dtypes", a.dtypes, DTYPES), ("variants", a.variants, tuple(VARIANTS))):
        if not got or any(g not in allowed for g in got):
            p.error(f"--{name}: expected a comma list from {', '.join(allowed)}, got {','.join(got)!r}")
    if a.attention == "cudnn" and "float32" in a.dtypes:
        p.error("--attention cudnn: cuDNN's flash attention takes bf16/fp16 only; drop float32")
    if min(a.steps, a.rounds, a.trace_steps, a.trace_repeats) < 1 or a.warmup < 0 or a.round_seconds < 0:
        p.error("--steps, --rounds, --trace-steps and --trace-repeats must be >= 1, --warmup and --round-seconds >= 0")
    if a.devices < 1:
        p.error(f"--devices: expected >= 1, got {a.devices}")
    if a.scaling and a.devices < 2:
        p.error("--scaling: compares one device with N: give --devices N (N >= 2)")
    if a.devices > 1 and len(jax.devices()) < a.devices:
        found = jax.devices()
        p.error(f"--devices {a.devices}: only {len(found)} {jax.default_backend()} device"
                f"{'s are' if len(found) > 1 else ' is'} visible ({', '.join(map(str, found))}); "
                f"on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={a.devices} makes more")
    configure(p, a)
    return a


def configure(p, a) -> None:
    """a.configs (each model at its size, with the overrides), a.runs_of (each model's variants:
    with --variants those of its norm, else its defaults) and a.baselines (each model's first
    variant); p.error on a mismatch."""
    sizes = {f: getattr(a, f) for f in SIZE_FIELDS if getattr(a, f) is not None}
    a.configs = [dataclasses.replace((SMALL if a.small else FULL)[m], attention=a.attention,
                                     dense_bias=FULL[m].dense_bias and not a.no_dense_bias,
                                     offset=(FULL[m].offset if a.offset is None else a.offset)
                                     if FULL[m].norm == "rmsnorm" else 0.0,
                                     qk_norm=has_qk_norm(m, a.qk_norm), **sizes)
                 for m in a.models]
    if a.qk_norm and not any(c.qk_norm for c in a.configs):
        p.error("--qk-norm: applies to the public-style models (public_llama, public_gemma) only")
    qk_only = [v for v in a.variants if VARIANTS[v].qk_norm is not None]
    if qk_only and not a.qk_norm:
        p.error(f"--variants {','.join(qk_only)}: QK-norm variants run in a model with a QK-norm: add --qk-norm")

    def runs(v, cfg):  # whether variant v runs in the model cfg
        return VARIANTS[v].norm == cfg.norm and (VARIANTS[v].qk_norm is None or cfg.qk_norm)
    a.runs_of = {c.name: [v for v in (a.variants if a.variants_given else default_variants(c.name, c.qk_norm))
                          if runs(v, c)] for c in a.configs}
    for cfg in a.configs:
        if not a.runs_of[cfg.name]:
            p.error(f"--variants: none for {cfg.name}, a {cfg.norm} model: " +
                    ", ".join(v for v in VARIANTS if runs(v, cfg)))
    if a.offset and not any(c.norm == "rmsnorm" for c in a.configs):
        p.error("--offset: applies to rmsnorm models (llama, public_llama, public_gemma) only")
    # The baselines: each model's first variant (with --variants: each norm's first listed).
    a.baselines = tuple(dict.fromkeys(a.runs_of[c.name][0] for c in a.configs))
    for cfg in a.configs:
        if cfg.d_model % cfg.heads:
            p.error(f"{cfg.name}: d_model {cfg.d_model} is not a multiple of heads {cfg.heads}")
    if any(c.name == "vit" for c in a.configs) and "seq" in sizes:
        p.error("--seq: the vit's token count is its patches + 1 (change its patch grid in config.py)")


def same_steps(runs) -> str:
    """Gives every run of one (model, api, dtype) the most steps per round any of them needs:
    the variants then take the same steps (their losses compare) and both rounds of a pair
    hold the same work. Returns "model api dtype N, ..." for the progress output."""
    groups = {}
    for run in runs:
        groups.setdefault((run.model, run.api, run.dtype), []).append(run)
    for group in groups.values():
        most = max(r.round_steps for r in group)
        for r in group:
            r.round_steps = most
    return ", ".join(f"{' '.join(k)} {g[0].round_steps}" for k, g in groups.items())


def interleaved(runs: list, repeats: int) -> list[tuple[int, object]]:
    """(repeat, run) in the order the timed rounds and the traces take them: every run once per
    repeat, the order reversed every other repeat. The GPU drifts (clocks, temperature); runs
    taken one after the other would each meet a different part of that drift."""
    return [(rep, run) for rep in range(repeats) for run in (runs if rep % 2 == 0 else runs[::-1])]


def describe(cfg, devices: int) -> str:
    """One model's line in the run's header."""
    return (f"  {cfg.name}: d {cfg.d_model}, {cfg.heads} heads, {cfg.layers} layers, seq {cfg.seq}, "
            f"batch {cfg.batch}" + (" per device" if devices > 1 else "") +
            (f", vocab {cfg.vocab}" if cfg.vocab else "") +
            f", {'pre' if cfg.pre_ln else 'post'}-norm {cfg.norm}" +
            (f" (offset {cfg.offset:g})" if cfg.offset else "") +
            (", public-style" if cfg.style == "public" else "") +
            (", QK-norm" if cfg.qk_norm else "") +
            (", embeddings x sqrt(d)" if cfg.embed_scale else "") + f", {cfg.mlp} MLP" +
            (", rotary" if cfg.rope else "") +
            (", tied head" if cfg.style == "public" and cfg.tied_head else "") +
            (f", attention {cfg.attention}" if cfg.style == "own" else ", attention written out (einsums)") +
            ("" if cfg.dense_bias else ", no Dense biases in the blocks"))


def dump_hlo(run, folder: str) -> str:
    """Writes run.hlo, the compiled step's optimized HLO, to folder/<model>_<api>_<dtype>_<variant>.hlo.txt;
    returns the path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{run.model}_{run.api}_{run.dtype}_{run.variant}.hlo.txt")
    with open(path, "w") as fh:
        fh.write(run.hlo)
    return path


def main(argv=None):
    args = parse_args(argv)
    meta = _term.machine()
    precision = (contextlib.nullcontext() if args.matmul_precision == "default"
                 else jax.default_matmul_precision(args.matmul_precision))
    how, why = trace.available(args.trace)
    meta.update({"argv": sys.argv[1:] if argv is None else list(argv), "devices": args.devices,
                 "device_list": [str(d) for d in jax.devices()[:args.devices]], "steps": args.steps,
                 "rounds": args.rounds, "round_seconds": args.round_seconds, "warmup": args.warmup,
                 "trace": how, "trace_steps": args.trace_steps, "trace_repeats": args.trace_repeats,
                 "matmul_precision": args.matmul_precision, "baseline": args.baselines[0],
                 "baselines": list(args.baselines), "offset": args.offset, "qk_norm": args.qk_norm,
                 "models": [dataclasses.asdict(c) for c in args.configs], "failures": []})
    print(f"jax_lnbwd {meta['jax_lnbwd']} e2e bench  {meta['date']}  device: {meta['device']}  "
          f"jax {meta['jax']}")
    rounds = (f"at least {args.round_seconds:g} s and {args.steps} back-to-back steps" if args.round_seconds
              else f"{args.steps} back-to-back steps")
    print(f"timing: {args.rounds} interleaved rounds of {rounds} per run, after {args.warmup} warm-up "
          f"steps; trace: {why if how else 'none (' + why + ')'}")
    if args.devices > 1:
        print(f"data parallel over {args.devices} devices ({', '.join(meta['device_list'])}): "
              f"batch per device, global batch = batch x {args.devices}")
    for cfg in args.configs:
        print(describe(cfg, args.devices))
    if jax.default_backend() != "gpu":
        print("note: not on a GPU: a smoke test of the tool, not a measurement")
    elif not meta["kernels_built_for_cuda"]:
        print(paint("warning: jax_lnbwd was built without its CUDA handler: its variants will fail "
                    "(rebuild with nvcc on the PATH)", "red"))
    plan = [(cfg, api, dtype, VARIANTS[v]) for cfg in args.configs for api in args.apis
            for dtype in args.dtypes for v in args.runs_of[cfg.name]]
    prog = Progress(len(plan) * (2 + args.rounds), not args.no_progress)
    runs = []
    clock = {"start": time.perf_counter()}
    with precision:
        for cfg, api, dtype, variant in plan:  # compile all first: the rounds then only run steps
            label = f"{cfg.name} {api} {dtype} {variant.name}"
            prog.step(f"compile {label}")
            try:
                run = build(cfg, api, variant, dtype, args.seed, devices=args.devices)
                if args.dump_hlo:
                    prog.write(f"wrote {dump_hlo(run, args.dump_hlo)}")
                prog.step(f"warm up {label}")
                if args.warmup:
                    run_steps(run, args.warmup)
                if args.round_seconds:
                    probe(run)
            except Exception as e:  # one variant that breaks (OOM, a missing CUDA handler) must not end the run
                prog.write(paint(f"ERROR {label}: {type(e).__name__}: {str(e)[:500]}", "red"))
                meta["failures"].append({"run": label, "error": repr(e)[:2000]})
                continue
            runs.append(run)
            run.round_steps = round_steps(run.step_estimate_s, args.round_seconds, args.steps)
            prog.write(f"compiled {label} in {run.compile_s:.1f} s; norms: {run.paths}" + (
                "" if run.step_estimate_s is None else
                f"; {run.step_estimate_s * 1e3:.3f} ms a step: {run.round_steps} steps per round"))
        if runs and args.round_seconds:
            prog.write(f"steps per round (the most any variant needs): {same_steps(runs)}")
        clock["compiled"] = time.perf_counter()
        for i, run in interleaved(runs, args.rounds):
            prog.step(f"round {i + 1}/{args.rounds} {run.label}")
            run.times.append(run_steps(run, run.round_steps) / run.round_steps)
        prog.close()
        if args.scaling and args.devices > 1 and runs:
            print(f"scaling: each run again on one device, {args.rounds} alternating rounds")
            meta["scaling"] = scaling.measure(runs, plan, args.rounds, build, run_steps, args.seed)
        clock["timed"] = time.perf_counter()
        meta["seconds"] = {"compile_and_warm_up": clock["compiled"] - clock["start"],
                           "rounds": clock["timed"] - clock["compiled"]}
        if not runs:
            raise SystemExit("e2e: every run failed to build (above)")
        floors = None
        try:  # the copy speed, on a GPU the step runs left idle (floor.py)
            floors = floor.measure(args.configs, args.dtypes)
        except Exception as e:  # a broken floor must not cost the timings
            print(paint(f"byte floor failed: {type(e).__name__}: {str(e)[:300]}", "red"))
        clock["floor"] = time.perf_counter()
        meta["seconds"]["floor"] = clock["floor"] - clock["timed"]
        if how is None:
            print(seconds(meta))
        table = emit(runs, args, meta, traced=how is None, floors=floors)  # the timings, before any trace
        if how is None:
            return table
        prog = Progress(len(runs) * args.trace_repeats, not args.no_progress)
        done, broken = {id(r): [] for r in runs}, set()
        hlo_facts = {}  # id(run) -> its module's classes, our calls, QK-norm classes and our scope: read once
        for rep, run in interleaved(runs, args.trace_repeats):
            prog.step(f"trace {rep + 1}/{args.trace_repeats} {run.label}")
            if id(run) in broken:
                continue
            try:
                if id(run) not in hlo_facts:
                    hlo_facts[id(run)] = (trace.classify_hlo(run.hlo), trace.our_calls(run.hlo),
                                          trace.classify_hlo(run.hlo, QK_SCOPE), trace.our_scope(run.hlo))
                classes, ours, qk_classes, scope = hlo_facts[id(run)]
                done[id(run)].append(trace.summarize(trace.collect(lambda: run_steps(run, args.trace_steps), how),
                                                     classes, args.trace_steps, args.kernels, ours,
                                                     qk_classes, scope))
            except Exception as e:  # a trace that breaks must not cost the timings
                prog.write(paint(f"trace {run.label} failed: {type(e).__name__}: {str(e)[:300]}", "red"))
                broken.add(id(run))
        for run in runs:
            run.trace = None if id(run) in broken else trace.median_summary(done[id(run)]) or None
        prog.close()
    meta["seconds"]["traces"] = time.perf_counter() - clock["floor"]
    kinds = breakdown.text(report.rows(runs, args.baselines, {c.name: c.norm for c in args.configs}),
                           args.kernels) if args.kernels else ""
    if kinds:
        print(kinds)
    print(seconds(meta))
    return emit(runs, args, meta, traced=True, floors=floors, kinds=kinds)


if __name__ == "__main__":
    main()
