"""flashinfer fused all-reduce + residual + RMSNorm on 2 GPUs, against an fp32 reference.

One spawn of 2 NCCL ranks runs every case (process start-up and JIT loading dominate), and
each parametrized test then checks its own case's result.
"""
import itertools

import pytest
import torch

from tests.dist_utils import gpu_world_size, run_distributed

pytestmark = pytest.mark.tp_ranks(gpu_world_size())  # one rank per GPU, or ranks sharing a GPU

DTYPES = [torch.bfloat16, torch.float16]
HIDDENS = [1024, 4096, 8192]
TOKENS = [1, 7, 128, 1024, 4096]
ONESHOT = [True, False]
RESIDUAL = [True, False]
EPS = 1e-6
CASES = [c for c in itertools.product(DTYPES, HIDDENS, TOKENS, ONESHOT, RESIDUAL) if c[3] or c[2] > gpu_world_size()]


def make_inputs(rank, tokens, hidden, dtype, seed, device):
    g = torch.Generator(device="cpu").manual_seed(seed * 10 + rank)
    shared = torch.Generator(device="cpu").manual_seed(seed * 10 + 9)
    x = torch.randn(tokens, hidden, generator=g)
    residual = torch.randn(tokens, hidden, generator=shared)
    weight = 1 + 0.2 * torch.randn(hidden, generator=shared)
    return x.to(device, dtype), residual.to(device, dtype), weight.to(device, dtype)


def fp32_reference(tokens, hidden, dtype, seed, residual_on, world_size, device):
    """normed and residual_out computed in fp32 from the same (dtype-rounded) inputs."""
    xs = [make_inputs(r, tokens, hidden, dtype, seed, device) for r in range(world_size)]
    s = sum(x.float() for x, _, _ in xs)
    residual, weight = xs[0][1], xs[0][2]
    res_out = s + residual.float() if residual_on else s
    normed = res_out * torch.rsqrt(res_out.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
    return normed, res_out


def rel_l2(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


def _all_cases(rank, world_size):
    from arfusion.fusion import AllReduceFusionWorkspace, Strategy, all_reduce_add_rms_norm
    from arfusion.layers.parallel_state import get_tp_group

    group = get_tp_group()
    dev = group.device
    results = {}
    workspaces = {}
    for dtype in DTYPES:
        ws = AllReduceFusionWorkspace(group)
        assert ws.ensure(max(TOKENS), max(HIDDENS), dtype), ws.failure
        workspaces[dtype] = ws
    for seed, (dtype, hidden, tokens, one_shot, residual_on) in enumerate(CASES):
        x, residual, weight = make_inputs(rank, tokens, hidden, dtype, seed, dev)
        ref_normed, ref_res = fp32_reference(tokens, hidden, dtype, seed, residual_on, world_size, dev)
        res = residual if residual_on else None
        strategy = Strategy.FLASHINFER_ONE_SHOT if one_shot else Strategy.FLASHINFER_TWO_SHOT
        normed, res_out, _ = all_reduce_add_rms_norm(
            x.clone(), None if res is None else res.clone(), weight, EPS, group=group, strategy=strategy,
            workspace=workspaces[dtype],
        )
        un_normed, un_res, _ = all_reduce_add_rms_norm(
            x.clone(), None if res is None else res.clone(), weight, EPS, group=group, strategy=Strategy.NCCL
        )
        torch.cuda.synchronize()
        rtol, atol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (1e-2, 1e-2)
        err = None
        try:
            torch.testing.assert_close(normed.float(), ref_normed, rtol=rtol, atol=atol)
            torch.testing.assert_close(res_out.float(), ref_res, rtol=rtol, atol=atol)
        except AssertionError as e:
            err = str(e)[:500]
        results[(str(dtype), hidden, tokens, one_shot, residual_on)] = {
            "error": err,
            "fused_rel_l2": rel_l2(normed, ref_normed),
            "unfused_rel_l2": rel_l2(un_normed, ref_normed),
        }
    for ws in workspaces.values():
        ws.destroy()
    return results


@pytest.fixture(scope="module")
def case_results():
    return run_distributed(_all_cases, world_size=gpu_world_size(), device_kind="cuda", timeout_s=400)


@pytest.mark.parametrize("dtype,hidden,tokens,one_shot,residual_on", CASES)
def test_fused_matches_fp32_reference(case_results, dtype, hidden, tokens, one_shot, residual_on):
    for rank_results in case_results:
        r = rank_results[(str(dtype), hidden, tokens, one_shot, residual_on)]
        assert r["error"] is None, r["error"]


def test_fused_error_at_most_1_5x_unfused(case_results):
    """Aggregate over all cases with >= 128 tokens (enough elements for a stable L2)."""
    fused = [v["fused_rel_l2"] for k, v in case_results[0].items() if k[2] >= 128]
    unfused = [v["unfused_rel_l2"] for k, v in case_results[0].items() if k[2] >= 128]
    assert sum(fused) / len(fused) <= 1.5 * sum(unfused) / len(unfused), (sum(fused) / len(fused), sum(unfused) / len(unfused))
