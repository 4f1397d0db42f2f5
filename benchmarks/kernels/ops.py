"""The ops the kernel bench times, one row of OPS each: ``--op NAME`` (comma list, or ``all``).

An op's name is ``<norm>_<pass>``, the pass ``fwd`` or ``bwd``, as the public functions and the
FFI targets are named; the layernorm ops also answer to a short alias:

  layernorm_bwd      (backward)     the backward kernels of jax_lnbwd.KERNELS, given mean/rstd
  layernorm_fwd      (forward)      the fused forward: y, mean, rstd; x read once
  add_layernorm_fwd  (add_forward)  s = x + residual, then the forward of s; s is an output too
  rmsnorm_bwd                       the backward kernels that run rmsnorm (kernels 11, 12), given rstd
  rmsnorm_fwd                       the fused forward: y, rstd
  add_rmsnorm_fwd                   s = x + residual, then rmsnorm's forward of s
  qk_norm_fwd                       QK-norm, q and k apart (jax_lnbwd.qk_norm): q_out, k_out
  qk_norm_bwd                       its backward: dq, dk, dq_weight, dk_weight
  qk_norm_fused_fwd                 QK-norm of the fused projection (jax_lnbwd.qk_norm_fused): qkv_out
  qk_norm_fused_bwd                 its backward: dqkv, dq_weight, dk_weight

The qk ops read a shape ROWSxC as TOKENSxD, with fixed head counts (ops_qk_norm.Q_HEADS,
KV_HEADS). A group name (GROUPS) selects several ops: ``--op qk_norm`` both qk_norm ops,
``--op qk_norm_fused`` both fused ones.

A new op is one more Op here (cases.py: what an Op, a Case and an Impl are), with its inputs
and reference (prepare), the steps to time (impls), its outputs and its bytes, written in
ops_layernorm.py, ops_rmsnorm.py or ops_qk_norm.py.
"""
from __future__ import annotations

from jax_lnbwd import LAYERNORM, RMSNORM

from . import ops_layernorm as ln
from . import ops_qk_norm as qk
from . import ops_rmsnorm as rms
from .cases import Op

# Every op's defaults end with small-C rows: head_dim-sized norms (QK-norm: rows = tokens x
# heads) and small models, C 64, 128 and 256 at 64 MB a tensor in bf16.
SMALL_C_GPU_SHAPES = "524288x64,262144x128,131072x256"
FORWARD_GPU_SHAPES = "16384x1600,8192x8192,16384x1024,4096x16384,8192x768," + SMALL_C_GPU_SHAPES
BACKWARD_GPU_SHAPES = ("8192x1600,16384x768,16384x1600,16384x2048,16384x4096,8192x8192,4096x16384,1024x768,"
                       + SMALL_C_GPU_SHAPES)
# Llama-sized rows (d 2048 to 16384); every step moves 134-805 MB, past the H200's L2.
RMS_GPU_SHAPES = "16384x2048,16384x4096,8192x8192,4096x16384," + SMALL_C_GPU_SHAPES
# QK-norm: TOKENSxD (ops_qk_norm: 32 q and 8 k heads of D), batch 8 x 2048 tokens, D 64 to 256.
QK_GPU_SHAPES = "16384x64,16384x128,16384x256"
QK_PEERS = ("default", "two-calls", "xla", "torch", "liger")


OPS = {op.name: op for op in (
    Op("layernorm_bwd", "backward", "layernorm backward", ("dx", "dweight", "dbias"),
       BACKWARD_GPU_SHAPES, ("default", "xla", "autodiff", "torch", "liger", "pallas"), ln.prepare_backward,
       ln.backward_impls, norm=LAYERNORM, kernels=True),
    Op("layernorm_fwd", "forward", "layernorm forward", ("y", "mean", "rstd"),
       FORWARD_GPU_SHAPES, ("default", "xla", "torch", "liger", "pallas"), ln.prepare_forward, ln.forward_impls,
       norm=LAYERNORM),
    Op("add_layernorm_fwd", "add_forward", "add + layernorm forward", ("y", "s", "mean", "rstd"),
       FORWARD_GPU_SHAPES, ("default", "xla", "ours-unfus"), ln.prepare_add_forward, ln.add_forward_impls,
       norm=LAYERNORM, carry=2),
    Op("rmsnorm_bwd", "rms_backward", "rmsnorm backward", ("dx", "dweight"), RMS_GPU_SHAPES,
       ("default", "xla", "autodiff", "torch", "liger", "pallas"), rms.prepare_rms_backward, rms.rms_backward_impls,
       norm=RMSNORM, kernels=True),
    Op("rmsnorm_fwd", "rms_forward", "rmsnorm forward", ("y", "rstd"), RMS_GPU_SHAPES,
       ("default", "xla", "torch", "liger", "pallas"), rms.prepare_rms_forward, rms.rms_forward_impls,
       norm=RMSNORM),
    Op("add_rmsnorm_fwd", "add_rms_forward", "add + rmsnorm forward", ("y", "s", "rstd"),
       RMS_GPU_SHAPES, ("default", "xla", "ours-unfus"), rms.prepare_add_rms_forward, rms.add_rms_forward_impls,
       norm=RMSNORM, carry=2),
    # carry=2: k_out (dk) is the next step's k (dk), as q_out (dq) is its q (dq): ops_qk_norm.py
    Op("qk_norm_fwd", "qk_forward", qk.title("qk_norm forward"), ("q", "k"), QK_GPU_SHAPES, QK_PEERS,
       qk.prepare_forward, qk.forward_impls, norm=RMSNORM, carry=2),
    Op("qk_norm_bwd", "qk_backward", qk.title("qk_norm backward"), ("dq", "dk", "dq_weight", "dk_weight"),
       QK_GPU_SHAPES, QK_PEERS, qk.prepare_backward, qk.backward_impls, norm=RMSNORM, carry=2),
    Op("qk_norm_fused_fwd", "qk_fused_forward", qk.title("qk_norm_fused forward"), ("qkv",), QK_GPU_SHAPES,
       QK_PEERS, qk.prepare_fused_forward, qk.fused_forward_impls, norm=RMSNORM),
    Op("qk_norm_fused_bwd", "qk_fused_backward", qk.title("qk_norm_fused backward"),
       ("dqkv", "dq_weight", "dk_weight"), QK_GPU_SHAPES, QK_PEERS, qk.prepare_fused_backward,
       qk.fused_backward_impls, norm=RMSNORM),
)}
ALIASES = {op.alias: name for name, op in OPS.items()}
# Names that select several ops: a public function's forward and backward.
GROUPS = {"qk_norm": ("qk_norm_fwd", "qk_norm_bwd"), "qk_norm_fused": ("qk_norm_fused_fwd", "qk_norm_fused_bwd")}


def resolve(names: list[str]) -> list[Op]:
    """The ops of --op's names, aliases and groups (``all``: every op), in OPS order; KeyError
    names the first unknown one."""
    if names == ["all"]:
        return list(OPS.values())
    wanted = set()
    for n in names:
        members = GROUPS.get(n) or (ALIASES.get(n, n),)
        if any(m not in OPS for m in members):
            raise KeyError(n)
        wanted.update(members)
    return [op for name, op in OPS.items() if name in wanted]
