"""The MoE routing's two paths at each token count (layers/moe/kernels/triton_router.py), bf16, with
the slots grouped by expert as the experts' grouped launches need them (``--ungrouped``: without
the grouping, as the matrix-vector expert launches take the routing):

    one launch     `route_triton(..., one_launch=True)` whatever the token count (up to FUSED_MAX_SLOTS
                   slots): the logits' partials, then the last program's selection (SELECT_ELEMENTS
                   // E logits a step, one step after another) and grouping
    two launches   the partials, the selection by blocks of tokens, then the experts' own grouping
                   launch (`triton_align.align_by_expert_triton`; none with ``--ungrouped``)
    default        whichever of the two `route_triton` takes by default (`takes_one_launch`)

at the routers of qwen3-30b-a3b (128 experts, hidden 2048, top-8), gpt-oss-20b (32, 2880, top-4, a
bias), gpt-oss-120b (128, 2880, top-4, a bias) and mixtral-8x7b (8, 4096, top-2). Each call routes
one of a cycle of distinct gate weights and hidden states of at least 64 MB in all (nothing left in
L2 by an earlier call, as in a decode step, where the experts' weights evict the gate); µs per
call, one CUDA graph of the cycle, median of 10 replays; ``ratio`` = two launches / one launch.

    python -m arfusion.benchmarks.kernels.bench_routing --tokens 1 8 16 24 32 64 128 256 --out out/routing.json
    python -m arfusion.benchmarks.kernels.bench_routing --ungrouped --tokens 1 2 3 4
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

from arfusion.benchmarks.kernels.rows_file import write_rows
from arfusion.fusion.tuning.timing import median_us_per_call

ROUTERS = {"qwen3-30b-a3b": (128, 2048, 8, False), "gpt-oss-20b": (32, 2880, 4, True),
           "gpt-oss-120b": (128, 2880, 4, True), "mixtral-8x7b": (8, 4096, 2, False)}  # (E, hidden, top-k, bias)
BYTES_CYCLED = 64 << 20


def route_and_group(h: torch.Tensor, gate: torch.Tensor, bias: Optional[torch.Tensor], top_k: int,
                    block_m: Optional[int], counter: torch.Tensor, one_launch: bool) -> None:
    """The routing of ``h`` on the path ``one_launch`` names with the slots grouped in ``block_m``
    rows: by the routing launch on the one-launch path, else by the experts' grouping launch;
    ``block_m`` None: not grouped."""
    from arfusion.layers.moe.kernels.triton_align import align_by_expert_triton
    from arfusion.layers.moe.kernels.triton_router import route_triton

    _, ids, blocks = route_triton(h, gate, top_k, True, counter, block_m, bias, one_launch=one_launch)
    if blocks is None and block_m is not None:
        align_by_expert_triton(ids, gate.shape[0], block_m)


def main() -> None:
    from arfusion.layers.moe.kernels.triton_fused_moe import block_config
    from arfusion.layers.moe.kernels.triton_router import FUSED_MAX_SLOTS, takes_one_launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(ROUTERS), default=list(ROUTERS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 24, 32, 64, 96, 128, 256])
    parser.add_argument("--ungrouped", action="store_true", help="time the routing without the grouping by expert")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_routing needs a CUDA GPU")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    print(f"{'model':>14} {'tokens':>6} {'one launch us':>13} {'two launches us':>15} {'ratio':>6}  default")
    for model in args.models:
        experts, hidden, top_k, has_bias = ROUTERS[model]
        copies = max(4, -(-BYTES_CYCLED // (experts * hidden * 2)))
        gates = [torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
                 for _ in range(copies)]
        biases = [torch.randn(experts, device="cuda", dtype=torch.bfloat16) if has_bias else None for _ in gates]
        for tokens in args.tokens:
            block_m = None if args.ungrouped else block_config(tokens * top_k, experts).block_m
            hs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(min(copies, 16))]

            def cycle(one_launch: bool) -> None:
                for i, (gate, bias) in enumerate(zip(gates, biases)):
                    route_and_group(hs[i % len(hs)], gate, bias, top_k, block_m, counter, one_launch)

            timed = {}
            for label, one_launch in (("one", True), ("two", False)):
                if one_launch and tokens * top_k > FUSED_MAX_SLOTS:
                    continue
                cycle(one_launch)  # compiled before capture
                timed[label] = median_us_per_call(lambda: cycle(one_launch), len(gates))
            default = "one launch" if takes_one_launch(tokens, top_k, block_m is not None) else "two launches"
            one = timed.get("one", float("nan"))
            print(f"{model:>14} {tokens:>6} {one:>13.2f} {timed['two']:>15.2f} {timed['two'] / one:>6.2f}  {default}")
            rows.append(dict(model=model, tokens=tokens, block_m=block_m, grouped=not args.ungrouped,
                             one_launch_us=timed.get("one"),
                             two_launches_us=timed["two"], default=default))
        gates.clear()
        biases.clear()
        torch.cuda.empty_cache()
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
