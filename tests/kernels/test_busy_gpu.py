"""The backward runs promptly while a kernel on another stream holds an SM.

GPU only. In data-parallel training XLA runs NCCL kernels on other streams beside the backward,
and under MPS other processes share the GPU. A launch that needs the whole GPU at once (a
cooperative grid with a grid-wide barrier) cannot start until every SM is free, and so waits
for such a kernel to end. Ours needs no co-residency (launch_with_partials,
ffi/kernels/backward/launch.cuh): blocks that find no room start as others finish.

A one-block spinner (torch.cuda._sleep) runs on a torch stream for about 2 s; while it runs,
the jitted gradient (compiled before) must finish within 10 ms, and equal bit for bit the
gradient computed with the GPU idle. The run is in a subprocess (torch and JAX share the GPU there,
JAX without preallocating), three attempts, of which the fastest counts: other test workers'
kernels on the same GPU can delay one attempt.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import CHILD_CWD

pytestmark = pytest.mark.gpu

SCRIPT = r'''
import json, sys, time
import torch
import jax, jax.numpy as jnp, numpy as np
from jax_lnbwd import layernorm

kernel = None if sys.argv[1] == "default" else int(sys.argv[1])
rng = np.random.default_rng(0)
x, r = (jnp.asarray(rng.standard_normal((4096, 1600)), jnp.bfloat16) for _ in range(2))
w = jnp.asarray(1 + 0.1 * rng.standard_normal(1600), jnp.bfloat16)
b = jnp.asarray(rng.standard_normal(1600), jnp.bfloat16)
loss = lambda x, w, b: jnp.sum(layernorm(x, w, b, kernel=kernel).astype(jnp.float32) * r.astype(jnp.float32))
grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
idle = jax.block_until_ready(grad(x, w, b))   # compiled and run once, the GPU otherwise idle
t0 = time.perf_counter(); jax.block_until_ready(grad(x, w, b)); alone = time.perf_counter() - t0

side = torch.cuda.Stream()   # a non-blocking stream
# Calibrate the spinner: torch.cuda._sleep spins for a number of SM clock cycles, and the clock
# moves (an idle GPU starts low and boosts under load), so take the fastest of three runs: at
# any clock up to that one, the spinner lasts at least the 2 s asked for.
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
rates = []
for _ in range(3):
    with torch.cuda.stream(side):
        start.record(); torch.cuda._sleep(100_000_000); end.record()
    side.synchronize()
    rates.append(100_000_000 / (start.elapsed_time(end) / 1e3))
cycles = int(2.0 * max(rates))

attempts = []
for _ in range(3):
    with torch.cuda.stream(side):
        start.record(); torch.cuda._sleep(cycles); end.record()
    time.sleep(0.02)   # the spinner has reached the GPU and holds its SM
    t0 = time.perf_counter()
    got = jax.block_until_ready(grad(x, w, b))
    took = time.perf_counter() - t0
    spinning = not end.query()   # the spinner was still running when our gradient was done
    side.synchronize()
    same = all(bool(jnp.array_equal(g, i)) for g, i in zip(got, idle))
    attempts.append(dict(took_s=took, spinner_still_running=spinning, spinner_s=start.elapsed_time(end) / 1e3,
                         bit_identical=same))
print(json.dumps(dict(alone_s=alone, attempts=attempts)))
'''


@pytest.mark.parametrize("kernel", ["default", "11"])
def test_backward_is_not_held_back_by_a_kernel_on_another_stream(kernel):
    pytest.importorskip("torch")
    env = dict(os.environ, JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("JAX_LNBWD_COOPERATIVE_FINISH", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, kernel], env=env, cwd=CHILD_CWD, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    attempts = out["attempts"]
    assert all(a["spinner_s"] >= 0.5 for a in attempts), out   # the spinner held its SM >= 0.5 s
    assert all(a["spinner_still_running"] for a in attempts), out   # ... and past our backward
    assert all(a["bit_identical"] for a in attempts), out   # deterministic, busy GPU or not
    best = min(a["took_s"] for a in attempts)
    assert best < 0.010, f"backward took {best * 1e3:.1f} ms beside a spinning kernel (alone: " \
                         f"{out['alone_s'] * 1e3:.2f} ms): {out}"
