"""The ways one reduction point (all-reduce + residual add + RMSNorm) can run.

    nccl                 tensor_model_parallel_all_reduce, then fused_add_rmsnorm (unfused)
    flashinfer_oneshot   flashinfer's trtllm fused kernel, one-shot (Lamport, every rank reads all)
    flashinfer_twoshot   the same kernel, two-shot (reduce-scatter + all-gather; tokens > ranks)
    symm_mem_two_shot    torch symmetric-memory two-shot all-reduce, then fused_add_rmsnorm
    symm_mem_fused       our Triton two-shot over symmetric memory with the add + RMSNorm fused
                         (fusion/two_shot_norm_kernels.py)

Only ``nccl`` keeps NCCL's summation order (deterministic mode) and runs everywhere.
"""
from __future__ import annotations

NCCL = "nccl"
FLASHINFER_ONESHOT = "flashinfer_oneshot"
FLASHINFER_TWOSHOT = "flashinfer_twoshot"
SYMM_MEM_TWO_SHOT = "symm_mem_two_shot"
SYMM_MEM_FUSED = "symm_mem_fused"
TORCH_FUSED = "torch_fused"  # the torch backend's one-function form (CPU tests, GPUs without flashinfer)

STRATEGIES = (NCCL, FLASHINFER_ONESHOT, FLASHINFER_TWOSHOT, SYMM_MEM_TWO_SHOT, SYMM_MEM_FUSED, TORCH_FUSED)
FLASHINFER_STRATEGIES = (FLASHINFER_ONESHOT, FLASHINFER_TWOSHOT)
