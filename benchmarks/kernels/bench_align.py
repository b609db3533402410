"""The grouping of a MoE layer's slots by expert (layers/moe/align.py's ``ExpertBlocks``), the
launch the grouped expert launches run first when the routing did not group the slots itself:

    triton   `triton_align.align_by_expert_triton` (the experts' launch up to its MAX_SLOTS)
    torch    `align.align_by_expert` (its reference, the path past MAX_SLOTS)

at 128 experts (qwen3-30b-a3b: top-8; gpt-oss-120b: top-4) and 32 (gpt-oss-20b, top-4), with the
row blocks `fused_moe` takes at each slot count, on random top-k ids (distinct experts per token).
µs per call: one CUDA graph of 20 calls on distinct ids, median of 10 replays; ``ratio`` = torch /
triton.

    python -m arfusion.benchmarks.kernels.bench_align --slots 8 64 256 1024 2048 8192 --out out/align.json
"""
from __future__ import annotations

import argparse

import torch

from arfusion.benchmarks.kernels.rows_file import write_rows
from arfusion.fusion.tuning.timing import capture_cuda_graph, median_replay_us

EXPERTS_TOP_K = {"qwen3-30b-a3b": (128, 8), "gpt-oss-20b": (32, 4), "gpt-oss-120b": (128, 4)}
CALLS = 20


def random_ids(tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """``[tokens, top_k]`` int32 expert ids on the GPU, distinct within each token."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, experts, device="cuda", generator=generator)
    return scores.topk(top_k, dim=1).indices.to(torch.int32)


def timed_us(align, ids: list[torch.Tensor], experts: int, block_m: int) -> float:
    """µs per call of ``align`` over the cycle ``ids``, replayed from one CUDA graph."""
    graph, _ = capture_cuda_graph(lambda: [align(i, experts, block_m) for i in ids])
    return median_replay_us(graph, len(ids))


def main() -> None:
    from arfusion.layers.moe.align import align_by_expert
    from arfusion.layers.moe.kernels.triton_align import align_by_expert_triton
    from arfusion.layers.moe.kernels.triton_fused_moe import block_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(EXPERTS_TOP_K), default=list(EXPERTS_TOP_K))
    parser.add_argument("--slots", type=int, nargs="+", default=[8, 64, 256, 1024, 2048, 8192])
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_align needs a CUDA GPU")
    rows = []
    print(f"{'model':>14} {'slots':>6} {'block_m':>7} {'triton us':>9} {'torch us':>9} {'ratio':>6}")
    for model in args.models:
        experts, top_k = EXPERTS_TOP_K[model]
        for slots in args.slots:
            tokens = max(1, slots // top_k)
            block_m = block_config(tokens * top_k, experts).block_m
            ids = [random_ids(tokens, experts, top_k, seed) for seed in range(CALLS)]
            triton_us = timed_us(align_by_expert_triton, ids, experts, block_m)
            torch_us = timed_us(align_by_expert, ids, experts, block_m)
            print(f"{model:>14} {tokens * top_k:>6} {block_m:>7} {triton_us:>9.2f} {torch_us:>9.2f} "
                  f"{torch_us / triton_us:>6.2f}")
            rows.append(dict(model=model, slots=tokens * top_k, block_m=block_m, triton_us=triton_us,
                             torch_us=torch_us))
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
