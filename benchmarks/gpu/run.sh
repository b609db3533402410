#!/usr/bin/env bash
# One entry point for the GPU runs: bash benchmarks/gpu/run.sh PART [N]
#
# Every command of a part runs under `timeout`, within BUDGET_S seconds for the whole part
# (default 570). A part sources .gpu/env.sh, an environment script you provide (it activates a
# Python environment set up as in the README's "Set-up and run": a CUDA build of torch, then
# `pip install -e '.[gpu,test]'`, or one with the dependencies and this checkout not installed),
# then puts a link named `arfusion` to this checkout first on PYTHONPATH (the repository root is
# the package `arfusion`), so this checkout's code runs, installed or not. It prints
# `nvidia-smi -L`, writes its log ($OUT/PART.log) and
# a few result files under $OUT (default ./out), and exits non-zero when its main command
# failed (124: out of time). TP (default 2) is the GPU count of the multi-GPU parts.
#
#   tests          python -m pytest tests/gpu. ARFUSION_GPU_WORLD is the collective tests' world
#                  (default 2): with fewer GPUs its ranks share them (correctness only), and only
#                  tests whose subject is two physical GPUs skip. TESTS picks files (default
#                  tests/gpu). The server fault tests (FAULT_TESTS, or some of its test ids in
#                  TESTS) kill ranks, after which an MPS daemon can refuse the next client: they
#                  run after the others, each test in its own pytest (results in
#                  $OUT/fault_tests_N.xml), with a fresh MPS daemon before each and after the
#                  last (when the part started one).
#
# With fewer GPUs than ranks (tests, kernels, engine, accuracy), the part starts the CUDA MPS daemon (its
# pipe and log folders under /tmp) so that the ranks sharing a GPU run concurrently instead of
# time-sliced, and quits it when the part ends; it changes no GPU setting (compute mode stays).
#   kernels        benchmark_fused_collective.py, no quantization, with residual, at HIDDEN
#                  (default 4096) x SEQ_LENS (default 1 32 128 512 1024 2048 4096).
#   table          python -m arfusion.engine.tune_fusion (the strategy table) at HIDDEN (default 896 1024
#                  1536 2048 2560 2880 3584 4096 5120 7168 8192; pass a subset per run if they
#                  do not fit BUDGET_S), up to MAX_TOKENS (default 4096) tokens, into
#                  $OUT/strategy_table.json; TABLE_BASE=FILE starts from a copy of FILE (e.g.
#                  fusion/dispatch/tables/strategy_table.json) and merges into it.
#   engine         engine.bench_one_batch on MODEL (default llama3-8b, dummy weights) at BATCH
#                  (default 1 32 128), FUSION (default off on), input 128 / output 64;
#                  PROFILE=1 adds --profile. BASE=FOLDER (an older checkout of the project, one
#                  package `arfusion` as now): this checkout against BASE's in ROUNDS (default 2)
#                  interleaved rounds, each running both in turn (the order swapped every round),
#                  into $OUT/bench_one_batch_{this,base}_ROUND.jsonl, then a table of every
#                  setting's TPOT per round and the ratio of the medians (this / base).
#                  BASE="FOLDER1 FOLDER2 ...": each of them (labels base1, base2, ...) beside
#                  this checkout, every round running all in turn (the order rotated by one every
#                  round), a column and a ratio (this / baseN) for each.
#                  THIS_ARGS: flags for this checkout's runs only; with BASE=. it compares a
#                  flag against the same checkout without it.
#   serving        the server with fusion off and on (COMPARE=deterministic: in the default mode
#                  and with --deterministic, fusion FUSION, default off), interleaved, REPEATS
#                  (default 3) times each; bench_serving at CONCURRENCY (default 1 32), input
#                  INPUT_LEN (default 512) / output OUTPUT_LEN (default 1024), NUM_PROMPTS (default
#                  2 x concurrency, at least 4) into $OUT/serving.jsonl, a median table per setting.
#   accuracy       benchmarks.accuracy_regression on MODEL (default /tmp/model.gguf, see
#                  model-piece): TP1, then TP (default 2) with fusion off and on, on the
#                  evaluation data you provide in .data/ (gsm8k/test.jsonl and train.jsonl, mmlu/
#                  with dev/ and test/: the README's "Benchmarks and evaluations" says where they
#                  come from); results kept in RESULTS_DIR (default .accuracy: a later run with
#                  the folder in place resumes) and also packed into accuracy_results.tgz.
#   digest         benchmarks.output_digest of the checkout at BASE (a folder with an older checkout
#                  of the project) and of this one, with MODEL (default tiny) at TP ranks, in each
#                  of DIGEST_SETTINGS (default: off on deterministic; on = fusion with the built-in
#                  dispatch, deterministic = fusion on with --deterministic and the batch sent at
#                  once) into $OUT/digest.jsonl; fails when a setting's two digests differ.
#   model-piece N  appends .model/part-0N to /tmp/model.gguf (0 starts it afresh), prints its
#                  size and, after the last piece, checks its sha256: .model/ holds the GGUF model
#                  of docs/results.md's accuracy runs split into 60 MiB pieces
#                  (`split -b 60M -d model.gguf .model/part-`).
#
# EXTRA_ARGS: more flags for the main command of kernels, table, engine and accuracy.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-out}
BUDGET_S=${BUDGET_S:-570}
TP=${TP:-2}
read -ra EXTRA <<< "${EXTRA_ARGS:-}"
TABLE_HIDDEN="896 1024 1536 2048 2560 2880 3584 4096 5120 7168 8192"
FAULT_TESTS=tests/gpu/test_server_faults_gpu.py
# The model of model-piece (Qwen2.5-Coder-0.5B-Instruct, GGUF): its pieces' size and its checksum.
PIECE_BYTES=62914560
MODEL_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32

