#!/usr/bin/env bash
# The H200 runs of this project in as few device calls as possible (device time is scarce).
# Usage on the device machine, from the repository root, with .whl/ carried (pydantic & co
# for cp312 plus the fp4_dispatch wheel built from this tree):
#   bash benchmarks/h200_batch.sh serving     # graph check, unpack correctness, hopper table
#   bash benchmarks/h200_batch.sh selection   # tuned/heuristic pick vs exhaustive
#   bash benchmarks/h200_batch.sh heldout     # the same on other shapes (later fitted on)
#   bash benchmarks/h200_batch.sh heldout2    # a third shape set, never fitted on
#   bash benchmarks/h200_batch.sh hotpath     # GPU tests, fused quantize, capture, serving table
#   bash benchmarks/h200_batch.sh w4a16       # W4A16 / W4A4 kernels vs bf16 and FP8
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 FP4_DISPATCH_PROGRESS=0
export FP4_DISPATCH_CACHE=/tmp/fp4-tuning.json
OUT=${OUT:-out}
mkdir -p "$OUT"
cd /tmp  # import the installed package, never the source folders
src=$OLDPWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
case "${1:-}" in
  serving)
    timeout 150 python3 "$src/benchmarks/cuda_graph_check.py" 2>&1 | tee "$OUT/cuda_graph.log"
    timeout 120 python3 "$src/benchmarks/hopper_correctness.py" --backends triton-sm90-unpack \
      --out "$OUT" 2>&1 | tail -25
    timeout 280 python3 "$src/benchmarks/bench_hopper.py" --out "$OUT" 2>&1 | tee "$OUT/bench_hopper.log" | tail -40
    ;;
  selection)  # selection [time-limit] [--shapes M,N,K ...]
    limit=${2:-240}
    shift $(( $# > 1 ? 2 : 1 ))
    timeout 330 python3 "$src/benchmarks/bench_selection.py" --time-limit "$limit" \
      --out "$OUT" "$@" 2>&1 | tee "$OUT/selection.log" | tail -40
    ;;
  heldout|heldout2)  # the cost model on shapes it was not fitted on + torch.compile check
    timeout 120 python3 "$src/benchmarks/cuda_graph_check.py" --no-tune --no-conformance \
      2>&1 | tee "$OUT/cuda_graph.log" | grep -E "PASS|FAIL|SKIP|us"
    shapes=""
    if [ "$1" = heldout ]; then nks="4096,4096 14336,4096 4096,14336"; ms="1 8 32 64 256 2048"
    else nks="6144,4096 4096,11008 11008,4096"; ms="1 4 16 48 96 512"; fi
    for nk in $nks; do
      for m in $ms; do shapes="$shapes $m,$nk"; done
    done
    # shellcheck disable=SC2086
    timeout 300 python3 "$src/benchmarks/bench_selection.py" --time-limit 200 \
      --out "$OUT" --shapes $shapes 2>&1 | tee "$OUT/selection.log" | tail -32
    ;;
  hotpath)
    cp -r "$src/tests" /tmp/fp4-tests
    timeout 150 python3 -m pytest /tmp/fp4-tests/test_quantize_kernel.py \
      /tmp/fp4-tests/test_nvfp4.py /tmp/fp4-tests/test_gemm_direct.py \
      /tmp/fp4-tests/test_gemm_w4a16.py -m gpu -q -p no:cacheprovider 2>&1 | tail -15
    timeout 120 python3 "$src/benchmarks/bench_quantize.py" 2>&1 | tee "$OUT/quantize.log" | tail -25
    timeout 150 python3 "$src/benchmarks/cuda_graph_check.py" --no-tune 2>&1 \
      | tee "$OUT/cuda_graph.log" | grep -E "PASS|FAIL|SKIP"
    timeout 200 python3 "$src/benchmarks/bench_serving.py" --out "$OUT" 2>&1 \
      | tee "$OUT/serving.log" | tail -16
    ;;
  w4a16)
    timeout 300 python3 "$src/benchmarks/bench_w4a16.py" 2>&1 | tee "$OUT/w4a16.log" | tail -50
    ;;
  *) echo "usage: $0 serving|selection|heldout|heldout2|hotpath|w4a16" >&2; exit 2 ;;
esac
