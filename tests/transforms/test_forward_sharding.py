"""The fused forward on several devices: jit with shardings, vmap, shard_map, a C-sharded x.

The checks are in forward_sharding_checks.py, run in a subprocess (8 host CPU devices need an
XLA flag read when JAX starts); each test reports one check's result line. The GPU run needs
at least two GPUs and is skipped otherwise.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import pytest

from conftest import HAS_GPU
from forward_sharding_checks import CHECKS

HELPER = os.path.join(os.path.dirname(__file__), "forward_sharding_checks.py")


@functools.cache
def results(platform: str) -> dict:
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    proc = subprocess.run([sys.executable, HELPER, "--platform", platform], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by_check = {line["check"]: line for line in lines if "check" in line}
    assert by_check, f"the helper printed no results (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return by_check


def gpu_count() -> int:
    return len(jax.devices("gpu")) if HAS_GPU else 0


@pytest.mark.parametrize("platform", [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 2, reason="needs at least 2 GPUs")])])
@pytest.mark.parametrize("check", list(CHECKS))
def test_forward_sharding(platform, check):
    result = results(platform).get(check)
    assert result is not None, f"{check} did not report (the helper stopped early?)"
    assert result["ok"], f"{check} failed on {platform}:\n{result['detail']}"
