"""What each traced activity is: its class (ln, mixed, other, comm, unmapped: layernorm's share)
and its kind (where all the kernel time goes).

Attribution rule
  Every add & norm of the models runs under ``jax.named_scope("e2e_layernorm")``. JAX keeps
  the scope in each HLO operation's metadata (op_name) through jvp and transpose, so the
  forward, the backward and the weight-gradient sums of each LayerNorm, and the residual add
  in front of it and its gradient, all carry it. In the compiled step, an instruction that
  launches a kernel (a fusion, a custom call, a copy) is
    ln      if every operation in it (a fusion's fused operations included) carries the scope;
    mixed   if some do: XLA fused layernorm work with other work (a matmul's bias add or the
            GELU before a LayerNorm, a gradient add after it);
    other   if none do.
  Kernels are matched to instructions by the trace's hlo_op where there is one, else by name:
  XLA names a fusion's kernel after the instruction ("loop_add_fusion.3" -> loop_add_fusion_3).
  Our own kernels (C++ namespace lnbwd; RMSNorm runs the same kernels, and its FFI targets
  jax_lnbwd_rmsnorm_* match our_calls) are ln. Kernels named by their library (cuBLAS,
  cuBLASLt, CUTLASS, cuDNN: matmuls and attention) and memcpys/memsets are other. What is left
  matched nothing: unmapped, and its share of the time is reported (it should be ~0; if not,
  ``--trace jax`` matches by the trace's HLO op instead of by name).

QK-norm (--qk-norm: the public models' q and k norms, under ``jax.named_scope(QK_SCOPE)``)
  The same rule with QK_SCOPE gives its own classes (classify_hlo's scope): its kernels, and
  the fusions that mix its work with other work, add up to the trace's qk and qk + mixed
  figures (summary.py). Our kernels found by name are QK-norm's where every custom call of
  ours in the module is under QK_SCOPE (our_scope: the QK-norm variants' add & norms are XLA's),
  else layernorm's; found by their instruction (--trace jax), they take its scopes.

Limits
  "ln" is a lower bound and "ln + mixed" an upper bound of what layernorm costs: a mixed
  kernel's time is not split. XLA compiles identical fusions once and names the kernel after
  the first, so by name all copies take the first one's class (the jax trace has no such
  limit). Operations without metadata (parameters, constants, some that XLA creates) take no
  part; an instruction with none at all is other. The optimizer's update of the LayerNorm
  parameters is adam's (other), as is the loss. Tracing adds a little to every launch, so idle
  times compare between variants under the same collector, not with an untraced step.

Kinds: where ALL the kernel time goes
  Independent of the classes above, every activity also gets a kind, from its kernel name
  (and HLO op where the trace has one), the first rule that matches winning (kind()):
    comm           a collective (the comm class)
    ours           our kernels: lnbwd in the name, or a custom call to a jax_lnbwd target
    copy/memset    memcpys, memsets, and XLA's bare copy instructions (copy.3)
    attention      cuDNN's and flash attention (cudnn, flash, fmha, sdpa in the name)
    gemm           matmuls: cuBLAS, cuBLASLt (nvjet), xmma, CUTLASS, sm90_..., XLA's Triton gemm
                   fusions (gemm in the name), and a CPU thunk of a dot instruction (dot.3)
    reduce fusion  XLA kernels with a reduction: the name starts with input_ or contains reduce
    loop fusion    XLA's other kernels: elementwise, transpose and concatenate fusions (loop_,
                   wrapped_, triton_, ...fusion), and anything matched to an HLO instruction
    other          the rest (sorts, RNG, kernels of other libraries)
  A variant's per-kind difference against its baseline shows where a step gained or lost
  time outside layernorm (cli's --kernels prints it).
"""
from __future__ import annotations

import re
from collections import defaultdict

from ..models_linen import LN_SCOPE
from ..models_public_linen import QK_SCOPE

OURS = re.compile(r"lnbwd")  # our CUDA kernels live in C++ namespace lnbwd
# Kernels of the matmul and attention libraries (cuBLAS, cuBLASLt's nvjet, CUTLASS, cuDNN), and
# copies: named by their library, not after an instruction. They never do layernorm's work.
LIBRARY = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|cudnn|flash|^sm\d+_|memcpy|memset", re.IGNORECASE)
# Collectives: NCCL's kernels (ncclDevKernel_AllReduce_Sum_f32_RING_LL, ...), XLA's own collective
# kernels and the HLO ops (all-reduce-start.3; a CPU thunk is named after its op: all-reduce.29).
COMM = re.compile(r"nccl|all[-_]?reduce|reduce[-_]?scatter|all[-_]?gather|all[-_]?to[-_]?all|"
                  r"collective[-_]?permute", re.IGNORECASE)
