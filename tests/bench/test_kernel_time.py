"""The kernel bench's --kernel-time (benchmarks/kernels/kernel_time.py): the kernels of one traced
chain call per step, beside the step's time. On the CPU the collector is jax.profiler's thunks: a
check of the tool, no measurement (no timing is asserted)."""
from __future__ import annotations

import json
import sys

from conftest import CHECKOUT

sys.path.insert(0, str(CHECKOUT))  # the checkout: benchmarks/
from benchmarks.kernels import cli as bench  # noqa: E402
from benchmarks.kernels import kernel_time, report  # noqa: E402


def test_kernel_time_traces_every_impl_and_adds_its_column(tmp_path, capsys):
    bench.main(["--op", "forward", "--shapes", "4x24", "--dtypes", "float32", "--peers", "xla,copy",
                "--reps", "1", "--chain", "2", "--kernel-time", "--no-progress", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "bench.json").read_text())
    assert out["complete"] is True and not out["failures"]
    assert out["meta"]["kernel_time"] in ("jax", "torch")
    assert {r["impl"] for r in out["rows"]} == {"ours", "xla", "copy"}
    assert all(r["kernel_us"] is None or r["kernel_us"] > 0 for r in out["rows"])
    table = (tmp_path / "bench.txt").read_text()
    assert any(l.startswith("shape") and "kern µs" in l for l in table.splitlines())
    assert "kern µs: the step's kernels alone" in table
    assert "--kernel-time:" in capsys.readouterr().out


def test_without_the_flag_nothing_is_traced(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_time, "per_step_us", lambda *a: (_ for _ in ()).throw(AssertionError("traced")))
    bench.main(["--op", "forward", "--shapes", "4x24", "--dtypes", "float32", "--peers", "copy",
                "--reps", "1", "--chain", "2", "--no-progress", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "bench.json").read_text())
    assert out["meta"]["kernel_time"] is None and not any("kernel_us" in r for r in out["rows"])
    assert "kern µs" not in (tmp_path / "bench.txt").read_text()


def test_per_step_is_the_union_of_the_calls_activities_over_the_steps(monkeypatch):
    # Two overlapping kernels (a finalize launched early waits inside the kernel before it) count
    # once; a copy to the host is left out, as the e2e bench leaves it out of a step.
    events = [("kernel_a", None, 0.0, 4000.0), ("finalize", None, 3000.0, 2000.0),
              ("kernel_b", None, 9000.0, 1000.0), ("Memcpy DtoH", None, 20000.0, 5000.0)]
    from benchmarks.e2e.trace import collectors
    monkeypatch.setattr(collectors, "collect", lambda call, how: (call(), events)[1])
    calls = []
    assert kernel_time.per_step_us(lambda: calls.append(1), 2, "torch") == (5000 + 1000) / 2 / 1e3
    assert calls == [1]
    monkeypatch.setattr(collectors, "collect", lambda call, how: [])
    assert kernel_time.per_step_us(lambda: None, 2, "torch") is None


def test_table_column_sits_after_the_step_time():
    rows = [{"shape": "8x8", "dtype": "float32", "impl": "ours", "us": 3.0, "kernel_us": 1.25, "gbps": 1.0,
             "pct_copy": 50.0, "vs_xla": None, "vs_best": None},
            {"shape": "8x8", "dtype": "float32", "impl": "copy", "us": 1.5, "kernel_us": None, "gbps": 2.0,
             "pct_copy": 100.0, "vs_xla": None, "vs_best": None}]
    head, _, ours, copy = report.format_table(rows).splitlines()[:4]
    assert head.split()[:5] == ["shape", "dtype", "impl", "µs", "kern"]
    assert ours.split()[3:5] == ["3.00", "1.25"] and copy.split()[3:5] == ["1.50", "-"]
