#!/usr/bin/env bash
# Session-2 confirmation run (2 GPUs): the GPU tests of the new kernels and the model, the
# kernel benchmark with the packaged table (paths timed round-robin), and bench_one_batch
# (llama3-8b dummy, TP2) with fusion off / on (table) / builtin (no table).
#   bash benchmarks/gpu/final_suite.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 200 python -m pytest tests/gpu/test_triton_extend_attention.py tests/gpu/test_greedy.py \
  tests/gpu/test_flashinfer_lifecycle.py tests/gpu/test_model_fusion.py tests/gpu/test_cuda_graph_decode.py \
  -q -s -p no:cacheprovider > "$OUT/final-gpu-tests.log" 2>&1; echo "gpu tests rc=$?"
grep -E "passed|failed|FAILED|greedy batch|speedup|^ *[0-9]+ +[0-9]+ .*x$|vs_fp32|vs_unfused" "$OUT/final-gpu-tests.log" | tail -30
timeout 240 python -m engine.bench_one_batch --model-path llama3-8b --tp-size 2 --dtype bfloat16 \
  --fusion off on builtin --allreduce-fusion-max-tokens 4096 \
  --batch-size 1 8 32 64 128 256 --input-len 512 --output-len 32 --repeats 2 \
  --json-file "$OUT/bench_one_batch_llama3_8b_tp2.jsonl" > "$OUT/bench_one_batch.log" 2>&1; echo "bench rc=$?"
grep -v "^INFO\|Warning\|warn" "$OUT/bench_one_batch.log" | tail -9
timeout 150 torchrun --nproc_per_node=2 benchmarks/kernels/benchmark_fused_collective.py --hidden-dim 1024 4096 8192 \
  --seq-lens 1 4 16 64 128 256 512 1024 2048 4096 --no-quant --residual-only --trials 20 \
  --output-file "$OUT/fused_collective_tp2_interleaved.md" --json-file "$OUT/fused_collective_tp2_interleaved.json" \
  > "$OUT/bench_interleaved.log" 2>&1; echo "kernel bench rc=$?"
