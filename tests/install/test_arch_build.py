"""A build without sm_90 code gives correct results on an sm_90 GPU.

GPU only, and needs nvcc: builds the package for CUDA architecture 80 alone into a scratch
folder (a few minutes) and runs tests/cuda/check_without_sm90.sh's checks from it. Kernel 12's
body is compiled only for sm_90 and later; the sm_80 build of it is empty. The launcher asks the
runtime which architecture the kernel's code was built for and runs kernel 11 instead, so the
default gradients stay correct.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]   # a second build of the package: minutes

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "cuda" / "check_without_sm90.sh"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build")
def test_build_without_sm90_runs_kernel_11_instead_of_an_empty_kernel_12(tmp_path):
    from jax_lnbwd import _jax_lnbwd, kernels

    cc = _jax_lnbwd.device_limits(kernels._cuda_device())["compute_capability"]
    if cc[0] < 9:
        pytest.skip(f"kernel 12 needs sm_90; this GPU is sm_{cc[0]}{cc[1]}")
    env = dict(os.environ)
    env.pop("JAX_LNBWD_TEST_DEVICE_LIMITS", None)
    proc = subprocess.run([str(SCRIPT), str(tmp_path / "sm80")], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    assert proc.stdout.strip().endswith("OK"), proc.stdout
