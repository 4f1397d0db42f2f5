"""tools/gpu/gpu_check.sh's ab stage (a kernel change's before and after in one run), with a stub
python3 in place of the kernel bench: the bench runs first with the extension in jax_lnbwd/, then
with AB_BASE's, from a copy of the package, so that jax_lnbwd/'s own extension is never replaced,
not even while the base runs or when its run fails."""
import lzma
import os
import shutil
import subprocess

import pytest

from conftest import CHECKOUT

SCRIPT = CHECKOUT / "tools" / "gpu" / "gpu_check.sh"
pytestmark = [
    pytest.mark.skipif(not SCRIPT.is_file(), reason="run from outside the source tree"),
    pytest.mark.skipif(shutil.which("bash") is None or shutil.which("xz") is None, reason="needs bash and xz"),
]

# Stub: one line per bench run, the extension it would have imported (python -m puts the working
# directory first on sys.path), the checkout's at that moment, then its arguments. STUB_FAIL_BASE:
# the base's run fails, as one that a timeout stops.
PYTHON = r"""#!/usr/bin/env bash
own=$(cat "$PWD/jax_lnbwd/_jax_lnbwd.so")
echo "$own checkout=$(cat "$CHECKOUT_SO") $*" >> "$STUB_LOG"
[ "$own" = base ] && [ -n "${STUB_FAIL_BASE:-}" ] && exit 1
exit 0
"""


def run_ab(tmp_path, ok=True, **env_extra):
    tree = tmp_path / "checkout"
    (tree / "tools" / "gpu").mkdir(parents=True)
    shutil.copy(SCRIPT, tree / "tools" / "gpu" / "gpu_check.sh")
    (tree / "jax_lnbwd").mkdir()
    (tree / "jax_lnbwd" / "_jax_lnbwd.so").write_text("new")
    base = tree / "build" / "prebuilt_base"
    base.mkdir(parents=True)
    (base / "ext.name").write_text("_jax_lnbwd.so\n")
    (base / "ext.so.xz").write_bytes(lzma.compress(b"base"))
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "python3").write_text(PYTHON)
    (stubs / "python3").chmod(0o755)
    log, out = tmp_path / "bench.log", tmp_path / "out"
    env = dict(os.environ, PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", OUT=str(out), STUB_LOG=str(log),
               CHECKOUT_SO=str(tree / "jax_lnbwd" / "_jax_lnbwd.so"), **env_extra)
    ran = subprocess.run(["bash", str(tree / "tools" / "gpu" / "gpu_check.sh"), "ab"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert (ran.returncode == 0) == ok, ran.stdout + ran.stderr
    assert (tree / "jax_lnbwd" / "_jax_lnbwd.so").read_text() == "new"
    lines = log.read_text().splitlines()
    assert all(line.split()[1] == "checkout=new" for line in lines), lines
    return lines, out


def test_ab_runs_the_change_then_the_base_and_puts_the_change_back(tmp_path):
    lines, out = run_ab(tmp_path)
    assert [line.split()[0] for line in lines] == ["new", "base"]
    for line, tag in zip(lines, ("new", "base")):
        assert "--op layernorm_bwd,rmsnorm_bwd" in line
        assert "--shapes 524288x64,262144x128,131072x256" in line
        assert "--peers copy" in line
        assert f"--out {out / ('ab_' + tag)}" in line
    assert not (out / "ab_new.so").exists()


def test_ab_with_no_shapes_takes_the_ops_own(tmp_path):
    lines, _ = run_ab(tmp_path, AB_SHAPES="", AB_OPS="qk_norm_fused_bwd")
    assert len(lines) == 2
    assert all("--op qk_norm_fused_bwd" in line and "--shapes" not in line for line in lines)


def test_ab_whose_base_run_fails_leaves_the_checkouts_extension(tmp_path):
    lines, out = run_ab(tmp_path, ok=False, STUB_FAIL_BASE="1")
    assert [line.split()[0] for line in lines] == ["new", "base"]
    assert (out / "ab_base.log").is_file()
