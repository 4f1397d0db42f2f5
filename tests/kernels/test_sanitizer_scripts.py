"""The sanitizer scripts' plumbing, on any machine: their build and run steps, their result lines,
where their logs go, and their exit status.

tests/cuda/run_*sanitizers.sh compile a standalone check and its positive controls (SAN_STEP=build:
nvcc, no GPU) and link and run them under compute-sanitizer (SAN_STEP=run: a GPU). Here stubs
stand in for nvcc (an "object" names its source; a "binary" prints its check's count line, and
PLANTED when a control's object is linked in, hangs when it is the mask control's, and fails cases
when it is the cross control's) and for compute-sanitizer (it runs the binary and reports errors
where it printed PLANTED), so that a script that mixes up its objects, its controls or its status
fails here, not in a device call. The tools' own verdicts are the GPU's (tools/gpu/gpu_check.sh).
"""
import os
import pathlib
import shutil
import subprocess

import pytest

from conftest import CHECKOUT

HAS_SOURCES = (CHECKOUT / "ffi" / "kernels").is_dir()
pytestmark = [
    pytest.mark.skipif(not HAS_SOURCES, reason="run from outside the source tree"),
    pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash"),
]

NVCC = r"""#!/usr/bin/env bash
# Stub: `-c SOURCE -o OBJECT` writes an object naming its source; a link writes a "binary".
compile=0 src= out= objs=()
while (($#)); do
  case $1 in
    -c) compile=1; src=$2; shift ;;
    -o) out=$2; shift ;;
    *.o) objs+=("$1") ;;
  esac
  shift
done
if ((compile)); then
  [ -f "$src" ] || exit 1
  [[ -n "${STUB_NVCC_FAIL:-}" && $src == *"$STUB_NVCC_FAIL"* ]] && exit 1
  echo "object of $src" > "$out"
  exit 0
fi
planted=0
for o in "${objs[@]}"; do
  [ -f "$o" ] || { echo "stub nvcc: no object $o" >&2; exit 1; }
  [[ $o == */controls/* ]] && planted=1
done
name=$(basename "$out")
case $name in check) what=check ;; *_check) what="${name%_check} check" ;; *) what=control ;; esac
{
  echo '#!/usr/bin/env bash'
  echo "echo '$what: 7 cases, 0 failures'"
  ((planted)) && echo "echo PLANTED"
  echo "echo \"objects: ${#objs[@]}\""
  echo 'echo "max C: ${LNBWD_MAX_C:-none}"'
  echo 'echo "part: ${LNBWD_SHARD:-all}"'
  # A planted mask bug hangs the real check (its groups wait at shuffles for lanes that have left).
  [[ $name == check_mask ]] && echo '[ -n "${STUB_BLIND:-}" ] || sleep 5'
  # A planted sum across row groups gives the real check wrong values: it counts failures.
  [[ $name == check_cross ]] && echo '[ -n "${STUB_BLIND:-}" ] || { echo "control: 7 cases, 3 failures"; exit 1; }'
} > "$out"
chmod +x "$out"
"""

SANITIZER = r"""#!/usr/bin/env bash
# Stub: runs the program; reports errors where it printed PLANTED (unless STUB_BLIND is set).
tool=memcheck code=
while [[ $1 == --* ]]; do
  case $1 in
    --tool) tool=$2; shift 2 ;;
    --error-exitcode) code=$2; shift 2 ;;
    --leak-check | --num-cuda-barriers) shift 2 ;;
    *) shift ;;
  esac
done
out=$("$@")
echo "$out"
echo "$tool" >> "$STUB_TOOLS_LOG"
if [[ $out == *PLANTED* && -z "${STUB_BLIND:-}" ]]; then
  echo "========= ERROR SUMMARY: 2 errors"
  exit "${code:-0}"
fi
echo "========= ERROR SUMMARY: 0 errors"
"""

