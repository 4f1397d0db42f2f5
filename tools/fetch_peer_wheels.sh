#!/usr/bin/env bash
# Downloads the bench peers that the GPU machine lacks into .carry/wheels, for a machine with
# no network: run it here (where pip reaches PyPI), then name `.carry` in the device call's carry
# list; tools/gpu_check.sh's build stage installs what it finds there (pip --no-deps).
#   tools/fetch_peer_wheels.sh [PYTHON_VERSION]    (default 3.12, the GPU machine's)
# Only the peers themselves: their needs (torch, triton) are on the GPU machine already.
# .carry/ must be ignored by git (echo /.carry/ >> .git/info/exclude) so it travels only when named.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-3.12}
PEERS=("liger-kernel")   # benchmarks/kernels/peers.py and peers_rms.py: Liger's LayerNorm and RMSNorm
mkdir -p .carry/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .carry/wheels "${PEERS[@]}"
ls -l .carry/wheels
