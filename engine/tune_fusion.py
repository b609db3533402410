"""`python -m arfusion.engine.tune_fusion`: measure the fused all-reduce's strategies on this machine and
write the strategy table that ``--allreduce-fusion-table`` reads.

    torchrun --nproc_per_node=2 -m arfusion.engine.tune_fusion --hidden 4096 8192 --tune-dtypes bfloat16 \\
        --allreduce-fusion-max-tokens 8192 --output fusion_table.json

The fusion op is configured from the server options (`engine.launch_config.fusion_config`), as
a server would run it; per hidden size and dtype `fusion.tuning.measure` measures every strategy at the
token buckets up to ``--allreduce-fusion-max-tokens``. Entries are keyed by GPU name, world
size, hidden and dtype and merged into an existing file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    from arfusion.server_args import ServerArgs

    parser = ServerArgs.build_parser(prog="torchrun --nproc_per_node=N -m arfusion.engine.tune_fusion", description=__doc__)
    tune = parser.add_argument_group("tuning")
    tune.add_argument("--hidden", type=int, nargs="+", default=[4096], help="hidden sizes to measure (default: 4096)")
    tune.add_argument("--tune-dtypes", nargs="+", choices=sorted(DTYPES), default=["bfloat16"],
                      help="activation dtypes to measure (default: bfloat16)")
    tune.add_argument("--ops-per-graph", type=int, default=20, help="ops captured per CUDA graph (default: 20)")
    tune.add_argument("--warmup", type=int, default=3, help="untimed replays (default: 3)")
    tune.add_argument("--trials", type=int, default=10, help="timed replays; the median is kept (default: 10)")
    tune.add_argument("--output", default="fusion_table.json", help="table file to write or merge into (default: fusion_table.json)")
    return parser


def existing_entries(path: Path) -> list[dict[str, Any]]:
    from arfusion.fusion.dispatch.table import TuningTableError, parse_table

    if not path.exists():
        return []
    try:
        return parse_table(json.loads(path.read_text()))
    except (json.JSONDecodeError, TuningTableError) as exc:
        raise SystemExit(f"error: {path} exists but is not a strategy table ({exc}); choose another --output")


def measure_all(group: Any, config: Any, hiddens: Sequence[int], dtype_names: Sequence[str],
                entries: list[dict[str, Any]], on_entry: Callable[[dict[str, Any], str, list[dict[str, Any]]], None],
                **timing: Any) -> list[dict[str, Any]]:
    """Collective over ``group`` (a `fusion.TensorParallelGroup`): per dtype and hidden size a
    fusion op of ``config`` (a `fusion.FusionConfig`), built on its own ExitStack
    (`engine.runtime.rank_parts.enter_fusion_op`, so it is destroyed also when a measurement
    raises), its workspace set up for ``config.max_tokens``, and every strategy measured at the
    token buckets up to them (`fusion.tuning.measure.table_entry` with ``timing``). Returns
    ``entries`` with each new entry merged in; ``on_entry(entry, dtype name, entries)`` after each."""
    from arfusion.engine.runtime.rank_parts import enter_fusion_op
    from arfusion.fusion.dispatch.table import merge_entry
    from arfusion.fusion.tuning import measure

    buckets = measure.token_buckets(config.max_tokens)
    for dtype_name in dtype_names:
        for hidden in hiddens:
            with ExitStack() as stack:
                fusion = enter_fusion_op(stack, group, config, hidden, DTYPES[dtype_name])
                fusion.setup()
                fusion.ensure_all(config.max_tokens)
                entry = measure.table_entry(group, fusion.backends, hidden, DTYPES[dtype_name], buckets, **timing)
            entries = merge_entry(entries, entry)
            on_entry(entry, dtype_name, entries)
    return entries


def main(argv: Optional[Sequence[str]] = None) -> int:
    from arfusion.engine.launch_config import fusion_config
    from arfusion.engine.runtime.rank_parts import enter_group
    from arfusion.fusion.config import NO_TABLE
    from arfusion.fusion.dispatch.table import TABLE_VERSION
    from arfusion.layers.parallel_state import default_device
    from arfusion.server_args import ServerArgs

    ns = build_parser().parse_args(argv)
    server = ServerArgs.from_namespace(ns)
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or not torch.cuda.is_available():
        print("error: launch with torchrun --nproc_per_node=N (N >= 2 GPUs)", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    output = Path(ns.output)
    entries = existing_entries(output) if rank == 0 else []
    device = default_device(int(os.environ.get("LOCAL_RANK", rank)))

    def report(entry: dict[str, Any], dtype_name: str, merged: list[dict[str, Any]]) -> None:
        if rank == 0:
            for tokens, row in entry["timings_us"].items():
                best = min(row, key=row.__getitem__)
                print(f"{entry['gpu']} TP{world} hidden {entry['hidden']} {dtype_name} {tokens:>5} tokens: {best:<20} "
                      + "  ".join(f"{k} {v:.2f}" for k, v in sorted(row.items())), flush=True)
            output.write_text(json.dumps({"version": TABLE_VERSION, "entries": merged}, indent=1))

    with ExitStack() as stack:
        group = enter_group(stack, world, rank, "env://", device, timeout_s=server.dist_timeout)
        if group.shares_gpu:
            if rank == 0:
                print(f"error: {group.shared_gpu_note}. A strategy table measured there would be wrong: tune with one "
                      "GPU per rank", file=sys.stderr)
            return 2
        config = replace(fusion_config(server), enabled=True, table_path=NO_TABLE, tune_at_startup=False)
        measure_all(group, config, ns.hidden, ns.tune_dtypes, entries, report, ops_per_graph=ns.ops_per_graph,
                    warmup=ns.warmup, trials=ns.trials)
    return 0


if __name__ == "__main__":
    sys.exit(main())
