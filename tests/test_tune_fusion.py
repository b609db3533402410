"""`engine.tune_fusion.measure_all` builds each fusion op on its own ExitStack: a measurement
that raises (here on the second hidden size, on every rank of a CPU TP 2 group) leaves no op
undestroyed, and the entries measured before it were reported."""
from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.timeout(120)
HIDDENS = [64, 96, 128]


def _measure_failing_at(rank: int, world_size: int, failing_hidden: int) -> tuple[str, int, int, list[int]]:
    """(the error, ops built, ops destroyed, hidden sizes reported) of `measure_all` over the
    torch backend, whose measurement raises at ``failing_hidden`` and returns an entry before."""
    from arfusion.engine.tune_fusion import measure_all
    from arfusion.fusion import AllReduceFusion, FusionConfig
    from arfusion.fusion.config import NO_TABLE
    from arfusion.fusion.tuning import measure
    from arfusion.layers.parallel_state import get_tp_group

    counts = {"built": 0, "destroyed": 0}
    init, destroy = AllReduceFusion.__init__, AllReduceFusion.destroy

    def built(op: AllReduceFusion, *args: object) -> None:
        init(op, *args)
        counts["built"] += 1

    def destroyed(op: AllReduceFusion) -> None:
        counts["destroyed"] += 1
        destroy(op)

    def table_entry(group: object, backends: object, hidden: int, dtype: object, buckets: list[int],
                    **timing: object) -> dict:
        if hidden == failing_hidden:
            raise RuntimeError(f"measuring hidden {hidden} failed")
        return {"gpu": "cpu", "world_size": world_size, "hidden": hidden, "dtype": "bfloat16",
                "timings_us": {str(t): {"torch": 1.0} for t in buckets}}

    AllReduceFusion.__init__, AllReduceFusion.destroy, measure.table_entry = built, destroyed, table_entry
    config = FusionConfig(enabled=True, backend="torch", max_tokens=16, table_path=NO_TABLE, tune_at_startup=False)
    reported: list[int] = []
    try:
        measure_all(get_tp_group(), config, HIDDENS, ["bfloat16"], [],
                    lambda entry, dtype, entries: reported.append(entry["hidden"]))
        error = "measured"
    except RuntimeError as exc:
        error = str(exc)
    return error, counts["built"], counts["destroyed"], reported


@pytest.mark.parametrize(("failing_hidden", "expected"), [
    (96, ("measuring hidden 96 failed", 2, 2, [64])),
    (0, ("measured", 3, 3, HIDDENS)),
])
def test_a_measurement_that_raises_leaves_no_op_undestroyed(failing_hidden: int, expected: tuple):
    assert run_distributed(_measure_failing_at, world_size=2, args=(failing_hidden,), timeout_s=90) == [expected] * 2
