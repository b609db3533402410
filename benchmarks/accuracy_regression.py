r"""Accuracy with all-reduce fusion off vs on: one server per setting, same model, same evals.

    python -m benchmarks.accuracy_regression --model-path /models/Llama-3.1-8B-Instruct --tp-size 2 \
        --gsm8k-data-path /work/shared/data/gsm8k/test.jsonl --mmlu-data-dir /work/shared/data/mmlu \
        --output-file accuracy_regression.json

For each setting (off, then on with ``--enable-flashinfer-allreduce-fusion``) it starts
``python -m engine.launch_server`` with the pass-through flags, waits for ``GET /health``,
records ``GET /get_server_info``, runs GSM8K and MMLU (greedy, seeded) and shuts the server
down (SIGTERM to its process group, SIGKILL after 15 s). It then prints metric | off | on |
diff, and the generation agreement per eval: over all questions, the fraction of positions
where the whitespace-separated tokens of the two generations are equal (the denominator is
the longer generation), plus the fraction of questions whose generations are identical.
The JSON output holds the config, both runs' metrics and server info, the comparison and
every question's two generations.

Exit status: 0 when every accuracy differs by at most ``--tolerance`` points, 1 when one
differs by more, 3 when a server fails to start or dies (its log tail is printed).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import aiohttp

from benchmarks.client import ServerError, base_url
from benchmarks.gsm8k import bench as gsm8k_bench
from benchmarks.mmlu import bench as mmlu_bench

SERVER_MODULE = "engine.launch_server"
ACCURACY_METRICS = ("accuracy",)
REPORTED_METRICS = ("accuracy", "invalid", "latency_s", "output_throughput")


class ServerFailed(RuntimeError):
    """The server process exited or never became healthy; the message carries its log tail."""


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' when it does not exist)."""
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def free_port(host: str) -> int:
    """A port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(args: argparse.Namespace, fusion: bool, port: int) -> list[str]:
    """The launch command: only the flags the user gave, plus host, port and the fusion switch."""
    cmd = [sys.executable, "-m", SERVER_MODULE, "--host", args.host, "--port", str(port)]
    for flag in ("model_path", "tp_size", "device", "load_format", "allreduce_fusion_backend"):
        value = getattr(args, flag)
        if value is not None:
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    if fusion:
        cmd.append("--enable-flashinfer-allreduce-fusion")
    return cmd + shlex.split(args.server_args or "")


def wait_for_health(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Poll ``GET url/health`` until 200; raise `ServerFailed` when the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"server exited with code {proc.returncode} before it was healthy; "
                               f"log tail ({log_path}):\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise ServerFailed(f"server not healthy after {timeout_s:.0f} s; log tail ({log_path}):\n{log_tail(log_path)}")


def stop_server(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group (it was started in its own session); after ``grace_s``,
    or as soon as the server has exited, SIGKILL whatever is left of the group (TP workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def running_server(cmd: Sequence[str], url: str, log_path: Path, timeout_s: float) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` with output to ``log_path``, wait until healthy, stop it on exit."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_health(url, proc, log_path, timeout_s)
        yield proc
    finally:
        stop_server(proc)


def fetch_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def generation_agreement(off: Sequence[dict[str, Any]], on: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Compare the generations of the same questions (matched by ``id``) in two runs.

    agreement = sum over questions of #{i : off_tokens[i] == on_tokens[i]} divided by the sum of
    max(len(off_tokens), len(on_tokens)), tokens being whitespace-separated words (1.0 when all
    are empty); identical = fraction of questions with exactly equal text.
    """
    on_by_id = {r["id"]: r["generation"] for r in on}
    common = [(r["generation"], on_by_id[r["id"]]) for r in off if r["id"] in on_by_id]
    matched = total = identical = 0
    for a, b in common:
        ta, tb = a.split(), b.split()
        matched += sum(x == y for x, y in zip(ta, tb))
        total += max(len(ta), len(tb))
        identical += a == b
    return {"questions": len(common), "agreement": matched / total if total else 1.0,
            "identical": identical / len(common) if common else 1.0}


