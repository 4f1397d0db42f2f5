#!/usr/bin/env bash
# Downloads the bench peers a GPU machine without network lacks, for that machine's Python, into
# a folder (default build/peer-wheels): run it where pip reaches PyPI, bring the folder to the GPU
# machine's checkout, and gpu_check.sh's build stage installs what it finds there (pip --no-deps;
# PEER_WHEELS names another folder).
#   tools/gpu/fetch_peer_wheels.sh [PYTHON_VERSION [DIR]]    (default 3.12 and build/peer-wheels)
# Only the peers themselves: their needs (torch, triton) must be on the GPU machine already.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:-3.12}
dir=${2:-build/peer-wheels}
PEERS=("liger-kernel")   # benchmarks/kernels/peers.py and peers_rms.py: Liger's LayerNorm and RMSNorm
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$dir" "${PEERS[@]}"
ls -l "$dir"
