"""`build_rank` (one TP rank's parts, as every process of a launch builds them): the group, the
watch and the runner in that order, the watch given the runner's steps, and the teardown in
reverse on the caller's ExitStack (``peers_done`` before the runner, the group last), also
when the runner fails to build."""
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
