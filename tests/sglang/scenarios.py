"""What each SGLang TP rank runs in the two-rank tests (`tests.sglang.ranks`): SGLang's real
functions, after its ``load_plugins()`` applied our hooks. Each returns plain values for the
test to assert on; the unfused reference is SGLang's own: ``tensor_model_parallel_all_reduce``
then ``RMSNorm.forward_native``."""
from __future__ import annotations

from typing import Any

import torch

HIDDEN = 256
EPS = 1e-6


def _inputs(rank: int, tokens: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's partial sum (differs by rank), the residual and norm weight (same on every rank)."""
    partial = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)
    residual = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7)).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(8))).to(dtype)
    return partial, residual, weight


def _sglang_unfused(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from sglang.srt.distributed import tensor_model_parallel_all_reduce
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(partial.shape[1], eps=EPS).to(partial.dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm.forward_native(tensor_model_parallel_all_reduce(partial.clone()), residual.clone())


def _sglang_fused(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's fused entry: ``RMSNorm.forward_with_allreduce_fusion`` (which calls the fused
    call, ours after the hooks)."""
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(partial.shape[1], eps=EPS).to(partial.dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm.forward_with_allreduce_fusion(partial.clone(), residual.clone())


def hooks_applied(rank: int) -> list[str]:
    """The targets SGLang's own ``HookRegistry`` patched after ``load_plugins()``."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return sorted(HookRegistry._patched)


def fused_matches_unfused(rank: int) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
    """Per dtype and token count: SGLang's fused entry (our op, made by SGLang's
    ``pre_initialize_workspaces``) and SGLang's unfused math, and how the op ran them."""
    import sglang.srt.layers.flashinfer_comm_fusion as fc

    from arfusion.integrations.sglang import runtime

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        fc.pre_initialize_workspaces(max_token_num=64, hidden_dim=HIDDEN, dtype=dtype)
        op = runtime.fusion_op()
        for tokens in (1, 8, 64):
            args = _inputs(rank, tokens, HIDDEN, dtype)
            before = sum(op.counts.values())
            normed, residual = _sglang_fused(*args)
            ref_normed, ref_residual = _sglang_unfused(*args)
            out.append((str(dtype), tokens, {"normed": normed, "ref_normed": ref_normed, "residual": residual,
                                             "ref_residual": ref_residual,
                                             "op_reductions": torch.tensor(sum(op.counts.values()) - before)}))
    return out


def fallbacks(rank: int) -> dict[str, Any]:
    """Calls our op cannot take: each is still reduced (SGLang's all-reduce + norm, or our NCCL
    strategy), never handed back unreduced."""
    import sglang.srt.layers.flashinfer_comm_fusion as fc

    from arfusion.fusion import Strategy
    from arfusion.integrations.sglang import runtime

    fc.pre_initialize_workspaces(max_token_num=64, hidden_dim=HIDDEN, dtype=torch.float32)
    op = runtime.fusion_op()
    cases: dict[str, Any] = {}
    partial, residual, weight = _inputs(rank, 8, HIDDEN, torch.float32)
    strided = torch.stack([partial, -partial], dim=2).flatten(1)[:, ::2]  # the partial sum's values, not contiguous
    assert not strided.is_contiguous() and torch.equal(strided, partial)
    cases["not contiguous"] = (fc.flashinfer_allreduce_residual_rmsnorm(strided, residual.clone(), weight, EPS),
                               _sglang_unfused(partial, residual, weight))
    nccl_before = op.counts[Strategy.NCCL]
    big = _inputs(rank, 100, HIDDEN, torch.float32)  # more tokens than the op's backends hold
    cases["beyond capacity"] = (fc.flashinfer_allreduce_residual_rmsnorm(big[0].clone(), big[1].clone(), big[2], EPS),
                                _sglang_unfused(*big))
    other = _inputs(rank, 8, HIDDEN // 2, torch.float32)  # a hidden size the op was not made for
    cases["other hidden"] = (fc.flashinfer_allreduce_residual_rmsnorm(other[0].clone(), other[1].clone(), other[2], EPS),
                             _sglang_unfused(*other))
    fc.cleanup_flashinfer_workspace()
    after = _inputs(rank, 8, HIDDEN, torch.float32)
    cases["after cleanup"] = (fc.flashinfer_allreduce_residual_rmsnorm(after[0].clone(), after[1].clone(), after[2], EPS),
                              _sglang_unfused(*after))
    return {"cases": cases, "nccl_strategy_runs": op.counts[Strategy.NCCL] - nccl_before,
            "unfused_by_plugin": dict(runtime.unfused)}


def gate_and_lifecycle(rank: int) -> dict[str, Any]:
    """SGLang's real gate on this CPU, our gate with SGLang's conditions holding, keyed on
    (layer, batch), and the op's life cycle through SGLang's real entry points."""
    import sglang.srt.layers.communicator as comm
    import sglang.srt.layers.flashinfer_comm_fusion as fc

    from arfusion.integrations.sglang import hooks, layer_scope, runtime

    result: dict[str, Any] = {"before_pre_init": runtime.fusion_op() is None}
    fc.pre_initialize_workspaces(max_token_num=4096, hidden_dim=HIDDEN, dtype=torch.float32)
    op = runtime.fusion_op()
    result["created"] = op is not None and op.active
    result["sglang_gate_on_cpu"] = comm.apply_flashinfer_allreduce_fusion(8)

    # Stand-in for SGLang's own conditions holding (an sm90 GPU, flashinfer, its flag): they read
    # the CUDA device, which this machine has not; the rest of the gate is ours.
    def sglang_conditions_hold(batch_size: int) -> bool:
        return True

    result["gate"] = {n: hooks.gate(sglang_conditions_hold, n) for n in (0, 1, 8, 3000, 4096, 4097)}
    misses = op.cache_info().misses
    with layer_scope.scope(3):
        hooks.gate(sglang_conditions_hold, 8)
        hooks.gate(sglang_conditions_hold, 8)
    info = op.cache_info()
    result["new_layer_misses"] = info.misses - misses
    fc.cleanup_flashinfer_workspace()
    result["destroyed"] = runtime.fusion_op() is None and not op.active
    result["gate_after_cleanup"] = hooks.gate(sglang_conditions_hold, 8)
    return result
