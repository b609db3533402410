"""Tiles and variants of gpt-oss's experts kernel (layers/moe/kernels/triton_mxfp4_moe.py, whose
module docstring describes each variant): the configuration, the default chooser and the limits
a configuration must meet. Pure Python: nothing here needs triton or a GPU."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class Mxfp4MoEConfig:
    """Tiles and variant of the launches (the kernel module's docstring). ``block_m``: token rows
    per block (a power of two; at least 16 unless ``swap``); ``block_n_*``: output rows of W per
    program (of each of gate and up); ``block_k_*``: K per step (MXFP4: a multiple of 32, and at
    least 128 with ``word_decode``); ``swap``: the weight the left operand; ``word_decode``:
    MXFP4 decoded from 32-bit words; ``split_k_down``: K splits of the down projection;
    ``num_warps`` and ``num_stages``: the gate/up launch's, and the down launch's unless
    ``num_warps_down`` / ``num_stages_down`` are set (0: the same). ``gemv``: the matrix-vector
    launches of layers/moe/kernels/triton_mxfp4_gemv.py instead (a program per slot and
    ``block_n_*`` rows, ``block_k_*`` columns a K step, the warps as above; ``block_m``, ``swap``,
    ``word_decode`` and the stages unused, no K splits). ``tensor_cores``: the grouped launches of
    layers/moe/kernels/gluon_mxfp4_experts.py instead (MXFP4 only; rows grouped by expert in
    blocks of ``block_m`` = 8 to 64, the MMA's N side; ``block_n_*`` a multiple of 16 x the warps;
    ``block_k_*`` 32 to 512, the K steps up to the last multiple of it, then a step of each power
    of two in the rest; no swap, word decoder or K splits; the stages unused).
    ``prefetch`` (``tensor_cores`` only): each K step's weights, scales and activations loaded one
    step ahead, while the step before is decoded and multiplied. ``early_weights`` (``gemv``
    only, and only where the launches take PDL): the down launch loads its slot's expert id and
    first K step of weights before its wait on the gate/up launch (layers/kernels/pdl.py)."""

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
    num_warps_down: int = 0
    num_stages_down: int = 0
    gemv: bool = False
    tensor_cores: bool = False
    prefetch: bool = False
    early_weights: bool = False


# Decode-sized defaults for MXFP4 weights: (the most rows per expert an entry serves, its
# configuration), ascending; `decode_block_config` takes the first that fits. The one entry is the
# configuration measured best up to 4 rows per expert (`experts_block_config`'s table), used up to
# 8 rows as before.
DECODE_CONFIGS: tuple[tuple[float, Mxfp4MoEConfig], ...] = (
    (8.0, Mxfp4MoEConfig(block_m=16, block_n_gate_up=32, block_k_gate_up=128, block_n_down=32, block_k_down=128,
                         num_warps=4, num_stages=4)),
)


# The matrix-vector launches (``gemv``) serve MXFP4 calls of at most this many slots (tokens x
# top-k): they read an expert's weights once per slot that uses it, so past a few tokens the
# grouped launches, which read them once per expert, take over. Tiles and bound from the GPU sweep
# of benchmarks/kernels/bench_mxfp4_moe.py (docs/results.md, gpt-oss section): 8 rows, K steps of
# 1024 columns (128 words), 2 warps: as fast as the best of 5 tiles at 1, 2, 4 and 8 tokens (within
# 3 %) and faster than the grouped launches at each; the down launch takes 16 rows a program since
# its K loop got leaner (docs/results.md, "The matrix-vector experts' K loop"); bf16-form weights
# stay on the grouped launches, faster there.
GEMV_MAX_SLOTS = 32
GEMV_CONFIG = Mxfp4MoEConfig(block_m=1, block_n_gate_up=8, block_k_gate_up=1024, block_n_down=16, block_k_down=1024,
                             num_warps=2, gemv=True, early_weights=True)

# From this many slots MXFP4 experts take the tensor-core launches (`tensor_core_config`) where
# they can run (bf16 activations, K a multiple of 32, scales up to 2^1; else the launches above):
# on the GPU benchmark of benchmarks/kernels/bench_mxfp4_moe.py (docs/results.md, gpt-oss), with
# K steps of 512 up to LONG_K_MAX_SLOTS slots, they were slower than the matrix-vector launches at
# 1 token of gpt-oss-20b (4 slots) and faster at 2 and 4 (8 and 16 slots), as with K steps of 64
# from 8 tokens on and against the grouped launches at every larger count.
TENSOR_CORE_MIN_SLOTS = 8
# K steps of the tensor-core launches: the few programs of a small call need many bytes in flight
# (docs/notes.md, gpt-oss). On the same benchmark, 512 columns were the fastest at 4, 8 and 16
# slots; past them 256 (1.06-1.30x steps of 64) wherever the mean rows per expert were at most
# MID_K_MAX_ROWS (32 to 1,024 slots of gpt-oss-20b and -120b), 64 above (256 0.53-0.89x there).
LONG_K_MAX_SLOTS = 16
MID_K_MAX_ROWS = 8

# The tensor-core launches load each K step one step ahead (``prefetch``) where the slots are
# expected to reach at least this many experts (`expected_active_experts`): on the GPU benchmark
# (docs/results.md, gpt-oss) faster at every measured batch of gpt-oss-20b and -120b past the
# bound and slower or equal at every one below it; the slot count alone does not separate the two
# models (32 slots: slower over 32 experts, faster over 128).
PREFETCH_MIN_ACTIVE_EXPERTS = 24.0


def expected_active_experts(num_slots: int, num_experts: int) -> float:
    """The expected number of the ``num_experts`` experts that get at least one of ``num_slots``
    slots drawn uniformly and independently: ``E * (1 - (1 - 1/E) ** S)``."""
    return num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** num_slots)


def decode_block_config(rows_per_expert: float) -> Optional[Mxfp4MoEConfig]:
    """The first entry of `DECODE_CONFIGS` whose bound is at least ``rows_per_expert`` (MXFP4
    weights); None past the last bound."""
    for most_rows, config in DECODE_CONFIGS:
        if rows_per_expert <= most_rows:
            return config
    return None


def experts_block_config(num_slots: int, num_experts: int, mxfp4: bool = True,
                         deterministic: bool = False) -> Mxfp4MoEConfig:
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
    expert, then 32 and 64, 64-column tiles and 8 warps past 16 rows.

    MXFP4 up to 8 rows per expert: `decode_block_config`.

    MXFP4 up to `GEMV_MAX_SLOTS` slots, outside batch-invariant mode: `GEMV_CONFIG` (a slot's result
    then depends on its own token alone, but its sums over K run in another order than the
    grouped launches', so batch-invariant mode does not take it and keeps the tiles above).

    Batch-invariant mode (``deterministic``): the tiles above with `BATCH_INVARIANT_VARIANT`, so
    that an output element's sums take the same k-chunks in the same order at every batch size:
    the token rows the MMA's M side, the byte decoder, K steps of 128 in both launches, no K
    splits (what still follows the rows: the M/N tiles, warps and stages, and with them mma.sync or
    wgmma, as in layers/moe/kernels/triton_fused_moe.py's docstring)."""
    if mxfp4 and num_slots <= GEMV_MAX_SLOTS and not deterministic:
        return GEMV_CONFIG
    chosen = _default_grouped_config(num_slots / num_experts, mxfp4)
    return replace(chosen, **BATCH_INVARIANT_VARIANT) if deterministic else chosen


# What batch-invariant mode pins in every grouped configuration (`experts_block_config`)
BATCH_INVARIANT_VARIANT = dict(swap=False, word_decode=False, block_k_gate_up=128, block_k_down=128, split_k_down=1)


def _default_grouped_config(rows_per_expert: float, mxfp4: bool) -> Mxfp4MoEConfig:
    """The grouped launches' tiles for ``rows_per_expert`` (`experts_block_config`'s table)."""
    decode = decode_block_config(rows_per_expert) if mxfp4 else None
    if decode is not None:
        return decode
    if mxfp4:
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
    if not cfg.swap and not cfg.gemv and not cfg.tensor_cores and cfg.block_m < 16:
        raise ValueError(f"block_m below 16 ({cfg.block_m}) needs swap=True (the token rows are the MMA's M side)")
    if cfg.split_k_down < 1:
        raise ValueError(f"split_k_down must be at least 1, got {cfg.split_k_down}")
    for name in ("num_warps", "num_stages", "num_warps_down", "num_stages_down"):
        if getattr(cfg, name) < (0 if name.endswith("_down") else 1):
            raise ValueError(f"{name} must be at least {0 if name.endswith('_down') else 1}, got {getattr(cfg, name)}")
    if cfg.gemv and cfg.split_k_down > 1:
        raise ValueError("gemv has no K splits (split_k_down must be 1)")
    if cfg.early_weights and not cfg.gemv:
        raise ValueError("early_weights is a variant of the matrix-vector launches (gemv=True)")
    if cfg.tensor_cores:
        _check_tensor_cores(cfg, mxfp4)
    elif cfg.prefetch:
        raise ValueError("prefetch is a variant of the tensor-core launches (tensor_cores=True)")
    least = (128 if cfg.word_decode and not cfg.gemv else 32) if mxfp4 else 16
    for name in ("block_k_gate_up", "block_k_down"):
        if getattr(cfg, name) < least:
            raise ValueError(f"{name} must be at least {least} here ({'MXFP4' if mxfp4 else 'bf16'} weights"
                             f"{', word decoder' if mxfp4 and cfg.word_decode else ''}), got {getattr(cfg, name)}")


def _check_tensor_cores(cfg: Mxfp4MoEConfig, mxfp4: bool) -> None:
    """ValueError naming what a ``tensor_cores`` configuration (`Mxfp4MoEConfig`) may not have."""
    if not mxfp4:
        raise ValueError("tensor_cores takes MXFP4 weights only")
    if cfg.gemv or cfg.swap or cfg.word_decode or cfg.split_k_down != 1:
        raise ValueError("tensor_cores has no gemv, swap, word_decode or K splits")
    if cfg.block_k_gate_up > 512 or cfg.block_k_down > 512:
        raise ValueError("tensor_cores takes K steps of 32 to 512 columns (at most 16 words a thread and row)")
    if not 8 <= cfg.block_m <= 64:
        raise ValueError(f"tensor_cores groups rows in blocks of 8 to 64 (block_m), got {cfg.block_m}")
    for name, warps in (("block_n_gate_up", cfg.num_warps), ("block_n_down", cfg.num_warps_down or cfg.num_warps)):
        if getattr(cfg, name) % (16 * warps):
            raise ValueError(f"{name} must be a multiple of 16 x its {warps} warps, got {getattr(cfg, name)}")


def tensor_core_config(num_slots: int, num_experts: int, hidden: int, inter: int,
                       batch_invariant: bool = False) -> Mxfp4MoEConfig:
    """The tensor-core launches' tiles (``tensor_cores``) for ``num_slots`` slots (tokens x top-k)
    over ``num_experts`` experts at a hidden size and a rank's intermediate size that are multiples
    of 32: rows grouped in blocks of 8, 16, 32 or 64 (the first that holds the mean rows per expert,
    ``num_slots / num_experts``), 64 output rows a program on 4 warps, K steps of 64 where K allows,
    else 32 (the same at every batch), and each K step loaded one step ahead (``prefetch``: the
    same products in the same order) where the slots are expected to reach
    `PREFETCH_MIN_ACTIVE_EXPERTS` experts. Batch-invariant mode takes them too: the blocks and the
    prefetch follow the batch but a row's sums do not (layers/moe/kernels/gluon_mxfp4_experts.py).
    Within a few % of the best of seven tiles on the GPU benchmark at 16, 32 and 128 tokens
    (docs/results.md, gpt-oss). Outside batch-invariant mode, K steps of 512 columns up to
    `LONG_K_MAX_SLOTS` slots and of 256 up to `MID_K_MAX_ROWS` rows per expert (the rest of K in
    steps of its powers of two); batch-invariant mode keeps one K step at every batch (``batch_invariant``)."""
    rows_per_expert = num_slots / num_experts
    block_m = next((m for m in (8, 16, 32) if rows_per_expert <= m), 64)
    if batch_invariant or rows_per_expert > MID_K_MAX_ROWS:
        k_gate_up, k_down = (64 if hidden % 64 == 0 else 32), (64 if inter % 64 == 0 else 32)
    else:
        k_gate_up = k_down = 512 if num_slots <= LONG_K_MAX_SLOTS else 256
    # (up to LONG_K_MAX_SLOTS slots fewer than PREFETCH_MIN_ACTIVE_EXPERTS experts are active: no prefetch)
    return Mxfp4MoEConfig(block_m=block_m, block_n_gate_up=64, block_k_gate_up=k_gate_up, block_n_down=64,
                          block_k_down=k_down, num_warps=4, tensor_cores=True,
                          prefetch=expected_active_experts(num_slots, num_experts) >= PREFETCH_MIN_ACTIVE_EXPERTS)
