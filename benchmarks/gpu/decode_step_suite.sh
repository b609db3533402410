#!/usr/bin/env bash
# Session-4 GPU evidence for the decode step (issue 5), in parts that fit one device call each
# (PART=<part> bash benchmarks/gpu/decode_step_suite.sh):
#   probe    decode-attention launch grid at batch 32, 64, 128 (C=544), and the decode-step
#            profile with fusion off and on
#   order    why every other kernel is slower with fusion on: the settings in both orders, with
#            and without PDL, GPU clocks logged meanwhile
#   power    GPU tests of the sharded greedy head; long decodes (1024 steps) fusion off/on with
#            clocks and power sampled every 100 ms; the same with torch TunableOp choosing the GEMMs
#   midgrid  decode-attention splits x block at batch 16-64, short and long context
#   final    every GPU test, then bench_one_batch off/on/builtin (5 repeats, 64 tokens)
#   profile  the decode-step profile, fusion off/on
#   context  the fusion gain against the prompt length (input 128 and 2048; 512 is PART=final)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
PART=${PART:-probe}
BENCH=(python -m engine.bench_one_batch --model-path llama3-8b --tp-size 2 --dtype bfloat16
       --allreduce-fusion-max-tokens 4096 --input-len 512)
top5() {  # the five fastest points of each shape of a sweep JSON
  python - "$1" <<'PY'
import json, sys
for shape in json.load(open(sys.argv[1])):
    pts = sorted(shape["points"], key=lambda p: p["us"])
    default = next(p for p in shape["points"] if p.get("default"))
    print(f"B={shape['batch']} C={shape['context']} default {default['us']:.2f} us (splits {default['splits']})")
    for p in pts[:5]:
        print(f"   {p['us']:7.2f}  splits={p['splits']} block={p['block']} warps={p['warps']} stages={p['stages']}")
PY
}
clock_log() {  # clock_log FILE MS: sample clocks, power and throttle reasons in the background
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms "$2" > "$1" 2>&1 &
}
print_bench() {  # TPOT and prefill per (setting, batch) of a bench_one_batch JSONL
  python - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    for r in json.loads(line)["results"]:
        print(f"  {r['fusion']:>8} bs={r['batch_size']:>4} TPOT {r['tpot_ms']:.3f} ms prefill {r['prefill_ms']:.1f} ms")
PY
}
if [ "$PART" = probe ]; then
  timeout 240 python -m benchmarks.kernels.sweep_decode_attention --grid --batch 32 --context 544 \
    --splits 1 2 3 4 --json-file "$OUT/grid_b32.json" > "$OUT/grid_b32.log" 2>&1; echo "grid b32 rc=$?"
  top5 "$OUT/grid_b32.json"
  timeout 150 python -m benchmarks.kernels.sweep_decode_attention --grid --batch 64 128 --context 544 \
    --splits 1 2 --json-file "$OUT/grid_b128.json" > "$OUT/grid_b128.log" 2>&1; echo "grid b64/128 rc=$?"
  top5 "$OUT/grid_b128.json"
  timeout 200 "${BENCH[@]}" --fusion off on --batch-size 32 128 --output-len 4 --repeats 1 --profile \
    > "$OUT/profile_off_on.log" 2>&1; echo "profile rc=$?"
  grep -E "^\[profile|^ +[0-9.]+ us" "$OUT/profile_off_on.log" | head -100
fi
if [ "$PART" = midgrid ]; then
  timeout 300 python -m benchmarks.kernels.sweep_decode_attention --grid --batch 16 32 48 64 --context 544 4096 \
    --splits 1 2 4 8 --blocks 64 128 --warps 4 --stages 3 --json-file "$OUT/midgrid.json" > "$OUT/midgrid.log" 2>&1
  echo "midgrid rc=$?"; top5 "$OUT/midgrid.json"
