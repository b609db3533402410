#!/usr/bin/env bash
# The fusion core's GPU evidence in one run (2 GPUs): GPU tests, then the kernel benchmark
# sweep (PDL launch, the default) and a no-quant sweep without PDL. Logs and results go to $OUT (or ./out).
#   bash benchmarks/gpu/fusion_suite.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
NPROC=${NPROC:-2}
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv | tee "$OUT/gpus.txt"
ARFUSION_GPU_WORLD="$NPROC" timeout 400 python -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -5
SEQ="1 4 16 64 128 256 512 1024 2048 4096"
timeout 300 torchrun --nproc_per_node="$NPROC" benchmarks/kernels/benchmark_fused_collective.py \
  --hidden-dim 1024 4096 8192 --seq-lens $SEQ --quant-all \
  --output-file "$OUT/fused_collective_tp$NPROC.md" --json-file "$OUT/fused_collective_tp$NPROC.json" > "$OUT/bench.log" 2>&1
echo "benchmark rc=$?"
timeout 200 torchrun --nproc_per_node="$NPROC" benchmarks/kernels/benchmark_fused_collective.py \
  --hidden-dim 1024 4096 8192 --seq-lens $SEQ --no-quant --disable-pdl \
  --output-file "$OUT/fused_collective_tp${NPROC}_nopdl.md" --json-file "$OUT/fused_collective_tp${NPROC}_nopdl.json" > "$OUT/bench_nopdl.log" 2>&1
echo "benchmark (no PDL) rc=$?"