usage() {
  sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

# ---- shared helpers ---------------------------------------------------------------------------

left() {  # seconds left of the part's BUDGET_S
  echo $((BUDGET_S - SECONDS))
}

run_timed() {  # run_timed LIMIT CMD...: CMD under timeout (LIMIT s, or what is left); returns its status
  local limit=$1 rc
  shift
  (($(left) < limit)) && limit=$(left)
  if ((limit < 5)); then
    echo "!! no time left for: $*"
    return 124
  fi
  echo "+ [timeout ${limit}s] $*"
  timeout -k 15 "$limit" "$@"
  rc=$?
  echo "+ exit status $rc"
  return "$rc"
}

gpu_count() {
  nvidia-smi -L 2> /dev/null | grep -c '^GPU '
}

share_gpus_if_needed() {  # share_gpus_if_needed RANKS: MPS for ranks sharing GPUs, quit at exit
  (($(gpu_count) >= $1)) && return 0
  echo "$1 ranks on $(gpu_count) GPU(s): the ranks share a GPU (correctness only, timings not representative)"
  if ! command -v nvidia-cuda-mps-control > /dev/null; then
    echo "no nvidia-cuda-mps-control: the sharing ranks are time-sliced (slow, still correct)"
    return 0
  fi
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  # each client (rank) gets at most its share of the SMs: a spinning Lamport kernel of one rank
  # can then never occupy the SMs its peer's kernel needs to arrive (a deadlock otherwise)
  export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 * $(gpu_count) / $1))
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS daemon started" && MPS_STARTED=1 && trap stop_mps EXIT
}

stop_mps() {
  echo quit | nvidia-cuda-mps-control && echo "MPS daemon stopped"
}

