"""The torch and Liger peers of rmsnorm_fwd and rmsnorm_bwd, and of the qk ops (qk_step: the
same norms on q and on k); CUDA only, peers.py times them.

  torch  torch.nn.functional.rms_norm; the backward by autograd through it
  liger  liger_kernel.ops.rms_norm.LigerRMSNormFunction, the autograd Function of Liger's
         RMSNorm (its forward and backward kernels); casting_mode "llama" (rstd in fp32, the
         normalized x rounded to x's dtype before the weight), not in place

Neither API hands a caller its backward given the saved statistics, so each backward runs its
own forward once, outside the timed chain, and every step is torch.autograd.grad of that graph
(retain_graph) with the chained dy: the backward kernels alone, as the JAX entries are timed.
Liger's forward/backward helpers changed signatures across releases; its Function keeps
(X, W, eps, offset, casting_mode, in_place, ...) in that order, so that is what is called.
"""
from __future__ import annotations

import inspect

from .timing import EPS


def _liger(x, w):
    """Liger's RMSNorm of x, with offset 0, casting_mode "llama" and in_place False where the
    installed release has those arguments."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    names = list(inspect.signature(LigerRMSNormFunction.forward).parameters)[1:]  # after ctx
    wanted = {"eps": EPS, "offset": 0.0, "casting_mode": "llama", "in_place": False}
    args = [x, w]
    for name in names[2:]:
        if name not in wanted:
            break  # later arguments keep their defaults
        args.append(wanted[name])
    return LigerRMSNormFunction.apply(*args)


def _norm(impl: str, C: int):
    """The entry's rmsnorm of rows of C: norm(x, w)."""
    import torch.nn.functional as F
    return (lambda x, w: F.rms_norm(x, [C], w, EPS)) if impl == "torch" else _liger


def step(op: str, impl: str, x, w, dy=None):
    """(step, state0) for op's torch or Liger entry on CUDA tensors (peers.torch_step)."""
    import torch

    norm = _norm(impl, x.shape[-1])
    if op == "rmsnorm_fwd":
        def forward(x):
            with torch.no_grad():
                return (norm(x, w),)
        return forward, x
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = norm(xg, wg)

    def backward(d):
        return torch.autograd.grad(y, (xg, wg), d, retain_graph=True)
    return backward, dy


def qk_step(op: str, impl: str, *tensors):
    """(step, state0) for a qk op's torch or Liger entry (ops_qk_norm.py): the norm applied to q
    and to k viewed as [tokens * heads, D], one call each; the fused form slices q and k out of
    qkv and concatenates the results with v. tensors: the Case's torch_inputs, as CUDA tensors.
    The backward, as step()'s: autograd of one forward graph, retained. The separate form's state
    is the pair (q, k), or (dq, dk): both are chained (peers.time_torch), so that k is read fresh
    each step as in the JAX chain (op.carry), not found again in L2."""
    import torch

    from .ops_qk_norm import KV_HEADS, Q_HEADS

    fused = op.startswith("qk_norm_fused")
    x, *rest = tensors
    D = x.shape[-1] // (Q_HEADS + 2 * KV_HEADS) if fused else x.shape[-1]
    norm = _norm(impl, D)

    def qk(q, k, wq, wk):
        return norm(q.reshape(-1, D), wq).view(q.shape), norm(k.reshape(-1, D), wk).view(k.shape)

    def forward(x, *others):   # (q, k, wq, wk) or (qkv, wq, wk) -> the op's outputs
        if not fused:
            return qk(x, *others)
        heads = x.view(*x.shape[:-1], -1, D)
        q, k = qk(heads[..., :Q_HEADS, :], heads[..., Q_HEADS:Q_HEADS + KV_HEADS, :], *others)
        return (torch.cat([q, k, heads[..., Q_HEADS + KV_HEADS:, :]], dim=-2).view(x.shape),)

    if op.endswith("_fwd"):
        if fused:
            def fwd(x):
                with torch.no_grad():
                    return forward(x, *rest)
            return fwd, x

        def fwd_qk(q, k):   # q_out and k_out are the next step's q and k, as in the JAX chain
            with torch.no_grad():
                return forward(q, k, *rest[1:])
        return fwd_qk, (x, rest[0])
    n_in = 2 if fused else 3              # the inputs besides x: (wq, wk) or (k, wq, wk)
    inputs = [a.detach().requires_grad_() for a in (x, *rest[:n_in])]
    dys = rest[n_in:]                     # (dqkv,) or (dq, dk)
    ys = forward(*inputs)

    def backward(*d):   # (dqkv,) or (dq, dk): dq and dk both chained, as in the JAX chain
        return torch.autograd.grad(ys, inputs, d, retain_graph=True)
    return backward, dys[0] if fused else tuple(dys)
