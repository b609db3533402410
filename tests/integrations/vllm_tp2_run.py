"""One vLLM run for the plugin test: a tiny Llama with seeded random weights at TP2 on vLLM's CPU
backend, compiled (vLLM's ``mode`` 3), with or without arfusion's pass; prints one JSON line:
greedy tokens, the prompt tokens' log-probabilities and, with the pass, every worker's counters.

    python tests/integrations/vllm_tp2_run.py MODEL_DIR {vllm|arfusion}

Seeded random weights (normal, std 0.1), not vLLM's dummy loader: its uniform +-1e-3 weights make
every logit equal to six digits, so no comparison of outputs could fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per TP worker (vLLM refuses to bind 2 workers otherwise)
    "VLLM_HOST_IP": "127.0.0.1",  # the message queue on loopback
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function (the counters)
}
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0, "hidden_act": "silu",
}
PROMPTS = [[3, 17, 52, 9, 300, 41, 7], [11, 12, 13], [200, 5, 77, 400, 8]]
MAX_TOKENS = 6
ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 1200  # a cold compiled TP2 start-up on two loaded cores takes minutes


def write_model(path: Path, seed: int = 0) -> Path:
    """config.json + model.safetensors of CONFIG's Llama: bf16 normals (std 0.1), norms 1 + 0.1 N."""
    import torch
    from safetensors.torch import save_file

    c = CONFIG
    h, inter, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["hidden_size"] // c[
        "num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    g = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.randn(shape, generator=g) * 0.1 + name.endswith("norm.weight")).to(torch.bfloat16)
               for name, shape in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def run(model_dir: str, which: str) -> dict:
    from vllm import LLM, SamplingParams

    from integrations.vllm import PASS_NAME

    compilation = {"mode": 3}
    if which == "arfusion":
        compilation["inductor_passes"] = {"post_grad_custom_post_pass": PASS_NAME}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=2, distributed_executor_backend="mp",
              dtype="bfloat16", max_model_len=128, max_num_seqs=4, seed=0, compilation_config=compilation)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        # the log-probability of each prompt token after the first, given the ones before it
        "prompt_logprobs": [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, PROMPTS)],
    }
    if which == "arfusion":
        from integrations.vllm.runtime import worker_stats

        result["workers"] = llm.collective_rpc(worker_stats)
    return result


def run_in_subprocess(model_dir: Path, which: str) -> dict:
    """`run` in a fresh process (one engine per process); its result, or an AssertionError
    with the run's output."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(model_dir), which], cwd=ROOT,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (f"vLLM run '{which}' failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                            f"{proc.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    model_dir, which = sys.argv[1], sys.argv[2]
    if which not in ("vllm", "arfusion"):
        raise SystemExit(f"second argument must be 'vllm' or 'arfusion', got {which!r}")
    print("RESULT " + json.dumps(run(model_dir, which), default=str), flush=True)


if __name__ == "__main__":
    main()
