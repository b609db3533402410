#!/usr/bin/env bash
# Session-3 GPU evidence (2 GPUs), in parts that fit one device call each:
#   PART=tests  bash benchmarks/gpu/overlap_suite.sh   GPU tests of the changed kernels and paths,
#                                                       then the decode-attention launch sweep
#   PART=final  bash benchmarks/gpu/overlap_suite.sh   GPU tests of the final kernels and the model,
#                                                       bench_one_batch off/on/builtin (5 repeats,
#                                                       64 tokens), the decode-step profile
#   PART=bench  bash benchmarks/gpu/overlap_suite.sh   the decode-attention GPU tests, then
#                                                       bench_one_batch (llama3-8b dummy, TP2) fusion
#                                                       off/on with the overlap schedule, then
#                                                       without it, then the decode-step profile
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
PART=${PART:-tests}
BENCH=(python -m engine.bench_one_batch --model-path llama3-8b --tp-size 2 --dtype bfloat16
       --allreduce-fusion-max-tokens 4096 --input-len 512 --output-len 32)
if [ "$PART" = tests ]; then
  timeout 300 python -m pytest tests/gpu/test_triton_decode_attention.py tests/gpu/test_cuda_graph_decode.py \
    tests/gpu/test_strategies.py -q -s -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"
  grep -E "passed|failed|FAILED|Error|error" "$OUT/gpu-tests.log" | tail -25
  timeout 240 python -m benchmarks.kernels.sweep_decode_attention --batch 1 8 32 128 256 --context 544 \
    --json-file "$OUT/sweep_decode_attention.json" > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
  grep -v "^  skip" "$OUT/sweep.log" | tail -12
fi
if [ "$PART" = bench ]; then
  timeout 120 python -m pytest tests/gpu/test_triton_decode_attention.py -q -p no:cacheprovider \
    > "$OUT/attention-tests.log" 2>&1; echo "attention tests rc=$?"; tail -1 "$OUT/attention-tests.log"
  timeout 300 "${BENCH[@]}" --fusion off on --batch-size 1 8 32 64 128 256 --repeats 3 \
    --json-file "$OUT/bench_overlap.jsonl" > "$OUT/bench_overlap.log" 2>&1; echo "bench overlap rc=$?"
  grep -v "^INFO\|Warning\|warn" "$OUT/bench_overlap.log" | tail -9
  timeout 150 "${BENCH[@]}" --fusion off on --batch-size 1 32 128 --repeats 2 --disable-overlap-schedule \
    --json-file "$OUT/bench_no_overlap.jsonl" > "$OUT/bench_no_overlap.log" 2>&1; echo "bench no-overlap rc=$?"
  grep -v "^INFO\|Warning\|warn" "$OUT/bench_no_overlap.log" | tail -6
  timeout 120 "${BENCH[@]}" --fusion on --batch-size 1 32 128 --output-len 4 --repeats 1 --profile \
    > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
  grep -E "^\[profile|^ +[0-9.]+ us" "$OUT/profile.log" | head -60
fi
if [ "$PART" = final ]; then
  timeout 240 python -m pytest tests/gpu/test_triton_decode_attention.py tests/gpu/test_cuda_graph_decode.py \
    tests/gpu/test_model_fusion.py -q -s -p no:cacheprovider > "$OUT/gpu-tests-final.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "passed|failed|FAILED|vs_fp32|vs_unfused" "$OUT/gpu-tests-final.log" | tail -8
  timeout 300 "${BENCH[@]}" --fusion off on builtin --batch-size 1 8 32 64 128 256 --repeats 5 --output-len 64 \
    --json-file "$OUT/bench_final.jsonl" > "$OUT/bench_final.log" 2>&1; echo "bench rc=$?"
  grep -v "^INFO\|Warning\|warn" "$OUT/bench_final.log" | tail -9
  timeout 100 "${BENCH[@]}" --fusion on --batch-size 1 32 128 --output-len 4 --repeats 1 --profile \
    > "$OUT/profile_final.log" 2>&1; echo "profile rc=$?"
  grep -E "^\[profile|^ +[0-9.]+ us" "$OUT/profile_final.log" | head -45
fi
