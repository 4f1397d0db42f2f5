"""The DRAM's peak bandwidth of known GPUs: the denominator of the table's %peak column.

%copy compares an op with a same-bytes copy measured in the same run (what this GPU reaches in
practice); %peak with the DRAM's datasheet peak, the figure papers and other libraries quote.
The peak is looked up by the device's name (jax's device_kind); --dram-gbps or the environment
variable JAX_LNBWD_DRAM_GBPS overrides it, and an unknown device has none (%peak is "-").
"""
from __future__ import annotations

import os

ENV = "JAX_LNBWD_DRAM_GBPS"

# (a substring of device_kind, peak GB/s), most specific first; datasheet figures.
PEAK_GBPS = (
    ("GH200", 4000),
    ("H200", 4800),
    ("H100 PCIe", 2000),
    ("H100 NVL", 3900),
    ("H100", 3350),            # SXM5
    ("H800", 3350),
    ("B200", 8000),
    ("GB200", 8000),
    ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIe", 1935),
    ("A100", 1555),            # 40 GB, SXM4 and PCIe
    ("L40S", 864),
    ("L40", 864),
    ("L4", 300),
    ("A10G", 600),
    ("RTX 4090", 1008),
    ("RTX 5090", 1792),
    ("V100", 900),
)


def peak_gbps(device_kind: str, override: float | None = None) -> tuple[float | None, str]:
    """(peak GB/s or None, where it came from) for a device: the flag, the environment, the table."""
    if override is not None:
        return override, "--dram-gbps"
    if os.environ.get(ENV):
        return float(os.environ[ENV]), ENV
    for name, gbps in PEAK_GBPS:
        if name in device_kind:
            return float(gbps), f"the table for {name}"
    return None, "unknown device"
