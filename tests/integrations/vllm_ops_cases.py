"""The vLLM plugin's custom ops on 2 ranks, against the reference, without vLLM: the ops take the
project's TP group (`integrations.vllm.runtime.group_source`), as they take vLLM's inside the
engine. Shared by the CPU test (gloo, the "torch" fusion backend) and the GPU test (flashinfer
and our strategies)."""
from __future__ import annotations

from typing import Any

import torch

from arfusion.fusion import reference

EPS = 1e-6
HIDDEN = 128
TOKENS = (1, 7, 33, 3000)  # 3000: beyond the flashinfer workspace's 2048 rows on GPU


def _inputs(rank: int, tokens: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """This rank's partial sum; the residual and weight every rank shares (seeded, never zeros)."""
    g = torch.Generator().manual_seed(seed * 10 + rank)
    shared = torch.Generator().manual_seed(seed * 10 + 9)
    x = torch.randn(tokens, HIDDEN, generator=g).to(device, torch.bfloat16)
    residual = torch.randn(tokens, HIDDEN, generator=shared).to(device, torch.bfloat16)
    weight = (1 + 0.2 * torch.randn(HIDDEN, generator=shared)).to(device, torch.bfloat16)
    return x, residual, weight


def _expected(tokens: int, world_size: int, device: torch.device, seed: int, with_residual: bool):
    xs = [_inputs(r, tokens, device, seed) for r in range(world_size)]
    total = sum(x.float() for x, _, _ in xs).to(torch.bfloat16)
    return reference.add_rms_norm(total, xs[0][1] if with_residual else None, xs[0][2], EPS)


def ops_match_reference(rank: int, world_size: int, compiled: bool) -> dict[str, Any]:
    """Every token count, with and without residual, eager (and through ``torch.compile`` with
    ``compiled``: the fake implementations and Inductor's handling of the mutated inputs).
    Returns the counters and the op's status."""
    from arfusion.integrations.vllm import ops, runtime
    from arfusion.layers.parallel_state import get_tp_group
    from tests.tolerances import assert_close

    group = get_tp_group()
    runtime.group_source = lambda: group
    device = group.device

    def with_residual(x, residual, weight):
        ops.all_reduce_add_rms_norm(x, residual, weight, EPS, 1)
        return x, residual

    def without_residual(x, weight):
        normed = ops.all_reduce_rms_norm(x, weight, EPS, 0)
        return normed, x

    runs = [(with_residual, without_residual)]
    if compiled:
        runs.append((torch.compile(with_residual, backend="inductor", fullgraph=True),
                     torch.compile(without_residual, backend="inductor", fullgraph=True)))
    for add_fn, first_fn in runs:
        for seed, tokens in enumerate(TOKENS):
            x, residual, weight = _inputs(rank, tokens, device, seed)
            normed, total = add_fn(x.clone(), residual.clone(), weight)
            expected = _expected(tokens, world_size, device, seed, True)
            assert_close(normed, expected[0])
            assert_close(total, expected[1])
            normed, total = first_fn(x.clone(), weight)
            expected = _expected(tokens, world_size, device, seed, False)
            assert_close(normed, expected[0])
            assert_close(total, expected[1])
    stats = runtime.stats()
    runtime.destroy_all()
    return stats
