"""Multi-process JAX on one machine: 2 processes with 4 CPU devices each (gloo collectives), rows
sharded over all 8 devices. The gradients of rmsnorm, add_rmsnorm, layernorm and add_layernorm
equal one process's (multiprocess_worker.py). This is how multi-host training runs our ops: each
host's devices run the kernels on their own rows, and XLA all-reduces the parameter sums.
run_two_processes serves test_multigpu.py too (one GPU per process, NCCL)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(platform: str):
    """Runs the worker as processes 0 and 1 on `platform` and checks each printed 'ok <op>'."""
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu" if platform == "cpu" else "cuda"
    procs = [subprocess.Popen([sys.executable, str(WORKER), port, str(i), platform], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, cwd=WORKER.parent) for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
        for op in ("rmsnorm", "add_rmsnorm", "layernorm", "add_layernorm"):
            assert f"ok {op}\n" in out, f"process {i}: no 'ok {op}':\n{out[-4000:]}"


@pytest.mark.slow
def test_two_processes_equal_one():
    run_two_processes("cpu")
