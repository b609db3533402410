r"""Accuracy with all-reduce fusion off vs on (and, optionally, a baseline at another TP size):
one server per setting, same model, same evals.

    python -m arfusion.benchmarks.accuracy_regression --model-path /tmp/model.gguf --tp-size 2 --baseline-tp-size 1 \
        --gsm8k-data-path grade_school_math/data/test.jsonl --mmlu-data-dir data \
        --results-dir /tmp/accuracy --output-file accuracy_regression.json

Settings, in this order: the baseline (``--baseline-tp-size N``: fusion off at TP N, e.g. TP1),
then fusion off and fusion on (``--enable-flashinfer-allreduce-fusion``) at ``--tp-size``. For
each it starts ``python -m arfusion.engine.launch_server`` with the pass-through flags, waits for
``GET /health``, records ``GET /get_server_info``, runs GSM8K and MMLU (greedy, seeded; all
questions unless ``--gsm8k-num-questions`` / ``--mmlu-examples`` / ``--mmlu-subjects`` limit
them; MMLU 5-shot, or ``--mmlu-style simple-evals --mmlu-examples 1000``: zero-shot chat, the
letter after "Answer:", 1000 questions sampled from all subjects) and shuts the server down (SIGTERM to its process group, SIGKILL after 15 s).

With ``--results-dir`` every (setting, eval) result is kept there as soon as it is done, and a
later run with the same options reuses it and runs only what is missing: a run cut short (a
timeout, a lost machine) is resumed by running the same command again.

It then prints metric | baseline | off | on | on - off | off - baseline (the gsm8k rows include
each run's wall time, ``latency_s``, and output token throughput), and the generation agreement
per eval, of on with off and of off with the baseline: over all questions, the fraction of
positions where the whitespace-separated tokens of the two generations are equal (the
denominator is the longer generation), plus the fraction of questions whose generations are
identical. The JSON output holds the config, every run's metrics and server info, the
comparison and every question's generations.

Then, per eval, the paired comparison of on with off (and of off with the baseline) question by
question (`benchmarks.paired_stats`): the difference in points, its paired 95 % confidence
interval, the discordant counts, McNemar's exact p and the verdict: FAIL only when the drop is
significant (p < 0.01) or the whole interval lies below ``-tolerance``; INCONCLUSIVE when the
interval is wider than the tolerance (too few questions to tell); else PASS. A fixed threshold
on the difference alone would fail at random: on 1,319 GSM8K questions one standard error of
the paired difference is about a point.

Exit status: 0 unless a comparison FAILs (on against off with ``--tolerance``, off against the
baseline with ``--baseline-tolerance``) or the on server reports fusion inactive (1), or a server
fails to start or dies (3, its log tail printed).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import aiohttp

from arfusion.benchmarks import paired_stats
from arfusion.benchmarks.accuracy_compare import compare, exit_code, format_table, generation_agreement
from arfusion.benchmarks.client import ServerError, base_url
from arfusion.benchmarks.gsm8k import bench as gsm8k_bench
from arfusion.benchmarks.mmlu import bench as mmlu_bench

SERVER_MODULE = "arfusion.engine.launch_server"


class ServerFailed(RuntimeError):
    """The server process exited or never became healthy; the message carries its log tail."""


@dataclass(frozen=True)
class Setting:
    """One server configuration: ``label`` keys the report ("baseline", "off", "on");
    ``tp_size`` None leaves --tp-size to the server's default."""

    label: str
    tp_size: Optional[int]
    fusion: bool

    @property
    def title(self) -> str:
        """The column title: ``TP2 off``, ``TP2 on``, ``TP1`` (the baseline)."""
        tp = f"TP{self.tp_size or 1}"
        return tp if self.label == "baseline" else f"{tp} {self.label}"


def settings_of(args: argparse.Namespace) -> list[Setting]:
    """The baseline (when ``--baseline-tp-size`` is given), then fusion off and on at ``--tp-size``."""
    runs = [Setting("off", args.tp_size, False), Setting("on", args.tp_size, True)]
    if args.baseline_tp_size is not None:
        runs.insert(0, Setting("baseline", args.baseline_tp_size, False))
    return runs


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


def server_command(args: argparse.Namespace, fusion: bool, port: int, tp_size: Optional[int] = None) -> list[str]:
    """The launch command: only the flags the user gave, plus host, port and the fusion switch;
    ``tp_size`` replaces ``--tp-size`` (the baseline's)."""
    cmd = [sys.executable, "-m", SERVER_MODULE, "--host", args.host, "--port", str(port)]
    for flag in ("model_path", "tp_size", "device", "load_format", "allreduce_fusion_backend"):
        value = tp_size if flag == "tp_size" and tp_size is not None else getattr(args, flag)
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


