"""Every ```python block of the README runs as written, on its own, on a CPU-only install.

Each block is extracted and run in a fresh interpreter (a subprocess on the CPU, with a time
limit), with none of the suite's JAX_LNBWD_* switches: as a user who pastes it would run it.
Signature listings use ```text and are not run. The README also stays within 400 lines."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import CHECKOUT

README = (CHECKOUT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)


def test_readme_has_python_blocks_and_stays_short():
    assert len(BLOCKS) >= 3
    assert len(README.splitlines()) <= 400


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code, tmp_path):
    if "flax" in code:
        pytest.importorskip("flax")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_LNBWD_")}
    env["JAX_PLATFORMS"] = "cpu"
    script = tmp_path / "block.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{code}\n---\n{done.stderr[-3000:]}"
