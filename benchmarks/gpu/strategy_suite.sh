#!/usr/bin/env bash
# Strategy evidence (2 GPUs): the strategy / lifecycle / model GPU tests, a measured strategy
# table (python -m fusion.tune), the kernel benchmark with that table, and the default server.
#   bash benchmarks/gpu/strategy_suite.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 150 python -m pytest tests/gpu/test_strategies.py tests/gpu/test_flashinfer_lifecycle.py \
  tests/gpu/test_model_fusion.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/strategy-tests.log" \
  | grep -E "passed|failed|FAILED|/[0-9]+: |fp8:|fused vs unfused" | tail -30
timeout 90 torchrun --nproc_per_node=2 -m fusion.tune --hidden 4096 --max-tokens 4096 --trials 5 \
  --output "$OUT/fusion_table_h200_tp2.json" > "$OUT/tune.log" 2>&1; echo "tune rc=$?"; grep tokens "$OUT/tune.log" | tail -19
timeout 60 torchrun --nproc_per_node=2 benchmarks/kernels/benchmark_fused_collective.py --hidden-dim 4096 \
  --seq-lens 1 128 1024 4096 --no-quant --allreduce-fusion-table "$OUT/fusion_table_h200_tp2.json" \
  --output-file "$OUT/fused_collective_tp2_table.md" > "$OUT/bench_table.log" 2>&1; echo "bench rc=$?"
python -m engine.launch_server --port 31500 > "$OUT/default_server.log" 2>&1 &
pid=$!
for _ in $(seq 1 90); do curl -sf localhost:31500/health > /dev/null && break; sleep 1; done
curl -s localhost:31500/v1/completions -H 'content-type: application/json' \
  -d '{"prompt": "Hello", "max_tokens": 8, "temperature": 0}' | tee "$OUT/default_server_completion.json"; echo
kill -TERM $pid; wait $pid; echo "default server exit code $?"