def eval_argv(args: argparse.Namespace, name: str, port: int) -> list[str]:
    """The CLI of one eval, against ``port``, seeded and without a progress bar when quiet."""
    common = ["--host", args.host, "--port", str(port), "--parallel", str(args.parallel), "--seed", str(args.sampling_seed)]
    if args.no_progress:
        common.append("--no-progress")
    if name == "gsm8k":
        argv = ["--num-shots", str(args.gsm8k_num_shots)]
        argv += ["--num-questions", str(args.gsm8k_num_questions)] if args.gsm8k_num_questions is not None else []
        argv += ["--data-path", args.gsm8k_data_path] if args.gsm8k_data_path else []
        argv += ["--train-path", args.gsm8k_train_path] if args.gsm8k_train_path else []
        return argv + common
    argv = ["--data-dir", args.mmlu_data_dir, "--style", args.mmlu_style]
    argv += ["--num-shots", str(args.mmlu_num_shots)] if args.mmlu_num_shots is not None else []
    argv += ["--examples", str(args.mmlu_examples)] if args.mmlu_examples is not None else []
    argv += ["--subjects", args.mmlu_subjects] if args.mmlu_subjects else []
    return argv + common


def result_key(args: argparse.Namespace, setting: Setting, name: str) -> dict[str, Any]:
    """What a kept result must have been run with to be reused: the server command and the
    eval's CLI, host and ports left out."""
    def without_address(argv: list[str]) -> list[str]:
        return [a for i, a in enumerate(argv) if a not in ("--host", "--port") and argv[i - 1] not in ("--host", "--port")]
    return {"server": without_address(server_command(args, setting.fusion, 0, setting.tp_size)[1:]),
            "eval": without_address(eval_argv(args, name, 0))}


def kept_result(args: argparse.Namespace, setting: Setting, name: str) -> Optional[dict[str, Any]]:
    """The result of (setting, eval) kept in ``--results-dir`` by an earlier run with the same
    options, else None."""
    if not args.results_dir:
        return None
    path = Path(args.results_dir) / f"{setting.label}_{name}.json"
    if not path.exists():
        return None
    kept = json.loads(path.read_text())
    if kept["key"] != result_key(args, setting, name):
        print(f"[{setting.title}] {path} was run with other options: running {name} again", flush=True)
        return None
    print(f"[{setting.title}] {name}: reusing {path}", flush=True)
    return kept


def keep_result(args: argparse.Namespace, setting: Setting, name: str, result: dict[str, Any]) -> None:
    """Write (setting, eval)'s result into ``--results-dir`` (when given), atomically."""
    if not args.results_dir:
        return
    directory = Path(args.results_dir)
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{setting.label}_{name}.json.part"
    partial.write_text(json.dumps({"key": result_key(args, setting, name), **result}))
    partial.replace(directory / f"{setting.label}_{name}.json")


def run_setting(args: argparse.Namespace, setting: Setting, log_dir: Path) -> dict[str, Any]:
    """Metrics, records and server info of every eval of one setting: kept results reused, the
    others run on a server launched for them (none when every eval is kept)."""
    results = {name: kept_result(args, setting, name) for name in args.evals}
    todo = [name for name, r in results.items() if r is None]
    if todo:
        port = args.port or free_port(args.host)
        url = base_url(args.host, port)
        cmd = server_command(args, setting.fusion, port, setting.tp_size)
        print(f"[{setting.title}] {shlex.join(cmd)}", flush=True)
        log_path = log_dir / f"server_{setting.label}.log"
        with running_server(cmd, url, log_path, args.server_timeout):
            try:
                info = fetch_json(f"{url}/get_server_info")
                print(f"[{setting.title}] server fusion info: {json.dumps(info.get('fusion'))}", flush=True)
                for name in todo:
                    bench = gsm8k_bench if name == "gsm8k" else mmlu_bench
                    result = bench.run(bench.build_parser().parse_args(eval_argv(args, name, port)))
                    results[name] = {"server_command": cmd, "server_info": info, "metrics": result.metrics(),
                                     "records": result.records}
                    keep_result(args, setting, name, results[name])
            except (OSError, aiohttp.ClientError, ServerError) as exc:
                raise ServerFailed(f"request to the {setting.title} server failed ({exc!r}); "
                                   f"log tail ({log_path}):\n{log_tail(log_path)}") from exc
    first = results[args.evals[0]]
    return {"server_command": first["server_command"], "server_info": first["server_info"],
            "metrics": {name: r["metrics"] for name, r in results.items()},
            "records": {name: r["records"] for name, r in results.items()}}