def compare(off: dict[str, dict[str, Any]], on: dict[str, dict[str, Any]], tolerance_points: float) -> list[dict[str, Any]]:
    """Rows ``{metric, off, on, diff, checked, exceeds}`` for every eval's reported metrics.

    Fractions (accuracy, invalid) are turned into points (percent); ``diff = on - off``.
    Accuracy rows are checked: ``exceeds`` when ``|diff| > tolerance_points``.
    """
    rows = []
    for eval_name in off:
        for metric in (m for m in REPORTED_METRICS if m in off[eval_name]):
            a, b = off[eval_name][metric], on[eval_name].get(metric)
            scale = 100.0 if metric in ("accuracy", "invalid") else 1.0
            a = None if a is None else a * scale
            b = None if b is None else b * scale
            diff = None if a is None or b is None else b - a
            checked = metric in ACCURACY_METRICS
            rows.append({"metric": f"{eval_name} {metric}" + (" (%)" if scale == 100.0 else ""), "off": a, "on": b,
                         "diff": diff, "checked": checked,
                         "exceeds": checked and (diff is None or abs(diff) > tolerance_points)})
    return rows


def format_table(rows: Sequence[dict[str, Any]], agreement: dict[str, dict[str, Any]]) -> str:
    """The side-by-side table, then one agreement line per eval."""
    def cell(v: Optional[float]) -> str:
        return "n/a" if v is None else f"{v:.3f}"
    width = max([len("metric")] + [len(r["metric"]) for r in rows])
    lines = [f"{'metric':<{width}}  {'off':>10}  {'on':>10}  {'diff':>10}"]
    for r in rows:
        flag = "  EXCEEDS TOLERANCE" if r["exceeds"] else ""
        lines.append(f"{r['metric']:<{width}}  {cell(r['off']):>10}  {cell(r['on']):>10}  {cell(r['diff']):>10}{flag}")
    for name, a in agreement.items():
        lines.append(f"{name} generation agreement: {a['agreement']:.4f} of tokens, "
                     f"{a['identical']:.4f} of {a['questions']} generations identical")
    return "\n".join(lines)


def exit_code(rows: Sequence[dict[str, Any]]) -> int:
    """1 when a checked row exceeds the tolerance, else 0."""
    return 1 if any(r["exceeds"] for r in rows) else 0


def eval_argv(args: argparse.Namespace, name: str, port: int) -> list[str]:
    """The CLI of one eval, against ``port``, seeded and without a progress bar when quiet."""
    common = ["--host", args.host, "--port", str(port), "--parallel", str(args.parallel), "--seed", str(args.sampling_seed)]
    if args.no_progress:
        common.append("--no-progress")
    if name == "gsm8k":
        argv = ["--num-questions", str(args.gsm8k_num_questions), "--num-shots", str(args.gsm8k_num_shots)]
        argv += ["--data-path", args.gsm8k_data_path] if args.gsm8k_data_path else []
        argv += ["--train-path", args.gsm8k_train_path] if args.gsm8k_train_path else []
        return argv + common
    argv = ["--data-dir", args.mmlu_data_dir, "--num-shots", str(args.mmlu_num_shots), "--examples", str(args.mmlu_examples)]
    argv += ["--subjects", args.mmlu_subjects] if args.mmlu_subjects else []
    return argv + common


def run_setting(args: argparse.Namespace, fusion: bool, log_dir: Path) -> dict[str, Any]:
    """Launch one server, run the evals, return metrics, records and server info."""
    port = args.port or free_port(args.host)
    url = base_url(args.host, port)
    label = "on" if fusion else "off"
    cmd = server_command(args, fusion, port)
    print(f"[fusion {label}] {shlex.join(cmd)}", flush=True)
    log_path = log_dir / f"server_fusion_{label}.log"
    with running_server(cmd, url, log_path, args.server_timeout):
        try:
            info = fetch_json(f"{url}/get_server_info")
            print(f"[fusion {label}] server fusion info: {json.dumps(info.get('fusion'))}", flush=True)
            metrics, records = {}, {}
            for name in args.evals:
                bench = gsm8k_bench if name == "gsm8k" else mmlu_bench
                result = bench.run(bench.build_parser().parse_args(eval_argv(args, name, port)))
                metrics[name], records[name] = result.metrics(), result.records
        except (OSError, aiohttp.ClientError, ServerError) as exc:
            raise ServerFailed(f"request to the fusion-{label} server failed ({exc!r}); "
                               f"log tail ({log_path}):\n{log_tail(log_path)}") from exc
    return {"server_command": cmd, "server_info": info, "metrics": metrics, "records": records}


