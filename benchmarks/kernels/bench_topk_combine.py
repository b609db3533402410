"""The MoE combine and the add + RMSNorm after it at TP1, as two launches or one
(layers/moe/kernels/triton_topk_combine.py), bf16, at each token count:

    two launches   `combine` (a program per token and 512 columns), then flashinfer's in-place
                   ``fused_add_rmsnorm`` (`fusion.norm.add_rms_norm`)
    one launch     `combine_add_rms_norm` (a program per token, the row in one block)

at gpt-oss's hidden size 2880 and top-4 (``--hidden``, ``--top-k``). Each call takes one of a cycle
of distinct inputs of at least 64 MB in all (fp32 partials of T * k rows, residuals; nothing left
in L2 by an earlier call); µs per call, one CUDA graph of the cycle, median of 10 replays, PDL off
(inside a decode step both take part in it); ``ratio`` = one launch / two launches.

    python -m arfusion.benchmarks.kernels.bench_topk_combine --tokens 1 8 32 128 512 4096 --out out/topk_combine.json
"""
from __future__ import annotations

import argparse

import torch

from arfusion.benchmarks.kernels.rows_file import write_rows
from arfusion.fusion.tuning.timing import median_us_per_call

BYTES_CYCLED = 64 << 20
EPS = 1e-5


def main() -> None:
    from arfusion.fusion import norm
    from arfusion.layers.moe.kernels.triton_topk_combine import combine, combine_add_rms_norm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 4096])
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_topk_combine needs a CUDA GPU")
    hidden, top_k = args.hidden, args.top_k
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16()
    rows = []
    print(f"{'tokens':>6} {'two launches us':>15} {'one launch us':>13} {'ratio':>6}")
    for tokens in args.tokens:
        per_call = tokens * hidden * (4 * top_k + 2)
        copies = max(4, -(-BYTES_CYCLED // per_call))
        partials = [torch.randn(1, tokens * top_k, hidden, device="cuda") for _ in range(copies)]
        weights = [torch.rand(tokens, top_k, device="cuda") for _ in range(copies)]
        residuals = [torch.randn(tokens, hidden, device="cuda").bfloat16() for _ in range(copies)]

        def two() -> None:
            for p, w, r in zip(partials, weights, residuals):
                norm.add_rms_norm(combine(p, w, torch.bfloat16), r, weight, EPS)

        def one() -> None:
            for p, w, r in zip(partials, weights, residuals):
                combine_add_rms_norm(p, w, r, weight, EPS)

        timed = {}
        for label, calls in (("two", two), ("one", one)):
            calls()  # compiled before capture
            timed[label] = median_us_per_call(calls, copies)
        print(f"{tokens:>6} {timed['two']:>15.2f} {timed['one']:>13.2f} {timed['one'] / timed['two']:>6.3f}")
        rows.append(dict(tokens=tokens, hidden=hidden, top_k=top_k, two_launches_us=timed["two"],
                         one_launch_us=timed["one"]))
        for inputs in (partials, weights, residuals):
            inputs.clear()
        torch.cuda.empty_cache()
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