restart_mps() {  # a fresh MPS daemon (only one this part started): quit, wait until it is gone, start
  local i
  [ "${MPS_STARTED:-0}" = 1 ] || return 0
  echo quit | nvidia-cuda-mps-control
  for ((i = 0; i < 40; i++)); do
    pgrep -f '^nvidia-cuda-mps-(control|server)' > /dev/null || break
    sleep 0.5
  done
  nvidia-cuda-mps-control -d && echo "MPS daemon restarted"
}

need_gpus() {  # need_gpus N: fails when fewer than N GPUs are visible
  local found
  found=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ')
  ((found >= $1)) && return 0
  echo "!! this part needs $1 GPUs, found $found"
  return 2
}

checkout_on_path() {  # `arfusion` = this checkout: a link to the root, first on PYTHONPATH
  local folder
  folder=$(mktemp -d /tmp/arfusion-path.XXXXXX) && ln -s "$PWD" "$folder/arfusion" || return 2
  export PYTHONPATH="$folder:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # $PWD: the tests' own package, tests.*
  python -c 'import arfusion.fusion' || { echo "!! arfusion is not importable from $folder"; return 2; }
  echo "arfusion: $PWD (through $folder/arfusion)"
}

start_part() {  # the environment, and which GPUs this machine has
  if [ ! -f .gpu/env.sh ]; then
    echo "!! .gpu/env.sh is missing: provide it (see this script's header) in the project root first"
    return 2
  fi
  # shellcheck source=/dev/null
  source .gpu/env.sh
  checkout_on_path || return
  nvidia-smi -L
}

# ---- parts ------------------------------------------------------------------------------------

