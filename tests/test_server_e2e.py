"""The real server (tiny model, TP2 over gloo, CPU) in a subprocess: the API, bad requests,
fusion status, identical greedy output with fusion on and off, and a TP group spread over two
"nodes" on localhost (faults: test_server_faults.py)."""
import json
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server_process import EXIT_TIMEOUT_S, REQUEST_TIMEOUT_S, ServerProcess, free_port

pytestmark = pytest.mark.timeout(600)
TP2_TORCH_FUSION = ("--tp-size", "2", "--device", "cpu", "--enable-flashinfer-allreduce-fusion",
                    "--allreduce-fusion-backend", "torch", "--max-running-requests", "16")
PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time", "def f(x):"]


@pytest.fixture(scope="module")
def fused_server():
    server = ServerProcess(*TP2_TORCH_FUSION)
    yield server
    server.kill()


def greedy(server, prompt, max_tokens=16):
    status, body = server.request("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]


def test_completion_and_usage(fused_server):
    text, usage = greedy(fused_server, "Hello", max_tokens=8)
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] == 6  # BOS + 5 bytes
    assert usage["total_tokens"] == 14


def test_streamed_completion_equals_non_streamed(fused_server):
    text, _ = greedy(fused_server, PROMPTS[0])
    req = urllib.request.Request(fused_server.url + "/v1/completions", headers={"content-type": "application/json"},
                                 data=json.dumps({"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "stream": True,
                                                  "stream_options": {"include_usage": True}}).encode())
    pieces, usage, done = [], None, False
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                pieces.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert done and "".join(pieces) == text and usage["completion_tokens"] == 16


def test_chat_completion(fused_server):
    status, body = fused_server.request("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] == 5


def test_eight_concurrent_clients_get_their_own_greedy_answers(fused_server):
    alone = {p: greedy(fused_server, p)[0] for p in PROMPTS}
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: greedy(fused_server, p)[0], PROMPTS * 2))
    assert together == [alone[p] for p in PROMPTS * 2], "continuous batching must not change greedy output"


@pytest.mark.parametrize("body,raw,status,needle", [
    (None, b"{not json", 400, ""),
    ({"prompt": "x", "max_tokens": "many"}, None, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5000}, None, 400, "context"),
    ({"prompt": "x" * 3000, "max_tokens": 1}, None, 400, ""),
    ({"prompt": "x", "model": "no-such-model"}, None, 404, "no-such-model"),
    ({"prompt": "x", "temperature": -1}, None, 400, "temperature"),
    ({"prompt": ""}, None, 400, ""),
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(fused_server, body, raw, status, needle):
    code, answer = fused_server.request("/v1/completions", body, raw=raw)
    assert code == status, answer
    assert needle in json.dumps(answer)
    assert greedy(fused_server, "still alive", max_tokens=2)[1]["completion_tokens"] == 2


def test_server_info_shows_active_torch_fusion_and_flush_clears_its_cache(fused_server):
    greedy(fused_server, "warm", max_tokens=4)
    status, info = fused_server.request("/get_server_info")
    assert status == 200
    fusion = info["fusion"]
    assert fusion["active"] and fusion["backend"] == "torch" and fusion["reason_inactive"] is None
    assert sum(n for strategy, n in fusion["reductions"].items() if strategy != "nccl") > 0, fusion["reductions"]
    assert fusion["cache"]["hits"] > 0
    assert info["server_args"]["enable_flashinfer_allreduce_fusion"] is True
    assert fused_server.request("/flush_cache", {})[0] == 200
    assert fused_server.request("/get_server_info")[1]["fusion"]["cache"]["currsize"] == 0


def test_fusion_on_and_off_give_identical_greedy_completions(fused_server):
    off = ServerProcess("--tp-size", "2", "--device", "cpu", "--max-running-requests", "16")
    try:
        assert off.request("/get_server_info")[1]["fusion"]["active"] is False
        for prompt in PROMPTS:
            assert greedy(off, prompt, 24)[0] == greedy(fused_server, prompt, 24)[0]
    finally:
        off.kill()


def test_tp_group_across_two_nodes_turns_flashinfer_fusion_off():
    addr = f"127.0.0.1:{free_port()}"
    common = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--enable-flashinfer-allreduce-fusion")
    node1 = ServerProcess(*common, "--node-rank", "1", wait_healthy=False)
    node0 = ServerProcess(*common, "--node-rank", "0")
    try:
        info = node0.request("/get_server_info")[1]
        assert info["tp_spans_nodes"] is True and info["tp_shared_gpu"] is None
        assert not info["fusion"]["active"] and "spans nodes" in info["fusion"]["reason_inactive"]
        assert greedy(node0, "two nodes", 4)[1]["completion_tokens"] == 4
        node0.stop(signal.SIGTERM)
        node1.proc.wait(timeout=EXIT_TIMEOUT_S)
        assert node1.proc.returncode == 0, node1.log_tail()
    finally:
        node0.kill()
        node1.kill()


def test_seeded_sampling_is_reproducible(fused_server):
    body = {"prompt": "Sample me", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 5}
    first = fused_server.request("/v1/completions", body)[1]["choices"][0]["text"]
    again = fused_server.request("/v1/completions", body)[1]["choices"][0]["text"]
    others = {fused_server.request("/v1/completions", {**body, "seed": s})[1]["choices"][0]["text"] for s in (6, 7, 8)}
    assert first == again
    assert others - {first}, "other seeds give other samples"
