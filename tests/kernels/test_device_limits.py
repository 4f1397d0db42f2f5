"""Kernel choice follows the device's limits: every shape works on smaller GPUs.

GPU only. The launchers of kernels 11 and 12 read the opt-in shared memory per block, the SM
count, and cluster and cooperative-launch support from the device (device_limits,
ffi/kernels/common/device_limits.h). The test-only environment variable JAX_LNBWD_TEST_DEVICE_LIMITS replaces
them, so that one GPU (the H200) runs the choices an RTX 4090 or L40 (99 KB), an A100 (164 KB), a
GPU without clusters or cooperative launch, or a partition of 1 or 8 SMs would make. It is read
once per process, so each cap runs the kernel matrix in a subprocess, against the float64
reference, and reports the launch each case planned: its shared memory must fit the cap, and
without clusters no case may use them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import CHILD_CWD, RTOL

pytestmark = pytest.mark.gpu

# The caps: (id, JAX_LNBWD_TEST_DEVICE_LIMITS, JAX_LNBWD_COOPERATIVE_FINISH).
CAPS = [
    ("99KB", "smem=101376", "0"),          # sm_86, sm_89, sm_120: 99 KB per block
    ("164KB", "smem=167936", "0"),         # A100
    ("no-clusters", "clusters=0", "0"),
    ("no-cooperative", "cooperative=0", "1"),   # opted in to the cooperative finish, which is not there
    ("1-SM", "sms=1", "0"),
    ("8-SMs", "sms=8", "0"),
    ("99KB-8-SMs-no-clusters", "smem=101376,clusters=0,sms=8", "0"),
    ("cooperative-opt-in", "", "1"),      # the opt-in cooperative finish, where it fits
    ("cooperative-opt-in-1-SM", "sms=1", "1"),
]

# (kernel (None: the default), dtype, (rows, C), vmap batch or None). Shapes that take each path
# on the H200: ring (whole and split rows), wide rows, kernel 11 in registers and wide, scalar
# (misaligned C), fp64, and segments.
CASES = [
    (11, "bfloat16", (96, 768), None),
    (12, "bfloat16", (96, 768), None),
    (None, "bfloat16", (96, 768), None),
    (11, "float32", (64, 1600), None),
    (12, "float32", (64, 1600), None),
    (12, "bfloat16", (40, 4096), None),
    (12, "float16", (24, 8192), None),
    (11, "float32", (16, 16384), None),
    (12, "float32", (16, 16384), None),
    (12, "bfloat16", (8, 32768), None),
    (11, "float16", (33, 1001), None),
    (12, "float16", (33, 1001), None),
    (11, "float64", (24, 512), None),
    (12, "float64", (24, 2048), None),
    (11, "bfloat16", (6, 2048), 5),
    (12, "bfloat16", (6, 2048), 5),
    (12, "float32", (4, 4096), 3),
]

SCRIPT = r'''
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np
from jax_lnbwd import layernorm_bwd, reference, kernels, _jax_lnbwd

cpu, gpu = jax.devices("cpu")[0], jax.devices("gpu")[0]
dev = kernels._cuda_device()

def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n = np.linalg.norm(b.ravel())
    e = float(np.linalg.norm((a - b).ravel()) / (n if n > 0 else 1.0))
    return e if np.isfinite(e) else float("inf")

results = []
for kernel, dtype, (rows, C), batch in json.loads(sys.argv[1]):
    rng = np.random.default_rng(rows * 7 + C)
    lead = (batch, rows) if batch else (rows,)
    x = rng.standard_normal(lead + (C,))
    dy = rng.standard_normal(lead + (C,))
    w = 1 + 0.1 * rng.standard_normal(C)
    t = jnp.dtype(dtype)
    x, dy, w = (np.asarray(jnp.asarray(a, t)) for a in (x, dy, w))
    _, mean, rstd = reference.layernorm_fwd(jax.device_put(x, cpu), None, None)
    mean, rstd = np.asarray(mean), np.asarray(rstd)
    op = lambda dy, x, w, m, r: layernorm_bwd(dy, x, w, m, r, kernel=kernel)
    if batch:
        op = jax.vmap(op, in_axes=(0, 0, None, 0, 0))
    got = jax.jit(op)(*(jax.device_put(a, gpu) for a in (dy, x, w, mean, rstd)))
    ref = reference.layernorm_bwd
    if batch:
        ref = jax.vmap(ref, in_axes=(0, 0, None, 0, 0))
    want = ref(*(jax.device_put(np.asarray(a, np.float64), cpu) for a in (dy, x, w, mean, rstd)))
    k = 12 if kernel is None else kernel
    plan = _jax_lnbwd.launch_plan(k, dtype, rows * (batch or 1), C, batch or 1, dev)
    results.append(dict(case=[kernel, dtype, [rows, C], batch], errs=[rel(g, r) for g, r in zip(got, want)],
                        plan=plan))
print(json.dumps(dict(limits=_jax_lnbwd.device_limits(dev), results=results)))
'''


def run_matrix(caps: str, cooperative: str, cases=CASES) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cuda,cpu", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               JAX_LNBWD_TEST_DEVICE_LIMITS=caps, JAX_LNBWD_COOPERATIVE_FINISH=cooperative)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], env=env, cwd=CHILD_CWD, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cap(caps: str, key: str):
    for item in filter(None, caps.split(",")):
        k, v = item.split("=")
        if k == key:
            return int(v)
    return None


@pytest.mark.parametrize("caps,cooperative", [pytest.param(c, o, id=i) for i, c, o in CAPS])
def test_kernel_matrix_under_device_caps(caps, cooperative):
    out = run_matrix(caps, cooperative)
    limits = out["limits"]
    if caps:
        assert limits["test_caps"], limits
    smem, sms, clusters = _cap(caps, "smem"), _cap(caps, "sms"), _cap(caps, "clusters")
    if smem is not None:
        assert limits["smem_optin"] == smem
    if sms is not None:
        assert limits["sms"] == sms
    failures = []
    for r in out["results"]:
        kernel, dtype, shape, batch = r["case"]
        for name, err in zip(("dx", "dweight", "dbias"), r["errs"]):
            if not err <= RTOL[dtype]:
                failures.append(f"{r['case']}: {name} rel_err {err:.2e} > {RTOL[dtype]:.0e} (plan {r['plan']})")
        plan = r["plan"]
        assert plan["smem"] <= limits["smem_optin"], r
        if clusters == 0 or (sms is not None and sms < 2):
            assert plan["cluster"] == 1, r
        if cooperative == "0" or not limits["cooperative"]:
            assert not plan["cooperative"], r
        if sms is not None:
            # A persistent grid is sized for the SMs it is told of: at most a few blocks on each.
            assert plan["slots"] <= (batch or 1) * max(1, 32 * sms), r
    assert not failures, "\n".join(failures)
