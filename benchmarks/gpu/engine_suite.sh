#!/usr/bin/env bash
# The engine's GPU evidence in one run (2 GPUs): bench_one_batch on llama3-8b shapes (dummy
# weights, bf16, TP2) with fusion off and on, then the model / attention / elementwise GPU tests.
#   bash benchmarks/gpu/engine_suite.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 200 python -m engine.bench_one_batch --model-path llama3-8b --tp-size 2 --dtype bfloat16 \
  --batch-size 1 8 32 64 128 256 --input-len 512 --output-len 32 --repeats 2 \
  --json-file "$OUT/bench_one_batch_llama3_8b_tp2.jsonl" 2>&1 | tee "$OUT/bench_one_batch.log" | grep -v "^INFO\|Warning\|warn" | tail -9
timeout 200 python -m pytest tests/gpu/test_model_fusion.py tests/gpu/test_triton_elementwise.py \
  tests/gpu/test_triton_decode_attention.py tests/gpu/test_flashinfer_lifecycle.py -q -s -p no:cacheprovider 2>&1 \
  | tee "$OUT/engine-gpu-tests.log" | grep -E "passed|failed|FAILED|vs_fp32|vs_unfused|us|speedup|^ *[0-9]+ " | tail -40
