"""examples/llama_linen.py and examples/llama_nnx.py: each runs as written on the CPU (a few
steps, a subprocess with a timeout) and its loss goes down; the linen model's gradient calls
our RMSNorm backward once per norm (2 per block and the final one)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import jax
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

from conftest import CHECKOUT  # noqa: E402

EXAMPLES = CHECKOUT / "examples"


@pytest.mark.parametrize("script", ["llama_linen.py", "llama_nnx.py"])
def test_example_trains_on_cpu(script):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(EXAMPLES / script), "8"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=CHECKOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", out.stdout).groups())
    assert last < 0.8 * first


def test_linen_example_calls_our_rmsnorm():
    spec = importlib.util.spec_from_file_location("llama_linen", EXAMPLES / "llama_linen.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tokens = jax.numpy.zeros((2, 8), jax.numpy.int32)
    model = example.Llama()
    params = model.init(jax.random.key(0), tokens)
    hlo = jax.jit(jax.grad(lambda p: model.apply(p, tokens).sum())).lower(params).compile().as_text()
    assert hlo.count('custom_call_target="jax_lnbwd_rmsnorm_bwd_v1"') == 2 * example.LAYERS + 1
