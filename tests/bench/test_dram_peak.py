"""The kernel bench's second denominator: the DRAM's peak of known GPUs (benchmarks/kernels/dram.py),
overridable by the flag and the environment, and the table's %peak column beside %copy."""
from __future__ import annotations

import pytest

from benchmarks.kernels import dram
from benchmarks.kernels.report import format_table


@pytest.mark.parametrize("kind, gbps", [("NVIDIA H200", 4800), ("NVIDIA H100 80GB HBM3", 3350),
                                        ("NVIDIA H100 PCIe", 2000), ("NVIDIA GH200 480GB", 4000),
                                        ("NVIDIA A100-SXM4-80GB", 2039), ("NVIDIA L40", 864), ("NVIDIA L4", 300),
                                        ("cpu (x86_64)", None)])
def test_peak_by_device_name(kind, gbps, monkeypatch):
    monkeypatch.delenv(dram.ENV, raising=False)
    assert dram.peak_gbps(kind)[0] == gbps


def test_flag_then_environment_override_the_table(monkeypatch):
    monkeypatch.setenv(dram.ENV, "1234")
    assert dram.peak_gbps("NVIDIA H200") == (1234.0, dram.ENV)
    assert dram.peak_gbps("NVIDIA H200", 99.0) == (99.0, "--dram-gbps")


def test_table_has_both_denominators():
    row = {"shape": "1024x768", "dtype": "bfloat16", "impl": "k12/bs0", "us": 10.0, "gbps": 2400.0,
           "pct_copy": 80.0, "pct_peak": 50.0, "vs_xla": 2.0, "vs_best": 1.5}
    text = format_table([row, {**row, "impl": "copy", "pct_peak": None}], dram_gbps=4800)
    head = text.splitlines()[0].split()
    assert head.index("%copy") + 1 == head.index("%peak")
    assert "50.0%" in text and "4800 GB/s" in text