part_tests() {
  local tests others=() faults=() t rc=0
  read -ra tests <<< "${TESTS:-tests/gpu}"
  for t in "${tests[@]}"; do  # the fault file, a folder holding it, or one of its tests
    if [[ $t == "$FAULT_TESTS::"* ]]; then
      faults+=("$t")
      continue
    fi
    if [[ $FAULT_TESTS == "${t%/}" || $FAULT_TESTS == "${t%/}"/* ]]; then
      faults+=("$FAULT_TESTS")
      [ "${t%/}" = "$FAULT_TESTS" ] && continue
    fi
    others+=("$t")
  done
  echo "ARFUSION_GPU_WORLD=${ARFUSION_GPU_WORLD:-2}"
  share_gpus_if_needed "${ARFUSION_GPU_WORLD:-2}"
  if ((${#others[@]})); then
    run_timed 560 python -m pytest "${others[@]}" --ignore="$FAULT_TESTS" -q -s -p no:cacheprovider \
      --junitxml="$OUT/tests.xml" || rc=$?
  fi
  if ((${#faults[@]})); then
    run_fault_tests "${faults[@]}" || { ((rc)) || rc=1; }
  fi
  return "$rc"
}

run_fault_tests() {  # run_fault_tests FILE-OR-ID...: each test in its own pytest, a fresh MPS daemon before each
  local ids id n=0 rc=0
  mapfile -t ids < <(python -m pytest "$@" --collect-only -q -p no:cacheprovider | grep "^$FAULT_TESTS::")
  ((${#ids[@]})) || { echo "!! no test collected from $*"; return 2; }
  for id in "${ids[@]}"; do
    restart_mps
    n=$((n + 1))
    run_timed 400 python -m pytest "$id" -q -s -p no:cacheprovider --junitxml="$OUT/fault_tests_$n.xml" || rc=1
  done
  restart_mps
  return "$rc"
}

part_kernels() {
  local hidden seq_lens
  read -ra hidden <<< "${HIDDEN:-4096}"
  read -ra seq_lens <<< "${SEQ_LENS:-1 32 128 512 1024 2048 4096}"
  share_gpus_if_needed "$TP"
  run_timed 560 torchrun --nproc_per_node="$TP" benchmarks/kernels/benchmark_fused_collective.py \
    --hidden-dim "${hidden[@]}" --seq-lens "${seq_lens[@]}" --no-quant --residual-only \
    --output-file "$OUT/fused_collective.md" --json-file "$OUT/fused_collective.json" "${EXTRA[@]}"
}

part_table() {
  local hidden
  read -ra hidden <<< "${HIDDEN:-$TABLE_HIDDEN}"
  need_gpus "$TP" || return
  if [ -n "${TABLE_BASE:-}" ]; then
    cp "$TABLE_BASE" "$OUT/strategy_table.json" || return 2
  fi
  # the tuner rewrites the file after each hidden size: a timeout keeps the sizes it finished
  run_timed 560 torchrun --nproc_per_node="$TP" -m arfusion.engine.tune_fusion --hidden "${hidden[@]}" \
    --allreduce-fusion-max-tokens "${MAX_TOKENS:-4096}" --output "$OUT/strategy_table.json" "${EXTRA[@]}"
}

part_engine() {
  local batch fusion args this_args own round label root bases labels roots i k rc=0
  read -ra batch <<< "${BATCH:-1 32 128}"
  read -ra fusion <<< "${FUSION:-off on}"
  share_gpus_if_needed "$TP"
  args=(--model-path "${MODEL:-llama3-8b}" --tp-size "$TP" --batch-size "${batch[@]}" --fusion "${fusion[@]}"
        --input-len 128 --output-len 64)
  [ "${PROFILE:-0}" = 1 ] && args+=(--profile)
  if [ -z "${BASE:-}" ]; then
    run_timed 560 python -m arfusion.engine.bench_one_batch "${args[@]}" --json-file "$OUT/bench_one_batch.jsonl" \
      "${EXTRA[@]}"
    return
  fi
  read -ra bases <<< "$BASE"
  labels=(this) roots=("$PWD")
  for i in "${!bases[@]}"; do
    [ -d "${bases[i]}" ] || { echo "!! BASE must name folders with older checkouts (${bases[i]} is none)"; return 2; }
    label=base
    ((${#bases[@]} > 1)) && label=base$((i + 1))
    labels+=("$label") roots+=("$(cd "${bases[i]}" && pwd)")
  done
  read -ra this_args <<< "${THIS_ARGS:-}"
  for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
    for ((k = 0; k < ${#labels[@]}; k++)); do  # the order rotated by one every round
      i=$(((k + round - 1) % ${#labels[@]}))
      label=${labels[i]} root=${roots[i]} own=()
      [ "$label" = this ] && own=("${this_args[@]}")
      echo "== round $round: $label ($root)"
      bench_one_batch_of "$root" "${args[@]}" --json-file "$OUT/bench_one_batch_${label}_$round.jsonl" \
        "${EXTRA[@]}" "${own[@]}" || rc=1
    done
  done
  python - "$OUT" << 'PY' || rc=1
import glob, json, statistics, sys
tpot = {}  # (label, setting) -> TPOT of each round
for path in sorted(glob.glob(f"{sys.argv[1]}/bench_one_batch_*_*.jsonl")):
    label = path.rsplit("/", 1)[1].split("_")[3]
    for line in open(path):
        for r in json.loads(line)["results"]:
            setting = (r["batch_size"], r["fusion"], r["deterministic"])
            tpot.setdefault((label, setting), []).append(r["tpot_ms"])
settings = sorted({s for _, s in tpot})
bases = sorted({label for label, _ in tpot} - {"this"})
print(f"{'batch':>5} {'fusion':>7} {'det':>5}  " + "  ".join(f"{f'{label} TPOT ms (rounds)':>28}" for label in bases)
      + f"  {'this TPOT ms (rounds)':>28}  " + "  ".join(f"this/{label}" for label in bases))
for s in settings:
    this = tpot.get(("this", s), [])
    columns = [tpot.get((label, s), []) for label in bases]
    ratios = [statistics.median(this) / statistics.median(base) if base and this else float("nan") for base in columns]
    print(f"{s[0]:>5} {s[1]:>7} {str(s[2]):>5}  " + "  ".join(f"{' / '.join(f'{t:.3f}' for t in base):>28}"
                                                          for base in columns)
          + f"  {' / '.join(f'{t:.3f}' for t in this):>28}  " + "  ".join(f"{ratio:.3f}" for ratio in ratios))
sys.exit(0 if settings else 1)
PY
  return "$rc"
}

bench_one_batch_of() {  # bench_one_batch_of ROOT ARGS...: engine.bench_one_batch of the checkout at ROOT
  local root=$1 folder
  shift
  folder=$(mktemp -d /tmp/arfusion-path.XXXXXX) && ln -s "$root" "$folder/arfusion" || return 2
  PYTHONPATH="$folder:$root:$PYTHONPATH" python -c \
    'import arfusion.engine, os; print("arfusion:", os.path.realpath(os.path.dirname(arfusion.engine.__file__) + "/.."))' \
    || return 2
  PYTHONPATH="$folder:$root:$PYTHONPATH" run_timed 560 python -m arfusion.engine.bench_one_batch "$@"
}

wait_healthy() {  # wait_healthy PORT PID SECONDS: until GET /health answers; fails if PID dies
  local port=$1 pid=$2 i
  for ((i = 0; i < $3; i++)); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && return 0
    kill -0 "$pid" 2> /dev/null || return 1
    sleep 1
  done
  return 1
}

stop_server() {  # stop_server PID: SIGTERM to the server's process group (led by its timeout), SIGKILL after 30 s
  local pid=$1 i
  kill -TERM "$pid" 2> /dev/null
  for ((i = 0; i < 30; i++)); do
    kill -0 -- "-$pid" 2> /dev/null || break
    sleep 1
  done
  kill -KILL -- "-$pid" 2> /dev/null
  wait "$pid" 2> /dev/null
  echo "server stopped (exit status $?)"
}

serve_and_measure() {  # serve_and_measure SETTING REPEAT PORT: one server, bench_serving at every concurrency
  # SETTING: off / on (fusion), or default / deterministic (the mode; fusion as FUSION says)
  local setting=$1 repeat=$2 port=$3 flags=() server_args concurrency pid c n rc=0
  local runs=/tmp/serving_run.jsonl fusion=$1
  read -ra server_args <<< "${SERVER_ARGS:---context-length 8192 --max-running-requests 64 --cuda-graph-max-bs 64}"
  read -ra concurrency <<< "${CONCURRENCY:-1 32}"
  case $setting in
    default | deterministic) fusion=${FUSION:-off} ;;
  esac
  [ "$fusion" = on ] && flags=(--enable-flashinfer-allreduce-fusion)
  [ "$setting" = deterministic ] && flags+=(--deterministic)
  echo "== $setting (fusion $fusion), repeat $repeat, port $port ($(left) s left)" | tee -a "$OUT/servers.log"
  # timeout leads a process group of its own: stop_server ends the server and its TP workers
  timeout -k 15 "$(left)" python -m arfusion.engine.launch_server --model-path "${MODEL:-llama3-8b}" --tp-size "$TP" \
    "${server_args[@]}" "${flags[@]}" --port "$port" >> "$OUT/servers.log" 2>&1 &
  pid=$!
  if ! wait_healthy "$port" "$pid" "${SERVER_START_S:-300}"; then
    echo "!! the server (fusion $setting) did not become healthy"
    tail -20 "$OUT/servers.log"
    stop_server "$pid"
    return 1
  fi
  for c in "${concurrency[@]}"; do
    n=${NUM_PROMPTS:-$((2 * c > 4 ? 2 * c : 4))}
    rm -f "$runs"
    run_timed 300 python -m arfusion.benchmarks.bench_serving --port "$port" --random-input-len "${INPUT_LEN:-512}" \
      --random-output-len "${OUTPUT_LEN:-1024}" --random-range-ratio 1 --num-prompts "$n" --max-concurrency "$c" \
      --warmup-requests 2 --no-progress --output-file "$runs" || rc=1
    [ -f "$runs" ] && python - "$runs" "$OUT/serving.jsonl" "$setting" "$fusion" "$repeat" << 'PY'
import json, sys
runs, out, setting, fusion, repeat = sys.argv[1:]
with open(out, "a") as f:
    for line in open(runs):
        f.write(json.dumps({"setting": setting, "fusion": fusion, "deterministic": setting == "deterministic",
                            "repeat": int(repeat), **json.loads(line)}) + "\n")
PY
  done
  stop_server "$pid"
  return "$rc"
}

serving_summary() {  # median over repeats per (concurrency, setting) of $OUT/serving.jsonl, and each
  # setting's output throughput over that of fusion off (or the default mode) at that concurrency
  python - "$OUT/serving.jsonl" << 'PY'
import json, statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs[r["max_concurrency"], r.get("setting", r["fusion"])].append(r)
first = {}
print(f"{'conc':>4} {'setting':>13} {'runs':>4} {'out tok/s':>10} {'ratio':>6} {'TPOT ms':>8} {'TTFT ms':>8}")
for (c, setting), rs in sorted(runs.items()):  # off before on, default before deterministic
    med = lambda key: statistics.median(r[key] for r in rs if r[key] is not None)
    first.setdefault(c, med("output_throughput"))
    print(f"{c:>4} {setting:>13} {len(rs):>4} {med('output_throughput'):>10.1f} "
          f"{med('output_throughput') / first[c]:>6.3f} {med('median_tpot_ms'):>8.3f} {med('median_ttft_ms'):>8.1f}")
PY
}

part_serving() {
  local repeat setting settings=(off on) port=${PORT:-31000} rc=0
  [ "${COMPARE:-fusion}" = deterministic ] && settings=(default deterministic)
  need_gpus "$TP" || return
  for ((repeat = 1; repeat <= ${REPEATS:-3}; repeat++)); do
    for setting in "${settings[@]}"; do
      if (($(left) < ${SERVER_MIN_S:-90})); then
        echo "!! $(left) s left: stopping before repeat $repeat, $setting"
        rc=124
        break 2
      fi
      serve_and_measure "$setting" "$repeat" "$port" || rc=1
      port=$((port + 1))  # a new port per server: nothing waits on the last one's socket
    done
  done
  [ -f "$OUT/serving.jsonl" ] && serving_summary
  return "$rc"
}

part_accuracy() {
  local model=${MODEL:-/tmp/model.gguf} data=() results=${RESULTS_DIR:-.accuracy} logs=/tmp/accuracy_logs rc=0
  rm -rf "$logs"
  if [ ! -f "$model" ]; then
    echo "!! no model at $model: assemble it first (model-piece 0 .. 7)"
    return 2
  fi
  if [ -d .data ]; then
    data=(--gsm8k-data-path .data/gsm8k/test.jsonl --mmlu-data-dir .data/mmlu)
  else
    echo "!! no .data/: the evaluations look for their data at their default paths"
  fi
  # TP1 (the baseline), then TP$TP fusion off and on; every (setting, eval) result is kept in
  # $results as it finishes (and is packed into accuracy_results.tgz): with the folder in place
  # the same command resumes with what is missing. With fewer GPUs than
  # TP the TP$TP ranks share them (correct; the timings it prints are not representative).
  share_gpus_if_needed "$TP"
  run_timed "$(left)" python -m arfusion.benchmarks.accuracy_regression --model-path "$model" --tp-size "$TP" \
    --baseline-tp-size 1 "${data[@]}" --parallel 256 --no-progress --results-dir "$results" --log-dir "$logs" \
    --output-file "$OUT/accuracy.json" "${EXTRA[@]}" || rc=$?
  [ -d "$results" ] && tar czf "$OUT/accuracy_results.tgz" -C "$results" .
  [ -d "$logs" ] && tar czf "$OUT/accuracy_server_logs.tgz" -C "$logs" .
  return "$rc"
}

part_digest() {
  local settings setting root flags extra rc=0
  read -ra settings <<< "${DIGEST_SETTINGS:-off on deterministic}"
  [ -d "${BASE:-}" ] || { echo "!! BASE must name a folder with the older checkout"; return 2; }
  share_gpus_if_needed "$TP"
  for setting in "${settings[@]}"; do
    flags=(--model-path "${MODEL:-tiny}" --tp-size "$TP" --step-time-target-ms 0)
    extra=()
    case $setting in
      on) flags+=(--enable-flashinfer-allreduce-fusion) ;;
      deterministic) flags+=(--enable-flashinfer-allreduce-fusion --deterministic) && extra=(--concurrent) ;;
      off) ;;
      *) echo "!! unknown digest setting $setting" && return 2 ;;
    esac
    for root in "$BASE" "$PWD"; do
      run_timed 400 python -m arfusion.benchmarks.output_digest --code-root "$root" --label "$setting" "${extra[@]}" \
        -- "${flags[@]}" "${EXTRA[@]}" | tee -a "$OUT/digest.jsonl" || rc=1
    done
  done
  python - "$OUT/digest.jsonl" << 'PY' || rc=1
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
by_label = {}
for r in rows:
    by_label.setdefault(r["label"], []).append(r)
bad = 0
for label, rs in by_label.items():
    same = len({r["digest"] for r in rs}) == 1 and all(r["repeatable"] for r in rs)
    bad += not same
    print(f"{label:>13}: {'identical' if same else 'DIFFERENT'} {[r['digest'][:12] for r in rs]} "
          f"reductions {[r['reductions'] for r in rs]}")
sys.exit(1 if bad or not rows else 0)
PY
  return "$rc"
}

part_model_piece() {  # part_model_piece N
  local n=${1:-} model=/tmp/model.gguf piece size
  if [[ ! $n =~ ^[0-9]$ ]]; then
    echo "!! usage: run.sh model-piece N (N = 0 .. 9)"
    return 2
  fi
  piece=.model/part-0$n
  if [ ! -f "$piece" ]; then
    echo "!! $piece is missing"
    return 2
  fi
  [ "$n" = 0 ] && : > "$model"
  size=$(stat -c %s "$model" 2> /dev/null || echo 0)
  if ((size != n * PIECE_BYTES)); then
    echo "!! $model has $size bytes, piece $n belongs at $((n * PIECE_BYTES)): start again at piece 0"
    return 1
  fi
  cat "$piece" >> "$model" || return 1
  size=$(stat -c %s "$model")
  echo "$model: $size bytes after piece $n"
  if (($(stat -c %s "$piece") < PIECE_BYTES)); then  # the last piece is the short one
    sha256sum "$model"
    [ "$(sha256sum "$model" | cut -d' ' -f1)" = "$MODEL_SHA" ] || { echo "!! sha256 differs from $MODEL_SHA"; return 1; }
    echo "sha256 matches: the model is complete"
  fi
}

# ---- main -------------------------------------------------------------------------------------

run_part() {  # run_part PART [N]
  # model-piece needs no .gpu/ environment
  [ "$1" = model-piece ] && { part_model_piece "${2:-}"; return; }
  start_part || return
  case $1 in
    tests) part_tests ;;
    kernels) part_kernels ;;
    table) part_table ;;
    engine) part_engine ;;
    serving) part_serving ;;
    accuracy) part_accuracy ;;
    digest) part_digest ;;
  esac
}

case ${1:-} in
  tests | kernels | table | engine | serving | accuracy | digest | model-piece) ;;
  *)
    usage
    exit 2
    ;;
esac
mkdir -p "$OUT" || exit 2
run_part "$@" 2>&1 | tee "$OUT/$1.log"
exit "${PIPESTATUS[0]}"
