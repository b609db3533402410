#!/usr/bin/env bash
# The fused two-shot strategy (symm_mem_fused) and a profile of the decode step (2 GPUs):
# the strategy GPU tests, the kernel benchmark at large token counts (all paths side by side),
# and bench_one_batch --profile (llama3-8b dummy, TP2, fusion on) for the per-kernel step time.
#   bash benchmarks/gpu/fused_two_shot_suite.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 150 python -m pytest tests/gpu/test_strategies.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/strategy-tests.log" \
  | grep -E "passed|failed|FAILED|Error|/[0-9]+: " | tail -30
timeout 120 torchrun --nproc_per_node=2 benchmarks/kernels/benchmark_fused_collective.py --hidden-dim 4096 \
  --seq-lens 128 1024 2048 4096 --no-quant --trials 10 \
  --output-file "$OUT/fused_two_shot_h4096.md" > "$OUT/bench_two_shot.log" 2>&1; echo "bench rc=$?"
grep -E "^\|" "$OUT/fused_two_shot_h4096.md" | head -60
timeout 240 python -m engine.bench_one_batch --model-path llama3-8b --tp-size 2 --dtype bfloat16 --fusion on \
  --batch-size 1 32 128 --input-len 512 --output-len 8 --repeats 1 --profile \
  --json-file "$OUT/profile_llama3_8b_tp2.jsonl" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -v "^INFO\|Warning\|warn" "$OUT/profile.log" | tail -100
