"""The batch-invariant matmul's K splits (layers/kernels/triton_bi_matmul.py) against their
definition, bit for bit, on any device the kernel runs on: with S splits of Ks columns, the result
is ``((P_0 + P_1) + ...) + P_{S-1} (+ b)`` in fp32 where P_s is the unsplit kernel's result on
split s's columns alone (fp32 inputs and output, so P_s is the kernel's own fp32 sum, unrounded);
the sum over the splits is added by the tile's last program to arrive. Shared by the CPU test
(Triton interpreter, tests/test_bi_matmul_split_order.py) and the GPU one
(tests/gpu/test_bi_matmul_split_order.py)."""
from __future__ import annotations

import torch

# (M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, S): several tiles in M and N with masked edges; an
# uneven last split; S = 3 with a split past K (empty: its partial is zero)
CASES = [(9, 40, 96, 16, 16, 32, 2), (33, 48, 160, 16, 32, 32, 3), (5, 24, 64, 16, 16, 32, 3)]


def split_sum_mismatches(device: torch.device, repeats: int = 1) -> list[str]:
    """The cases (and repeat) whose result differs in any bit from the definition, or whose arrival
    counters are not all zero after the call; empty when all match."""
    import triton

    from arfusion.layers.kernels import triton_bi_matmul as bm

    bad = []
    gen = torch.Generator().manual_seed(3)
    for m, n, k, block_m, block_n, block_k, splits in CASES:
        x = torch.randn(m, k, generator=gen).to(device)
        w = torch.randn(n, k, generator=gen).to(device)
        b = torch.randn(n, generator=gen).to(device)
        width = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
        whole = bm.MatmulConfig(block_m, block_n, block_k, 1, 4, 1)
        expected = None
        for s in range(splits):
            cols = slice(min(s * width, k), min((s + 1) * width, k))
            part = (bm.matmul(x[:, cols].contiguous(), w[:, cols].contiguous(), None, whole) if cols.start < k
                    else torch.zeros(m, n, device=device))
            expected = part if expected is None else expected + part
        expected = expected + b
        for r in range(repeats):
            got = bm.matmul(x, w, b, bm.MatmulConfig(block_m, block_n, block_k, splits, 4, 1))
            if not torch.equal(got, expected):
                bad.append(f"{(m, n, k, block_m, block_n, block_k, splits)} repeat {r}: max |diff| "
                           f"{(got - expected).abs().max().item()}")
        if bm.ARRIVALS.get(x.device, 1).count_nonzero().item():
            bad.append(f"{(m, n, k, splits)}: arrival counters left non-zero")
    return bad
