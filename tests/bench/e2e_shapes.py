"""The e2e bench's models as shapes, for the tests of tests/bench (not a test module itself):
nothing is computed or compiled. Imported as `from e2e_shapes import shapes` (pytest puts a test
module's folder on sys.path; the benchmarks package is found from the checkout, as in the tests)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.e2e import config, train, variants


def shapes(cfg, api, variant, dtype=jnp.bfloat16):
    """(params, logits, grads) of a model built with `variant`, as shapes."""
    batch = config.make_batch(cfg, dtype)
    made = {}

    def make():
        made["apply"], params = train.init(cfg, api, variants.VARIANTS[variant], dtype, batch[0], 0)
        return params
    params = jax.eval_shape(make)
    logits = jax.eval_shape(made["apply"], params, batch[0])
    grads = jax.eval_shape(jax.grad(lambda p: made["apply"](p, batch[0]).astype(jnp.float32).sum()), params)
    return params, logits, grads
