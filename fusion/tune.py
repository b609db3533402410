"""Measure every available strategy for all-reduce + residual + RMSNorm and write the table
the dispatcher reads (``--allreduce-fusion-table``).

    torchrun --nproc_per_node=2 -m fusion.tune --hidden 4096 --dtypes bfloat16 \\
        --max-tokens 4096 --output fusion_table.json

Per hidden size and dtype, per token bucket (powers of two up to ``--max-tokens`` plus the
decode batch sizes of the CUDA graphs), each strategy of `fusion.strategies` that runs here
(voted over the CPU group) is captured ``--ops-per-graph`` times in one CUDA graph, replayed
``--warmup`` then ``--trials`` times; the table keeps the median µs per op of the slowest rank.
Entries are keyed by GPU name, world size, hidden and dtype and merged into an existing file.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from fusion import strategies as st
from fusion.allreduce_fusion import AllReduceFusion, FusionConfig
from fusion.cuda_graph_timing import median_us_per_call
from fusion.group import TensorParallelGroup
from fusion.tuning_table import TABLE_VERSION, TuningTableError, merge_entry, parse_table

DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two up to ``max_tokens`` (and ``max_tokens``) plus the decode batch sizes."""
    powers = {1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens}
    return sorted(powers | {max_tokens} | {b for b in DECODE_BATCH_SIZES if b <= max_tokens})


def measure(group: TensorParallelGroup, fusion: AllReduceFusion, hidden: int, dtype: torch.dtype, tokens: int,
            args: argparse.Namespace) -> dict[str, float]:
    """µs per op of every strategy that can run ``tokens`` here (slowest rank), by name."""
    candidates = [st.NCCL, st.FLASHINFER_ONESHOT, st.SYMM_MEM_TWO_SHOT, st.SYMM_MEM_FUSED]
    if tokens > group.world_size:
        candidates.append(st.FLASHINFER_TWOSHOT)
    g = torch.Generator(device=group.device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=group.device, dtype=dtype, generator=g)
    residual = torch.randn(tokens, hidden, device=group.device, dtype=dtype, generator=g)
    weight = torch.rand(hidden, device=group.device, dtype=dtype, generator=g) + 0.5
    runnable = {
        st.NCCL: True,
        st.FLASHINFER_ONESHOT: fusion.workspace.fits(tokens, hidden, dtype),
        st.FLASHINFER_TWOSHOT: fusion.workspace.fits(tokens, hidden, dtype),
        st.SYMM_MEM_TWO_SHOT: fusion.symm_mem.fits(x),
        st.SYMM_MEM_FUSED: fusion.symm_fused.fits(x),
    }
    timings = {}
    for strategy in candidates:
        if not runnable[strategy]:
            continue
        def calls(strategy: str = strategy) -> None:
            for _ in range(args.ops_per_graph):
                fusion.all_reduce_add_rms_norm(x, residual, weight, 1e-6, strategy)

        try:
            us: Optional[float] = median_us_per_call(calls, args.ops_per_graph, args.warmup, args.trials)
            error = None
        except Exception as exc:  # a strategy that fails here is left out, on every rank
            us, error = None, f"{type(exc).__name__}: {exc}"
        results = group.all_gather_object((us, error))
        if all(u is not None for u, _ in results):
            timings[strategy] = max(u for u, _ in results)
        elif group.rank == 0:
            print(f"  {strategy} at {tokens} tokens left out: {[e for _, e in results if e]}", file=sys.stderr)
    return timings


def init_group() -> TensorParallelGroup:
    """The TP group of this torchrun job (all ranks), NCCL plus a gloo CPU group."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("nccl", world_size=world, rank=rank, timeout=timeout)
    cpu_group = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    return TensorParallelGroup(rank, world, device, dist.group.WORLD, cpu_group)


def existing_entries(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    try:
        return parse_table(json.loads(path.read_text()))
    except (json.JSONDecodeError, TuningTableError) as exc:
        raise SystemExit(f"error: {path} exists but is not a strategy table ({exc}); choose another --output")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[4096])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bfloat16"])
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--ops-per-graph", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--output", default="fusion_table.json")
    args = p.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or not torch.cuda.is_available():
        print("error: launch with torchrun --nproc_per_node=N (N >= 2 GPUs)", file=sys.stderr)
        return 2
    output = Path(args.output)
    entries = existing_entries(output) if int(os.environ["RANK"]) == 0 else []
    group = init_group()
    gpu = torch.cuda.get_device_name(group.device)
    try:
        for dtype_name in args.dtypes:
            for hidden in args.hidden:
                dtype = DTYPES[dtype_name]
                fusion = AllReduceFusion(group, FusionConfig(enabled=True, max_tokens=args.max_tokens), hidden, dtype)
                fusion.setup()
                fusion.symm_mem.ensure(args.max_tokens, hidden, dtype)
                fusion.symm_fused.ensure(args.max_tokens, hidden, dtype)
                rows = {str(t): measure(group, fusion, hidden, dtype, t, args) for t in token_buckets(args.max_tokens)}
                fusion.destroy()
                entries = merge_entry(entries, {"gpu": gpu, "world_size": group.world_size, "hidden": hidden,
                                                "dtype": dtype_name, "timings_us": rows})
                if group.rank == 0:
                    for t, row in rows.items():
                        best = min(row, key=row.__getitem__)
                        print(f"{gpu} TP{group.world_size} hidden {hidden} {dtype_name} {t:>5} tokens: {best:<20} "
                              + "  ".join(f"{k} {v:.2f}" for k, v in sorted(row.items())))
                    output.write_text(json.dumps({"version": TABLE_VERSION, "entries": entries}, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
