#!/usr/bin/env bash
# 1 GPU: does the plugin start inside SGLang's real processes? First it probes what SGLang needs on
# CUDA: on a CUDA machine SGLang 0.5.11-0.5.17 imports sgl_kernel at module level in
# srt/layers/layernorm.py and srt/layers/activation.py (so no model, and not the communicator our
# hooks patch, imports without it), and its engine asserts the sglang-kernel version at start
# (SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 skips only that check). Where both import, it serves a
# tiny dummy-weight Qwen3 at TP1 with --enable-flashinfer-allreduce-fusion and ARFUSION_SGLANG=1,
# sends one request and checks the log for the plugin's lines (the hooks registered in the server
# and scheduler processes; the op made where SGLang makes its workspace: inactive at TP1).
#
#   TOKENIZER=/path/to/hf/tokenizer/dir bash benchmarks/integrations/sglang_smoke.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
: "${TOKENIZER:?set TOKENIZER to a Hugging Face tokenizer directory}"
echo "== probes"
python -c "import sgl_kernel; print('sgl_kernel', getattr(sgl_kernel, '__version__', '?'))" 2>&1 | tail -1
python -c "import torch, sglang; print('torch', torch.__version__, 'sglang', sglang.__version__)" 2>&1 | tail -1
if ! python -c "import sglang.srt.layers.communicator" > "$OUT/sglang_import.log" 2>&1; then
  echo "!! SGLang's layers do not import on this machine:"; tail -1 "$OUT/sglang_import.log"
  exit 3
fi
MODEL=$(mktemp -d)
cp "$TOKENIZER"/tokenizer* "$MODEL"/
cat > "$MODEL/config.json" <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
 "intermediate_size": 3072, "num_hidden_layers": 2, "num_attention_heads": 16,
 "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 151936, "max_position_embeddings": 4096,
 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
 "tie_word_embeddings": true, "attention_bias": false}
JSON
ARFUSION_SGLANG=1 python -m sglang.launch_server --model-path "$MODEL" --load-format dummy --tp-size 1 \
  --enable-flashinfer-allreduce-fusion --port 30123 --mem-fraction-static 0.3 > "$OUT/sglang_smoke.log" 2>&1 &
server=$!
for _ in $(seq 1 240); do
  curl -sf localhost:30123/health > /dev/null && break
  kill -0 $server 2> /dev/null || break
  sleep 1
done
curl -s localhost:30123/generate -H 'content-type: application/json' \
  -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}'
echo
kill $server 2> /dev/null
wait $server 2> /dev/null
rm -rf "$MODEL"
echo "== the plugin's lines"
grep -E "arfusion" "$OUT/sglang_smoke.log"
grep -q "arfusion's SGLang plugin: .* hooks registered" "$OUT/sglang_smoke.log" && grep -q "arfusion replaces" "$OUT/sglang_smoke.log"
