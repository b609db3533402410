"""GGUF -> HF mapping of the MoE and Qwen3 parts: architectures, metadata, stacked expert tensors.

Names and keys come from the ``gguf`` package's constants (llama.cpp's spelling):

    general.architecture   qwen3 -> Qwen3ForCausalLM, qwen3moe -> Qwen3MoeForCausalLM,
                           llama with {arch}.expert_count > 0 -> MixtralForCausalLM
    {arch}.expert_count / expert_used_count           -> num_experts / num_experts_per_tok
    {arch}.expert_feed_forward_length (qwen3moe), feed_forward_length (Mixtral) -> moe_intermediate_size
    {arch}.expert_weights_norm (default True: llama.cpp's qwen3moe and Mixtral graphs renormalize)
                                                      -> norm_topk_prob

    blk.N.ffn_gate_inp.weight     [E, H]     -> model.layers.N.<moe>.gate.weight
    blk.N.ffn_gate_exps.weight    [E, I, H]  -> model.layers.N.<moe>.experts.{e}.<gate>.weight  [I, H]
    blk.N.ffn_up_exps.weight      [E, I, H]  -> model.layers.N.<moe>.experts.{e}.<up>.weight    [I, H]
    blk.N.ffn_down_exps.weight    [E, H, I]  -> model.layers.N.<moe>.experts.{e}.<down>.weight  [H, I]
    blk.N.attn_{q,k}_norm.weight  [head_dim] -> model.layers.N.self_attn.{q,k}_norm.weight

with <moe>, <gate>, <up>, <down> = mlp, gate_proj, up_proj, down_proj (Qwen3-MoE) or
block_sparse_moe, w1, w3, w2 (Mixtral). Shapes are as ``GGUFReader`` exposes them (ggml's ``ne``
reversed), already HF's layout; a stacked tensor is split into one view per expert, no copy.
Everything else (attention, norms, embeddings, dense MLPs) is engine/weights/gguf_names.py's.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch
from gguf import Keys, MODEL_TENSOR, TENSOR_NAMES

GGUF_MOE_ARCHITECTURES: dict[str, str] = {"qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
MIXTRAL = "MixtralForCausalLM"
# the HF architectures whose files hold this module's tensors
MOE_NAME_ARCHITECTURES = frozenset(GGUF_MOE_ARCHITECTURES.values()) | {MIXTRAL}


def _block_suffix(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".", 2)[2]


_ROUTER = _block_suffix(MODEL_TENSOR.FFN_GATE_INP)
_EXPERTS = {_block_suffix(MODEL_TENSOR.FFN_GATE_EXP): 0, _block_suffix(MODEL_TENSOR.FFN_UP_EXP): 1,
            _block_suffix(MODEL_TENSOR.FFN_DOWN_EXP): 2}
_QK_NORMS = {_block_suffix(MODEL_TENSOR.ATTN_Q_NORM): "q_norm", _block_suffix(MODEL_TENSOR.ATTN_K_NORM): "k_norm"}
_NAME = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<base>\w+)\.weight$")


def hf_moe_architecture(gguf_arch: str, expert_count: int) -> Optional[str]:
    """The HF architecture that this module maps for a file of ``general.architecture``
    ``gguf_arch`` with ``expert_count`` experts; None when the dense mapping applies."""
    if gguf_arch in GGUF_MOE_ARCHITECTURES:
        return GGUF_MOE_ARCHITECTURES[gguf_arch]
    if gguf_arch == "llama" and expert_count > 0:
        return MIXTRAL
    return None


def moe_config_fields(get: Callable[..., Any], gguf_arch: str) -> dict[str, Any]:
    """`ModelConfig` fields of a MoE file (the module docstring's keys); ``{}`` for a dense one.
    ``get(key_template, default=...)`` reads one key of this file's architecture (a missing key
    without a default raises, naming it)."""
    architecture = hf_moe_architecture(gguf_arch, int(get(Keys.LLM.EXPERT_COUNT, 0)))
    if architecture is None or architecture == GGUF_MOE_ARCHITECTURES["qwen3"]:
        return {} if architecture is None else {"architecture": architecture}
    num_experts = int(get(Keys.LLM.EXPERT_COUNT))  # a qwen3moe file without it: the error names the key
    inter_key = Keys.LLM.FEED_FORWARD_LENGTH if architecture == MIXTRAL else Keys.LLM.EXPERT_FEED_FORWARD_LENGTH
    return {
        "architecture": architecture,
        "num_experts": num_experts,
        "num_experts_per_tok": int(get(Keys.LLM.EXPERT_USED_COUNT)),
        "moe_intermediate_size": int(get(inter_key)),
        "norm_topk_prob": bool(get(Keys.LLM.EXPERT_WEIGHTS_NORM, True)),
    }


def is_moe_tensor(gguf_name: str) -> bool:
    """Whether `hf_moe_tensors` maps ``gguf_name`` (router, stacked experts, q/k norm)."""
    m = _NAME.match(gguf_name)
    return m is not None and (m["base"] == _ROUTER or m["base"] in _EXPERTS or m["base"] in _QK_NORMS)


def hf_moe_tensors(gguf_name: str, tensor: torch.Tensor, architecture: str) -> list[tuple[str, torch.Tensor]]:
    """The HF ``(name, tensor)`` pairs of one GGUF tensor of `is_moe_tensor` (module docstring):
    one for the router and the q/k norms, one view per expert for a stacked expert tensor.
    ValueError for a name outside the table."""
    m = _NAME.match(gguf_name)
    if m is None or not is_moe_tensor(gguf_name):
        raise ValueError(f"{gguf_name!r} is not a GGUF MoE or q/k-norm tensor")
    layer = f"model.layers.{m['layer']}"
    if m["base"] in _QK_NORMS:
        return [(f"{layer}.self_attn.{_QK_NORMS[m['base']]}.weight", tensor)]
    mixtral = architecture == MIXTRAL
    block = f"{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
    if m["base"] == _ROUTER:
        return [(f"{block}.gate.weight", tensor)]
    proj = (("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"))[_EXPERTS[m["base"]]]
    return [(f"{block}.experts.{e}.{proj}.weight", tensor[e]) for e in range(tensor.shape[0])]