def check_data(args: argparse.Namespace) -> None:
    """Fail before any server starts when the eval data cannot be found (downloads GSM8K if needed)."""
    if "gsm8k" in args.evals:
        test, train = gsm8k_bench.resolve_paths(args.gsm8k_data_path, args.gsm8k_train_path)
        for path in (test, train) if args.gsm8k_num_shots > 0 else (test,):
            if not path.exists():
                raise SystemExit(f"GSM8K file {path} not found (--gsm8k-data-path / --gsm8k-train-path)")
    if "mmlu" in args.evals:
        subjects = args.mmlu_subjects.replace(",", " ").split() if args.mmlu_subjects else None
        simple = args.mmlu_style == "simple-evals"
        mmlu_bench.load_subjects(Path(args.mmlu_data_dir), subjects,
                                 mmlu_bench.resolve_num_shots(args.mmlu_style, args.mmlu_num_shots),
                                 None if simple else args.mmlu_examples)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arfusion.benchmarks.accuracy_regression", description=__doc__,
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
    b = p.add_argument_group("baseline and checks")
    b.add_argument("--baseline-tp-size", type=int, help="also run fusion off at this TP size (e.g. 1), the first column")
    b.add_argument("--tolerance", type=float, default=1.0,
                   help="points: fail when the whole paired 95 %% interval of on - off lies below -tolerance (or the drop "
                        "is significant, p < 0.01); inconclusive when the interval is wider than this")
    b.add_argument("--baseline-tolerance", type=float, default=1.0,
                   help="points: the same check of off against the baseline")
    b.add_argument("--results-dir", help="keep each (setting, eval) result here and reuse it when run again with the "
                                         "same options (resumes a run that was cut short)")
    e = p.add_argument_group("evals (all questions by default; the limits are for smoke runs)")
    e.add_argument("--evals", default="gsm8k,mmlu", help="comma-separated subset of gsm8k,mmlu")
    e.add_argument("--gsm8k-data-path")
    e.add_argument("--gsm8k-train-path")
    e.add_argument("--gsm8k-num-questions", type=int, help="the first N test questions (default: all)")
    e.add_argument("--gsm8k-num-shots", type=int, default=8)
    e.add_argument("--mmlu-data-dir")
    e.add_argument("--mmlu-style", choices=mmlu_bench.STYLES, default="hendrycks",
                   help="hendrycks: 5-shot completions; simple-evals: zero-shot chat, the letter after 'Answer:' "
                        "(python -m arfusion.benchmarks.mmlu --help)")
    e.add_argument("--mmlu-examples", type=int, help="hendrycks: the first N test questions per subject; simple-evals: N "
                                                     "questions sampled from all subjects, e.g. 1000 (default: all)")
    e.add_argument("--mmlu-num-shots", type=int, help="default: 5 (hendrycks), 0 (simple-evals)")
    e.add_argument("--mmlu-subjects", help="comma-separated subjects (default: all)")
    e.add_argument("--parallel", type=int, default=64)
    e.add_argument("--sampling-seed", type=int, default=0, help="seed sent with every eval request (the server's own --seed goes in --server-args)")
    e.add_argument("--no-progress", action="store_true")
    p.add_argument("--output-file", help="write the full comparison as JSON")
    return p


