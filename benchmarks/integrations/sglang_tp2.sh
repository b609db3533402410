#!/usr/bin/env bash
# SGLang at TP2 on 2 GPUs, a dummy-weight llama3-8b-shaped model: SGLang's own fused all-reduce +
# residual + RMSNorm (flashinfer) against arfusion's (ARFUSION_SGLANG=1) and against no fusion;
# decode at batch 1, 8, 32, 128 and one 4096-token prefill; prints a table, writes $OUT/*.jsonl.
#
#   TOKENIZER=/path/to/any/hf/tokenizer/dir bash benchmarks/integrations/sglang_tp2.sh
#
# Needs: 2 GPUs (sm90/sm100, NVLink), SGLang 0.5.11-0.5.17 with its CUDA dependencies
# (sglang-kernel, flashinfer) and arfusion installed (pip install -e .). SGLang's Llama does not
# take the fused path (its decoder layer calls the norms itself, no LayerCommunicator): the model
# is Qwen3ForCausalLM, whose layers do, with llama3-8b's dimensions.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
: "${TOKENIZER:?set TOKENIZER to a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json)}"
MODEL=$(mktemp -d)
trap 'rm -rf "$MODEL"' EXIT
cp "$TOKENIZER"/tokenizer* "$MODEL"/
cat > "$MODEL/config.json" <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
 "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
 "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
 "tie_word_embeddings": false, "attention_bias": false}
JSON
mkdir -p "$OUT"
COMMON=(--model-path "$MODEL" --load-format dummy --tp-size 2 --dtype bfloat16 --mem-fraction-static 0.7)
run() {  # run NAME ARFUSION_SGLANG FUSION_FLAG...
  local name=$1 env=$2
  shift 2
  for shape in "decode --batch-size 1 8 32 128 --input-len 128 --output-len 32" \
               "prefill --batch-size 1 --input-len 4096 --output-len 1"; do
    read -ra args <<< "$shape"
    echo "== $name ${args[0]}"
    ARFUSION_SGLANG=$env timeout 900 python -m arfusion.benchmarks.integrations.sglang_one_batch "${COMMON[@]}" "$@" \
      --run-name "$name" "${args[@]:1}" --result-filename "$OUT/sglang_tp2_${args[0]}.jsonl" 2>&1 \
      | tee "$OUT/sglang_tp2_${name}_${args[0]}.log" | grep -E "arfusion|Prefill\. |Decode\.  median|Error" || true
  done
}
rm -f "$OUT"/sglang_tp2_*.jsonl
run unfused 0
run sglang_flashinfer 0 --enable-flashinfer-allreduce-fusion
run arfusion 1 --enable-flashinfer-allreduce-fusion
python - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for f in ("decode", "prefill") for l in open(f"{sys.argv[1]}/sglang_tp2_{f}.jsonl")]
print("| path | batch | input | prefill ms | median decode ms |")
print("|---|---|---|---|---|")
for r in rows:
    decode = r.get("median_decode_latency")
    print(f"| {r['run_name']} | {r['batch_size']} | {r['input_len']} | {1e3 * r['prefill_latency']:.2f} | "
          + (f"{1e3 * decode:.3f} |" if decode else "- |"))
PY
