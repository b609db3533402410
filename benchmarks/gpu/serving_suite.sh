#!/usr/bin/env bash
# Serving and accuracy evidence on 2 GPUs: the server on llama3-8b shapes (dummy weights, bf16,
# TP2) with fusion off and on, bench_serving at concurrency 1/8/32/64, then the accuracy
# regression (gsm8k + mmlu, fusion off vs on). Evaluation data is read from $EVAL_DATA
# (default .evaldata: a copy of ../shared/data). Results go to $OUT (or ./out).
# SKIP_ACCURACY=1 runs the serving benchmark only. SETTINGS (default "off on"; "builtin" is fusion
# on with the built-in thresholds instead of the measured table) and CONCURRENCY (default
# "1 8 32 64") choose the serving runs.
#   bash benchmarks/gpu/serving_suite.sh
set -uo pipefail
OUT=${OUT:-out}; LOGS="$OUT/logs"; mkdir -p "$LOGS"
EVAL_DATA=${EVAL_DATA:-.evaldata}
PORT=31000
SERVER=(--model-path llama3-8b --tp-size 2 --context-length 8192 --max-running-requests 64 --cuda-graph-max-bs 64)

wait_healthy() {
  for _ in $(seq 1 240); do
    curl -sf "localhost:$PORT/health" > /dev/null && return 0
    kill -0 "$1" 2> /dev/null || return 1
    sleep 1
  done
  return 1
}

for fusion in ${SETTINGS:-off on}; do
  case $fusion in
    off) flag=() ;;
    on) flag=(--enable-flashinfer-allreduce-fusion) ;;
    builtin) flag=(--enable-flashinfer-allreduce-fusion --allreduce-fusion-table none) ;;
    *) echo "unknown setting $fusion"; exit 2 ;;
  esac
  python -m engine.launch_server "${SERVER[@]}" "${flag[@]}" --port $PORT > "$LOGS/server_$fusion.log" 2>&1 &
  pid=$!
  if wait_healthy $pid; then
    curl -s "localhost:$PORT/get_server_info" > "$LOGS/server_info_$fusion.json"
    for c in ${CONCURRENCY:-1 8 32 64}; do
      n=$(( c * 3 < 16 ? 16 : c * 3 ))
      timeout 120 python -m benchmarks.bench_serving --port $PORT --random-input-len 256 --random-output-len 128 \
        --random-range-ratio 1 --num-prompts $n --max-concurrency $c --warmup-requests 2 --no-progress \
        --output-file "$OUT/serving_fusion_$fusion.jsonl" 2>&1 | tail -4
    done
  else
    echo "server (fusion $fusion) failed to start"; tail -20 "$LOGS/server_$fusion.log"
  fi
  kill -TERM $pid; wait $pid
  echo "server (fusion $fusion) exit code $?"
done

[ "${SKIP_ACCURACY:-0}" = 1 ] || timeout 300 python -m benchmarks.accuracy_regression --model-path llama3-8b --tp-size 2 \
  --server-args "--context-length 8192 --max-running-requests 64 --cuda-graph-max-bs 64" \
  --gsm8k-data-path "$EVAL_DATA/gsm8k/test.jsonl" --gsm8k-num-shots 2 --gsm8k-num-questions 64 \
  --mmlu-data-dir "$EVAL_DATA/mmlu" --mmlu-num-shots 1 --mmlu-examples 2 --parallel 64 --no-progress --log-dir "$LOGS" \
  --output-file "$OUT/accuracy_regression_llama3_8b_dummy.json" 2>&1 | tail -25
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
