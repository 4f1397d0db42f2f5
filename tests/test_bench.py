"""The benchmark's command line on whatever platform this is (CPU in CI): it validates, times and
writes its outputs. A smoke test of the tool, not a measurement: no timing is asserted."""
from __future__ import annotations

import json

from jax_lnbwd import bench


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

    n = bench.calls_per_run(run, 0.02)
    assert run(n) >= 0.02 and n == tried[-2]
    assert len(tried) <= 6  # a few runs, not a scan
    assert bench.calls_per_run(lambda n: 0.0, 0.0) == 1  # CPU: no minimum, one call