# script: (its check's count line, its controls, the binaries its run step links)
SCRIPTS = {
    "run_qk_sanitizers.sh": ("qk check", ["head_off_by_one"], ["qk_check", "controls/qk_check_head_off"]),
    "run_rms_sanitizers.sh": ("rms check", ["one_buffer"], ["rms_check", "controls/rms_check_one_buffer"]),
    "run_forward_sanitizers.sh": ("forward check", ["oob", "race", "oob_s", "cross"],
                                  ["forward_check"] + [f"controls/check_{p}" for p in ("oob", "race", "oob_s", "cross")]),
    "run_sanitizers.sh": ("check", ["oob", "race", "mask", "oob12"],
                          ["check"] + [f"controls/check_{p}" for p in ("oob", "race", "mask", "oob12")]),
}


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "stub_bin"
    bin_dir.mkdir()
    for name, text in (("nvcc", NVCC), ("compute-sanitizer", SANITIZER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", KERNELS="11 12", JOBS="4",
               STUB_TOOLS_LOG=str(tmp_path / "tools.log"), LNBWD_HANG_LIMIT="1")
    return env


def script(name, env, step, *dirs):
    return subprocess.run(["bash", str(CHECKOUT / "tests" / "cuda" / name), *map(str, dirs)],
                          env=dict(env, SAN_STEP=step), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_build_then_run(name, stubs, tmp_path):
    what, controls, binaries = SCRIPTS[name]
    out, logs = tmp_path / "objects", tmp_path / "logs"
    built = script(name, stubs, "build", out)
    assert built.returncode == 0, built.stdout + built.stderr
    assert list((out / "obj").glob("*.o")), "the build step wrote no objects"
    # One object a control; QK-norm's one control plants a header, which the two sets kernels' files
    # (the forward's and kernel 11's) include.
    assert len(list((out / "controls").glob("*.o"))) == (2 if name == "run_qk_sanitizers.sh" else len(controls))
    assert not list(out.rglob("*.cu")) and not list(out.rglob("*.cuh")), "the planted sources are left behind"
    assert not (out / binaries[0]).exists(), "the build step linked"
    assert not (tmp_path / "tools.log").exists(), "the build step ran a tool"

    ran = script(name, stubs, "run", out, logs)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
        lines = [l for l in ran.stdout.splitlines() if l.startswith(tool)]
        assert lines and all(f"ERROR SUMMARY: 0 errors ({what}: 7 cases, 0 failures)" in l for l in lines), ran.stdout
    for control in controls:
        line = [l for l in ran.stdout.splitlines() if l.startswith(f"control {control} (")]
        assert line and "): reported: " in line[0], ran.stdout
    assert "NOT reported" not in ran.stdout
    for binary in binaries:
        assert (out / binary).is_file(), f"{binary} was not linked"
    assert list(logs.glob("*.log")), "no logs in LOG_DIR"
    assert not list(out.rglob("*.log")), "logs written beside the objects, not in LOG_DIR"


def test_the_mask_control_runs_small_rows_only(stubs, tmp_path):
    # Kernel 11's mask bug lives in small rows only: its control's check stops at C = 512; the
    # other controls and the tools check every C. No sanitizer reports it (the check hangs): the
    # control is the check itself, run plainly under a time limit.
    out, logs = tmp_path / "objects", tmp_path / "logs"
    assert script("run_sanitizers.sh", stubs, "build", out).returncode == 0
    ran = script("run_sanitizers.sh", stubs, "run", out, logs)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "max C: 512" in (logs / "mask.log").read_text()
    assert "control mask (plain run): reported: no result within 1 s (hung)" in ran.stdout
    assert "PLANTED" in (logs / "mask.log").read_text() and "ERROR SUMMARY" not in (logs / "mask.log").read_text()
    for log in ("oob.log", "race.log", "synccheck-k11.log"):
        assert "max C: none" in (logs / log).read_text(), log
    # Kernel 12's planted write is in its ring of row chunks, which takes C <= 256.
    assert "max C: 256" in (logs / "oob12.log").read_text()


def test_the_cross_control_is_the_plain_check(stubs, tmp_path):
    # The forward's cross bug (a row's sum taken across two row groups) is wrong values from
    # well-formed shuffles: no sanitizer reports it, so its control is the check run plainly, which
    # must count failures. Its line says so, and no tool ran on its binary.
    out, logs = tmp_path / "objects", tmp_path / "logs"
    assert script("run_forward_sanitizers.sh", stubs, "build", out).returncode == 0
    ran = script("run_forward_sanitizers.sh", stubs, "run", out, logs)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "control cross (plain run): reported: 7 cases, 3 failures (exit 1)" in ran.stdout
    assert "ERROR SUMMARY" not in (logs / "cross.log").read_text()


def test_racecheck_and_the_plain_qk_check_run_in_parts(stubs, tmp_path):
    # The slow runs are spread over processes side by side, each on its part of the cases
    # (LNBWD_SHARD, cuda_harness/shard.h), one result line a part: racecheck of every kernel
    # (RACECHECK_PARTS), and the plain QK check of every dtype (PLAIN_PARTS). The other tools
    # check every case in one process.
    out, logs = tmp_path / "objects", tmp_path / "logs"
    assert script("run_sanitizers.sh", stubs, "build", out).returncode == 0
    ran = script("run_sanitizers.sh", dict(stubs, RACECHECK_PARTS="3"), "run", out, logs)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    for kernel in (11, 12):
        for k in range(3):
            line = f"racecheck kernel {kernel} (part {k}/3): ERROR SUMMARY: 0 errors (check: 7 cases, 0 failures)"
            assert line in ran.stdout, ran.stdout
            assert f"part: {k}/3" in (logs / f"racecheck-k{kernel}-part{k}.log").read_text()
        assert "part: 0/1" in (logs / f"memcheck-k{kernel}.log").read_text()
    assert len([l for l in ran.stdout.splitlines() if l.startswith("racecheck kernel")]) == 6

    qk_out, qk_logs = tmp_path / "qk_objects", tmp_path / "qk_logs"
    assert script("run_qk_sanitizers.sh", stubs, "build", qk_out).returncode == 0
    ran = script("run_qk_sanitizers.sh", dict(stubs, PLAIN_PARTS="2"), "run", qk_out, qk_logs)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    for dtype in ("float32", "bfloat16", "float16", "float64"):
        for k in range(2):
            line = f"plain {dtype} (part {k}/2): qk check: 7 cases, 0 failures (plain exit 0)"
            assert line in ran.stdout, ran.stdout
            assert f"part: {k}/2" in (qk_logs / f"plain_{dtype}_part{k}.log").read_text()
    assert "part: all" in (qk_logs / "memcheck.log").read_text()


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_control_the_tool_misses_fails_the_run(name, stubs, tmp_path):
    out = tmp_path / "all"
    ran = script(name, dict(stubs, STUB_BLIND="1"), "all", out)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "NOT reported" in ran.stdout


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_failed_compile_stops_the_build(name, stubs, tmp_path):
    ran = script(name, dict(stubs, STUB_NVCC_FAIL="registers/kernel11_sets.cu"
                            if name != "run_forward_sanitizers.sh" else "forward/forward_wide.cu"), "build",
                 tmp_path / "objects")
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert "did not compile" in ran.stderr


def test_an_unknown_step_is_refused(stubs, tmp_path):
    ran = script("run_qk_sanitizers.sh", stubs, "link", tmp_path / "objects")
    assert ran.returncode == 2 and "SAN_STEP=link" in ran.stderr


def test_gpu_check_links_prebuilt_objects(stubs, tmp_path):
    """tools/gpu/gpu_check.sh's sanitize stages run a script's run step on the objects the prebuilt
    stage unpacked into BINS/san (compiling nothing), with the logs under OUT."""
    bins, out = tmp_path / "bins", tmp_path / "out"
    built = script("run_rms_sanitizers.sh", stubs, "build", bins / "san" / "rms")
    assert built.returncode == 0, built.stdout + built.stderr
    env = dict(stubs, BINS=str(bins), OUT=str(out), STUB_NVCC_FAIL=".cu")   # a compile now would fail
    ran = subprocess.run(["bash", str(CHECKOUT / "tools" / "gpu" / "gpu_check.sh"), "sanitize_rms"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "control one_buffer (racecheck): reported" in ran.stdout
    assert (out / "sanitize_rms" / "memcheck.log").is_file()
    assert (bins / "san" / "rms" / "rms_check").is_file()


def test_later_scripts_reuse_the_kernels_objects(stubs, tmp_path):
    """prebuild.sh compiles the kernels once (run_sanitizers.sh's build) and the other scripts
    hard-link them (SAN_REUSE): with every compile of ffi/kernels failing, their builds still pass."""
    bwd = tmp_path / "bwd"
    assert script("run_sanitizers.sh", stubs, "build", bwd).returncode == 0
    for name in ("run_rms_sanitizers.sh", "run_qk_sanitizers.sh", "run_forward_sanitizers.sh"):
        out = tmp_path / name
        built = script(name, dict(stubs, SAN_REUSE=str(bwd / "obj"), STUB_NVCC_FAIL="ffi/kernels/"), "build", out)
        assert built.returncode == 0, built.stdout + built.stderr
        reused = (out / "obj" / "forward_rows.cu.o").stat()
        assert reused.st_ino == (bwd / "obj" / "forward_rows.cu.o").stat().st_ino, "compiled again, not linked"


def test_tune_and_check_link_from_the_sanitizers_objects(stubs, tmp_path):
    """tools/tune/build.sh with KERNEL_OBJECTS links tune and check from a sanitizer script's
    objects, the checks' mains left out, and compiles no kernel."""
    bwd = tmp_path / "bwd"
    assert script("run_sanitizers.sh", stubs, "build", bwd).returncode == 0
    kernels = [o for o in (bwd / "obj").glob("*.o") if not o.name.endswith("check.cu.o")]
    ran = subprocess.run(["bash", str(CHECKOUT / "tools" / "tune" / "build.sh"), str(tmp_path / "bins"), "tune", "check"],
                         env=dict(stubs, KERNEL_OBJECTS=str(bwd / "obj"), STUB_NVCC_FAIL="ffi/kernels/"),
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    for program in ("tune", "check"):
        printed = subprocess.run([str(tmp_path / "bins" / program)], capture_output=True, text=True).stdout
        assert f"objects: {len(kernels)}" in printed
