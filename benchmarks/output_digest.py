"""A digest of a server's greedy outputs, to show that a change leaves every bit as it was.

    python -m arfusion.benchmarks.output_digest [--code-root DIR] [--port P] -- SERVER FLAGS...

Starts ``python -m arfusion.engine.launch_server SERVER FLAGS`` from ``--code-root`` (default: this
checkout; another checkout of the project gives the "before" of a change; the checkout is put
first on the server's path as `arfusion`, through a link, or as it is for a checkout from before
the packages moved into the `arfusion` namespace, whose server is ``engine.launch_server``), waits for
``/health``, then sends greedy completions one at a time: single prompts of several lengths
and one request of eight prompts, each with ``echo`` and ``logprobs`` (so prefill and decode
are both covered). It prints one JSON line: the SHA-256 of every returned token and logprob
(as their exact float text), the same digest from a second pass (equal unless the server is
not repeatable), and the fusion reductions the server counted by strategy
(``/get_server_info``). Two trees give bit-identical outputs when their digests are equal.
Pass ``--step-time-target-ms 0`` among the server flags: the default step budget follows the
measured step time, so how a prompt is chunked (and so its bits) would vary between runs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import tempfile
from concurrent.futures import ThreadPoolExecutor
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

from arfusion.benchmarks.accuracy_regression import running_server

PROMPTS = ["a", "def f(x):", "The quick brown fox jumps over the lazy dog. " * 6,
           "import torch\n" + "x = torch.randn(4, 4)\n" * 40, "1 2 3 4 5 6 7 8 9 10 " * 60]
BATCH = [f"item {i}: " + "abc " * (3 * i + 1) for i in range(8)]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: {exc.code} {exc.read().decode(errors='replace')}") from exc


def complete(url: str, prompt: str, max_tokens: int) -> str:
    """One greedy completion's text, tokens and logprobs (exact float text), as JSON."""
    out = post(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                         "echo": True, "logprobs": 1})
    choice = out["choices"][0]
    lp = choice["logprobs"]
    return json.dumps([choice["text"], lp["tokens"], [repr(v) for v in lp["token_logprobs"]]])


def one_pass(url: str, max_tokens: int, concurrent: bool) -> str:
    """SHA-256 over every completion, in prompt order: ``PROMPTS`` one at a time, then ``BATCH``
    one at a time or, with ``concurrent``, all at once (batched by the server: equal digests
    then need deterministic mode)."""
    digest = hashlib.sha256()
    for prompt in PROMPTS:
        digest.update(complete(url, prompt, max_tokens).encode())
    if concurrent:
        with ThreadPoolExecutor(len(BATCH)) as pool:
            outputs = list(pool.map(lambda p: complete(url, p, max_tokens), BATCH))
    else:
        outputs = [complete(url, p, max_tokens) for p in BATCH]
    for out in outputs:
        digest.update(out.encode())
    return digest.hexdigest()


def server_command(root: Path, link_folder: Path) -> str:
    """The shell command that starts the server of the checkout at ``root``: this layout (the root
    is the package `arfusion`: a link to it in ``link_folder``, first on PYTHONPATH) or the one
    before it (the root on PYTHONPATH, top-level `engine`)."""
    if (root / "engine" / "launch_server.py").read_text().count("from arfusion."):
        (link_folder / "arfusion").symlink_to(root, target_is_directory=True)
        path, module = link_folder, "arfusion.engine.launch_server"
    else:
        path, module = root, "engine.launch_server"  # a checkout from before the arfusion namespace
    return f"cd {shlex.quote(str(root))} && PYTHONPATH={shlex.quote(str(path))}:$PYTHONPATH exec python -m {module}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--code-root", default=str(Path(__file__).resolve().parents[1]),
                        help="the project checkout whose server runs (default: this one)")
    parser.add_argument("--port", type=int, default=30123)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    parser.add_argument("--concurrent", action="store_true",
                        help="send the eight batch prompts at once (compare digests only in deterministic mode)")
    parser.add_argument("--label", default="", help="a name printed with the result")
    parser.add_argument("server_flags", nargs=argparse.REMAINDER, help="flags for engine.launch_server (after --)")
    args = parser.parse_args(argv)
    flags = [f for f in args.server_flags if f != "--"]
    root = Path(args.code_root).resolve()
    work = Path(tempfile.mkdtemp(prefix="output-digest-"))
    cmd = ["bash", "-c", f"{server_command(root, work)} --port {args.port} " + " ".join(map(shlex.quote, flags))]
    url = f"http://127.0.0.1:{args.port}"
    log = work / "server.log"
    with running_server(cmd, url, log, args.server_timeout):
        first, second = (one_pass(url, args.max_tokens, args.concurrent) for _ in range(2))
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=60) as resp:
            fusion = json.loads(resp.read()).get("fusion", {})
    print(json.dumps({"label": args.label, "code_root": str(root), "flags": flags, "concurrent": args.concurrent, "digest": first,
                      "repeatable": first == second, "reductions": fusion.get("reductions"),
                      "fusion_active": fusion.get("active")}), flush=True)


if __name__ == "__main__":
    main()
