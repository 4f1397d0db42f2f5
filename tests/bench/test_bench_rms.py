"""The kernel bench's rmsnorm rows and its Pallas peer, on CPU (tests/bench/test_bench.py: the rest)."""
from __future__ import annotations

import json
import sys

import jax
import numpy as np
import pytest

import jax_lnbwd

from conftest import CHECKOUT

sys.path.insert(0, str(CHECKOUT))  # the checkout: benchmarks/
from benchmarks.kernels import cli as bench  # noqa: E402
from benchmarks.kernels import ops, ops_rmsnorm, pallas, timing  # noqa: E402

RMS_OPS = ("rmsnorm_bwd", "rmsnorm_fwd", "add_rmsnorm_fwd")


def test_help_and_all_list_the_rmsnorm_ops_and_the_pallas_peer(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"], on_gpu=False)
    text = capsys.readouterr().out
    for name in (*RMS_OPS, "pallas"):
        assert name in text
    every = [op.name for op in bench.parse_args(["--op", "all"], on_gpu=False).ops]
    assert set(RMS_OPS) <= set(every)
    gpu = bench.parse_args(["--op", ",".join(RMS_OPS)], on_gpu=True)
    for name in RMS_OPS:
        assert gpu.shapes[name] == [(16384, 2048), (16384, 4096), (8192, 8192), (4096, 16384),
                                    (524288, 64), (262144, 128), (131072, 256)]


def test_rmsnorm_backward_runs_only_the_kernels_that_take_rmsnorm():
    combos, refused = bench.plan_ours([1, 12], "best", "float32", 768, jax_lnbwd.RMSNORM)
    assert [k for k, _ in combos] == [12]
    assert len(refused) == 1 and refused[0].startswith("k1:") and "rmsnorm" in refused[0]
    assert [k for k, _ in bench.plan_ours([1, 12], "best", "float32", 768, jax_lnbwd.LAYERNORM)[0]] == [1, 12]


def test_rmsnorm_rows_validate_time_and_write_their_rows(tmp_path, capsys):
    bench.main(["--op", ",".join(RMS_OPS), "--shapes", "4x24", "--dtypes", "bfloat16,float32",
                "--params", "float32", "--peers", "xla,autodiff,copy,ours-unfus,pallas", "--reps", "1",
                "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "peers skipped: pallas: JAX runs on the CPU here" in out
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    got = {(r["op"], r["dtype"], r["impl"]) for r in rows}
    for dtype in ("bfloat16", "float32"):
        for impl in ("xla", "autodiff", "copy"):
            assert ("rmsnorm_bwd", dtype, impl) in got
        for op in ("rmsnorm_fwd", "add_rmsnorm_fwd"):
            assert {(op, dtype, "xla"), (op, dtype, "copy")} <= got
    fwd = {r["dtype"]: r for r in rows if r["op"] == "rmsnorm_fwd" and r["impl"] == "xla"}
    assert fwd["bfloat16"]["params"] == "float32"
    assert fwd["float32"]["bytes"] == ops_rmsnorm.rms_forward_bytes(4, 24, "float32", "float32")
    for dtype in ("bfloat16", "float32"):
        assert {("rmsnorm_fwd", dtype, "ours"), ("add_rmsnorm_fwd", dtype, "ours"),
                ("add_rmsnorm_fwd", dtype, "ours-unfus")} <= got
        assert any(op == "rmsnorm_bwd" and d == dtype and i.startswith("k12/") for op, d, i in got)
    assert "FAIL" not in out and "ERROR" not in out


@pytest.mark.parametrize("op", sorted(pallas.OPS))
def test_pallas_steps_match_the_reference_in_the_interpreter(op):
    """The Pallas entries' wiring (shapes, bias, statistics, argument order), run by Pallas's
    interpreter on CPU; on a GPU the same steps run Pallas's Triton kernels."""
    case = ops.OPS[op].prepare(16, 200, "float32", "same", jax.random.key(1))
    outs = jax.jit(pallas.step(op, interpret=True))(case.state, *case.consts)
    assert outs[0].shape == case.state.shape  # chainable: the next step's state
    ok, errs = timing.validate(outs, case.ref, "float32", ops.OPS[op].outputs)
    assert ok, errs
    assert all(np.isfinite(e) for e in errs.values())
