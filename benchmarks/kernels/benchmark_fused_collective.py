"""Benchmark: fused all-reduce + residual add + RMSNorm (+ FP8/FP4 quantization) against the
unfused composition, on a tensor-parallel group of >= 2 GPUs.

    torchrun --nproc_per_node=2 benchmarks/kernels/benchmark_fused_collective.py \\
        --hidden-dim 1024 4096 8192 --seq-lens 1 16 128 1024 --output-file r.md --json-file r.json

Paths per configuration (seq_len, hidden_dim, dtype, residual, quant_mode):

* ``standard_allreduce_rmsnorm``: NCCL all-reduce (torch.distributed) + flashinfer
  (fused_add_)rmsnorm [+ torch FP8 / flashinfer FP4 quantization]
* ``standard_allreduce_rmsnorm_native_compiled``: NCCL + torch.compile'd add + RMSNorm [+ FP8]
* ``flashinfer_fused_allreduce_rmsnorm_oneshot`` / ``_twoshot``: arfusion's fused op
  (two-shot only when tokens > world size)
* ``flashinfer_raw_oneshot``: flashinfer.comm.allreduce_fusion called directly
* ``arfusion_dispatch``: what arfusion's own dispatcher picks (no quantization only)

Each path: ``--ops-per-graph`` ops captured in one CUDA graph, ``--warmup`` replays, then the
median of ``--trials`` timed replays divided by ops-per-graph (the slowest rank's median). The
trials of one configuration go round-robin over its paths, so drift hits all paths alike.
Speedup = the faster standard path's time / the path's time. Each path is also checked once,
eagerly, against an fp32 reference (relative L2 error in the notes and the JSON).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a script (torchrun FILE): this checkout is the package `arfusion`
    # (pyproject.toml maps the repository root to it), whatever arfusion is installed
    _spec = importlib.machinery.ModuleSpec("arfusion", None, is_package=True)
    _spec.submodule_search_locations = [str(REPO_ROOT)]
    sys.modules.setdefault("arfusion", importlib.util.module_from_spec(_spec))

from arfusion.benchmarks.kernels.fused_collective_report import (  # noqa: E402
    ConfigResult,
    PathResult,
    format_table,
    json_document,
    markdown_document,
)

DTYPES = ("float16", "bfloat16", "float32")
QUANT_FLAGS = {"no_quant": ["none"], "quant_fp8": ["fp8"], "quant_fp4": ["fp4"], "quant_all": ["none", "fp8", "fp4"]}
FP4_SKIPPED = "skipped: FP4 needs sm100+"
LAUNCH_HINT = (
    "benchmark_fused_collective needs a tensor-parallel group of at least 2 GPUs: launch it with "
    "torchrun, e.g. torchrun --nproc_per_node=2 benchmarks/kernels/benchmark_fused_collective.py"
)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=positive_int, nargs="+", default=[128, 512, 1024, 2048], help="token counts")
    p.add_argument("--hidden-dim", type=positive_int, nargs="+", default=[8192], help="hidden sizes")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["bfloat16"], help="activation dtypes")
    residual = p.add_mutually_exclusive_group()
    residual.add_argument("--no-residual", action="store_true", help="only the no-residual case (default: with and without)")
    residual.add_argument("--residual-only", action="store_true",
                          help="only the case with a residual (every reduction of a decoder but the first layer's)")
    quant = p.add_mutually_exclusive_group()
    quant.add_argument("--no-quant", action="store_true", help="only unquantized output")
    quant.add_argument("--quant-fp8", action="store_true", help="only static FP8 (e4m3) output")
    quant.add_argument("--quant-fp4", action="store_true", help="only NVFP4 output (sm100+)")
    quant.add_argument("--quant-all", action="store_true", help="none, FP8 and FP4 (the default)")
    p.add_argument("--disable-oneshot", action="store_true", help="skip the one-shot fused paths")
    p.add_argument("--allreduce-fusion-table", help="strategy table (python -m arfusion.engine.tune_fusion) for arfusion_dispatch")
    p.add_argument("--disable-pdl", action="store_true",
                   help="launch the fused kernels (arfusion and raw) without programmatic dependent launch")
    p.add_argument("--warmup", type=positive_int, default=5, help="untimed graph replays per path")
    p.add_argument("--trials", type=positive_int, default=20, help="timed graph replays per path")
    p.add_argument("--ops-per-graph", type=positive_int, default=20, help="ops captured in one CUDA graph")
    p.add_argument("--output-file", help="write the tables as Markdown here (rank 0)")
    p.add_argument("--json-file", help="write the full results as JSON here (rank 0)")
    return p


def quant_modes(args: argparse.Namespace) -> list[str]:
    """The quantization modes the flags select (``--quant-all`` when none is given)."""
    chosen = [modes for flag, modes in QUANT_FLAGS.items() if getattr(args, flag)]
    return list(chosen[0] if chosen else QUANT_FLAGS["quant_all"])


def residual_modes(args: argparse.Namespace) -> list[bool]:
    if args.no_residual:
        return [False]
    return [True] if args.residual_only else [True, False]


def launch_error(environ: Mapping[str, str]) -> Optional[str]:
    """Why this process was not started as one rank of a >= 2-rank torchrun job; None if it was."""
    try:
        world_size = int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return f"WORLD_SIZE={environ['WORLD_SIZE']!r} is not an integer. {LAUNCH_HINT}"
    if world_size < 2:
        return f"WORLD_SIZE is {environ.get('WORLD_SIZE', 'unset')}. {LAUNCH_HINT}"
    return None


class Recorder:
    """Prints each configuration's table (rank 0) and rewrites the output files after each,
    so that a run cut short keeps what it measured."""

    def __init__(self, args: argparse.Namespace, meta: dict[str, Any], rank: int) -> None:
        self.args, self.meta, self.rank = args, meta, rank
        self.configs: list[ConfigResult] = []
        self.skipped: list[str] = []

    def log(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def skip(self, line: str) -> None:
        self.skipped.append(line)
        self.log(line)

    def add(self, cfg: ConfigResult) -> None:
        self.configs.append(cfg)
        self.log(format_table(cfg) + "\n")
        self.write()

    def write(self) -> None:
        if self.rank != 0:
            return
        if self.args.output_file:
            Path(self.args.output_file).write_text(markdown_document(self.meta, self.configs, self.skipped))
        if self.args.json_file:
            doc = json_document(self.meta, self.configs, self.skipped)
            Path(self.args.json_file).write_text(json.dumps(doc, indent=1))


def fp4_skip_reason(device: Any, flashinfer_error: Optional[str]) -> Optional[str]:
    """The line printed instead of the FP4 tables, or None when FP4 can run here."""
    from arfusion.fusion.errors import FusionUnsupportedError
    from arfusion.fusion.backends.flashinfer import require_fp4_support

    if flashinfer_error:
        return "skipped: FP4 needs flashinfer"
    try:
        require_fp4_support(device)
    except FusionUnsupportedError:
        return FP4_SKIPPED
    return None


def run(args: argparse.Namespace, group: Any, recorder: Recorder) -> None:
    """Every configuration, hidden size by hidden size (one workspace each, destroyed after)."""
    import torch

    from arfusion.benchmarks.kernels import fused_collective_paths as fcp
    from arfusion.fusion.platform import flashinfer_import_error

    fi_error = flashinfer_import_error()
    if fi_error:
        recorder.log(f"flashinfer unavailable ({fi_error}): timing the standard paths only")
    modes = quant_modes(args)
    if "fp4" in modes:
        reasons = group.all_gather_object(fp4_skip_reason(group.device, fi_error))
        reason = next((r for r in reasons if r), None)  # the same decision on every rank
        if reason:
            recorder.skip(reason)
            modes.remove("fp4")
    max_tokens = max(args.seq_lens)
    seed = 0
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for hidden in args.hidden_dim:
            res = fcp.FusedResources(group, max_tokens, hidden, dtype, enabled=fi_error is None,
                                     launch_with_pdl=not args.disable_pdl, table_path=args.allreduce_fusion_table)
            try:
                for seq_len, with_residual, quant in itertools.product(args.seq_lens, residual_modes(args), modes):
                    seed += 1
                    inputs = fcp.make_inputs(group, seq_len, hidden, dtype, with_residual, quant, seed)
                    paths, notes = fcp.build_paths(group, quant, inputs, res, args.disable_oneshot)
                    results = [PathResult(**r) for r in
                               fcp.run_paths(group, paths, inputs, quant, args.ops_per_graph, args.warmup, args.trials)]
                    recorder.add(ConfigResult(seq_len, hidden, dtype_name, with_residual, quant, results, notes,
                                              shared_gpu=group.shares_gpu))
            finally:
                res.destroy()


def run_metadata(args: argparse.Namespace, group: Any) -> dict[str, Any]:
    """What the output files say about the run."""
    import torch

    from arfusion.fusion.platform import flashinfer_import_error

    fi_error = flashinfer_import_error()
    return {
        "world_size": group.world_size,
        "shared_gpu": group.shared_gpu_note,
        "device": torch.cuda.get_device_name(group.device),
        "capability": "sm%d%d" % torch.cuda.get_device_capability(group.device),
        "torch": torch.__version__,
        "flashinfer": fi_error or importlib.import_module("flashinfer").__version__,
        "ops_per_graph": args.ops_per_graph,
        "warmup": args.warmup,
        "trials": args.trials,
        "command": " ".join(sys.argv),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    error = launch_error(os.environ)
    if error:
        print(error, file=sys.stderr)
        return 2
    import torch

    from arfusion.layers import parallel_state

    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if not torch.cuda.is_available():
        print(f"rank {rank}: no CUDA GPU is visible. {LAUNCH_HINT}", file=sys.stderr)
        return 2
    group = parallel_state.init_tensor_parallel(world_size, rank, init_method="env://",
                                                device=parallel_state.default_device(local_rank))
    try:
        group.all_reduce(torch.ones(1, device=group.device))  # NCCL communicator up before any capture
        torch.cuda.synchronize(group.device)
        recorder = Recorder(args, run_metadata(args, group), group.rank)
        if group.shares_gpu:
            recorder.log(f"NOT REPRESENTATIVE (every row is marked 'shared GPU'): {group.shared_gpu_note}. The "
                         "unfused paths run over gloo, which a CUDA graph cannot capture: they are left out.")
        with torch.no_grad():
            run(args, group, recorder)
    finally:
        parallel_state.destroy_tensor_parallel()  # after run() destroyed its workspaces
    return 0


if __name__ == "__main__":
    sys.exit(main())
