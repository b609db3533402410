"""bf16 SwiGLU MoE experts on one GPU: the grouped launches (layers/moe/kernels/triton_fused_moe.py,
its tiles for the slot count) against the matrix-vector launches (layers/moe/kernels/triton_moe_gemv.py,
the default tiles and any given ones), at a model's expert shapes (random weights, random top-k
routing; hidden, intermediate per rank, experts, top-k).

For each token count: µs per call, the median of 10 replays of a CUDA graph of CALLS calls, each
with its own inputs and routing (consecutive calls mostly read other experts' weights); the bytes
of the active experts' weights (the mean over the CALLS routings), the share of 4.8 TB/s that
reaching them in that time takes, and the speed-up over the grouped launches; the relative RMS
difference from the grouped launches' output; with ``--profile`` each launch's GPU µs per call.

    python -m arfusion.benchmarks.kernels.bench_moe_experts --model qwen3-30b-a3b --tokens 1 2 4 8 16 \\
        --configs 8,512,8,128,4,4 16,256,8,128,2,4 --out out/bench_moe_experts.json

``--configs``: matrix-vector tiles, each
``block_n_gate_up,block_k_gate_up,block_n_down,block_k_down,num_warps_gate_up,num_warps_down``, and
``,summed`` for launch 1 summing each K step at once (`MoEGemvConfig.sum_each_step`, the
default's way; a config without it keeps an accumulator per output and column).
Slot counts above the matrix-vector path's GEMV_MAX_SLOTS are timed too (to show where the
grouped launches take over).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from arfusion.benchmarks.kernels.graph_timing import kernel_us_per_op
from arfusion.benchmarks.kernels.rows_file import write_rows
from arfusion.fusion.tuning.timing import capture_cuda_graph, median_replay_us

HBM_BYTES_PER_S = 4.8e12
CALLS = 8
MODELS = {  # (experts, hidden, intermediate per rank, top-k)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "qwen3-30b-a3b-tp2": (128, 2048, 384, 8),
    "mixtral-8x7b-tp2": (8, 4096, 7168, 2),
}


def parse_config(text: str):
    from arfusion.layers.moe.kernels.triton_moe_gemv import MoEGemvConfig

    fields, words = text.split(",")[:6], text.split(",")[6:]
    if len(fields) != 6 or not all(v.isdigit() for v in fields) or not set(words) <= {"summed"}:
        raise argparse.ArgumentTypeError(f"a config is 6 comma-separated integers, then optionally 'summed', got {text!r}")
    return MoEGemvConfig(*map(int, fields), sum_each_step="summed" in words)


def time_calls(fn, profile: bool) -> tuple[float, dict]:
    """(median µs per call, {kernel: µs per call} when ``profile``) of ``fn(i)`` for i < CALLS in one graph
    (`capture_cuda_graph`)."""
    graph, _ = capture_cuda_graph(lambda: [fn(i) for i in range(CALLS)])
    graph.replay()
    us = median_replay_us(graph, CALLS)
    kernels = kernel_us_per_op(graph, CALLS) if profile else {}
    del graph
    return us, kernels


def bench(model: str, tokens: int, configs: list, profile: bool) -> list[dict]:
    from arfusion.layers.moe.kernels.triton_fused_moe import block_config, fused_moe
    from arfusion.layers.moe.kernels.triton_moe_gemv import MoEGemvConfig, moe_gemv

    experts, hidden, inter, top_k = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(tokens)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda") / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g, device="cuda") / inter ** 0.5).bfloat16()
    xs = [torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16() for _ in range(CALLS)]
    ids = [torch.rand(tokens, experts, generator=g, device="cuda").topk(top_k, -1).indices.to(torch.int32)
           for _ in range(CALLS)]
    ws = [torch.softmax(torch.randn(tokens, top_k, generator=g, device="cuda"), -1) for _ in range(CALLS)]
    active = statistics.mean(torch.unique(i).numel() for i in ids)
    nbytes = active * 3 * hidden * inter * 2
    floor_us = nbytes / HBM_BYTES_PER_S * 1e6
    grouped_config = block_config(tokens * top_k, experts)
    grouped = fused_moe(xs[0], w13, w2, ws[0], ids[0], config=grouped_config)
    runs = [("grouped", lambda i: fused_moe(xs[i], w13, w2, ws[i], ids[i], config=grouped_config), None)]
    for config in [MoEGemvConfig()] + configs:
        runs.append(("gemv", lambda i, c=config: moe_gemv(xs[i], w13, w2, ws[i], ids[i], c), config))
    rows = []
    for kind, fn, config in runs:
        row = {"model": model, "tokens": tokens, "slots": tokens * top_k, "kind": kind,
               "config": None if config is None else list(vars(config).values()), "bytes": nbytes,
               "floor_us": floor_us}
        try:
            out = fn(0)
            row["rel_rms_vs_grouped"] = ((out.float() - grouped.float()).pow(2).mean().sqrt()
                                         / grouped.float().pow(2).mean().sqrt()).item()
            row["us"], row["kernels"] = time_calls(fn, profile)
            row["bandwidth_share"] = floor_us / row["us"]
        except Exception as exc:  # a tile that does not compile or run: its row says why
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            torch.cuda.synchronize()
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--configs", type=parse_config, nargs="*", default=[],
                        help="more matrix-vector tiles: block_n_gate_up,block_k_gate_up,block_n_down,block_k_down,"
                             "num_warps_gate_up,num_warps_down[,summed] (module docstring)")
    parser.add_argument("--profile", action="store_true", help="also print each launch's GPU µs per call")
    parser.add_argument("--out", default=None, help="write every row to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_experts needs a CUDA GPU")
    print(f"{'model':>18} {'tokens':>6} {'slots':>5} {'kind':>7} {'us':>8} {'x grp':>6} {'% 4.8TB/s':>9} "
          f"{'floor us':>8} {'rel diff':>8}  tiles")
    rows = []
    for tokens in args.tokens:
        grouped_us = None
        for row in bench(args.model, tokens, args.configs, args.profile):
            rows.append(row)
            tiles = "" if row["config"] is None else ",".join(map(str, row["config"]))
            if "error" in row:
                print(f"{args.model:>18} {tokens:>6} {row['slots']:>5} {row['kind']:>7} {'failed':>8}  {tiles}: "
                      f"{row['error']}", flush=True)
                continue
            grouped_us = grouped_us or row["us"]
            print(f"{args.model:>18} {tokens:>6} {row['slots']:>5} {row['kind']:>7} {row['us']:>8.1f} "
                  f"{grouped_us / row['us']:>6.2f} {100 * row['bandwidth_share']:>8.1f}% {row['floor_us']:>8.1f} "
                  f"{row['rel_rms_vs_grouped']:>8.1e}  {tiles}", flush=True)
            for name, us in row["kernels"].items():
                print(f"{'':>18} {us:8.1f} us  {name}", flush=True)
        torch.cuda.empty_cache()  # this token count's weights, freed with its rows' closures
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
