"""`StepRunner`: what the `Scheduler` uses of a rank's runner (`engine.runtime.model_runner.
ModelRunner`, or a test's stand-in): the TP group it broadcasts plans over, the device its
step timer waits on, the `RunnerLimits` it plans within, and the steps themselves."""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from arfusion.engine.runtime.model_runner import RunnerLimits
from arfusion.engine.runtime.sampler import StepLogits
from arfusion.engine.runtime.step_plan import StepPlan
from arfusion.fusion import TensorParallelGroup


class StepRunner(Protocol):
    group: TensorParallelGroup
    device: torch.device

    @property
    def limits(self) -> RunnerLimits: ...

    def forward(self, plan: StepPlan) -> StepLogits:
        """Collective: run the plan; the greedy tokens (and the logits if it gathers them)."""
        ...

    def commit_tokens(self, tokens: Optional[torch.Tensor]) -> torch.Tensor:
        """Collective: rank 0's next tokens of the last forward become every rank's."""
        ...

    def raise_if_failed(self) -> None:
        """Raise when the fused reduction gave up on a peer (the steps since are garbage)."""
        ...
