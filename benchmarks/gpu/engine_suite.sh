#!/usr/bin/env bash
# The engine's GPU evidence (2 GPUs): bench_one_batch on llama3-8b shapes (dummy weights, bf16,
# TP2) with fusion off, on (the packaged strategy table) and builtin (thresholds, no table) in
# one run, then a profile of the decode step (kernel time per step, fusion on).
#   bash benchmarks/gpu/engine_suite.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 420 python -m engine.bench_one_batch --model-path llama3-8b --tp-size 2 --dtype bfloat16 \
  --fusion off on builtin --allreduce-fusion-max-tokens 4096 \
  --batch-size 1 8 32 64 128 256 --input-len 512 --output-len 32 --repeats 2 \
  --json-file "$OUT/bench_one_batch_llama3_8b_tp2.jsonl" 2>&1 | tee "$OUT/bench_one_batch.log" \
  | grep -v "^INFO\|Warning\|warn" | tail -9
timeout 150 python -m engine.bench_one_batch --model-path llama3-8b --tp-size 2 --dtype bfloat16 --fusion on \
  --batch-size 1 32 128 --input-len 512 --output-len 4 --repeats 1 --profile > "$OUT/profile.log" 2>&1
echo "profile rc=$?"; grep -E "^\[profile|^ +[0-9.]+ us" "$OUT/profile.log" | head -80