def report(args: argparse.Namespace, runs: dict[str, dict[str, Any]], titles: dict[str, str]) -> int:
    """Print the comparison and PASS/FAIL, write ``--output-file``; returns the exit code."""
    baseline = runs.get("baseline")
    rows = compare(runs["off"]["metrics"], runs["on"]["metrics"], args.tolerance,
                   baseline and baseline["metrics"], args.baseline_tolerance)
    agreement = {name: generation_agreement(runs["off"]["records"][name], runs["on"]["records"][name]) for name in args.evals}
    baseline_agreement = {name: generation_agreement(baseline["records"][name], runs["off"]["records"][name])
                          for name in args.evals} if baseline else None
    stats = {name: {"on_vs_off": paired_stats.paired(runs["off"]["records"][name], runs["on"]["records"][name]).as_dict()}
             | ({"off_vs_baseline": paired_stats.paired(baseline["records"][name], runs["off"]["records"][name]).as_dict()}
                if baseline else {}) for name in args.evals}
    for name, pair in stats.items():
        for key, tolerance in (("on_vs_off", args.tolerance), ("off_vs_baseline", args.baseline_tolerance)):
            if key in pair:
                pair[key]["verdict"] = paired_stats.verdict(paired_stats.PairedComparison(**pair[key]), tolerance)
    for r in rows:  # the accuracy rows are flagged by the paired verdicts, not by |diff| alone
        if r["checked"]:
            pair = stats[r["metric"].split()[0]]
            r["exceeds"] = pair["on_vs_off"]["verdict"] == "fail"
            r["baseline_exceeds"] = "off_vs_baseline" in pair and pair["off_vs_baseline"]["verdict"] == "fail"
    print(format_table(rows, agreement, baseline_agreement, titles))
    for name, pair in stats.items():
        for key, label, tolerance in (("on_vs_off", f"{titles['on']} vs {titles['off']}", args.tolerance),
                                      ("off_vs_baseline", f"{titles['off']} vs {titles.get('baseline')}",
                                       args.baseline_tolerance)):
            if key in pair:
                cmp = paired_stats.PairedComparison(**{k: v for k, v in pair[key].items() if k != "verdict"})
                print(paired_stats.describe(f"{name} accuracy, {label}", cmp, tolerance))
    code, failed = exit_code(rows), []
    if any(r["exceeds"] for r in rows):
        failed.append(f"an accuracy of on is significantly below off (McNemar p < {paired_stats.ALPHA}, or the 95 % "
                      f"interval below -{args.tolerance} points)")
    if any(r["baseline_exceeds"] for r in rows):
        failed.append(f"an accuracy of off is significantly below the baseline (McNemar p < {paired_stats.ALPHA}, or the "
                      f"95 % interval below -{args.baseline_tolerance} points)")
    fusion = runs["on"]["server_info"].get("fusion", {})
    if fusion.get("active") is False:
        failed.append(f"fusion was not active in the on run ({fusion.get('reason_inactive')}): nothing was compared")
        code = 1
    print("PASS" if code == 0 else "FAIL: " + "; ".join(failed))
    if args.output_file:
        generations = {name: [{"id": r["id"], **{label: run["records"][name][i]["generation"] for label, run in runs.items()}}
                              for i, r in enumerate(runs["off"]["records"][name])] for name in args.evals}
        Path(args.output_file).write_text(json.dumps({
            "config": vars(args), "tolerance_points": args.tolerance, "baseline_tolerance_points": args.baseline_tolerance,
            "passed": code == 0, "titles": titles,
            "runs": {k: {"server_command": r["server_command"], "server_info": r["server_info"], "metrics": r["metrics"]}
                     for k, r in runs.items()},
            "comparison": rows, "paired": stats, "generation_agreement": agreement, "baseline_generation_agreement": baseline_agreement,
            "generations": generations,
        }, indent=2))
    return code


def join_server_args(argv: Sequence[str]) -> list[str]:
    """``--server-args X`` -> ``--server-args=X``: argparse would take an X that starts with a dash
    (``--server-args --deterministic``) for a flag of its own and refuse it."""
    out, items = [], iter(argv)
    for item in items:
        following = next(items, None) if item == "--server-args" else None
        out.append(item if following is None else f"--server-args={following}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(join_server_args(sys.argv[1:] if argv is None else argv))
    args.evals = [e.strip() for e in args.evals.split(",") if e.strip()]
    if not args.evals or set(args.evals) - {"gsm8k", "mmlu"}:
        parser.error(f"--evals must be a subset of gsm8k,mmlu, got {args.evals}")
    if "mmlu" in args.evals and not args.mmlu_data_dir:
        parser.error("mmlu needs --mmlu-data-dir (or --evals gsm8k)")
    if any(n is not None and n < 1 for n in (args.gsm8k_num_questions, args.mmlu_examples)):
        parser.error("--gsm8k-num-questions and --mmlu-examples must be >= 1 (leave them out for all questions)")
    check_data(args)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="accuracy_regression_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs: {log_dir}", flush=True)
    settings = settings_of(args)
    runs = {}
    try:
        for setting in settings:
            start = time.perf_counter()
            runs[setting.label] = run_setting(args, setting, log_dir)
            print(f"[{setting.title}] done in {time.perf_counter() - start:.1f} s", flush=True)
    except ServerFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    return report(args, runs, {s.label: s.title for s in settings})


if __name__ == "__main__":
    raise SystemExit(main())
