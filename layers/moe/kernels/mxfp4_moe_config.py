"""Tiles and variants of gpt-oss's experts kernel (layers/moe/kernels/triton_mxfp4_moe.py, whose
module docstring describes each variant): the configuration, the default chooser and the limits
a configuration must meet. Pure Python: nothing here needs triton or a GPU."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mxfp4MoEConfig:
    """Tiles and variant of the launches (the kernel module's docstring). ``block_m``: token rows per block
    (a power of two; at least 16 unless ``swap``); ``block_n_*``: output rows of W per program
    (of each of gate and up); ``block_k_*``: K per step (MXFP4: a multiple of 32, and at least
    128 with ``word_decode``); ``swap``: the weight the left operand; ``word_decode``: MXFP4
    decoded from 32-bit words; ``split_k_down``: K splits of the down projection."""

    block_m: int
    block_n_gate_up: int
    block_k_gate_up: int
    block_n_down: int
    block_k_down: int
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False
    word_decode: bool = False
    split_k_down: int = 1


def experts_block_config(num_slots: int, num_experts: int, mxfp4: bool = True) -> Mxfp4MoEConfig:
    """Tiles by the mean rows per expert (``num_slots / num_experts``), chosen by the sweep of
    benchmarks/kernels/bench_mxfp4_moe.py (``--sweep``) at gpt-oss-20b's shapes on 1 × H200,
    MXFP4 weights (µs per call; the best of 7 to 14 configurations at each point):

        tokens  rows/expert  chosen                                         µs     % of 4.8 TB/s
        1       0.125        x @ W^T, bytes, m 16, n 32, k 128, 4 warps     85.2   12.9
        8       1            (the same)                                     335.5  17.2
        32      4            (the same)                                     544.8  15.9
        128     16           W @ x^T, words, m 16, n 64, k 256, 4 warps     868.3  10.2 (1.30x)
        512     64           W @ x^T, words, m 64, n 64, k 256, 4 warps     1457.2 6.1  (2.75x)

    (the speed-ups over the tiles used before: x @ W^T with the byte decoder, m 16 / 32). Up
    to 4 rows no variant beat the tiles of the first row (the weight as the left operand, the word decoder,
    token blocks of 8 or 1, K splits, 16 .. 128 rows and K steps of 128 .. 512 were all slower).
    The switch points between the measured rows (8 and 32 rows per expert) are not measured.
    bf16-form weights (not swept) keep the tiles from before: 16-row blocks up to 16 rows per
    expert, then 32 and 64, 64-column tiles and 8 warps past 16 rows."""
    rows_per_expert = num_slots / num_experts
    if mxfp4 and rows_per_expert > 8:
        return Mxfp4MoEConfig(block_m=16 if rows_per_expert <= 32 else 64, block_n_gate_up=64, block_k_gate_up=256,
                              block_n_down=64, block_k_down=256, num_warps=4, num_stages=3, swap=True,
                              word_decode=True)
    if rows_per_expert <= 16:
        return Mxfp4MoEConfig(block_m=16, block_n_gate_up=32, block_k_gate_up=128, block_n_down=32, block_k_down=128,
                              num_warps=4, num_stages=4)
    return Mxfp4MoEConfig(block_m=32 if rows_per_expert <= 64 else 64, block_n_gate_up=64, block_k_gate_up=128,
                          block_n_down=64, block_k_down=128, num_warps=8, num_stages=3)


def check_config(cfg: Mxfp4MoEConfig, mxfp4: bool) -> None:
    """ValueError naming the field when ``cfg`` cannot run (`Mxfp4MoEConfig`'s limits)."""
    for name in ("block_m", "block_n_gate_up", "block_k_gate_up", "block_n_down", "block_k_down"):
        value = getattr(cfg, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if not cfg.swap and cfg.block_m < 16:
        raise ValueError(f"block_m below 16 ({cfg.block_m}) needs swap=True (the token rows are the MMA's M side)")
    if cfg.split_k_down < 1:
        raise ValueError(f"split_k_down must be at least 1, got {cfg.split_k_down}")
    least = (128 if cfg.word_decode else 32) if mxfp4 else 16
    for name in ("block_k_gate_up", "block_k_down"):
        if getattr(cfg, name) < least:
            raise ValueError(f"{name} must be at least {least} here ({'MXFP4' if mxfp4 else 'bf16'} weights"
                             f"{', word decoder' if mxfp4 and cfg.word_decode else ''}), got {getattr(cfg, name)}")
