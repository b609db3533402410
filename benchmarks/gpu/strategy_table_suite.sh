#!/usr/bin/env bash
# The measured strategy table for hidden 1024/4096/8192 (2 GPUs) and the kernel benchmark that
# checks the table's choice (arfusion_dispatch) against every single path, side by side.
#   bash benchmarks/gpu/strategy_table_suite.sh      (writes $OUT/strategy_table.json, merged
#   into a copy of fusion/tables/strategy_table.json)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 150 python -m pytest tests/gpu/test_strategies.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/strategy-tests.log" \
  | grep -E "passed|failed|FAILED|Error|/[0-9]+: " | tail -30
cp fusion/tables/strategy_table.json "$OUT/strategy_table.json"
timeout 240 torchrun --nproc_per_node=2 -m fusion.tune --hidden 1024 4096 8192 --max-tokens 4096 --trials 5 \
  --output "$OUT/strategy_table.json" > "$OUT/tune.log" 2>&1; echo "tune rc=$?"; grep tokens "$OUT/tune.log"
timeout 300 torchrun --nproc_per_node=2 benchmarks/kernels/benchmark_fused_collective.py --hidden-dim 1024 4096 8192 \
  --seq-lens 1 4 16 64 128 256 512 1024 2048 4096 --no-quant --residual-only --trials 10 \
  --allreduce-fusion-table "$OUT/strategy_table.json" --output-file "$OUT/fused_collective_tp2_table.md" \
  --json-file "$OUT/fused_collective_tp2_table.json" > "$OUT/bench_table.log" 2>&1; echo "bench rc=$?"
grep -E "^###|symm_mem_fused|flashinfer_fused_allreduce_rmsnorm_oneshot|arfusion_dispatch \||chose" "$OUT/fused_collective_tp2_table.md"
