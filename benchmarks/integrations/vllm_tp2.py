"""vLLM at TP2 (2 GPUs): its own fused all-reduce + RMSNorm pass against arfusion's pass, on a
llama3-8b-shaped model with dummy weights; decode steps at several batch sizes and one prefill.

    python -m arfusion.benchmarks.integrations.vllm_tp2 [--batch 1 8 32 128] [--prefill 4096]
        [--decode-steps 64] [--repeats 3] [--configs vllm arfusion unfused] [--output FILE]

Each configuration runs in a fresh process (one engine at a time, each with CUDA graphs):

    vllm      compilation_config.pass_config.fuse_allreduce_rms = True (vLLM's flashinfer pass)
    arfusion  fuse_allreduce_rms = False; arfusion's pass in compilation_config.inductor_passes
    unfused   neither (vLLM's all-reduce, then its RMSNorm)

Decode at batch B: B prompts of 32 random token ids; one decode step is
(time of generate(max_tokens=1 + S) - time of generate(max_tokens=1)) / S, S = --decode-steps.
Prefill: one prompt of --prefill tokens, generate(max_tokens=1), prefix caching off. Every time
is the median of --repeats after one warm-up call. The arfusion run also reports how its
reductions ran (by strategy, summed over both ranks). Prints a table (ms; ratio to unfused) and
writes every number to --output (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
}
PROMPT_TOKENS = 32
CONFIGS = ("vllm", "arfusion", "unfused")
RUN_TIMEOUT_S = 1800


def compilation_config(which: str) -> dict[str, Any]:
    """vLLM's ``compilation_config`` of configuration ``which`` (module docstring)."""
    from arfusion.integrations.vllm import PASS_NAME

    config: dict[str, Any] = {"pass_config": {"fuse_allreduce_rms": which == "vllm"}}
    if which == "arfusion":
        config["inductor_passes"] = {"post_grad_custom_post_pass": PASS_NAME}
    return config


def _timed(llm: Any, prompts: list[list[int]], max_tokens: int, repeats: int) -> float:
    """Median seconds of ``llm.generate(prompts, max_tokens)`` over ``repeats`` after a warm-up."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, params, use_tqdm=False)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in this process: the engine, the decode and prefill times."""
    import random

    from vllm import LLM

    model_dir = Path(tempfile.mkdtemp(prefix="llama3-8b-dummy-"))
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=2,
              dtype="bfloat16", max_model_len=args.prefill + 64, max_num_batched_tokens=max(8192, args.prefill),
              max_num_seqs=max(args.batch), enable_prefix_caching=False, seed=0,
              gpu_memory_utilization=0.85, compilation_config=compilation_config(args.worker))
    rng = random.Random(0)
    vocab = LLAMA3_8B["vocab_size"]
    result: dict[str, Any] = {"config": args.worker, "decode_ms": {}, "prefill_ms": None}
    for batch in args.batch:
        prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
        first = _timed(llm, prompts, 1, args.repeats)
        full = _timed(llm, prompts, 1 + args.decode_steps, args.repeats)
        result["decode_ms"][str(batch)] = (full - first) / args.decode_steps * 1e3
    prompt = [[rng.randrange(vocab) for _ in range(args.prefill)]]
    result["prefill_ms"] = _timed(llm, prompt, 1, args.repeats) * 1e3
    if args.worker == "arfusion":
        from arfusion.integrations.vllm.runtime import worker_stats

        result["arfusion_workers"] = llm.collective_rpc(worker_stats)
    return result


def _run_config(which: str, argv: list[str]) -> dict[str, Any]:
    env = os.environ | {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc with a function
    proc = subprocess.run([sys.executable, "-m", "arfusion.benchmarks.integrations.vllm_tp2", "--worker", which] + argv,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-8000:])
        raise SystemExit(f"configuration {which} failed (exit {proc.returncode})")
    return json.loads(lines[-1].removeprefix("RESULT "))


def strategies(result: dict[str, Any]) -> dict[str, int]:
    """The arfusion run's reductions by strategy, summed over its ranks."""
    total: dict[str, int] = {}
    for stats in result.get("arfusion_workers", []):
        for op in stats["ops"].values():
            for strategy, n in op["reductions"].items():
                total[strategy] = total.get(strategy, 0) + n
    return total


def table(results: dict[str, dict[str, Any]], batches: list[int], prefill: int) -> str:
    """Rows: decode at each batch, then the prefill; columns: ms per configuration and its ratio
    to unfused (when measured)."""
    names = list(results)
    head = f"{'what':<22}" + "".join(f"{n + ' ms':>14}" for n in names) + "".join(
        f"{n + '/unfused':>18}" for n in names if n != "unfused" and "unfused" in results)
    rows = [head, "-" * len(head)]
    cells = [(f"decode step, batch {b}", lambda r, b=b: r["decode_ms"][str(b)]) for b in batches]
    cells.append((f"prefill {prefill} tokens", lambda r: r["prefill_ms"]))
    for label, get in cells:
        row = f"{label:<22}" + "".join(f"{get(results[n]):>14.3f}" for n in names)
        if "unfused" in results:
            row += "".join(f"{get(results[n]) / get(results['unfused']):>18.3f}" for n in names if n != "unfused")
        rows.append(row)
    return "\n".join(rows)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128], help="decode batch sizes")
    parser.add_argument("--prefill", type=int, default=4096, help="tokens of the one prefill")
    parser.add_argument("--decode-steps", type=int, default=64, help="decode steps timed per batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median) after one warm-up")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--output", type=Path, default=Path("out/vllm_tp2.json"))
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)  # internal: run one configuration
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args), default=str), flush=True)
        return
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit(f"vLLM runs one TP rank per GPU: TP2 needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    passthrough = ["--batch", *map(str, args.batch), "--prefill", str(args.prefill),
                   "--decode-steps", str(args.decode_steps), "--repeats", str(args.repeats)]
    results = {which: _run_config(which, passthrough) for which in args.configs}
    print(table(results, args.batch, args.prefill))
    if "arfusion" in results:
        print("arfusion reductions by strategy (both ranks, all calls):", strategies(results["arfusion"]))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
