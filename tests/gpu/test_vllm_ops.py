"""The vLLM plugin's custom ops on CUDA (without vLLM: the ops take the project's TP group), ranks
as `tp_ranks` gives them: eager and through ``torch.compile`` (Inductor), with and without
residual, at 1 to 3000 tokens (3000: beyond the flashinfer workspace's 2048 rows, where the
op's symmetric-memory strategy or NCCL takes over), against the reference; every call is one
reduction of the fusion op, whose strategies are reported."""
import pytest

from tests.dist_utils import gpu_world_size, run_distributed
from tests.integrations.vllm_ops_cases import TOKENS, ops_match_reference

pytestmark = pytest.mark.tp_ranks(gpu_world_size())


def test_ops_on_cuda_equal_the_reference():
    per_rank = run_distributed(ops_match_reference, world_size=gpu_world_size(), args=(True,), timeout_s=900,
                               device_kind="cuda")
    for stats in per_rank:
        assert stats["calls"] == {0: 2 * len(TOKENS), 1: 2 * len(TOKENS)}
        (op,) = stats["ops"].values()
        assert op["backend"] == "flashinfer"
        assert sum(op["reductions"].values()) == 4 * len(TOKENS)
        print("vLLM plugin ops on CUDA:", op["reductions"], "active:", op["active"], op["reason_inactive"] or "")
