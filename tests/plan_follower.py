"""What a TP rank other than 0 does in the engine's plan loop, for tests that drive rank 0
themselves (`engine.supervision.tp_worker` runs the same loop in a server's worker processes)."""
from __future__ import annotations

from arfusion.engine.runtime.model_runner import ModelRunner


def follow_plans(runner: ModelRunner) -> int:
    """Run every plan rank 0 broadcasts and commit its tokens, until a "shutdown" plan; returns
    the number of forward steps run."""
    steps = 0
    while True:
        plan = runner.group.broadcast_object(None, src=0)
        if plan.kind == "shutdown":
            return steps
        if plan.kind == "idle":
            continue
        runner.forward(plan)
        runner.commit_tokens(None)
        steps += 1