def check_data(args: argparse.Namespace) -> None:
    """Fail before any server starts when the eval data cannot be found (downloads GSM8K if needed)."""
    if "gsm8k" in args.evals:
        test, train = gsm8k_bench.resolve_paths(args.gsm8k_data_path, args.gsm8k_train_path)
        for path in (test, train) if args.gsm8k_num_shots > 0 else (test,):
            if not path.exists():
                raise SystemExit(f"GSM8K file {path} not found (--gsm8k-data-path / --gsm8k-train-path)")
    if "mmlu" in args.evals:
        subjects = args.mmlu_subjects.replace(",", " ").split() if args.mmlu_subjects else None
        mmlu_bench.load_subjects(Path(args.mmlu_data_dir), subjects, args.mmlu_num_shots, args.mmlu_examples)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accuracy_regression", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server (passed through when given)")
    g.add_argument("--model-path")
    g.add_argument("--tp-size", type=int)
    g.add_argument("--device")
    g.add_argument("--load-format")
    g.add_argument("--allreduce-fusion-backend")
    g.add_argument("--server-args", default="", help='more server flags, one string: --server-args "--seed 1 --dtype bfloat16"')
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=None, help="server port (default: a free one per launch)")
    g.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    g.add_argument("--log-dir", help="server logs (default: a new temporary directory)")
    e = p.add_argument_group("evals")
    e.add_argument("--evals", default="gsm8k,mmlu", help="comma-separated subset of gsm8k,mmlu")
    e.add_argument("--gsm8k-data-path")
    e.add_argument("--gsm8k-train-path")
    e.add_argument("--gsm8k-num-questions", type=int, default=200)
    e.add_argument("--gsm8k-num-shots", type=int, default=8)
    e.add_argument("--mmlu-data-dir")
    e.add_argument("--mmlu-examples", type=int, default=10, help="test questions per subject")
    e.add_argument("--mmlu-num-shots", type=int, default=5)
    e.add_argument("--mmlu-subjects")
    e.add_argument("--parallel", type=int, default=64)
    e.add_argument("--sampling-seed", type=int, default=0, help="seed sent with every eval request (the server's own --seed goes in --server-args)")
    e.add_argument("--no-progress", action="store_true")
    p.add_argument("--tolerance", type=float, default=1.5, help="largest allowed |accuracy diff| in points")
    p.add_argument("--output-file", help="write the full comparison as JSON")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.evals = [e.strip() for e in args.evals.split(",") if e.strip()]
    if not args.evals or set(args.evals) - {"gsm8k", "mmlu"}:
        parser.error(f"--evals must be a subset of gsm8k,mmlu, got {args.evals}")
    if "mmlu" in args.evals and not args.mmlu_data_dir:
        parser.error("mmlu needs --mmlu-data-dir (or --evals gsm8k)")
    check_data(args)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="accuracy_regression_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs: {log_dir}", flush=True)
    runs = {}
    try:
        for fusion in (False, True):
            runs["on" if fusion else "off"] = run_setting(args, fusion, log_dir)
    except ServerFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    rows = compare(runs["off"]["metrics"], runs["on"]["metrics"], args.tolerance)
    agreement = {name: generation_agreement(runs["off"]["records"][name], runs["on"]["records"][name]) for name in args.evals}
    print(format_table(rows, agreement))
    code = exit_code(rows)
    print("PASS" if code == 0 else f"FAIL: an accuracy differs by more than {args.tolerance} points")
    if args.output_file:
        generations = {name: [{"id": a["id"], "off": a["generation"], "on": b["generation"]}
                              for a, b in zip(runs["off"]["records"][name], runs["on"]["records"][name])]
                       for name in args.evals}
        report = {
            "config": vars(args), "tolerance_points": args.tolerance, "passed": code == 0,
            "runs": {k: {"server_command": r["server_command"], "server_info": r["server_info"], "metrics": r["metrics"]}
                     for k, r in runs.items()},
            "comparison": rows, "generation_agreement": agreement, "generations": generations,
        }
        Path(args.output_file).write_text(json.dumps(report, indent=2))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
