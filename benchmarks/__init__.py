"""jax_lnbwd's benchmarks, run from a checkout (they are not part of the installed package).

    pip install -e ".[bench]"                 # matplotlib, flax, optax, tqdm
    python -m benchmarks.kernels --help       # the layernorm backward against its peers
    python -m benchmarks.e2e --help           # whole training steps, Flax's LayerNorm against ours

Each writes a text table to stdout and, with ``--out DIR``, the table, a JSON file with every
row and the run's metadata, and a PNG.
"""
