"""gpt-oss's clamped SwiGLU as a Triton function, shared by its experts kernels
(layers/moe/kernels/triton_mxfp4_moe.py, layers/moe/kernels/triton_mxfp4_gemv.py); the torch
reference is `layers.moe.gpt_oss_moe.clamped_swiglu`."""
import triton
import triton.language as tl


@triton.jit
def clamped_swiglu(gate, up, alpha, limit):
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``,
    elementwise in fp32 (gate and up already rounded to the activations' dtype)."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1.0) * gate * tl.sigmoid(alpha * gate)
