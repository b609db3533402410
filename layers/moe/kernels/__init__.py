"""Triton kernels of the MoE layer (their torch references: layers/moe/torch_experts.py, layers/moe/align.py)."""