# The kinds, in the order kind() tries them (the module doc): name patterns, case-insensitive.
KINDS = ("ours", "gemm", "attention", "reduce fusion", "loop fusion", "copy/memset", "comm", "other")
_COPY = re.compile(r"memcpy|memset|^copy([._]\d+)?$", re.IGNORECASE)
_ATTENTION = re.compile(r"cudnn|flash|fmha|sdpa", re.IGNORECASE)
_GEMM = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|^sm\d+_|^dot([._]|$)", re.IGNORECASE)
_REDUCE = re.compile(r"^input_|reduce", re.IGNORECASE)
_FUSION = re.compile(r"fusion|^loop_|^wrapped_|^triton", re.IGNORECASE)
# Copies between the host and a GPU (torch: "Memcpy DtoH (Device -> Pinned)"; jax: MemcpyD2H):
# the host asks for them (the loss read after the last step), so they bound no step's GPU work.
HOST_COPY = re.compile(r"DtoH|HtoD|D2H|H2D", re.IGNORECASE)


_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s")
# Only calls= (a fusion's body, a wrapped or async op's): to_apply= bodies (a reduction's add)
# are shared between instructions by XLA, with the metadata of one of them.
_CALLS = re.compile(r"\bcalls=(\{[^}]*\}|%?[\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def sanitize(name: str) -> str:
    """An HLO instruction name as XLA names its kernel: "loop_add_fusion.3" -> "loop_add_fusion_3"."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def classify_hlo(hlo_text: str, scope: str = LN_SCOPE) -> dict[str, str]:
    """{sanitized instruction name: "ln" | "mixed" | "other"} for every instruction of the module:
    "ln" where all its operations carry `scope` (LN_SCOPE; QK_SCOPE for the QK-norm's classes)."""
    comps: dict[str, list] = defaultdict(list)  # computation -> [(instruction, op_name, calls)]
    current = None
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            op = _OP_NAME.search(line)
            calls = [c for group in _CALLS.findall(line) for c in re.findall(r"%?([\w.\-]+)", group)]
            comps[current].append((m.group(1), op.group(1) if op else None, calls))
        elif (c := _COMPUTATION.match(line)) and " = " not in line:
            current = c.group(1)
    memo: dict[str, list] = {}

    def op_names(comp: str) -> list:  # every op_name inside a computation, recursively
        if comp not in memo:
            memo[comp] = []
            memo[comp] = [o for _, op, calls in comps.get(comp, ()) for o in
                          ([op] if op else []) + [x for c in calls for x in op_names(c)]]
        return memo[comp]

    out = {}
    for instrs in comps.values():
        for name, op, calls in instrs:
            ops = ([op] if op else []) + [x for c in calls for x in op_names(c)]
            inside = [scope in o for o in ops]
            out[sanitize(name)] = ("ln" if inside and all(inside) else "mixed" if any(inside) else "other")
    return out


_OUR_CALL = re.compile(r'custom_call_target="jax_lnbwd_')


def our_calls(hlo_text: str) -> frozenset[str]:
    """The sanitized names of the module's custom calls to our FFI targets: how the jax trace
    (whose CPU thunks are named after the instruction, not the kernel) finds our op's events."""
    return frozenset(sanitize(m.group(1)) for line in hlo_text.splitlines()
                     if _OUR_CALL.search(line) and (m := _INSTRUCTION.match(line)))


def our_scope(hlo_text: str) -> str:
    """Whose work our kernels found by name do: "qk" where the module has custom calls of ours
    and every one is under QK_SCOPE, else "ln" (see the module doc)."""
    scopes = [(m.group(1) if (m := _OP_NAME.search(line)) else "") for line in hlo_text.splitlines()
              if _OUR_CALL.search(line)]
    return "qk" if scopes and all(QK_SCOPE in s for s in scopes) else "ln"


def attribute(name: str, hlo_op: str | None, classes: dict[str, str], ours: str = "ln") -> str:
    """The class of one traced activity: comm, ln, mixed, other or unmapped (see the module doc).
    ours: the class of our kernels found by name ("ln"; "other" for classes of a scope they do
    not work for)."""
    if COMM.search(name) or hlo_op and COMM.search(hlo_op):
        return "comm"
    if hlo_op and sanitize(hlo_op) in classes:
        return classes[sanitize(hlo_op)]
    if OURS.search(name):
        return ours
    key = sanitize(name)
    for candidate in (key, re.sub(r"_\d+$", "", key)):  # a fusion's second kernel: name_1
        if candidate in classes:
            return classes[candidate]
    return "other" if LIBRARY.search(name) else "unmapped"


def kind(name: str, hlo_op: str | None = None, ours: frozenset[str] = frozenset(),
         xla: bool = False) -> str:
    """The kind of one traced activity (KINDS, the rule in the module doc). ours: our_calls()
    of the module; xla: the activity was matched to an HLO instruction of the module (its
    class is ln, mixed or other), so an XLA kernel that no fusion pattern names is a loop fusion."""
    if COMM.search(name) or hlo_op and COMM.search(hlo_op):
        return "comm"
    if OURS.search(name) or hlo_op and sanitize(hlo_op) in ours:
        return "ours"
    for k, pattern in (("copy/memset", _COPY), ("attention", _ATTENTION), ("gemm", _GEMM),
                       ("reduce fusion", _REDUCE), ("loop fusion", _FUSION)):
        if pattern.search(name):
            return k
    return "loop fusion" if xla else "other"
