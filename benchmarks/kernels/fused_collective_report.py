"""Results of `benchmark_fused_collective`: the per-configuration table (text and Markdown),
the baseline choice, and the JSON document.

Pure Python (no torch), so that the CLI tests and the plot script import it anywhere.

    baseline = the faster of the successful ``standard_*`` paths
    speedup  = baseline time / path time            (per op, median over timed replays)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

STANDARD_PREFIX = "standard_"
ONESHOT_PATH = "flashinfer_fused_allreduce_rmsnorm_oneshot"
RAW_PATH = "flashinfer_raw_oneshot"
TABLE_COLUMNS = ("Operation", "Time (ms)", "Speedup")


@dataclass
class PathResult:
    """One timed path of one configuration, as agreed by all ranks."""

    name: str
    time_ms: Optional[float] = None  # slowest rank's median time per op
    time_ms_per_rank: list[float] = field(default_factory=list)
    rel_l2_error: Optional[float] = None  # ||out - ref|| / ||ref|| vs the fp32 reference, worst rank
    error: Optional[str] = None  # one line: why the path failed (on some rank)

    @property
    def ok(self) -> bool:
        return self.error is None and self.time_ms is not None


@dataclass
class ConfigResult:
    """All paths of one (seq_len, hidden_dim, dtype, residual, quant_mode) configuration."""

    seq_len: int
    hidden_dim: int
    dtype: str
    residual: bool
    quant_mode: str
    paths: list[PathResult]
    notes: list[str] = field(default_factory=list)
    shared_gpu: bool = False  # the ranks shared a GPU: correct, but no timing is representative


def choose_baseline(paths: Sequence[PathResult]) -> Optional[PathResult]:
    """The faster of the successful standard (unfused) paths; None if none succeeded."""
    standard = [p for p in paths if p.name.startswith(STANDARD_PREFIX) and p.ok]
    return min(standard, key=lambda p: p.time_ms, default=None)  # type: ignore[arg-type, return-value]


def speedup(path: PathResult, baseline: Optional[PathResult]) -> Optional[float]:
    """``baseline.time_ms / path.time_ms``; None when either did not run."""
    if baseline is None or not path.ok or not path.time_ms:
        return None
    return baseline.time_ms / path.time_ms  # type: ignore[operator]


def overhead_vs_raw(cfg: ConfigResult) -> Optional[float]:
    """arfusion's one-shot path time over the raw flashinfer call's, minus 1 (0.02 = 2 % slower)."""
    by_name = {p.name: p for p in cfg.paths if p.ok}
    ours, raw = by_name.get(ONESHOT_PATH), by_name.get(RAW_PATH)
    if ours is None or raw is None:
        return None
    return ours.time_ms / raw.time_ms - 1.0  # type: ignore[operator]


def config_header(cfg: ConfigResult) -> str:
    return (
        f"Configuration: seq_len={cfg.seq_len}, hidden_dim={cfg.hidden_dim}, dtype={cfg.dtype}, "
        f"residual={cfg.residual}, quant_mode={cfg.quant_mode}"
    )


def table_rows(cfg: ConfigResult) -> list[tuple[str, str, str]]:
    """(operation, time, speedup) cells: ``baseline`` on the baseline row, ``failed`` for a
    failed path, ``-`` where no speedup can be given; every operation of a shared-GPU run is
    marked ``(shared GPU)``."""
    baseline = choose_baseline(cfg.paths)
    rows = []
    for p in cfg.paths:
        time = f"{p.time_ms:.4f}" if p.ok else "failed"
        ratio = speedup(p, baseline)
        cell = "baseline" if p is baseline else (f"{ratio:.2f}x" if ratio is not None else "-")
        rows.append((p.name + (" (shared GPU)" if cfg.shared_gpu else ""), time, cell))
    return rows


def notes(cfg: ConfigResult) -> list[str]:
    """Lines shown under a table: failures, accuracy, arfusion overhead, caller notes."""
    lines = [f"failed: {p.name}: {p.error}" for p in cfg.paths if p.error]
    errors = [f"{p.name} {p.rel_l2_error:.4f}" for p in cfg.paths if p.rel_l2_error is not None]
    if errors:
        lines.append("relative L2 error vs fp32 reference: " + ", ".join(errors))
    over = overhead_vs_raw(cfg)
    if over is not None:
        lines.append(f"arfusion one-shot vs raw flashinfer call: {100 * over:+.1f}%")
    return lines + cfg.notes


def format_table(cfg: ConfigResult) -> str:
    """The configuration's header, then aligned columns ``Operation  Time (ms)  Speedup``."""
    rows = table_rows(cfg)
    w0 = max(len(TABLE_COLUMNS[0]), *(len(r[0]) for r in rows)) if rows else len(TABLE_COLUMNS[0])
    w1 = max(len(TABLE_COLUMNS[1]), *(len(r[1]) for r in rows)) if rows else len(TABLE_COLUMNS[1])
    lines = [config_header(cfg), f"{TABLE_COLUMNS[0]:<{w0}}  {TABLE_COLUMNS[1]:>{w1}}  {TABLE_COLUMNS[2]}"]
    lines.append(f"{'-' * w0}  {'-' * w1}  {'-' * len(TABLE_COLUMNS[2])}")
    lines += [f"{name:<{w0}}  {time:>{w1}}  {cell}" for name, time, cell in rows]
    lines += [f"  {line}" for line in notes(cfg)]
    return "\n".join(lines)


def format_markdown(cfg: ConfigResult) -> str:
    """The same table as Markdown, under a ``###`` heading with the configuration."""
    lines = [f"### {config_header(cfg)}", "", "| " + " | ".join(TABLE_COLUMNS) + " |", "|---|---:|---:|"]
    lines += [f"| {name} | {time} | {cell} |" for name, time, cell in table_rows(cfg)]
    extra = notes(cfg)
    if extra:
        lines += [""] + [f"- {line}" for line in extra]
    return "\n".join(lines) + "\n"


def markdown_document(meta: dict[str, Any], configs: Sequence[ConfigResult], skipped: Sequence[str]) -> str:
    """The whole --output-file: a run header, the skipped modes, then one table per configuration."""
    head = ["# Fused all-reduce + residual add + RMSNorm benchmark", ""]
    head += [f"- {key}: {value}" for key, value in meta.items()]
    head += [f"- {line}" for line in skipped]
    return "\n".join(head) + "\n\n" + "\n".join(format_markdown(c) for c in configs)


def config_to_dict(cfg: ConfigResult) -> dict[str, Any]:
    """A configuration as JSON-ready data, with the baseline name and each path's speedup."""
    baseline = choose_baseline(cfg.paths)
    data = asdict(cfg)
    data["baseline"] = baseline.name if baseline else None
    data["arfusion_overhead_vs_raw"] = overhead_vs_raw(cfg)
    for entry, p in zip(data["paths"], cfg.paths):
        entry["speedup"] = speedup(p, baseline)
    return data


def json_document(meta: dict[str, Any], configs: Sequence[ConfigResult], skipped: Sequence[str]) -> dict[str, Any]:
    """The whole --json-file."""
    return {"meta": meta, "skipped": list(skipped), "configs": [config_to_dict(c) for c in configs]}
