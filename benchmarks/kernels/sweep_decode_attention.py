"""Sweep the Triton decode attention's launch parameters on one GPU: split count, keys per block,
warps and pipeline stages, per (batch, context), by default at llama3-8b TP2 head shapes (16
query heads, 4 KV heads, head dim 128, bf16); ``--heads``, ``--kv-heads``, ``--head-dim``,
``--window`` (a sliding window of that many keys) and ``--sinks`` (random per-head sink logits)
set another model's layer, e.g. gpt-oss's sliding layers: ``--heads 64 --kv-heads 8 --head-dim 64
--window 128 --sinks``; ``--combine in-split`` / ``launch`` times the combine of several splits
inside the split launch / as a launch of its own instead of the group size's default
(`triton_decode_attention.combine_in_split_for`). Each time is `time_decode_attention` (µs per call, a CUDA graph of 32
calls cycling over caches larger than L2). Prints, per shape, the shape-based default's time
(`plan_splits`: the split count for the keys a row can hold) and the fastest setting found, and
writes every point as JSON.

    python -m arfusion.benchmarks.kernels.sweep_decode_attention --batch 1 8 32 128 --context 544 2048 \\
        --json-file out.json

By default the split count is swept at the module's launch constants, then (block, warps,
stages) at the best split count. ``--grid`` times the full product of ``--splits``,
``--blocks``, ``--warps`` and ``--stages`` instead (larger blocks with one pipeline stage load a
program's whole chunk at once, which is what mid-size batches with short chunks may want).
"""
from __future__ import annotations

import argparse
import functools
import itertools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

import arfusion.layers.kernels.triton_decode_attention as attn
from arfusion.benchmarks.kernels.attention_timing import time_decode_attention
from arfusion.benchmarks.kernels.rows_file import write_rows

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


@dataclass(frozen=True)
class LayerShape:
    """The attention layer timed: head counts and size, the sliding window (0: none), whether
    the heads have sink logits, and whether several splits combine in the split launch, in a
    launch of their own, or as the group size chooses (None)."""

    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    window: int = 0
    sinks: bool = False
    combine_in_split: Optional[bool] = None


def time_setting(batch: int, context: int, splits: Optional[int], block: int, warps: int, stages: int,
                 shape: LayerShape = LayerShape()) -> float:
    """µs per call with ``splits`` splits of ``block`` keys and the module's launch constants set
    to ``warps``/``stages`` (restored afterwards); ``splits`` None: the shape-based choice of
    splits and block."""
    saved = attn.NUM_WARPS, attn.NUM_STAGES
    attn.NUM_WARPS, attn.NUM_STAGES = warps, stages
    sinks = None
    if shape.sinks:
        sinks = torch.randn(shape.heads, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    overrides = {} if splits is None else {"num_splits": splits, "block": block}
    fn = functools.partial(attn.decode_attention, sinks=sinks, window=shape.window,
                           combine_in_split=shape.combine_in_split, **overrides)
    try:
        return time_decode_attention(batch, context, shape.heads, shape.kv_heads, shape.head_dim, attention_fn=fn)
    finally:
        attn.NUM_WARPS, attn.NUM_STAGES = saved


def time_or_none(batch: int, context: int, splits: Optional[int], block: int, warps: int, stages: int,
                 shape: LayerShape) -> Optional[float]:
    """`time_setting`, or None (printed) for a config the compiler refuses (shared memory)."""
    try:
        return time_setting(batch, context, splits, block, warps, stages, shape)
    except Exception as exc:
        print(f"  skip B={batch} C={context} splits={splits} block={block} warps={warps} stages={stages}: {exc}")
        return None


def default_point(batch: int, context: int, shape: LayerShape) -> dict[str, Any]:
    q = torch.empty(batch, shape.heads, shape.head_dim, device="cuda")
    plan = attn.plan_splits(q, shape.kv_heads, context, None, None, None, shape.window)
    return {"splits": plan.splits, "block": plan.block, "warps": attn.NUM_WARPS, "stages": attn.NUM_STAGES,
            "us": time_setting(batch, context, None, plan.block, attn.NUM_WARPS, attn.NUM_STAGES, shape),
            "default": True}


def sweep_grid(batch: int, context: int, splits: Sequence[int], blocks: Sequence[int], warps: Sequence[int],
               stages: Sequence[int], shape: LayerShape) -> dict[str, Any]:
    """Every (splits, block, warps, stages) of the given lists, plus the default."""
    points = [default_point(batch, context, shape)]
    for s, b, w, st in itertools.product(splits, blocks, warps, stages):
        us = time_or_none(batch, context, s, b, w, st, shape)
        if us is not None:
            points.append({"splits": s, "block": b, "warps": w, "stages": st, "us": us})
    return {"batch": batch, "context": context, "points": points}


def sweep_shape(batch: int, context: int, shape: LayerShape) -> dict[str, Any]:
    points = [default_point(batch, context, shape)]
    default_splits = points[0]["splits"]
    base = (points[0]["block"], attn.NUM_WARPS, attn.NUM_STAGES)
    for splits in SPLITS:
        if splits != default_splits and splits * 16 <= context:
            points.append({"splits": splits, "block": base[0], "warps": base[1], "stages": base[2],
                           "us": time_setting(batch, context, splits, *base, shape)})
    best_splits = min(points, key=lambda p: p["us"])["splits"]
    for block, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
        if (block, warps, stages) != base:
            us = time_or_none(batch, context, best_splits, block, warps, stages, shape)
            if us is not None:
                points.append({"splits": best_splits, "block": block, "warps": warps, "stages": stages, "us": us})
    return {"batch": batch, "context": context, "points": points}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--context", type=int, nargs="+", default=[544])
    p.add_argument("--grid", action="store_true", help="time the full product of the four lists below")
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--heads", type=int, default=16, help="query heads (default: llama3-8b at TP2)")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=0, help="a sliding window of this many keys (0: none)")
    p.add_argument("--sinks", action="store_true", help="per-head sink logits (random), as gpt-oss's")
    p.add_argument("--combine", choices=("default", "in-split", "launch"), default="default",
                   help="where several splits are combined: as the group size chooses (default), in the "
                        "split launch, or in a launch of its own")
    p.add_argument("--json-file")
    args = p.parse_args(argv)
    shape = LayerShape(args.heads, args.kv_heads, args.head_dim, args.window, args.sinks,
                       {"default": None, "in-split": True, "launch": False}[args.combine])
    results = []
    print(f"{'B':>4} {'C':>6} {'default us':>11} {'(splits)':>9} {'best us':>9}  best setting")
    for batch, context in itertools.product(args.batch, args.context):
        r = (sweep_grid(batch, context, args.splits, args.blocks, args.warps, args.stages, shape) if args.grid
             else sweep_shape(batch, context, shape))
        results.append(r)
        default = next(p for p in r["points"] if p.get("default"))
        best = min(r["points"], key=lambda p: p["us"])
        print(f"{batch:>4} {context:>6} {default['us']:>11.2f} {default['splits']:>9} {best['us']:>9.2f}  "
              f"splits={best['splits']} block={best['block']} warps={best['warps']} stages={best['stages']}",
              flush=True)
    write_rows(args.json_file, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
