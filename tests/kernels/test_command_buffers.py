"""CUDA graphs: XLA's command buffers capture our custom call and replay it bit-identically.

GPU only. XLA can record a program's kernels into a CUDA graph once and replay the graph on
later calls; the CUDA handler declares itself command-buffer compatible (it only enqueues work
on XLA's stream, on buffers XLA gives it). A handler that kept state between calls, or relied
on something done only while recording (the counter memset of kernel 10, say), would give
wrong or varying results on replay.

The XLA flags are read once per process, so each configuration runs in a subprocess:
  * GRAPHS: command buffers for fusions and custom calls, with no minimum graph size (so even
    our small programs are captured);
  * NO_GRAPHS: command buffers off.
Each computes jitted gradients of layernorm for the CASES five times, alternating between two
inputs (A, B, A, B, A: a replay that reused stale buffers would repeat the previous answer),
and prints SHA-256 hashes of the results. Every repeat must be bit-identical to the others on
the same input and to the run without graphs (with XLA's autotuning pinned in both, PINNED).
XLA's log says which thunks went into a command buffer; the test checks that our custom call
did (where this XLA logs it).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import CHILD_CWD
from jax_lnbwd import TARGET

pytestmark = pytest.mark.gpu

# XLA autotunes its own Triton fusions (the forward's mean and variance reductions, say) by
# timing candidate configurations, so two processes can compile the same program with different
# configurations, and different rounding (seen on the H200, 2026-11-30: two compilations of one
# bf16 program chose TMA for different reductions). Both runs pin XLA to its default
# configurations, so whatever differs between them is the command buffers'.
PINNED = "--xla_gpu_autotune_level=0"
GRAPHS = f"{PINNED} --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
NO_GRAPHS = f"{PINNED} --xla_gpu_enable_command_buffer="
# XLA's command buffer pass logs, per module, which thunks it put into each command buffer.
LOG_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "command_buffer_conversion_pass=2"}

# (dtype, shape of x, kernel (None: the default), vmap batch (None: no vmap))
CASES = [
    ("bfloat16", (4096, 1600), None, None),
    ("float32", (4096, 1600), None, None),
    ("bfloat16", (3, 333, 768), None, None),
    ("float32", (4096, 1600), 10, None),   # kernel 10: a counter zeroed by a memset on every call
    ("bfloat16", (4, 512, 1600), None, 4),  # vmap(grad): one call with 4 segments
    ("bfloat16", (1024, 4096), None, None),  # split rows: 2-block clusters, then the finalize kernel
]

SCRIPT = r'''
import hashlib, json, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax_lnbwd import TARGET, layernorm


def program(i, kernel, batch):
    def loss(x, w, b, r):
        y = layernorm(x, w, b, kernel=kernel)
        return jnp.sum(y.astype(jnp.float32) * r.astype(jnp.float32))
    grads = jax.grad(loss, argnums=(0, 1, 2))
    if batch:
        grads = jax.vmap(grads, in_axes=(0, None, None, 0))
    def case(*args):
        return grads(*args)
    case.__name__ = f"case{i}"  # names the HLO module: jit_case{i}
    return jax.jit(case)


def inputs(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    C = shape[-1]
    arrays = (rng.standard_normal(shape), 1 + 0.1 * rng.standard_normal(C), rng.standard_normal(C),
              rng.standard_normal(shape))
    return [jnp.asarray(a, dtype) for a in arrays]


results = []
for i, (dtype, shape, kernel, batch) in enumerate(json.loads(sys.argv[1])):
    fn = program(i, kernel, batch)
    ab = [inputs(dtype, shape, seed) for seed in (0, 1)]
    compiled = fn.lower(*ab[0]).compile()
    hlo = compiled.as_text()
    calls = re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*custom_call_target=\"" + TARGET + "\"", hlo, re.M)
    hashes, sums = [], []
    for k in range(5):
        outs = jax.block_until_ready(compiled(*ab[k % 2]))
        hashes.append([hashlib.sha256(np.asarray(o).tobytes()).hexdigest() for o in outs])
        sums.append([float(np.asarray(o, np.float64).sum()) for o in outs])
    results.append({"module": hlo.split()[1].rstrip(","), "calls": calls, "hashes": hashes, "sums": sums})
print("RESULT " + json.dumps(results))
'''


def run_script(script: str, cases, flags: str, env_extra: dict | None = None):
    """Run `script` on the JSON of `cases` in a child process on CUDA, under XLA_FLAGS += flags and
    env_extra; (the JSON of its RESULT line, its stderr)."""
    env = dict(os.environ, **(env_extra or {}), JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env, cwd=CHILD_CWD, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"XLA_FLAGS={env['XLA_FLAGS']}: exit {proc.returncode}\n{proc.stderr[-5000:]}"
    line = next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc.stderr


def run_cases(flags: str):
    """Run SCRIPT on CASES under XLA_FLAGS += flags, with XLA's command buffer log; (its results, its stderr)."""
    return run_script(SCRIPT, CASES, flags, LOG_ENV)


def captured_thunks(log: str) -> dict[str, set[str]] | None:
    """Module name -> names of the thunks XLA put into command buffers, from its log; None if the
    log has no such lines at all (an XLA that logs differently)."""
    line_re = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+(\d+) \S+\] (.*)$")  # glog: thread id, message
    module_of_thread: dict[str, str] = {}
    captured: dict[str, set[str]] | None = None
    for line in log.splitlines():
        m = line_re.match(line)
        if not m:
            continue
        thread, message = m.groups()
        if cfg := re.match(r"Module (\S+) CommandBufferConfig", message):
            module_of_thread[thread] = cfg.group(1)
            captured = captured or {}
        elif message.startswith("Creating command buffer thunk with the following thunks:") and captured is not None:
            thunks = {t.strip() for t in message.split(":", 1)[1].split(",")}
            captured.setdefault(module_of_thread.get(thread, "?"), set()).update(thunks)
    return captured


