"""The torch and Liger peers of the kernel bench: CUDA only, imported lazily, timed like the
JAX entries (the same k-step chain, captured in a CUDA graph, between two CUDA events); which
peers run here. layernorm_bwd's and layernorm_fwd's are here, rmsnorm's and the qk ops' in
peers_rms.py, the Pallas peer in pallas.py."""
from __future__ import annotations

import statistics

import jax.numpy as jnp
import numpy as np

from . import pallas
from .timing import EPS, calls_per_run


def to_torch(a):
    """A JAX array as a CUDA tensor of its dtype, via float32/64 numpy: exact for every dtype
    here, and needs no DLPack."""
    import torch
    acc = np.float64 if a.dtype == jnp.float64 else np.float32
    return torch.from_numpy(np.array(a.astype(acc))).to("cuda").to(getattr(torch, str(a.dtype)))


def torch_step(op: str, impl: str, *inputs):
    """(step, state0) for a torch-side peer of op; call(step, state) -> op's outputs on CUDA
    tensors (a prefix of them: the statistics only where the peer's API returns them), state0 the
    chained input (dy for a backward, x for a forward; a tuple for the separate qk ops, whose q
    and k are both chained). inputs: cases.Case.torch_inputs."""
    if op == "layernorm_bwd":
        return _layernorm_backward(impl, *inputs)
    if op == "layernorm_fwd":
        return _layernorm_forward(impl, *inputs)
    from . import peers_rms
    if op.startswith("qk_norm"):
        return peers_rms.qk_step(op, impl, *(to_torch(a) for a in inputs))
    return peers_rms.step(op, impl, *(to_torch(a) for a in inputs))


def _layernorm_backward(impl: str, x, w, b, dy):
    """Each peer gets mean/rstd from its own forward, in the shape and dtype it expects (for
    torch: (rows, 1) float32, float64 for float64), from the same x, w, b and eps."""
    import torch

    tx, tw, tb, tdy = (to_torch(a) for a in (x, w, b, dy))
    C = tx.shape[-1]
    if impl == "torch":
        _, mean, rstd = torch.ops.aten.native_layer_norm(tx, [C], tw, tb, EPS)
        def step(d):
            return torch.ops.aten.native_layer_norm_backward(d, tx, [C], mean, rstd, tw, tb,
                                                             [True, True, True])
    else:
        from liger_kernel.ops.layer_norm import layer_norm_backward, layer_norm_forward
        fwd = layer_norm_forward(tx, tw, tb, EPS)
        mean, rstd = fwd[2], fwd[3]
        def step(d):
            return tuple(layer_norm_backward(d, tx, tw, tb, mean, rstd))[:3]
    return step, tdy


def _layernorm_forward(impl: str, x, w, b):
    """y, with the statistics each peer's forward writes beside it (torch: mean and rstd of
    shape (rows, 1); Liger: mean and rstd of shape (rows,)): the bytes ours moves. Only y is
    compared with the reference (the statistics' shapes differ)."""
    import torch

    tx, tw, tb = (to_torch(a) for a in (x, w, b))
    C = tx.shape[-1]
    if impl == "torch":
        norm = lambda x: torch.ops.aten.native_layer_norm(x, [C], tw, tb, EPS)  # noqa: E731
    else:
        from liger_kernel.ops.layer_norm import layer_norm_forward
        norm = lambda x: layer_norm_forward(x, tw, tb, EPS)  # noqa: E731

    def step(x):
        with torch.no_grad():
            return norm(x)[:1]  # y first in both
    return step, tx


def call(step, d):
    """step's outputs on the state d: a tuple state is several chained inputs (the separate qk
    ops' q and k), each one of step's arguments."""
    return step(*d) if isinstance(d, tuple) else step(d)


def torch_chain(step, d0, k: int):
    """A function that runs k steps of `step` from the state d0 and returns the last state: each
    step's state is the step before's first output, or its first n for a tuple of n (as
    timing.chained's carry)."""
    def chain():
        d = d0
        for _ in range(k):
            outs = call(step, d)
            d = tuple(outs[:len(d0)]) if isinstance(d0, tuple) else outs[0]
        return d
    return chain


def time_torch(step, d0, k: int, reps: int, min_run_s: float, trace=None) -> tuple[float, bool]:
    """(median seconds per step, whether a CUDA graph was used): the JAX method with events, on
    torch_chain's k steps. trace: as timing.time_jax's, with one replay of the same graph."""
    import torch

    chain = torch_chain(step, d0, k)

    chain()  # warm-up (Triton compiles here)
    replay, graphed = chain, False
    try:  # a CUDA graph of the chain: like XLA's, free of per-launch host cost
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's capture-unsafe CUDA calls are refused. With torch's
        # default (global), a call from one of JAX's threads during the capture failed, and
        # left JAX's stream in an error state for the rest of the run.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            chain()
        replay, graphed = graph.replay, True
    except Exception:
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(n: int) -> float:
        start.record()
        for _ in range(n):
            replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    run(1)
    n = calls_per_run(run, min_run_s)
    sec = statistics.median(run(n) / (n * k) for _ in range(reps))
    if trace is not None:
        trace(lambda: (replay(), torch.cuda.synchronize()))
    return sec, graphed


def available_peers(on_gpu: bool) -> dict[str, str | None]:
    """{peer: None if usable, else why not}."""
    why = {"xla": None, "autodiff": None, "copy": None, "pallas": pallas.why_not(on_gpu)}
    if not on_gpu:
        return {**why, "torch": "JAX runs on the CPU here", "liger": "JAX runs on the CPU here"}
    try:
        import torch
        why["torch"] = None if torch.cuda.is_available() else "torch sees no CUDA GPU"
    except Exception as e:
        why["torch"] = f"torch does not import ({type(e).__name__})"
    try:
        import liger_kernel.ops.layer_norm  # noqa: F401
        why["liger"] = why["torch"]
    except Exception as e:
        why["liger"] = f"liger_kernel does not import ({type(e).__name__})"
    return why
