#!/usr/bin/env bash
# Every GPU test, the decode-step profile (fusion on), and the kernel benchmark with the
# packaged table, paths timed round-robin (2 GPUs).
#   bash benchmarks/gpu/verify_suite.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 280 python -m pytest tests/gpu -q -s -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"
grep -E "passed|failed|FAILED|XPASS|xfail" "$OUT/gpu-tests.log" | tail -15
timeout 120 python -m engine.bench_one_batch --model-path llama3-8b --tp-size 2 --dtype bfloat16 --fusion on \
  --batch-size 1 32 128 --input-len 512 --output-len 4 --repeats 1 --profile > "$OUT/profile.log" 2>&1
echo "profile rc=$?"; grep -E "^\[profile|^ +[0-9.]+ us" "$OUT/profile.log" | head -80
timeout 150 torchrun --nproc_per_node=2 benchmarks/kernels/benchmark_fused_collective.py --hidden-dim 1024 4096 8192 \
  --seq-lens 1 4 16 64 128 256 512 1024 2048 4096 --no-quant --residual-only --trials 20 \
  --output-file "$OUT/fused_collective_tp2_interleaved.md" --json-file "$OUT/fused_collective_tp2_interleaved.json" \
  > "$OUT/bench_interleaved.log" 2>&1; echo "bench rc=$?"
