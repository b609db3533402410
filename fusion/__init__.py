"""arfusion's fused all-reduce + residual add + RMSNorm for tensor-parallel inference."""
from fusion.allreduce_fusion import AllReduceFusion
from fusion.config import FusionConfig
from fusion.dispatch.decision import FusionDispatcher, FusionEnvironment
from fusion.errors import FusionInputError, FusionUnsupportedError
from fusion.group import TensorParallelGroup
from fusion.strategies import FusedOutput, Quant, Strategy, all_reduce_add_rms_norm
from fusion.backends.flashinfer_workspace import AllReduceFusionWorkspace

__all__ = [
    "AllReduceFusion",
    "AllReduceFusionWorkspace",
    "FusedOutput",
    "FusionConfig",
    "FusionDispatcher",
    "FusionEnvironment",
    "FusionInputError",
    "FusionUnsupportedError",
    "Quant",
    "Strategy",
    "TensorParallelGroup",
    "all_reduce_add_rms_norm",
]
