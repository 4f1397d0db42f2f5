"""The kernel bench (benchmarks/kernels, run from a checkout) on whatever platform this is (CPU
in CI): it validates, times and writes its outputs. A smoke test of the tool, not a measurement:
no timing is asserted."""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import CHECKOUT

sys.path.insert(0, str(CHECKOUT))  # the checkout: benchmarks/
from benchmarks import _term  # noqa: E402
from benchmarks.kernels import cli as bench  # noqa: E402
from benchmarks.kernels import ops, ops_layernorm, timing  # noqa: E402


def test_bench_writes_every_group_and_marks_the_run_complete(tmp_path, capsys):
    bench.main(["--shapes", "4x24,3x40", "--dtypes", "float32", "--peers", "xla,copy", "--reps", "1",
                "--chain", "2", "--no-progress", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "bench.json").read_text())
    assert out["complete"] is True and not out["failures"]
    groups = {(r["shape"], r["dtype"]) for r in out["rows"]}
    assert groups == {("4x24", "float32"), ("3x40", "float32")}
    impls = {r["impl"] for r in out["rows"]}
    assert {"xla", "copy"} <= impls and any(i.startswith("k") for i in impls)
    assert all(r["us"] > 0 and r["errors"] is not None for r in out["rows"])
    printed = capsys.readouterr().out
    assert "4x24" in printed and "3x40" in printed  # each group's line, then the table
    assert "\033[" not in printed  # captured output is no terminal: no colour codes
    table = (tmp_path / "bench.txt").read_text()
    assert "4x24" in table and "xla" in table
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_on_cpu_our_rows_are_marked_as_not_kernel_timings(tmp_path, capsys):
    bench.main(["--kernels", "1,12", "--shapes", "4x24", "--dtypes", "float32", "--peers", "xla",
                "--reps", "1", "--chain", "1", "--no-progress", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    ours = [r for r in rows if not r["peer"]]
    assert len(ours) == 2
    on_gpu = bench.jax.default_backend() == "gpu"
    assert all(r["kernel_timing"] is on_gpu for r in ours)
    assert all(r["kernel_timing"] for r in rows if r["peer"])
    printed = capsys.readouterr().out
    assert (bench.format_table(rows).count("[cpu-ref]") == (0 if on_gpu else 3))  # 2 rows + note
    assert ("[cpu-ref]" in printed) is not on_gpu


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch):
    class Tty:
        def isatty(self):
            return True
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert _term.paint("x", "red", Tty()) == "\033[31mx\033[0m"
    assert _term.paint("x", "red", open(os.devnull, "w")) == "x"  # a file or a pipe
    monkeypatch.setenv("NO_COLOR", "1")
    assert _term.paint("x", "red", Tty()) == "x"


def test_bench_json_after_the_first_group_says_incomplete(tmp_path, monkeypatch):
    # Stop the run after its first group, as a time limit would: the file must hold that group.
    calls = []
    real = bench.bench_group

    def first_only(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "bench_group", first_only)
    try:
        bench.main(["--shapes", "4x24,3x40", "--dtypes", "float32", "--peers", "copy", "--reps", "1",
                    "--chain", "1", "--no-progress", "--out", str(tmp_path)])
    except KeyboardInterrupt:
        pass
    out = json.loads((tmp_path / "bench.json").read_text())
    assert out["complete"] is False
    assert {r["shape"] for r in out["rows"]} == {"4x24"}


def test_calls_per_run_reaches_the_minimum_despite_a_runs_fixed_cost():
    # A run of n calls that costs 2 ms plus 0.4 ms a call (the shape of a small GPU op): n taken
    # from run(1) alone (20 / 2.4 -> 9) would give 5.6 ms runs; the search must reach 20 ms.
    tried = []

    def run(n):
        tried.append(n)
        return 0.002 + 0.0004 * n

    n = timing.calls_per_run(run, 0.02)
    assert run(n) >= 0.02 and n == tried[-2]
    assert len(tried) <= 6  # a few runs, not a scan
    assert timing.calls_per_run(lambda n: 0.0, 0.0) == 1  # CPU: no minimum, one call


def test_op_names_aliases_and_all():
    names = lambda argv: [op.name for op in bench.parse_args(argv, on_gpu=False).ops]  # noqa: E731
    assert names([]) == ["layernorm_bwd"]  # the default: the backward
    assert names(["--op", "forward,add_forward"]) == ["layernorm_fwd", "add_layernorm_fwd"]
    assert names(["--op", "add_layernorm_fwd,backward"]) == ["layernorm_bwd", "add_layernorm_fwd"]
    assert names(["--op", "all"]) == list(ops.OPS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--op", "groupnorm_fwd"], on_gpu=False)


def test_cpu_sized_defaults_and_gpu_defaults_per_op():
    cpu = bench.parse_args(["--op", "all"], on_gpu=False)
    assert cpu.cpu_sized and cpu.chain == bench.CPU_CHAIN and cpu.min_run_s == 0
    assert all(s == [(256, 768), (64, 1601)] for s in cpu.shapes.values())
    gpu = bench.parse_args(["--op", "all"], on_gpu=True)
    assert not gpu.cpu_sized and gpu.chain == bench.GPU_CHAIN
    assert (8192, 768) in gpu.shapes["layernorm_fwd"] and (1024, 768) in gpu.shapes["layernorm_bwd"]
    assert not bench.parse_args(["--shapes", "4x8"], on_gpu=False).cpu_sized


def test_forward_ops_validate_time_and_write_their_rows(tmp_path, capsys):
    bench.main(["--op", "forward,add_forward", "--shapes", "4x24", "--dtypes", "bfloat16", "--params",
                "float32", "--reps", "1", "--chain", "2", "--no-progress", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "bench.json").read_text())
    assert out["complete"] is True and not out["failures"]
    got = {(r["op"], r["impl"]) for r in out["rows"]}
    assert got == {("layernorm_fwd", i) for i in ("ours", "default", "xla", "copy")} | {
        ("add_layernorm_fwd", i) for i in ("ours", "default", "ours-unfus", "xla", "copy")}
    assert all(r["params"] == "float32" and r["dtype"] == "bfloat16" for r in out["rows"])
    add = [r for r in out["rows"] if r["op"] == "add_layernorm_fwd" and r["impl"] != "copy"]
    assert all(r["errors"]["s"] == 0 for r in add)  # s is jnp's x + residual, bit for bit
    table = (tmp_path / "bench.txt").read_text()
    assert "add_layernorm_fwd" in table and "params" in table
    assert "CPU-sized" not in capsys.readouterr().out  # shapes and chain were given


def test_every_copy_moves_its_ops_bytes_once():
    # The copy peer of every op reads bytes/2 and writes bytes/2 in one pass: add_layernorm_fwd's
    # copy is one array of twice the forward's, not two arrays (a second would be stacked).
    for nbytes in (ops_layernorm.forward_bytes(64, 256, "bfloat16", "same"), ops_layernorm.add_forward_bytes(64, 256, "bfloat16", "same"),
                   ops_layernorm.backward_bytes(64, 256, "float32")):
        words = timing.copy_words(nbytes)
        assert words.ndim == 1 and 2 * words.nbytes == nbytes - nbytes % 8
    assert ops_layernorm.add_forward_bytes(8, 16, "float32", "same") - ops_layernorm.forward_bytes(8, 16, "float32", "same") == 2 * 8 * 16 * 4


CARRIED = [name for name, op in ops.OPS.items() if op.carry > 1]


def work(text: str) -> tuple[int, int, int]:
    """(our custom calls, rsqrts, reductions) in compiled HLO: what a norm step of any entry
    does (a backward of XLA's takes rstd and computes none: its reductions count)."""
    return text.count('custom_call_target="jax_lnbwd'), text.count("rsqrt("), text.count(" reduce(")


@pytest.mark.parametrize("name", CARRIED)
def test_a_chain_keeps_every_steps_work(name):
    """A chain of k steps runs k times one step's work for every JAX entry, the ops that carry
    more than their state included (the add ops' s, the qk ops' k): XLA drops the work of outputs
    that nothing reads, so the chain returns the last step's carried outputs (timing.chained).
    Before it did, the qk ops' entries of separate calls (two-calls, xla) lost their whole k half."""
    import jax

    assert set(CARRIED) >= {"add_layernorm_fwd", "add_rmsnorm_fwd", "qk_norm_fwd", "qk_norm_bwd"}
    op, k = ops.OPS[name], 3
    case = op.prepare(4, 16, "float32", "same", jax.random.key(0))
    args = bench.parse_args(["--op", name, "--peers", ",".join(p for p in op.peers if p in bench.PEERS)], on_gpu=False)
    entries = op.impls(case, args, [])
    assert {"ours", "xla"} <= {e.name for e in entries}
    for entry in entries:
        one = work(jax.jit(entry.step).lower(case.state, *case.consts).compile().as_text())
        chain = timing.chained(entry.step, k, op.carry)
        assert work(chain.lower(case.state, case.consts).compile().as_text()) == tuple(k * n for n in one), entry.name
        assert sum(one) > 0, entry.name
        assert len(chain(case.state, case.consts)[0]) == op.carry, entry.name   # the last carried outputs


def test_a_copy_faster_than_the_dram_marks_its_group_l2():
    def group(copy_gbps, nbytes=100 * 2**20):
        return [{"impl": "ours", "gbps": 3000.0, "bytes": nbytes},
                {"impl": "copy", "gbps": copy_gbps, "bytes": nbytes}]
    fast, slow, off, small = group(5300.0), group(4100.0), group(5300.0), group(4100.0, 2**20)
    bench.mark_l2(fast, 60 * 2**20, 4800)
    bench.mark_l2(slow, 60 * 2**20, 4800)
    bench.mark_l2(off, None, None)   # off a GPU: no check
    bench.mark_l2(small, 60 * 2**20, 4800)   # the bytes fit, however fast the copy
    assert all(r["fits_l2"] for r in fast + small)
    assert not any(r["fits_l2"] for r in slow + off)


def test_shapes_that_fit_in_l2_are_marked():
    row = {"op": "layernorm_fwd", "shape": "8x8", "dtype": "float32", "params": "float32", "impl": "copy",
           "us": 1.0, "gbps": 1.0, "pct_copy": 100.0, "vs_xla": None, "vs_best": None}
    marked = bench.format_table([{**row, "fits_l2": True}], l2_mb=60)
    assert "8x8 L2" in marked and "60 MB L2" in marked
    assert "L2" not in bench.format_table([{**row, "fits_l2": False}])
