#!/usr/bin/env bash
# The CUDA checks in under ten minutes on one GPU: the accelerator paths against the CPU reference,
# the real-width benchmark on the GPU (1k-1M contexts: issue 14's attention core), and the CPU test
# suite of the routed experts, sparse attention and engine there. Results go to $OUT (or benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 scripts/device_check.py --device cuda | tee "$out/device-check-cuda.jsonl"
python3 benchmarks/real_width.py --device cuda --dtype bfloat16 --experts 64 --batches 1,8 --depths 0,1 \
    --contexts 1024,32768,131072,1048576 --out "$out/real-width-cuda.json"
python3 benchmarks/real_width.py --device cuda --dtype bfloat16 --experts 64 --batches 1,8 --depths 0 \
    --weights native --out "$out/real-width-native-cuda.json"
python3 -m pytest -q -x -p no:cacheprovider tests/test_moe.py tests/test_sparse_attention.py tests/test_engine.py \
    tests/test_fp8.py
