"""The decode attention's combine as its own launch against the combine in the split launch
(`decode_attention(..., combine_in_split=True)`, layers/kernels/triton_decode_attention.py), on
one GPU, bf16: µs per call (`time_decode_attention`: a CUDA graph of 32 calls over caches larger
than L2, so each call's launch gap counts), median of the rounds, the two interleaved round by
round, at the shape-based split count. The table is ``--width`` slots wide, as a serving step's
(the split count follows it), and each row attends to ``--seq-len`` keys (``--ragged``: the rows
spread from 1 key to it, as a serving batch's): short rows take one split (written directly),
long ones many.

    python -m arfusion.benchmarks.kernels.bench_decode_combine --batch 1 8 32 --seq-len 192 2048 8192 \\
        --width 8192 --heads 32 --kv-heads 4 --head-dim 128 --json-file out.json
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
from typing import Optional, Sequence

import torch

from arfusion.benchmarks.kernels.attention_timing import time_decode_attention
from arfusion.layers.kernels.triton_decode_attention import choose_launch, decode_attention


def bench_point(batch: int, width: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                rounds: int, ragged: bool = False) -> dict:
    """µs per call of both forms at one shape, each round timing one then the other."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for in_split in (False, True):
            fn = functools.partial(decode_attention, combine_in_split=in_split)
            times[in_split].append(time_decode_attention(batch, width, heads, kv_heads, head_dim, attention_fn=fn,
                                                         seq_len=seq_len, ragged=ragged))
    splits, _ = choose_launch(batch, kv_heads, width, torch.cuda.get_device_properties(0).multi_processor_count)
    separate, in_split = statistics.median(times[False]), statistics.median(times[True])
    return {"batch": batch, "width": width, "seq_len": seq_len, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "ragged": ragged, "splits": splits, "us_combine_launch": separate, "us_combine_in_split": in_split,
            "ratio": in_split / separate, "rounds_combine_launch": times[False], "rounds_combine_in_split": times[True]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--seq-len", type=int, nargs="+", default=[192, 2048, 8192])
    p.add_argument("--width", type=int, default=8192, help="slots per row of the table (the split count follows it)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ragged", action="store_true", help="rows from 1 key to --seq-len instead of all at it")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json-file")
    args = p.parse_args(argv)
    if any(n > args.width for n in args.seq_len):
        p.error(f"every --seq-len must fit the --width {args.width}")
    print(f"decode attention, H={args.heads} KVH={args.kv_heads} D={args.head_dim} bf16, table width {args.width}"
          f"{', rows ragged' if args.ragged else ''}, {torch.cuda.get_device_name(0)}")
    print(f"{'B':>4} {'keys':>6} {'splits':>6} {'combine launch us':>18} {'in split us':>12} {'ratio':>6}")
    rows = []
    for batch, seq_len in itertools.product(args.batch, args.seq_len):
        r = bench_point(batch, args.width, seq_len, args.heads, args.kv_heads, args.head_dim, args.rounds,
                        args.ragged)
        rows.append(r)
        print(f"{batch:>4} {seq_len:>6} {r['splits']:>6} {r['us_combine_launch']:>18.2f} "
              f"{r['us_combine_in_split']:>12.2f} {r['ratio']:>6.3f}", flush=True)
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
