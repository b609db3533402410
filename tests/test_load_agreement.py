"""`load_together` (engine/runtime/load_agreement.py) over a TP2 gloo group: a load that fails on
any rank is refused on every rank with the first failing rank's message, and the group is left
in step (the next collective completes on both)."""
import pytest

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.timeout(120)


def _load_on_each_rank(rank: int, world: int, failing: tuple[int, ...]) -> tuple[str, list[int]]:
    from arfusion.engine.runtime.load_agreement import LoadRefused, load_together
    from arfusion.engine.weights.errors import ModelFileError
    from arfusion.layers.parallel_state import get_tp_group

    group = get_tp_group()

    def load() -> int:
        if rank in failing:
            raise ModelFileError(f"/models/rank{rank}.gguf", "truncated")
        return 10 + rank

    try:
        outcome = f"loaded {load_together(group, load)}"
    except LoadRefused as exc:
        outcome = f"refused: {exc}"
    return outcome, group.all_gather_object(rank)  # nobody is left waiting: the group is in step


@pytest.mark.parametrize("failing, expected", [
    ((), ["loaded 10", "loaded 11"]),
    ((0,), ["refused: /models/rank0.gguf: truncated", "refused: TP rank 0: /models/rank0.gguf: truncated"]),
    ((1,), ["refused: TP rank 1: /models/rank1.gguf: truncated", "refused: /models/rank1.gguf: truncated"]),
    ((0, 1), ["refused: /models/rank0.gguf: truncated", "refused: TP rank 0: /models/rank0.gguf: truncated"]),
])
def test_every_rank_loads_or_every_rank_refuses(failing, expected):
    results = run_distributed(_load_on_each_rank, world_size=2, args=(failing,), timeout_s=90)
    assert [outcome for outcome, _ in results] == expected
    assert all(ranks == [0, 1] for _, ranks in results)
