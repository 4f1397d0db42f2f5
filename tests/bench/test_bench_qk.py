"""The kernel bench's QK-norm ops (benchmarks/kernels/ops_qk_norm.py), on CPU: the op groups, the
shapes, each op's rows validated against the float64 reference and timed, the bytes, and which
kernels each entry's step runs."""
from __future__ import annotations

import json
import re
import sys

import jax
import numpy as np
import pytest

import jax_lnbwd

from conftest import CHECKOUT

sys.path.insert(0, str(CHECKOUT))  # the checkout: benchmarks/
from benchmarks.kernels import cli as bench  # noqa: E402
from benchmarks.kernels import ops, ops_qk_norm as qk, timing  # noqa: E402

QK_OPS = ("qk_norm_fwd", "qk_norm_bwd", "qk_norm_fused_fwd", "qk_norm_fused_bwd")
ENTRIES = ("ours", "default", "two-calls", "xla", "copy")


def names(argv, on_gpu=False):
    return [op.name for op in bench.parse_args(argv, on_gpu=on_gpu).ops]


def test_qk_norm_and_qk_norm_fused_select_both_their_ops():
    assert names(["--op", "qk_norm"]) == ["qk_norm_fwd", "qk_norm_bwd"]
    assert names(["--op", "qk_norm_fused"]) == ["qk_norm_fused_fwd", "qk_norm_fused_bwd"]
    assert names(["--op", "qk_norm_fused,qk_norm,rmsnorm_fwd"]) == ["rmsnorm_fwd", *QK_OPS]  # OPS order
    assert names(["--op", "qk_norm_bwd,qk_fused_forward"]) == ["qk_norm_bwd", "qk_norm_fused_fwd"]  # name, alias
    # the other ops' names and aliases are as they were
    assert names(["--op", "forward,rms_backward"]) == ["layernorm_fwd", "rmsnorm_bwd"]
    assert set(QK_OPS) <= set(names(["--op", "all"]))
    with pytest.raises(KeyError):
        ops.resolve(["qk"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--op", "qk_norm_fwdd"], on_gpu=False)


def test_the_qk_ops_shapes_heads_and_help(capsys):
    gpu = bench.parse_args(["--op", "qk_norm,qk_norm_fused"], on_gpu=True)
    assert all(gpu.shapes[n] == [(16384, 64), (16384, 128), (16384, 256)] for n in QK_OPS)
    cpu = bench.parse_args(["--op", "qk_norm,qk_norm_fused"], on_gpu=False)   # the CPU defaults of every op
    assert cpu.cpu_sized and all(cpu.shapes[n] == [(256, 768), (64, 1601)] for n in QK_OPS)
    assert (qk.Q_HEADS, qk.KV_HEADS) == (32, 8)
    assert all(f"{qk.Q_HEADS} q" in ops.OPS[n].title and "TOKENSxD" in ops.OPS[n].title for n in QK_OPS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"], on_gpu=False)
    text = " ".join(capsys.readouterr().out.split())
    assert "qk_norm (qk_norm_fwd,qk_norm_bwd)" in text and "two-calls" in text
    assert "TOKENSxD (head_dim D), with 32 q heads and 8 k/v heads" in text


def test_the_bytes_of_the_qk_ops():
    T, D = 16, 64
    rows = T * (qk.Q_HEADS + qk.KV_HEADS)   # one row per q and k head
    assert qk.forward_bytes(T, D, "bfloat16", "same") == 2 * rows * D * 2 + 2 * D * 2 + rows * 4
    assert qk.forward_bytes(T, D, "bfloat16", "float32") == 2 * rows * D * 2 + 2 * D * 4 + rows * 4
    assert qk.backward_bytes(T, D, "float32") == 3 * rows * D * 4 + 4 * D * 4 + rows * 4
    # the fused form moves the q and k heads only: v stays in place
    assert qk.fused_forward_bytes(T, D, "float32", "same") == qk.forward_bytes(T, D, "float32", "same")
    case = ops.OPS["qk_norm_fused_bwd"].prepare(T, D, "float32", "same", jax.random.key(0))
    assert case.nbytes == qk.backward_bytes(T, D, "float32") and case.state.shape == (T, qk.HEADS * D)


@pytest.mark.parametrize("op", QK_OPS)
def test_each_qk_op_validates_times_and_writes_its_rows(op, tmp_path, capsys):
    """Every entry of the op runs a 2-step chain (the separate forms carry k), after its outputs
    matched the float64 reference; on CPU ours, default and two-calls are no kernel timings."""
    forward = op.endswith("_fwd")
    dtype = "bfloat16" if forward else "float32"
    bench.main(["--op", op, "--shapes", "3x16", "--dtypes", dtype, "--peers", "default,two-calls,xla,copy,liger",
                "--reps", "1", "--chain", "2", "--no-progress", "--out", str(tmp_path)]
               + (["--params", "float32"] if forward else []))
    printed = capsys.readouterr().out
    assert "FAIL" not in printed and "ERROR" not in printed
    out = json.loads((tmp_path / "bench.json").read_text())
    assert out["complete"] is True and not out["failures"]
    rows = {r["impl"]: r for r in out["rows"]}
    assert set(rows) == set(ENTRIES)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu:
        assert "peers skipped: liger" in printed
    want = (qk.forward_bytes(3, 16, dtype, "float32") if forward else qk.backward_bytes(3, 16, dtype))
    for impl, r in rows.items():
        assert r["bytes"] == want and r["us"] > 0
        assert r["kernel_timing"] is (on_gpu or impl in ("xla", "copy")), impl
        if impl != "copy":
            assert set(r["errors"]) == set(ops.OPS[op].outputs)
            assert all(e <= timing.TOLERANCE[dtype] for e in r["errors"].values()), (impl, r["errors"])
    if forward:
        assert rows["ours"]["params"] == "float32"
    if op == "qk_norm_fused_fwd":   # v passes through: ours is the reference's v exactly
        case = ops.OPS[op].prepare(3, 16, "float32", "same", jax.random.key(1))
        impl = ops.OPS[op].impls(case, bench.parse_args(["--op", op], on_gpu=False), [])[0]
        (out_qkv,) = jax.jit(impl.step)(case.state, *case.consts)
        np.testing.assert_array_equal(qk.split_heads(out_qkv)[2], qk.split_heads(case.state)[2])


@pytest.mark.parametrize("op", QK_OPS)
def test_ours_and_two_calls_run_our_kernels_and_xla_none(op):
    """ours traces our FFI ops of the op's direction only (the backwards: their pullbacks call our
    backward, with nothing of the forward in the step), whichever they are (two rmsnorm calls
    today, one QK-norm op later); two-calls two rmsnorm calls; xla none."""
    case = ops.OPS[op].prepare(2, 8, "float32", "same", jax.random.key(0))
    args = bench.parse_args(["--op", op, "--peers", "default,two-calls,xla"], on_gpu=False)
    entries = {e.name: e for e in ops.OPS[op].impls(case, args, [])}
    assert set(entries) == {"ours", "default", "two-calls", "xla"}
    assert [e.name for e in entries.values() if not e.peer] == ["ours", "default"]
    direction = "_fwd" if op.endswith("_fwd") else "_bwd"
    rms = jax_lnbwd.TARGET_RMS_FWD if direction == "_fwd" else jax_lnbwd.TARGET_RMS_BWD
    called = {}
    for name in ("ours", "two-calls", "xla"):
        text = jax.jit(entries[name].step).lower(case.state, *case.consts).as_text()
        called[name] = re.findall(r"@(jax_lnbwd_\w+)\(", text)
    assert called["ours"] and all(direction in t for t in called["ours"]), called["ours"]
    assert called["two-calls"] == [rms, rms]   # one for q, one for k
    assert called["xla"] == []


def test_the_torch_peer_of_the_qk_ops_matches_the_reference():
    """peers_rms.qk_step with torch's F.rms_norm, on CPU tensors (the bench hands it CUDA ones)."""
    torch = pytest.importorskip("torch")
    from benchmarks.kernels import peers, peers_rms
    for op in QK_OPS:
        case = ops.OPS[op].prepare(3, 16, "float32", "same", jax.random.key(2))
        tensors = [torch.from_numpy(np.array(a, np.float32)) for a in case.torch_inputs]
        step, state = peers_rms.qk_step(op, "torch", *tensors)
        outs = peers.call(step, state)
        ok, errs = timing.validate(outs, case.ref, "float32", ops.OPS[op].outputs)
        assert ok and len(outs) == len(ops.OPS[op].outputs), (op, errs)
        # chainable: the state's arrays are the outputs' first, q and k (dq and dk) both chained
        # where the JAX chain carries both (op.carry)
        carried = state if isinstance(state, tuple) else (state,)
        assert len(carried) == ops.OPS[op].carry, op
        assert [tuple(o.shape) for o in outs[:len(carried)]] == [tuple(a.shape) for a in carried]
        last = peers.torch_chain(step, state, 3)()   # time_torch's chain: the state stays whole
        assert type(last) is type(state) and len(last if isinstance(last, tuple) else (last,)) == len(carried)
