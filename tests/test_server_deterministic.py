"""The real server with ``--deterministic`` (tiny model, TP2 over gloo, CPU, torch fusion on) in a
subprocess: /get_server_info says so, with the fused strategies it allows and fusion active, and
a greedy request's logprobs and its echo prompt score have the same bits alone and while other
requests of other lengths run."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server_process import ServerProcess

pytestmark = pytest.mark.timeout(600)
TARGET = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 2}
SCORE = {"prompt": "Paris is the capital of France", "max_tokens": 0, "echo": True, "logprobs": 1}
LOAD = [{"prompt": "x" * (3 + 7 * i), "max_tokens": 4 + i, "temperature": 0} for i in range(8)]


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--tp-size", "2", "--device", "cpu", "--enable-flashinfer-allreduce-fusion",
                         "--allreduce-fusion-backend", "torch", "--deterministic", "--max-running-requests", "16")
    yield proc
    proc.kill()


def _logprobs(server, body):
    status, answer = server.request("/v1/completions", body)
    assert status == 200, answer
    return answer["choices"][0]["logprobs"]["token_logprobs"]


def test_server_info_says_deterministic_with_fusion_active(server):
    status, info = server.request("/get_server_info")
    assert status == 200 and info["deterministic"] is True and info["server_args"]["deterministic"] is True
    assert info["fusion"]["active"], info["fusion"]["reason_inactive"]
    assert info["deterministic_strategies"] == info["fusion"]["deterministic_strategies"]
    assert info["deterministic_strategies"], "the fused strategies deterministic mode allows"


def test_logprobs_and_prompt_score_are_the_same_bits_alone_and_under_load(server):
    alone, score = _logprobs(server, TARGET), _logprobs(server, SCORE)
    with ThreadPoolExecutor(len(LOAD) + 2) as pool:
        load = [pool.submit(server.request, "/v1/completions", body) for body in LOAD]
        loaded, loaded_score = pool.submit(_logprobs, server, TARGET), pool.submit(_logprobs, server, SCORE)
        assert all(f.result()[0] == 200 for f in load)
        assert loaded.result() == alone and loaded_score.result() == score
    assert len(alone) == 8 and len(score) == 1 + len(SCORE["prompt"]) and score[0] is None  # BOS + bytes
