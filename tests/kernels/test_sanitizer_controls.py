"""The sanitizer scripts' positive controls still plant their bugs.

tests/cuda/run_*sanitizers.sh prove that compute-sanitizer would notice a bug by compiling
scratch copies of a kernel with one planted change (an out-of-bounds store, a missing barrier)
made by `sed`. When the kernel's code moves on, a pattern can stop matching and the control
silently checks the unchanged kernel. The scripts report that on the GPU; this checks it on any
machine: every `sed 's|...|...|' FILE` of the scripts changes FILE.
"""
import pathlib
import re
import shutil
import subprocess

import pytest

from conftest import CHECKOUT

# The wheel route of CI runs a copy of tests/ without the kernel sources: nothing to check there.
HAS_SOURCES = (CHECKOUT / "ffi" / "kernels").is_dir()
needs_sources = pytest.mark.skipif(not HAS_SOURCES, reason="run from outside the source tree")
SCRIPTS = sorted((CHECKOUT / "tests" / "cuda").glob("run_*sanitizers.sh"))
# sed 's|PATTERN|REPLACEMENT|' \<newline> FILE  (the scripts' form; a line continuation may sit between)
SED = re.compile(r"sed '(s\|.*?\|.*?\|)'\s*\\?\s*\n?\s*(ffi/\S+\.(?:cu|cuh|h))\b")


def controls():
    out = []
    for script in SCRIPTS:
        for expr, path in SED.findall(script.read_text()):
            out.append(pytest.param(expr, path, id=f"{script.name}:{pathlib.Path(path).name}:{len(out)}"))
    return out


@needs_sources
@pytest.mark.skipif(shutil.which("sed") is None, reason="needs sed")
@pytest.mark.parametrize("expr,path", controls())
def test_planted_change_applies(expr, path):
    source = (CHECKOUT / path).read_text()
    planted = subprocess.run(["sed", expr], input=source, capture_output=True, text=True, check=True).stdout
    assert planted != source, f"the control `sed '{expr}'` no longer changes {path}"


@needs_sources
def test_every_script_has_controls():
    found = {p.values[1] for p in controls()}
    assert "ffi/kernels/forward/forward_rows.cu" in found
    assert any("backward" in f for f in found)
    assert "ffi/kernels/common/head_rows.h" in found   # run_qk_sanitizers.sh: the head rows' cursor
