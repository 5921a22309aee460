#!/usr/bin/env bash
# Set up a virtual environment with fp4-dispatch and run the main job: show what is loaded,
# self-check every backend that can run here, explain dispatch on a simulated Rubin (sm107)
# part, and run a GEMM through Dispatcher().gemm. Works on a machine with no GPU.
# The package is installed from a clean export of the tree (scripts/export.sh), so a stale
# build/ or *.egg-info in the checkout never ships.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
src=$(mktemp -d -t fp4-dispatch-demo.XXXXXX)
trap 'rm -rf "$src"' EXIT
bash "$root/scripts/export.sh" "$src"
venv=${FP4_VENV:-$root/.venv}
torch_spec=${FP4_TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "$torch_spec"
# The cute extra (NVIDIA CuTe-DSL) lets the Blackwell/Rubin families rank and compile here.
extras=${FP4_EXTRAS-cute}
"$py" -m pip install -q "$src${extras:+[$extras]}"
fp4="$venv/bin/fp4-dispatch"

echo "\$ fp4-dispatch list-backends"
"$fp4" list-backends
echo
echo "\$ fp4-dispatch doctor"
"$fp4" doctor
echo
echo "\$ fp4-dispatch explain 32768 4096 8192 --device sm107 --budget 16"
"$fp4" explain 32768 4096 8192 --device sm107 --budget 16
echo
echo "\$ python examples/quickstart.py"
"$py" "$root/examples/quickstart.py"