fi
if [ "$PART" = power ]; then
  timeout 200 python -m pytest tests/gpu/test_cuda_graph_decode.py -q -s -p no:cacheprovider \
    > "$OUT/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"; grep -E "passed|failed|greedy" "$OUT/gpu-tests.log" | tail -4
  clock_log "$OUT/clocks_long.csv" 100; SMI=$!
  timeout 240 "${BENCH[@]}" --fusion off on --batch-size 32 128 --output-len 1024 --repeats 1 \
    --json-file "$OUT/bench_long.jsonl" > "$OUT/bench_long.log" 2>&1; echo "bench long rc=$?"
  kill $SMI; print_bench "$OUT/bench_long.jsonl"
  python -m benchmarks.clock_phases "$OUT/clocks_long.csv"
  timeout 150 "${BENCH[@]}" --fusion off on --batch-size 1 32 128 --output-len 64 --repeats 3 \
    --json-file "$OUT/bench_greedy_head.jsonl" > "$OUT/bench_greedy_head.log" 2>&1; echo "bench rc=$?"
  print_bench "$OUT/bench_greedy_head.jsonl"
  PYTORCH_TUNABLEOP_ENABLED=1 PYTORCH_TUNABLEOP_TUNING=1 PYTORCH_TUNABLEOP_MAX_TUNING_DURATION_MS=30 \
    PYTORCH_TUNABLEOP_FILENAME="$OUT/tunableop.csv" timeout 200 "${BENCH[@]}" --fusion off on --batch-size 32 128 \
    --output-len 64 --repeats 3 --json-file "$OUT/bench_tunableop.jsonl" > "$OUT/bench_tunableop.log" 2>&1
  echo "bench tunableop rc=$?"; print_bench "$OUT/bench_tunableop.jsonl"; grep -iE "error|tunable" "$OUT/bench_tunableop.log" | head -5
fi
if [ "$PART" = final ]; then
  timeout 330 python -m pytest tests/gpu -q -p no:cacheprovider > "$OUT/gpu-tests-all.log" 2>&1
  echo "gpu tests rc=$?"; tail -1 "$OUT/gpu-tests-all.log"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-all.log" | head
  timeout 250 "${BENCH[@]}" --fusion off on builtin --batch-size 1 8 32 64 128 256 --repeats 5 --output-len 64 \
    --json-file "$OUT/bench_final.jsonl" > "$OUT/bench_final.log" 2>&1; echo "bench rc=$?"
  grep -v "^INFO\|Warning\|warn" "$OUT/bench_final.log" | tail -9
fi
if [ "$PART" = profile ]; then
  timeout 150 "${BENCH[@]}" --fusion off on --batch-size 1 32 128 --output-len 4 --repeats 1 --profile \
    > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
  grep -E "^\[profile|^ +[0-9.]+ us" "$OUT/profile.log" | head -120
fi
if [ "$PART" = context ]; then
  for len in 128 2048; do
    timeout 240 "${BENCH[@]}" --input-len $len --output-len 64 --fusion off on --batch-size 32 128 --repeats 3 --json-file "$OUT/bench_input$len.jsonl" > "$OUT/bench_input$len.log" 2>&1
    echo "input $len rc=$?"; grep -v "^INFO\|Warning\|warn" "$OUT/bench_input$len.log" | tail -3
  done
fi
if [ "$PART" = order ]; then
  clock_log "$OUT/clocks.csv" 250; SMI=$!
  for args in "--fusion on off on" "--fusion off on --allreduce-fusion-disable-pdl"; do
    name=$(echo "$args" | tr -d ' -'); echo "== $args"
    timeout 200 "${BENCH[@]}" $args --batch-size 32 128 --output-len 32 --repeats 3 \
      --json-file "$OUT/bench_$name.jsonl" > "$OUT/bench_$name.log" 2>&1; echo "bench rc=$?"
    print_bench "$OUT/bench_$name.jsonl"
  done
  kill $SMI
  python -m benchmarks.clock_phases "$OUT/clocks.csv" --window-s 1
fi
