"""tools/ncu_durations.py: ncu's CSV of gpu__time_duration, read into µs per kernel name."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "ncu_durations", Path(__file__).resolve().parents[2] / "tools" / "ncu_durations.py")
ncu_durations = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_durations)

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
        '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(i: int, kernel: str, unit: str, value: str, metric: str = "gpu__time_duration.sum") -> str:
    return (f'"{i}","1736","python3.12","127.0.0.1","{kernel}","1","14","(128, 1, 1)","(16384, 1, 1)","0",'
            f'"9.0","Command line profiler metrics","{metric}","{unit}","{value}"')


OURS = "void lnbwd::<unnamed>::forward_rows<1, __nv_bfloat16, __nv_bfloat16, 8, 4, 0>(FwdArgs<T2, T3>, int, int)"


def test_durations_by_kernel_in_us():
    text = "\n".join([
        "==PROF== Connected to process 1736",     # ncu's and the program's own lines are skipped
        "rmsnorm_fwd bfloat16 16384x4096 ours: 68.99 µs",
        HEAD,
        row(0, OURS, "ns", "67,520"),
        row(1, OURS, "ns", "65,920"),
        row(2, "wrapped_not", "usecond", "2.40"),
        row(3, "wrapped_not", "ns", "2,300", metric="sm__cycles_elapsed.avg"),   # another metric: ignored
    ])
    got = ncu_durations.durations(text)
    assert got == {"void lnbwd::<unnamed>::forward_rows<1, __nv_bfloat16, __nv_bfloat16, 8, 4, 0>": [67.52, 65.92],
                   "wrapped_not": [2.4]}
    lines = ncu_durations.table(got).splitlines()
    assert lines[0].startswith("void lnbwd::<unnamed>::forward_rows") and "median    66.72 µs" in lines[0]
    assert "min     2.40" in lines[1]


def test_argument_lists_are_cut_at_their_own_parenthesis():
    assert ncu_durations.without_arguments("f<(1 > 0), T>(Args<T2>, int)") == "f<(1 > 0), T>"
    assert ncu_durations.without_arguments("wrapped_not_1") == "wrapped_not_1"


def test_no_rows_and_unknown_units(tmp_path, capsys):
    empty = tmp_path / "empty.csv"
    empty.write_text("==PROF== nothing profiled\n")
    assert ncu_durations.main([str(empty)]) == 1
    assert "no gpu__time_duration.sum rows" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown unit 'cycle'"):
        ncu_durations.durations("\n".join([HEAD, row(0, OURS, "cycle", "5")]))
    assert ncu_durations.main([]) == 2
