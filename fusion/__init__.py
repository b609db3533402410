"""arfusion's fused all-reduce + residual add + RMSNorm for tensor-parallel inference."""
from fusion.allreduce_fusion import AllReduceFusion, FusionConfig
from fusion.dispatch import FusionDispatcher, FusionEnvironment
from fusion.errors import FusionInputError, FusionUnsupportedError
from fusion.group import TensorParallelGroup
from fusion.ops import (
    allreduce_residual_rmsnorm,
    allreduce_residual_rmsnorm_fp4,
    allreduce_residual_rmsnorm_fp8,
    unfused_allreduce_residual_rmsnorm,
)
from fusion.workspace import AllReduceFusionWorkspace

__all__ = [
    "AllReduceFusion",
    "AllReduceFusionWorkspace",
    "FusionConfig",
    "FusionDispatcher",
    "FusionEnvironment",
    "FusionInputError",
    "FusionUnsupportedError",
    "TensorParallelGroup",
    "allreduce_residual_rmsnorm",
    "allreduce_residual_rmsnorm_fp4",
    "allreduce_residual_rmsnorm_fp8",
    "unfused_allreduce_residual_rmsnorm",
]
