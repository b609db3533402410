"""`build_rank` (one TP rank's parts, as every process of a launch builds them): the group, the
watch, the fusion op, the model, the KV cache and the graphs in that order, each registering its
teardown as it is built; the teardown runs in reverse on the caller's ExitStack (the graphs,
``peers_done`` then the op, the watch, the group last). A failure at any stage (before the op,
after it, after the model, after the KV cache, during capture) tears down exactly what was built,
in reverse, and leaves no op undestroyed; one rank failing to load or short of KV room fails
every rank together."""
from contextlib import ExitStack

import pytest

import arfusion.engine.runtime.rank_parts as rank_parts
import arfusion.engine.runtime.rank_stack as rank_stack
from arfusion.engine.launch_config import free_port
from arfusion.engine.runtime.launch import LaunchConfig
from arfusion.engine.runtime.model_runner import ModelRunner, RunnerSettings
from arfusion.fusion import AllReduceFusion

pytestmark = pytest.mark.timeout(120)
SETTINGS = RunnerSettings(model_path="tiny", context_length=64, max_running_requests=2, kv_slots=256)
BUILT = ["op built", "model built", "KV cache built"]
TORN_DOWN = ["graphs destroy", "peers done", "op destroy", "watch stop", "group destroy"]


def tp1_launch() -> LaunchConfig:
    return LaunchConfig(1, 1, 0, f"tcp://127.0.0.1:{free_port()}", "cpu", 60.0, "info", SETTINGS, 1)


class RecordingWatch:
    """A `StepWatch` writing what happens to it into ``events``."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def watch_steps(self, progress: object) -> None:
        self.events.append("watch steps")

    def stop(self) -> None:
        self.events.append("watch stop")


def record(monkeypatch: pytest.MonkeyPatch, target: object, name: str, event: str, events: list[str],
           after: bool = True) -> None:
    """Wrap ``target.name`` so that it appends ``event`` to ``events`` (after the call, or before it)."""
    real = getattr(target, name)

    def recorded(*args: object, **kwargs: object) -> object:
        if not after:
            events.append(event)
        result = real(*args, **kwargs)
        if after:
            events.append(event)
        return result

    monkeypatch.setattr(target, name, recorded)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the rank's build and teardown do, in order (every real teardown still runs)."""
    seen: list[str] = []
    record(monkeypatch, AllReduceFusion, "__init__", "op built", seen)
    record(monkeypatch, AllReduceFusion, "destroy", "op destroy", seen, after=False)
    record(monkeypatch, rank_parts, "build_model", "model built", seen)
    record(monkeypatch, rank_parts, "enter_kv_cache", "KV cache built", seen)
    record(monkeypatch, ModelRunner, "drop_graphs", "graphs destroy", seen, after=False)
    record(monkeypatch, rank_parts, "destroy_tensor_parallel", "group destroy", seen, after=False)
    return seen


def build(stack: ExitStack, events: list[str]) -> rank_stack.RankStack:
    return rank_stack.build_rank(stack, tp1_launch(), 0, watch=lambda: RecordingWatch(events),
                                 peers_done=lambda: events.append("peers done"))


def test_a_rank_is_built_in_order_and_torn_down_in_reverse(events: list[str]):
    with ExitStack() as stack:
        rank = build(stack, events)
        assert rank.group.world_size == 1 and rank.fusion is rank.runner.fusion
        assert events == [*BUILT, "watch steps"]
    assert events == [*BUILT, "watch steps", *TORN_DOWN]


def fail(message: str):
    def failing(*args: object, **kwargs: object) -> None:
        raise RuntimeError(message)
    return failing


ENTER_GRAPHS = rank_parts.enter_graphs


def graph_stage_failing(stack: ExitStack, settings: RunnerSettings, runner: ModelRunner) -> None:
    """The graph stage (which captures nothing on a CPU), then raising as a failed capture would."""
    ENTER_GRAPHS(stack, settings, runner)
    raise RuntimeError("during capture failed")


# (stage that fails, what fails it, its stand-in, what was built before it, the teardown of what the stage built)
STAGES = [
    ("before the op", rank_parts, "load_config_and_weights", fail("before the op failed"), [], []),
    ("after the op", rank_parts, "build_model", fail("after the op failed"), ["op built"], []),
    ("fusion setup", AllReduceFusion, "setup", fail("fusion setup failed"), ["op built", "model built"], []),
    ("after the model", rank_parts, "kv_slots", fail("after the model failed"), ["op built", "model built"], []),
    ("after the KV cache", ModelRunner, "__init__", fail("after the KV cache failed"), BUILT, []),
    ("during capture", rank_parts, "enter_graphs", graph_stage_failing, BUILT, ["graphs destroy"]),
]


@pytest.mark.parametrize(("stage", "owner", "name", "stand_in", "built", "own_teardown"), STAGES,
                         ids=[stage[0] for stage in STAGES])
def test_a_failure_at_each_stage_tears_down_what_was_built_in_reverse(
        stage: str, owner: object, name: str, stand_in: object, built: list[str], own_teardown: list[str],
        events: list[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(owner, name, stand_in)
    with pytest.raises(RuntimeError, match=f"{stage} failed"), ExitStack() as stack:
        build(stack, events)
    op_teardown = ["peers done", "op destroy"] if "op built" in built else ["peers done"]
    assert events == [*built, *own_teardown, *op_teardown, "watch stop", "group destroy"]
    assert events.count("op built") == events.count("op destroy"), "every op built is destroyed"


def _build_failing_on(rank: int, world: int, failing_rank: int, kv_slots: list[int]) -> tuple[str, int, int]:
    """(the error, ops built, ops destroyed) of this rank's `build_runner`, whose model build
    raises on ``failing_rank`` (-1: none) and whose KV cache gets ``kv_slots[rank]`` slots."""
    from arfusion.layers.parallel_state import get_tp_group

    counts = {"built": 0, "destroyed": 0}
    init, destroy, build_model = AllReduceFusion.__init__, AllReduceFusion.destroy, rank_parts.build_model

    def built(op: AllReduceFusion, *args: object) -> None:
        init(op, *args)
        counts["built"] += 1

    def destroyed(op: AllReduceFusion) -> None:
        counts["destroyed"] += 1
        destroy(op)

    def model(*args: object) -> object:
        if rank == failing_rank:
            raise ValueError("no such tensor")
        return build_model(*args)

    AllReduceFusion.__init__, AllReduceFusion.destroy, rank_parts.build_model = built, destroyed, model
    settings = RunnerSettings(model_path="tiny", context_length=64, max_running_requests=2, kv_slots=kv_slots[rank])
    try:
        rank_parts.build_runner(settings, get_tp_group()).destroy()
        error = "built"
    except (RuntimeError, ValueError) as exc:
        error = str(exc)
    return error, counts["built"], counts["destroyed"]


def test_one_rank_without_kv_room_fails_every_rank_naming_it():
    from tests.dist_utils import run_distributed

    results = run_distributed(_build_failing_on, world_size=2, args=(-1, [256, 1]), timeout_s=60)
    assert results == [("no memory left for the KV cache on TP rank 1: kv_slots 1", 1, 1)] * 2


def test_one_rank_failing_to_load_fails_every_rank_and_destroys_every_op():
    from tests.dist_utils import run_distributed

    results = run_distributed(_build_failing_on, world_size=2, args=(1, [256, 256]), timeout_s=60)
    assert results == [("TP rank 1: no such tensor", 1, 1), ("no such tensor", 1, 1)]
