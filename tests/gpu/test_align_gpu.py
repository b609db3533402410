"""The grouping of slots by expert in one launch of one program per expert
(layers/moe/kernels/triton_align.py) on one GPU, against the torch version (layers/moe/align.py):
``sorted_slots``, ``block_expert`` and ``num_rows`` equal element for element.

Cases: 8, 32, 60 (not a power of two) and 128 experts; 1 to 32,768 slots (MAX_SLOTS; up to
32 chunks of 1,024 slots a program); random top-k ids (distinct per token) and skewed ones (every slot among 3 experts, so an
expert's rows span many blocks and most experts have none); 16- and 64-row blocks. Each case
also captured in a CUDA graph and replayed with new ids of the same shape."""
import pytest
import torch

pytest.importorskip("triton")

from arfusion.layers.moe.align import align_by_expert  # noqa: E402
from arfusion.layers.moe.kernels.triton_align import align_by_expert_triton  # noqa: E402
from arfusion.fusion.tuning.timing import capture_cuda_graph  # noqa: E402

pytestmark = pytest.mark.gpus(1)

DEVICE = torch.device("cuda", 0)
CASES = [(8, 1, 2), (8, 512, 2), (32, 1, 4), (32, 33, 4), (32, 750, 4), (60, 33, 4), (128, 1, 8), (128, 32, 8),
         (128, 256, 8), (128, 375, 8), (128, 4096, 8)]  # (experts, tokens, top-k)


def ids_of(experts: int, tokens: int, top_k: int, skewed: bool, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if skewed:
        return torch.randint(0, 3, (tokens, top_k), generator=g, device=DEVICE, dtype=torch.int32)
    return torch.rand(tokens, experts, generator=g, device=DEVICE).topk(top_k, dim=1).indices.to(torch.int32)


def assert_equal_blocks(blocks, expected) -> None:
    for field in ("sorted_slots", "block_expert", "num_rows"):
        assert torch.equal(getattr(blocks, field), getattr(expected, field)), field


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("skewed", [False, True], ids=["random", "skewed"])
@pytest.mark.parametrize("experts,tokens,top_k", CASES)
def test_equals_torch_align(experts, tokens, top_k, skewed, block_m):
    ids = ids_of(experts, tokens, top_k, skewed, seed=tokens)
    assert_equal_blocks(align_by_expert_triton(ids, experts, block_m), align_by_expert(ids, experts, block_m))
    static_ids = ids.clone()
    graph, blocks = capture_cuda_graph(lambda: align_by_expert_triton(static_ids, experts, block_m))
    fresh = ids_of(experts, tokens, top_k, skewed, seed=tokens + 1)
    static_ids.copy_(fresh)
    graph.replay()
    assert_equal_blocks(blocks, align_by_expert(fresh, experts, block_m))