@pytest.fixture(scope="module")
def runs():
    return {"graphs": run_cases(GRAPHS), "no-graphs": run_cases(NO_GRAPHS)}


def _case_id(case):
    dtype, shape, kernel, batch = case
    return f"{dtype}-{'x'.join(map(str, shape))}" + (f"-k{kernel}" if kernel else "") + (f"-vmap{batch}" if batch else "")


@pytest.mark.parametrize("run", ["graphs", "no-graphs"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_repeats_are_bit_identical(runs, run, case):
    result = runs[run][0][case]
    assert len(result["calls"]) == 1, f"custom calls of {TARGET}: {result['calls']}"
    a, b = result["hashes"][0::2], result["hashes"][1::2]
    assert all(h == a[0] for h in a), f"input A gave different bits across repeats: {result['sums'][0::2]}"
    assert all(h == b[0] for h in b), f"input B gave different bits across repeats: {result['sums'][1::2]}"
    assert a[0] != b[0], "inputs A and B gave the same results: a replay ignored its new inputs"


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_graphs_match_no_graphs(runs, case):
    """Whole grad programs give the same bits with and without command buffers."""
    with_graphs, without = runs["graphs"][0][case], runs["no-graphs"][0][case]
    assert with_graphs["hashes"] == without["hashes"], (with_graphs["sums"], without["sums"])


RAW_SCRIPT = r'''
import hashlib, json, sys
import jax, jax.numpy as jnp, numpy as np
from jax_lnbwd import layernorm_bwd, layernorm_fwd
out = []
for dtype, shape, kernel in json.loads(sys.argv[1]):
    rng = np.random.default_rng(0)
    x, dy = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(shape[-1]), dtype)
    _, mean, rstd = layernorm_fwd(x, w, w)
    mean, rstd = np.asarray(mean), np.asarray(rstd)   # fixed inputs: only our op runs in the program
    fn = jax.jit(lambda *a: layernorm_bwd(*a, kernel=kernel))
    out.append([[hashlib.sha256(np.asarray(o).tobytes()).hexdigest() for o in fn(dy, x, w, mean, rstd)]
                for _ in range(3)])
print("RESULT " + json.dumps(out))
'''
RAW_CASES = [("bfloat16", (3, 333, 768), None), ("float32", (4096, 1600), None), ("bfloat16", (4096, 1600), 10)]


def test_raw_op_is_bit_identical_with_graphs():
    (with_graphs, _), (without, _) = (run_script(RAW_SCRIPT, RAW_CASES, flags) for flags in (GRAPHS, NO_GRAPHS))
    for case, g, n in zip(RAW_CASES, with_graphs, without):
        assert all(h == n[0] for h in g + n), case


def test_our_call_is_captured(runs):
    (results, log), (_, log_off) = runs["graphs"], runs["no-graphs"]
    captured, captured_off = captured_thunks(log), captured_thunks(log_off)
    if captured is None:
        pytest.skip("this XLA does not log its command buffer contents (command_buffer_conversion_pass)")
    for case, result in zip(CASES, results):
        call = result["calls"][0]
        assert call in captured.get(result["module"], set()), (
            f"{_case_id(case)}: {call} not in a command buffer of {result['module']}: {captured}")
        assert call not in (captured_off or {}).get(result["module"], set())


# QK-norm's one op: its backward runs both sets' launches and one finalize in one custom call, the
# second set's launch programmatic where a row is at most 128 bytes (bf16 D = 64; kernel12.h), a
# dependency that stream capture must record. Both switches "ffi": the one op at any size.
QK_SCRIPT = r'''
import hashlib, json, sys
import jax, jax.numpy as jnp, numpy as np
from jax_lnbwd import qk_norm
out = []
for dtype, tokens, hq, hk, D in json.loads(sys.argv[1]):
    def loss(q, k, wq, wk, rq, rk):
        qo, ko = qk_norm(q, k, wq, wk)
        return jnp.sum(qo.astype(jnp.float32) * rq) + jnp.sum(ko.astype(jnp.float32) * rk)
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    hashes = []
    for seed in (0, 1, 0, 1, 0):
        rng = np.random.default_rng(seed)
        q, rq = (jnp.asarray(rng.standard_normal((tokens, hq, D)), t) for t in (dtype, jnp.float32))
        k, rk = (jnp.asarray(rng.standard_normal((tokens, hk, D)), t) for t in (dtype, jnp.float32))
        wq, wk = (jnp.asarray(1 + 0.1 * rng.standard_normal(D), dtype) for _ in range(2))
        hashes.append([hashlib.sha256(np.asarray(o).tobytes()).hexdigest() for o in fn(q, k, wq, wk, rq, rk)])
    out.append(hashes)
print("RESULT " + json.dumps(out))
'''
QK_CASES = [("bfloat16", 2048, 32, 8, 64), ("bfloat16", 2048, 32, 8, 128), ("float32", 1024, 16, 4, 64)]


def test_qk_norm_is_bit_identical_with_graphs():
    ffi = {"JAX_LNBWD_FORWARD": "ffi", "JAX_LNBWD_BACKWARD": "ffi"}
    (with_graphs, _), (without, _) = (run_script(QK_SCRIPT, QK_CASES, flags, ffi) for flags in (GRAPHS, NO_GRAPHS))
    for case, g, n in zip(QK_CASES, with_graphs, without):
        assert g == n, case
        a, b = g[0::2], g[1::2]
        assert all(h == a[0] for h in a) and all(h == b[0] for h in b), case
        assert a[0] != b[0], f"{case}: inputs A and B gave the same gradients"
