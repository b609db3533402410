"""Tune the batch-invariant matmul (layers/kernels/triton_bi_matmul.py) on one GPU and write its
config table (layers/kernels/bi_matmul_table.py describes the file).

    python -m arfusion.benchmarks.kernels.tune_bi_matmul --models llama3-8b qwen3-30b-a3b qwen2.5-0.5b \\
        --output layers/kernels/bi_matmul_configs.json

For every GEMM shape (N, K) of the models at the given TP sizes (qkv, o_proj, gate_up, down,
the MoE router, lm_head; bf16):

1. the K plan (BLOCK_K, splits), which fixes a row's bits: each candidate is timed at every
   bucket's row count with that bucket's reference tile; the plan with the least sum over the
   buckets of its time relative to the bucket's fastest plan wins (so the 2048-row prefill bucket
   does not outweigh decode's);
2. the tiles: with that plan, each of the bucket's (BLOCK_M, BLOCK_N, warps, stages) candidates
   is timed; a bucket takes the fastest tile whose rows have the bits of the smallest bucket's
   chosen tile (rows 0-15 of x, compared bit for bit), so no tile in the table changes a row's
   bits.

Times: the median of 5 CUDA-graph replays of up to 10 calls on distinct weights (at most 200
MiB of them: more than L2 holds, as in a forward), µs per call. The table is written with the
hardware's name and printed as a summary: the chosen config per shape and bucket beside the
default rule's time.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Optional, Sequence

import torch
import triton

from arfusion.fusion.tuning.timing import median_us_per_call
from arfusion.layers.kernels.triton_bi_matmul import MatmulConfig, default_config, matmul

BUCKETS = (16, 64, 128, 512)  # M upper bounds; a last tile serves larger M
BUCKET_ROWS = (16, 64, 128, 512, 2048)  # the row count timed for each bucket
PLANS = tuple((block_k, splits) for block_k in (64, 128, 256) for splits in (1, 2, 4, 8))
# (block_m, block_n, warps, stages) per bucket: narrow row tiles with deep pipelines for decode
# (memory-bound: bytes in flight), wide tiles for prefill (compute-bound)
TILES = (
    tuple((16, n, 4, s) for n in (32, 64, 128) for s in (3, 4, 5, 6)),
    tuple((m, n, 4, s) for m in (32, 64) for n in (64, 128) for s in (3, 4)),
    ((64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3)),
    ((64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (64, 256, 4, 3), (128, 256, 8, 3)),
    ((128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (256, 128, 8, 2),
     (128, 256, 8, 2)),
)
REFERENCE_TILES = ((16, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 8, 3))
CALLS = 10
MIN_SPLIT_COLUMNS = 256  # a split keeps at least this many K columns


def model_shapes(name: str, tp: int) -> dict[str, tuple[int, int]]:
    """``{gemm: (N, K)}`` of a built-in model's linear layers on one of ``tp`` ranks."""
    from arfusion.engine.models.builtin import builtin_config

    c = builtin_config(name)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"qkv_proj": ((q + 2 * kv) // tp, c.hidden_size), "o_proj": (c.hidden_size, q // tp),
              "lm_head": (c.vocab_size // tp, c.hidden_size)}
    if c.is_moe:
        shapes["router"] = (c.num_experts, c.hidden_size)
    else:
        shapes["gate_up_proj"] = (2 * c.intermediate_size // tp, c.hidden_size)
        shapes["down_proj"] = (c.hidden_size, c.intermediate_size // tp)
    return shapes


def time_us(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, ws: list) -> float:
    """Median µs per call over CUDA-graph replays of one call per weight in ``ws``."""
    return median_us_per_call(lambda: [fn(x, w) for w in ws], len(ws), trials=5)


def time_config(x: torch.Tensor, ws: list, config: MatmulConfig) -> float:
    """`time_us` of the matmul with ``config``; inf when the config does not fit the GPU (shared
    memory, registers)."""
    try:
        return time_us(lambda a, w: matmul(a, w, config=config), x, ws)
    except triton.runtime.errors.OutOfResources:
        return float("inf")


def _config(plan: tuple[int, int], tile: Sequence[int]) -> MatmulConfig:
    return MatmulConfig(tile[0], tile[1], plan[0], plan[1], tile[2], tile[3])


def tune_shape(n: int, k: int) -> tuple[dict, list[dict]]:
    """``(table entry, measurements)`` for one (N, K) (module docstring)."""
    calls = max(1, min(CALLS, (200 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(calls)]
    x = torch.randn(max(BUCKET_ROWS), k, dtype=torch.bfloat16, device="cuda")
    plans = [p for p in PLANS if p[1] == 1 or k // p[1] >= max(MIN_SPLIT_COLUMNS, p[0])]
    rows: list[dict] = []
    times = {}  # (plan, bucket index) -> us
    for plan in plans:
        for i, (m, tile) in enumerate(zip(BUCKET_ROWS, REFERENCE_TILES)):
            times[plan, i] = time_config(x[:m], ws, _config(plan, tile))
            rows.append({"n": n, "k": k, "m": m, "step": "plan", "config": _config(plan, tile)._asdict(),
                         "us": times[plan, i]})
    fastest = [min(times[p, i] for p in plans) for i in range(len(BUCKET_ROWS))]
    plan = min(plans, key=lambda p: sum(times[p, i] / fastest[i] for i in range(len(BUCKET_ROWS))))
    tiles: list[Sequence[int]] = []
    reference: Optional[torch.Tensor] = None
    for m, candidates in zip(BUCKET_ROWS, TILES):
        timed = []
        for tile in candidates:
            t = time_config(x[:m], ws, _config(plan, tile))
            rows.append({"n": n, "k": k, "m": m, "step": "tile", "config": _config(plan, tile)._asdict(), "us": t})
            timed.append((t, tile))
        for t, tile in sorted(timed):
            if t == float("inf"):
                continue
            head = matmul(x[:m], ws[0], config=_config(plan, tile))[:16]
            if reference is None or torch.equal(head, reference):
                reference = head if reference is None else reference
                tiles.append(tile)
                break
        else:
            raise RuntimeError(f"({n}, {k}) at M={m}: no tile gives the rows the bits of the first bucket's tile")
    default = default_config(n, k)
    for m in BUCKET_ROWS:
        rows.append({"n": n, "k": k, "m": m, "step": "default", "config": default._asdict(),
                     "us": time_config(x[:m], ws, default)})
    return {"block_k": plan[0], "splits": plan[1], "tiles": [list(t) for t in tiles]}, rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m arfusion.benchmarks.kernels.tune_bi_matmul", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["llama3-8b", "qwen3-30b-a3b", "qwen2.5-0.5b"],
                        help="built-in model names whose GEMM shapes are tuned (default: %(default)s)")
    parser.add_argument("--tp-size", type=int, nargs="+", default=[1], help="TP sizes of the shapes (default: 1)")
    parser.add_argument("--hardware", default="1 × H200", help="the hardware's name in the table (default: %(default)s)")
    parser.add_argument("--output", required=True, help="the table to write (JSON)")
    parser.add_argument("--measurements", help="also write every timing as JSON here (default: not written)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("tuning measures on a CUDA GPU; none is visible")
    torch.manual_seed(0)
    shapes: dict[tuple[int, int], list[str]] = {}
    for model in args.models:
        for tp in args.tp_size:
            for gemm, nk in model_shapes(model, tp).items():
                shapes.setdefault(nk, []).append(f"{model}/tp{tp}/{gemm}")
    started = time.perf_counter()
    configs, measurements = {}, []
    print(f"{'N':>7} {'K':>6} {'M':>5} {'default us':>10} {'tuned us':>9}  tuned config  (shape names)")
    for (n, k), names in sorted(shapes.items()):
        entry, rows = tune_shape(n, k)
        configs[f"{n},{k}"] = entry
        measurements += rows
        for i, m in enumerate(BUCKET_ROWS):
            default = next(r["us"] for r in rows if r["m"] == m and r["step"] == "default")
            tile = entry["tiles"][i]
            tuned = next(r["us"] for r in rows if r["m"] == m and r["step"] == "tile"
                         and [r["config"][f] for f in ("block_m", "block_n", "num_warps", "num_stages")] == tile)
            print(f"{n:>7} {k:>6} {m:>5} {default:>10.1f} {tuned:>9.1f}  k{entry['block_k']} s{entry['splits']} "
                  f"{tile}" + (f"  ({', '.join(names)})" if i == 0 else ""))
    table = {"hardware": args.hardware, "dtype": "bfloat16", "buckets": list(BUCKETS), "configs": configs}
    with open(args.output, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    if args.measurements:
        with open(args.measurements, "w") as f:
            json.dump(measurements, f, indent=1)
    print(f"wrote {args.output}: {len(configs)} shapes in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
