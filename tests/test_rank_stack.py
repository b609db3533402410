"""`build_rank` (one TP rank's parts, as every process of a launch builds them): the group, the
watch and the runner in that order, the watch given the runner's steps, and the teardown in
reverse on the caller's ExitStack (``peers_done`` before the runner, the group last), also
when the runner fails to build; a runner failing after its fusion op exists destroys the op
before the group goes, and a rank without room for a KV cache fails every rank, naming it."""
from contextlib import ExitStack

import pytest

import arfusion.engine.runtime.rank_stack as rank_stack
from arfusion.engine.launch_config import free_port
from arfusion.engine.runtime.launch import LaunchConfig
from arfusion.engine.runtime.model_runner import ModelRunner, RunnerSettings

pytestmark = pytest.mark.timeout(120)
SETTINGS = RunnerSettings(model_path="tiny", context_length=64, max_running_requests=2, kv_slots=256)


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


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the teardown does, in order (the runner's and the group's teardown still run)."""
    seen: list[str] = []
    destroy_runner, destroy_group = ModelRunner.destroy, rank_stack.destroy_tensor_parallel

    def runner_destroyed(runner: ModelRunner) -> None:
        seen.append("runner destroy")
        destroy_runner(runner)

    def group_destroyed() -> None:
        seen.append("group destroy")
        destroy_group()

    monkeypatch.setattr(ModelRunner, "destroy", runner_destroyed)
    monkeypatch.setattr(rank_stack, "destroy_tensor_parallel", group_destroyed)
    return seen


def test_a_rank_is_built_in_order_and_torn_down_in_reverse(events: list[str]):
    with ExitStack() as stack:
        rank = rank_stack.build_rank(stack, tp1_launch(), 0, watch=lambda: RecordingWatch(events),
                                     peers_done=lambda: events.append("peers done"))
        assert rank.group.world_size == 1 and rank.fusion is rank.runner.fusion
        assert events == ["watch steps"]
    assert events == ["watch steps", "peers done", "runner destroy", "watch stop", "group destroy"]


def test_a_runner_that_fails_to_build_tears_down_what_was_built(events: list[str], monkeypatch: pytest.MonkeyPatch):
    def refuse(settings: RunnerSettings, group: object, startup: object) -> ModelRunner:
        raise ValueError("no such model")

    monkeypatch.setattr(rank_stack, "ModelRunner", refuse)
    with pytest.raises(ValueError, match="no such model"), ExitStack() as stack:
        rank_stack.build_rank(stack, tp1_launch(), 0, watch=lambda: RecordingWatch(events),
                              peers_done=lambda: events.append("peers done"))
    assert events == ["peers done", "watch stop", "group destroy"]


@pytest.mark.parametrize("stage", ["fusion setup", "KV cache"])
def test_a_runner_that_fails_after_its_op_destroys_the_op_before_the_group(
        stage: str, events: list[str], monkeypatch: pytest.MonkeyPatch):
    from arfusion.fusion import AllReduceFusion

    destroy_op = AllReduceFusion.destroy

    def op_destroyed(op: AllReduceFusion) -> None:
        events.append("op destroy")
        destroy_op(op)

    def fail(*args: object) -> None:
        raise RuntimeError(f"{stage} failed")

    monkeypatch.setattr(AllReduceFusion, "destroy", op_destroyed)
    monkeypatch.setattr(AllReduceFusion if stage == "fusion setup" else ModelRunner,
                        "setup" if stage == "fusion setup" else "_kv_slots", fail)
    with pytest.raises(RuntimeError, match=f"{stage} failed"), ExitStack() as stack:
        rank_stack.build_rank(stack, tp1_launch(), 0, watch=lambda: RecordingWatch(events),
                              peers_done=lambda: events.append("peers done"))
    assert events == ["runner destroy", "op destroy", "peers done", "watch stop", "group destroy"]


def _build_with_kv_slots(rank: int, world: int, kv_slots: list[int]) -> str:
    from arfusion.layers.parallel_state import get_tp_group

    settings = RunnerSettings(model_path="tiny", context_length=64, max_running_requests=2, kv_slots=kv_slots[rank])
    try:
        ModelRunner(settings, get_tp_group()).destroy()
    except RuntimeError as error:
        return str(error)
    return "built"


def test_one_rank_without_kv_room_fails_every_rank_naming_it():
    from tests.dist_utils import run_distributed

    messages = run_distributed(_build_with_kv_slots, world_size=2, args=([256, 1],), timeout_s=60)
    assert messages == ["no memory left for the KV cache on TP rank 1: kv_slots 1"] * 2
