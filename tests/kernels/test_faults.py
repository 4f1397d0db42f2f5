"""A failed call raises an error that says what failed, and the next good call in the process works.

GPU only. Every failure the CUDA handler can meet comes back as an error naming the kernel, the
shape and the device limit involved, and leaves no CUDA error behind (a later launch that asks
cudaGetLastError would otherwise report it as its own; a sticky error would fail every later
call). Two failures are provoked:
  * a direct jax.ffi.ffi_call whose workspace has no room for one partial slot (refused by the
    handler's checks, before any CUDA call);
  * a refused launch: in a subprocess, JAX_LNBWD_TEST_DEVICE_LIMITS claims more shared memory
    than the GPU has, so kernel 12 plans a ring the driver refuses (cudaFuncSetAttribute). Through
    layernorm_bwd this is raised at trace time, when the workspace is planned; through the raw
    FFI target, by the CUDA handler. Shapes whose ring fits the real GPU then run, in the same
    process, and are checked.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jax_lnbwd
from conftest import CHILD_CWD, RTOL, assert_close, direct_ffi_call, make_inputs, put, reference_bwd, reference_stats

pytestmark = pytest.mark.gpu


def _raw_call(x, dy, w, mean, rstd, workspace_bytes: int, kernel: int = 12):
    rows, C = x.shape
    out_types = (
        jax.ShapeDtypeStruct((rows, C), x.dtype),
        jax.ShapeDtypeStruct((1, C), x.dtype),
        jax.ShapeDtypeStruct((1, C), x.dtype),
        jax.ShapeDtypeStruct((workspace_bytes,), np.uint8),
    )
    call = jax.ffi.ffi_call(jax_lnbwd.TARGET, out_types)
    f = jax.jit(lambda *a: call(*a, kernel=np.int32(kernel), block_size=np.int32(0)))
    return jax.block_until_ready(f(*put("gpu", dy, x, w[None], mean, rstd)))


def test_too_small_workspace_is_refused_then_a_good_call_works():
    x, dy, w, _ = make_inputs((64, 768), "float32", seed=3)
    mean, rstd = reference_stats(x)
    with pytest.raises(Exception, match=r"'workspace' has shape \(100,\) but expected at least 6400 bytes"):
        _raw_call(x, dy, w, mean, rstd, workspace_bytes=100)
    got = direct_ffi_call("gpu", dy, x, w[None], mean, rstd)
    want = reference_bwd(dy, x, w, mean, rstd)   # dweight, dbias (C,): the call's have one segment row
    for name, g, r in zip(("dx", "dweight", "dbias"), got, want):
        assert_close(name, np.reshape(g, np.shape(r)), r, "float32")


SCRIPT = r'''
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np
from jax_lnbwd import layernorm_bwd, reference, kernels, _jax_lnbwd

dev = kernels._cuda_device()
real_smem = int(sys.argv[1])
cpu = jax.devices("cpu")[0]

def run(dtype, rows, C):
    rng = np.random.default_rng(C)
    t = jnp.dtype(dtype)
    x, dy = (jnp.asarray(rng.standard_normal((rows, C)), t) for _ in range(2))
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(C), t)
    _, mean, rstd = reference.layernorm_fwd(x, None, None)
    got = jax.block_until_ready(jax.jit(lambda *a: layernorm_bwd(*a, kernel=12))(dy, x, w, mean, rstd))
    want = reference.layernorm_bwd(*(jax.device_put(np.asarray(a, np.float64), cpu) for a in (dy, x, w, mean, rstd)))
    return [float(np.linalg.norm(np.asarray(g, np.float64) - np.asarray(r)) / np.linalg.norm(np.asarray(r)))
            for g, r in zip(got, want)]

# A shape whose planned ring needs more shared memory than the GPU has (under the lie, the
# driver refuses the opt-in already when the launch is planned), and one whose plan fits.
def plan_refused(dtype, rows, C):
    try:
        _jax_lnbwd.launch_plan(12, dtype, rows, C, 1, dev)
        return False
    except RuntimeError:
        return True

too_big = next((case for case in [("bfloat16", 8, 32768), ("float32", 16, 16384), ("bfloat16", 16, 16384),
                                  ("bfloat16", 64, 2048)] if plan_refused(*case)), None)
fits = ("bfloat16", 64, 768)
assert _jax_lnbwd.launch_plan(12, *fits, 1, dev)["smem"] <= real_smem

def raw(dtype, rows, C):
    # The FFI target itself, with a workspace of a slot per row: no trace-time planning, so the
    # CUDA handler meets the refusal.
    t = jnp.dtype(dtype)
    x = jnp.ones((rows, C), t)
    w = jnp.ones((1, C), t)
    s = jnp.ones((rows,), jnp.float32)
    outs = (jax.ShapeDtypeStruct((rows, C), t), jax.ShapeDtypeStruct((1, C), t), jax.ShapeDtypeStruct((1, C), t),
            jax.ShapeDtypeStruct((256 + rows * 2 * C * 4,), np.uint8))
    call = jax.ffi.ffi_call("jax_lnbwd_layernorm_bwd_v1", outs)
    jax.block_until_ready(jax.jit(lambda *a: call(*a, kernel=np.int32(12), block_size=np.int32(0)))(x, x, w, s, s))

out = dict(too_big=too_big, errors=[])
if too_big:
    for attempt in (run, raw):   # refused at trace time (planning the workspace), then by the handler
        try:
            attempt(*too_big)
            out["errors"].append(None)
        except Exception as e:
            out["errors"].append(str(e))
out["good_errs"] = run(*fits)
out["good_again_errs"] = run("float32", 64, 1600)
print(json.dumps(out))
'''


def test_refused_launch_names_kernel_shape_and_limit_then_a_good_call_works():
    from jax_lnbwd import _jax_lnbwd, kernels

    real_smem = _jax_lnbwd.device_limits(kernels._cuda_device())["smem_optin"]
    env = dict(os.environ, JAX_PLATFORMS="cuda,cpu", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               JAX_LNBWD_TEST_DEVICE_LIMITS=f"smem={4 * real_smem}")
    env.pop("JAX_LNBWD_COOPERATIVE_FINISH", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(real_smem)], env=env, cwd=CHILD_CWD, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["too_big"] is None:
        pytest.skip("no kernel 12 shape plans more shared memory than this GPU has, even when told it has 4x")
    dtype, rows, C = out["too_big"]
    assert len(out["errors"]) == 2, out
    for err in out["errors"]:
        assert err is not None, out
        for part in ("kernel 12", f"x of shape ({rows}, {C}) {dtype}",
                     f"{4 * real_smem} bytes of shared memory per block", "JAX_LNBWD_TEST_DEVICE_LIMITS",
                     "bytes of dynamic shared memory per block"):
            assert part in err, f"{part!r} not in the error: {err}"
    for name, e in zip(("dx", "dweight", "dbias"), out["good_errs"]):
        assert e <= RTOL["bfloat16"], (name, out)
    for name, e in zip(("dx", "dweight", "dbias"), out["good_again_errs"]):
        assert e <= RTOL["float32"], (name, out)
