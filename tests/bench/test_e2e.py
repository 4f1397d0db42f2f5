"""The end-to-end training-step bench (benchmarks/e2e, run from a checkout), on CPU in CI.

A smoke test of the tool, not a measurement: no timing is asserted. It checks that the three
model families are the same model in linen and nnx, that every (model, API, variant) step
traces, that the command runs end to end in a pipe and writes its outputs (on the CPU, with
jax.profiler's trace), the trace attribution rule on a hand-written HLO module, the kernel
kinds on hand-written kernel names, the --kernels report on hand-made summaries, and the
round sizing and paired ratio on hand-made rounds. On a GPU it checks that each collector
(CUPTI through torch.profiler, jax.profiler) sees the step's kernels and finds layernorm's.

Data parallel (--devices N): on the CPU's host devices, the step over 2 devices equals the
one-device step on the same global batch, our ops run on each device's rows with no
activation moving between devices, the command runs with its communication columns, and the
overlap arithmetic is checked on hand-made events.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from conftest import CHECKOUT, RTOL, bench_cwd  # noqa: E402

import jax_lnbwd  # noqa: E402

sys.path.insert(0, str(CHECKOUT))  # the checkout: benchmarks/
from benchmarks.e2e import cli, config, report, trace, train, variants  # noqa: E402


def n_params(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", sorted(n for n, c in config.SMALL.items() if c.norm == "layernorm"))
def test_linen_and_nnx_build_the_same_model_and_every_step_traces(name):
    cfg = config.SMALL[name]
    batch = config.make_batch(cfg, jnp.bfloat16)
    counts = {}
    for api in cli.APIS:
        for v in ("flax", "jax_lnbwd", "add_layernorm"):
            made = {}

            def make():  # shapes only: nothing is computed or compiled
                made["apply"], params = train.init(cfg, api, variants.VARIANTS[v], jnp.bfloat16, batch[0], 0)
                return params
            params = jax.eval_shape(make)
            apply = made["apply"]
            counts[api, v] = n_params(params)
            logits = jax.eval_shape(apply, params, batch[0])
            assert logits.shape == batch[1].shape + (cfg.vocab or cfg.classes,)
            assert logits.dtype == jnp.bfloat16
            grads = jax.eval_shape(jax.grad(lambda p: apply(p, batch[0]).astype(jnp.float32).sum()), params)
            assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert len(set(counts.values())) == 1, counts  # 13 LayerNorms' scale and bias in every one


@pytest.mark.slow
def test_the_jnp_forward_variant_traces_the_jnp_forward_only():
    """jax_lnbwd_jnp_forward: the drop-in traced under use_ffi_forward(False), whatever the
    process-wide setting; the drop-in itself, under use_ffi_forward(True), calls the fused
    forward. Both still run our backward."""
    from jax_lnbwd import TARGET_FWD as FWD
    cfg = config.SMALL["gpt"]
    x = config.make_batch(cfg, jnp.bfloat16)[0]
    for api in cli.APIS:
        texts = {}
        for v in ("jax_lnbwd", "jax_lnbwd_jnp_forward"):
            with jax_lnbwd.use_ffi_forward(True):
                apply, params = train.init(cfg, api, variants.VARIANTS[v], jnp.bfloat16, x, 0)
                loss = lambda p: apply(p, x).astype(jnp.float32).sum()  # noqa: E731
                texts[v] = jax.jit(jax.grad(loss)).lower(params).as_text()
        assert f"@{FWD}(" in texts["jax_lnbwd"], api
        assert f"@{FWD}(" not in texts["jax_lnbwd_jnp_forward"], api
        assert all("jax_lnbwd_layernorm_bwd" in t for t in texts.values()), api


def test_no_dense_bias_drops_the_blocks_biases_only():
    full = cli.parse_args(["--small", "--models", "gpt"]).configs[0]
    bare = cli.parse_args(["--small", "--models", "gpt", "--no-dense-bias"]).configs[0]
    assert full.dense_bias and not bare.dense_bias
    batch = config.make_batch(bare, jnp.float32)
    for api in cli.APIS:
        count = {}
        for cfg in (full, bare):
            made = {}

            def make():
                made["apply"], params = train.init(cfg, api, variants.VARIANTS["add_layernorm"], jnp.float32,
                                                   batch[0], 0)
                return params
            params = jax.eval_shape(make)
            count[cfg.dense_bias] = n_params(params)
            logits = jax.eval_shape(made["apply"], params, batch[0])
            assert logits.shape == batch[1].shape + (cfg.vocab,)
        d, layers = full.d_model, full.layers
        # qkv (3d), proj (d), up (4d), down (d) biases per block
        assert count[True] - count[False] == layers * (3 * d + d + full.mlp_ratio * d + d), (api, count)


def run_e2e(tmp_path, *extra, platform="cpu", cpu_devices=1):
    """`python -m benchmarks.e2e --small ...` in a subprocess, as a user runs it (stdout a pipe);
    returns (stdout + stderr, the rows of e2e.json). Tiny models, one block, unoptimized code
    generation: compiling dominates, so it is kept short. cpu_devices: host devices to make."""
    # On a GPU this process may hold most of its memory already: the child allocates on demand.
    flags = "--xla_backend_optimization_level=0" + (
        f" --xla_force_host_platform_device_count={cpu_devices}" if cpu_devices > 1 else "")
    env = dict(os.environ, XLA_FLAGS=flags, NO_COLOR="",
               JAX_PLATFORMS="cuda" if platform == "gpu" else "cpu", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, "-m", "benchmarks.e2e", "--small", "--layers", "1", "--models", "vit", "--apis", "linen,nnx",
           "--rounds", "2", "--steps", "1", "--warmup", "1", "--trace-steps", "1", "--round-seconds", "0",
           "--out", str(tmp_path), *extra]
    done = subprocess.run(cmd, cwd=bench_cwd(tmp_path), env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr, json.loads((tmp_path / "e2e.json").read_text())["rows"]


@pytest.mark.slow
def test_the_command_runs_end_to_end_in_a_pipe(tmp_path):
    # --round-seconds: the rounds are sized from a probe after the warm-up (a short round here)
    printed, rows = run_e2e(tmp_path, "--kernels", "3", "--round-seconds", "0.01")
    assert "\033[" not in printed  # a pipe: no colour codes
    assert {(r["api"], r["variant"]) for r in rows} == {(a, v) for a in cli.APIS
                                                        for v in ("flax", "jax_lnbwd", "add_layernorm")}
    assert all(len(r["round_ms"]) == 2 and r["ms"] > 0 for r in rows)
    assert all(r["speedup"] == r["speedup_of_medians"] == 1.0 for r in rows if r["variant"] == "flax")
    for api in cli.APIS:  # every variant of a model, API and dtype takes the same steps per round
        steps = {r["round_steps"] for r in rows if r["api"] == api}
        assert len(steps) == 1 and 1 <= steps.pop() <= train.ROUND_STEPS_CAP, rows
    assert all(r["step_estimate_ms"] > 0 for r in rows)
    assert "steps per round" in printed
    # On the CPU: one short table that says it is a smoke run; no GPU columns, legend or byte floor.
    assert printed.count("CPU smoke run") == 1 and printed.count("ms/step") == 1
    assert "byte floor" not in printed and "GPU ms" not in printed and "layernorm work" not in printed
    for r in rows:  # on CPU: jax.profiler's per-instruction tasks
        assert r["trace"]["ln_ms"] > 0 and r["trace"]["other_ms"] > 0 and r["trace"]["idle_ms"] >= 0
        assert r["devices"] == r["trace"]["devices"] == 1 and r["trace"]["comm_ms"] == 0
        assert r["trace"]["overlap_ms"] == r["trace"]["comm_exposed_ms"] == 0
        top = r["trace"]["top"]  # --kernels 3: the costliest ln and mixed kernels, costliest first
        assert 0 < len(top) <= 3 and all(cls in ("ln", "mixed") and n > 0 and ms >= 0 for cls, _, n, ms in top)
        assert [t[3] for t in top] == sorted((t[3] for t in top), reverse=True)
        kinds = r["trace"]["kinds"]  # every kernel has a kind: they add up to the kernel time
        assert set(kinds) == set(trace.KINDS) and sum(kinds.values()) == pytest.approx(r["trace"]["kernel_ms"])
        assert (kinds["ours"] > 0) == (r["variant"] != "flax"), kinds
        other = r["trace"]["top_other"]
        assert len(other) <= 3 and all(k in ("reduce fusion", "loop fusion") for k, *_ in other)
        # the idle time split by the kernel after each gap adds up to it; every matmul is listed
        assert sum(ms for _, ms in r["trace"]["idle_after"].values()) == pytest.approx(r["trace"]["idle_ms"])
        assert sum(ms for *_, ms in r["trace"]["gemms"]) == pytest.approx(kinds["gemm"])
    assert "costliest ln and mixed kernels" in printed and "costliest XLA fusions" in printed
    assert "by the kernel after each gap" in printed and "matmul kernels against the baseline" in printed
    assert "linen bfloat16 add_layernorm vs flax: kernel" in printed
    text = (tmp_path / "e2e.txt").read_text()
    assert "jax_lnbwd" in text and "ms/step" in text and "overlap" not in text  # one device: no comm columns
    assert "linen bfloat16 add_layernorm vs flax: kernel" in text  # e2e.txt keeps --kernels' breakdown
    if _has("matplotlib"):
        assert (tmp_path / "e2e.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_the_data_parallel_command_runs_end_to_end(tmp_path):
    """--devices 2 on two host CPU devices: every variant runs data parallel, its trace sees
    both devices and their all-reduce, and the table gains the communication columns."""
    printed, rows = run_e2e(tmp_path, "--devices", "2", "--apis", "linen", cpu_devices=2)
    assert "data parallel over 2 devices" in printed
    assert [r["variant"] for r in rows] == ["flax", "jax_lnbwd", "add_layernorm"]
    for r in rows:
        t = r["trace"]
        assert r["devices"] == t["devices"] == 2 and t["ln_ms"] > 0 and t["other_ms"] > 0, t
        assert t["comm_ms"] > 0, t  # the gradients' all-reduce, a thunk on each device
        assert 0 <= t["overlap_ms"] <= t["comm_ms"] + 1e-9 and 0 <= t["comm_exposed_ms"] <= t["comm_ms"] + 1e-9, t
        assert math.isfinite(r["loss_last"])
    # Every variant takes the same steps on the same global batch: the losses agree to bf16's rounding.
    losses = [r["loss_last"] for r in rows]
    assert max(losses) - min(losses) <= RTOL["bfloat16"] * abs(losses[0]), losses
    text = (tmp_path / "e2e.txt").read_text()
    assert "x2, data parallel" in text.splitlines()[0]
    assert all(c in text.splitlines()[3] for c in ("comm", "overlap", "exposed"))
    json_meta = json.loads((tmp_path / "e2e.json").read_text())["meta"]
    assert json_meta["devices"] == 2 and len(json_meta["device_list"]) == 2


COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
OUR_CALL = re.compile(r'= \(?(\w+)\[([\d,]*)\].*custom_call_target="(jax_lnbwd_\w+)"')


@pytest.mark.skipif(jax.default_backend() != "cpu" or len(jax.devices()) < 2,
                    reason="runs on the CPU's host devices (conftest); a GPU runs the command")
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["jax_lnbwd", "add_layernorm"])
def test_data_parallel_step_equals_one_device_and_moves_no_activations(variant):
    """2 devices with 2 examples each against 1 device with the same 4: the same losses, step
    after step (float32: only the order of the sums differs). The compiled data-parallel step
    runs every one of our ops (forward and backward, the FFI forward forced on as on CUDA) on
    its device's rows only, and its only collectives are all-reduces (the gradients, with our
    dweight/dbias psum): no all-gather, all-to-all or collective-permute of activations."""
    cfg = dataclasses.replace(config.SMALL["vit"], layers=1)
    with jax_lnbwd.use_ffi_forward(True):
        one = train.build(dataclasses.replace(cfg, batch=2 * cfg.batch), "linen",
                          variants.VARIANTS[variant], "float32")
        dp = train.build(cfg, "linen", variants.VARIANTS[variant], "float32", devices=2)
    for run in (one, dp):
        for _ in range(3):
            train.run_steps(run, 1)
    assert dp.losses == pytest.approx(one.losses, rel=RTOL["float32"]), (dp.losses, one.losses)
    ops = [line.strip() for line in dp.hlo.splitlines() if COLLECTIVE.search(line)]
    assert ops and all("all-reduce" in op for op in ops), "\n".join(op[:200] for op in ops)
    calls = [m.groups() for line in dp.hlo.splitlines() if (m := OUR_CALL.search(line))]
    targets = {t for _, _, t in calls}
    assert any("fwd" in t for t in targets) and any("bwd" in t for t in targets), targets
    for dtype, dims, target in calls:  # the first result: y or dx, laid out (rows..., C)
        rows = math.prod(int(d) for d in dims.split(",")[:-1])
        assert rows == cfg.batch * cfg.seq, (target, dtype, dims)  # a device's rows, not the global 2x


def test_data_parallel_needs_the_devices():
    with pytest.raises(SystemExit):
        cli.parse_args(["--small", "--devices", str(len(jax.devices()) + 1)])
    with pytest.raises(SystemExit):
        cli.parse_args(["--small", "--devices", "0"])
    with pytest.raises(SystemExit):   # --scaling compares one device with N
        cli.parse_args(["--small", "--scaling"])


def test_scaling_times_each_run_on_one_device_beside_n():
    """--devices 2 --scaling: each run's one-device twin (same batch per device) is timed in
    alternation with it, and the table gives t1, tN and their median ratio."""
    from benchmarks.e2e import scaling
    from benchmarks.e2e.train import build, run_steps

    args = cli.parse_args(["--small", "--models", "gpt", "--variants", "flax", "--devices", "2", "--scaling"])
    cfg, variant = args.configs[0], cli.VARIANTS["flax"]
    run = build(cfg, "linen", variant, "float32", 0, devices=2)
    run.round_steps = 1
    rows = scaling.measure([run], [(cfg, "linen", "float32", variant)], 2, build, run_steps, 0)
    assert len(rows) == 1 and rows[0]["run"] == run.label and rows[0]["devices"] == 2
    assert rows[0]["one_ms"] > 0 and rows[0]["many_ms"] > 0 and rows[0]["efficiency"] > 0
    text = scaling.format_rows(rows)
    assert "1 device ms" in text and "2 devices ms" in text and "t1/t2" in text and run.label in text


@pytest.mark.gpu
@pytest.mark.parametrize("collector", ["torch", "jax"])
def test_the_gpu_trace_finds_the_layernorm_kernels(tmp_path, collector):
    # What the H200 run relies on: the collector sees the step's kernels, and the attribution
    # finds layernorm's among them (our backward, 3 LayerNorms: at least 3 kernels a step).
    if collector == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch sees no CUDA GPU")
    _, rows = run_e2e(tmp_path, "--apis", "linen", "--trace", collector, platform="gpu")
    assert len(rows) == 3   # flax, jax_lnbwd, add_layernorm
    for r in rows:
        t = r["trace"]
        assert t and t["kernels"] > 10 and t["busy_ms"] > 0, t
        assert t["ln_ms"] > 0 and t["other_ms"] > 0, t  # kernels matched to instructions of both kinds
        assert t["unmapped_ms"] < 0.2 * t["kernel_ms"], t  # the name matching works
    ours = next(r["trace"] for r in rows if r["variant"] == "jax_lnbwd")
    assert ours["ln_kernels"] >= 3, ours


def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def test_a_registered_variant_is_accepted_and_the_first_listed_is_the_baseline():
    extra = variants.register(dataclasses.replace(variants.VARIANTS["flax"], name="extra"))
    try:
        a = cli.parse_args(["--small", "--variants", "extra,jax_lnbwd", "--models", "gpt"])
        assert a.variants == ["extra", "jax_lnbwd"] and a.configs[0].d_model == config.SMALL["gpt"].d_model
        assert variants.VARIANTS["extra"] is extra
    finally:
        del variants.VARIANTS["extra"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--variants", "flax,nope"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--dtypes", "float32", "--attention", "cudnn"])


def test_rounds_are_sized_by_time_and_the_ratio_is_paired():
    rs = train.round_steps
    assert rs(0.042, 0.5, 10) == 12 and rs(0.004, 0.5, 10) == 125 and rs(0.2, 0.5, 10) == 10
    assert rs(1e-6, 0.5, 10) == train.ROUND_STEPS_CAP and rs(1e-6, 0.5, 5000) == 5000  # --steps is the floor
    assert rs(None, 0.5, 10) == rs(0.004, 0, 10) == 10
    a = cli.parse_args([])
    assert a.rounds == 7 and a.round_seconds == 0.5 and a.models == ["gpt", "bert", "vit"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--round-seconds", "-1"])

    def run(variant, times, steps):
        return train.Run("gpt", "linen", "bfloat16", variant, None, (), (), "", 0.0, times=times,
                         losses=[1.0], round_steps=steps)
    runs = [run("flax", [1.0, 2.0, 1.0], 4), run("ours", [0.9, 1.6, 1.1], 9)]
    assert cli.same_steps(runs) == "gpt linen bfloat16 9" and [r.round_steps for r in runs] == [9, 9]
    # A slow second round hits both runs: the paired ratio is the median of 1/0.9, 2/1.6, 1/1.1
    rows = report.rows(runs, "flax")
    assert rows[1]["speedup"] == pytest.approx(1 / 0.9)
    assert rows[1]["speedup_of_medians"] == pytest.approx(1.0 / 1.1)
    assert (rows[1]["speedup_min"], rows[1]["speedup_max"]) == pytest.approx((1 / 1.1, 1.25))
    assert rows[1]["round_steps"] == 9 and rows[0]["speedup"] == 1.0


def test_small_is_a_short_run_unless_told_otherwise():
    a = cli.parse_args(["--small"])
    assert (a.models, a.apis, a.rounds, a.round_seconds, a.trace_repeats) == (["gpt"], ["linen"], 3, 0.0, 1)
    assert a.configs[0] == dataclasses.replace(config.SMALL["gpt"], attention="xla")
    b = cli.parse_args(["--small", "--models", "vit,bert", "--apis", "nnx", "--rounds", "5", "--round-seconds", "0.2"])
    assert (b.models, b.apis, b.rounds, b.round_seconds) == (["vit", "bert"], ["nnx"], 5, 0.2)

