"""The vLLM plugin's custom ops (`integrations.vllm.ops`) on 2 CPU ranks over gloo, without vLLM:
eager and compiled, with and without residual, against the reference; each call is one
reduction through the fusion op's dispatch (the "torch" backend on CPU)."""
import pytest

from tests.dist_utils import run_distributed
from tests.integrations.vllm_ops_cases import TOKENS, ops_match_reference


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ops_equal_the_reference_and_count_every_reduction(compiled):
    per_rank = run_distributed(ops_match_reference, args=(compiled,), timeout_s=600)
    runs = 2 if compiled else 1
    for stats in per_rank:
        assert stats["calls"] == {0: runs * len(TOKENS), 1: runs * len(TOKENS)}
        (op,) = stats["ops"].values()
        assert op["active"] and op["backend"] == "torch"
        assert op["reductions"] == {"torch": 2 * runs * len(TOKENS)}
