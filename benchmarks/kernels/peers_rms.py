"""The torch and Liger peers of rmsnorm_fwd and rmsnorm_bwd (CUDA only; peers.py times them).

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


def step(op: str, impl: str, x, w, dy=None):
    """(step, state0) for op's torch or Liger entry on CUDA tensors (peers.torch_step)."""
    import torch
    import torch.nn.functional as F

    C = x.shape[-1]
    norm = (lambda x, w: F.rms_norm(x, [C], w, EPS)) if impl == "torch" else _liger
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
