"""Whether the plain kernel variants of a build are the same code as a base build's.

Kernels 11 and 12 and the finalize pass take the weight's type O and a residual switch RESID as
template parameters next to the data type T (target v2). The plain case, O = T and no
residual, must compile to the code it compiled to before those parameters existed. This
compares the PTX of every plain instantiation in NEW with its twin in BASE, after taking out
what differs between any two builds (symbol hashes, asm label numbers) and, for the row kernels,
renumbering the parameters after the inserted `dresidual` one.

    nvcc -std=c++17 -O3 -arch=sm_90 -Iffi/kernels -ptx ffi/kernels/backward/tma_ring/kernel12_bulk_copy_ring.cu -o new.ptx
    (the same in a checkout of the base commit, -o base.ptx)
    python tools/compare_plain_ptx.py base.ptx new.ptx --inserted-param 5   # finalize: no --inserted-param
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys


def entries(path: str) -> dict[str, str]:
    """Kernel name -> PTX body."""
    text = open(path).read()
    pattern = r"(?:\.visible )?\.entry (\S+)\((.*?)\)\s*(?:\.\w+[^\n]*\n)*\s*\{(.*?)\n\}"
    return {m.group(1): m.group(3) for m in re.finditer(pattern, text, re.S)}


def template_args(mangled: str):
    """(kernel, [template arguments]) of a mangled lnbwd kernel name, or (None, None)."""
    name = subprocess.run(["c++filt"], input=mangled, capture_output=True, text=True).stdout.strip()
    m = re.match(r"void lnbwd::\(anonymous namespace\)::(\w+)<(.*)>\(", name)
    if not m:
        return None, None
    args, depth, cur = [], 0, ""
    for ch in m.group(2):
        depth += ch in "<("
        depth -= ch in ">)"
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return m.group(1), args + [cur.strip()]


def normalized(body: str, name: str, inserted: int | None) -> str:
    body = body.replace(name, "FN")
    if inserted is not None:   # parameters after the inserted one move down by one
        body = re.sub(r"FN_param_(\d+)", lambda m: f"FN_param_{int(m.group(1)) - (int(m.group(1)) > inserted)}", body)
    body = re.sub(r"_ZZ\w+", lambda m: "LOCAL_" + re.sub(r".*E\d+", "", m.group(0)), body)   # function statics
    body = re.sub(r"_GLOBAL__N__[0-9a-f]+_", "_GLOBAL__N__H_", body)   # anonymous namespace hash
    body = re.sub(r"_cu_[0-9a-f]{8}", "_cu_H", body)                   # file hash
    body = re.sub(r"WAIT_\d+", "WAIT", body)                           # asm labels (%=)
    return re.sub(r"\$L__\w+", "L", body)


def plain_key(kernel: str, args: list[str]):
    """The base build's template arguments of a plain NEW instantiation, or None if not plain."""
    if kernel == "finalize_partials":   # <T, O, ...>
        return (kernel, tuple([args[0]] + args[2:])) if args[0] == args[1] else None
    if len(args) >= 3 and args[0] == args[1] and args[2] == "false":   # <T, O, RESID, ...>
        return kernel, tuple([args[0]] + args[3:])
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--inserted-param", type=int, default=None,
                        help="index of the kernel parameter NEW inserted (dresidual: 5); none for finalize")
    opts = parser.parse_args()
    base = {}
    for name, body in entries(opts.base).items():
        kernel, args = template_args(name)
        if kernel:
            base[(kernel, tuple(args))] = normalized(body, name, None)
    same, differ, missing = 0, [], []
    for name, body in entries(opts.new).items():
        kernel, args = template_args(name)
        key = plain_key(kernel, args) if kernel else None
        if key is None:
            continue
        if key not in base:
            missing.append(key)
        elif normalized(body, name, opts.inserted_param) == base[key]:
            same += 1
        else:
            differ.append(key)
    for key in differ:
        print("differs:", key)
    for key in missing:
        print("no twin in base:", key)
    print(f"{opts.new}: {same} plain variants identical to the base's, {len(differ)} differ, {len(missing)} without a twin")
    return 1 if differ or missing or same == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
