"""`ModelConfig`: the shapes of a Llama-family decoder, from a HF config.json or a built-in name.

MoE architectures (`MOE_ARCHITECTURES`) replace every layer's MLP by ``num_experts`` experts of
``moe_intermediate_size``, ``num_experts_per_tok`` of them per token; dense ones have
``num_experts == 0``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
LAYER_TYPES = ("full_attention", "sliding_attention")
EXPERT_FORMATS = ("bf16", "mxfp4")  # how a checkpoint stores its experts (gpt-oss: mxfp4 as published)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM") + MOE_ARCHITECTURES
REQUIRED_HF_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "max_position_embeddings")
_NON_NEGATIVE_INTS = ("head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")


def check_architecture(architecture: str) -> None:
    """ValueError naming ``architecture`` and the supported ones unless it is one of them."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _check_numbers(config: "ModelConfig") -> None:
    """ValueError naming the first size that is not a positive (or, for the optional ones,
    non-negative) integer, or an epsilon / rope base that is not a positive number."""
    for name in _POSITIVE_INTS + _NON_NEGATIVE_INTS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < (name in _POSITIVE_INTS):
            kind = "a positive" if name in _POSITIVE_INTS else "a non-negative"
            raise ValueError(f"{name} must be {kind} integer, not {value!r}")
    for name in _POSITIVE_FLOATS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number, not {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    num_experts: int = 0  # routed experts of every MoE layer; 0: dense MLPs
    num_experts_per_tok: int = 0  # experts per token (top-k)
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = False  # renormalize a token's top-k routing weights to sum 1
    sliding_window: int = 0  # keys a sliding-attention layer's query sees, itself included (0: none)
    layer_types: tuple[str, ...] = ()  # per layer, one of LAYER_TYPES (empty: all full attention)
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU: sigmoid gain
    swiglu_limit: float = 7.0  # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit
    expert_format: str = "bf16"  # the checkpoint's experts: EXPERT_FORMATS
    keep_mxfp4: bool = False  # mxfp4 experts stay mxfp4 in memory (a weight-only MXFP4 MoE) instead of bf16
    mxfp4_tensor_cores: bool = False  # kept mxfp4 experts run on the tensor-core launches (gluon_mxfp4_experts.py)
    norm_into_qkv: bool = False  # at TP1 a decode batch's input norm runs inside the q/k/v launch (layers/pending_norm.py)
    norm_into_route: bool = False  # at TP1 a decode batch's post-attention norm runs inside a MoE routing launch (the same)
    rotary_into_attention: bool = False  # a decode batch's rotary + KV write run inside its attention launch (layers/rotary_attention.py)
    combine_into_norm: bool = True  # at TP1 a MoE layer's combine runs inside the next norm's launch (fusion.UnformedSum)
    prefetch_o_proj_max_batch: int = 0  # decode batches up to this many sequences prefetch o_proj's weight into L2 during their attention (layers/kernels/l2_prefetch.py)

    def __post_init__(self) -> None:
        """ValueError naming the problem: an unknown architecture, a size of the wrong type or
        sign, inconsistent MoE fields or head counts."""
        check_architecture(self.architecture)
        _check_numbers(self)
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0):
            raise ValueError(
                f"{self.architecture} needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                f"({self.num_experts}) and moe_intermediate_size > 0 ({self.moe_intermediate_size})"
            )
        if self.architecture == "MixtralForCausalLM" and not self.norm_topk_prob:
            raise ValueError("MixtralForCausalLM renormalizes its top-k routing weights: norm_topk_prob must be True")
        if not self.is_moe and self.num_experts:
            raise ValueError(f"{self.architecture} is dense, but num_experts is {self.num_experts}")
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"layer_types must name one of {LAYER_TYPES} per layer ({self.num_hidden_layers}), "
                             f"got {list(self.layer_types)}")
        if "sliding_attention" in self.layer_types and self.sliding_window < 1:
            raise ValueError(f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {self.expert_format!r}")
        if self.keep_mxfp4 and self.expert_format != "mxfp4":
            raise ValueError("keep_mxfp4 needs a checkpoint whose experts are mxfp4")
        if self.mxfp4_tensor_cores and not self.keep_mxfp4:
            raise ValueError("mxfp4_tensor_cores needs the mxfp4 experts kept (keep_mxfp4)")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {self.num_key_value_heads}"
            )

    def window_of(self, layer_id: int) -> int:
        """The sliding window of layer ``layer_id``: `sliding_window` for a sliding-attention
        layer, 0 (every earlier key visible) for a full-attention one."""
        return self.sliding_window if self.layer_types and self.layer_types[layer_id] == "sliding_attention" else 0

    @property
    def is_moe(self) -> bool:
        return self.architecture in MOE_ARCHITECTURES

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """From the fields of a HF config.json. MoE fields: Qwen3-MoE's ``num_experts`` and
        ``moe_intermediate_size``, Mixtral's and gpt-oss's ``num_local_experts`` (their experts take
        ``intermediate_size``; Mixtral's routing always renormalizes); gpt-oss's ``layer_types``
        and ``sliding_window``, and its ``quantization_config`` (mxfp4 experts; any other
        quantization is refused); ``rope_parameters`` (transformers 5) as well as
        ``rope_theta`` / ``rope_scaling``. A Qwen3-MoE config with dense
        layers between the sparse ones (``decoder_sparse_step`` > 1, ``mlp_only_layers``) is refused.
        ValueError naming the problem: no architecture, an unknown one, missing keys (all named), or
        a value of the wrong type."""
        archs = d.get("architectures") or ([d["architecture"]] if "architecture" in d else None)
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ValueError(f"no 'architectures' list naming the model class (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        arch = archs[0]
        check_architecture(arch)  # before the keys: a config of another model family lacks some
        missing = [key for key in REQUIRED_HF_KEYS if key not in d]
        if missing:
            raise ValueError(f"missing key{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))} (a {arch} config needs "
                             f"{', '.join(REQUIRED_HF_KEYS)})")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise ValueError("MoE models with dense MLP layers (mlp_only_layers, decoder_sparse_step > 1) are not supported")
        mixtral, gpt_oss = arch == "MixtralForCausalLM", arch == "GptOssForCausalLM"
        rope = d.get("rope_parameters") or {}  # transformers >= 5 keeps rope_theta and the scaling there
        quant = d.get("quantization_config")
        quant_method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if quant is not None and not (gpt_oss and quant_method == "mxfp4"):
            raise ValueError(f"quantization_config {quant_method!r} is not supported (only gpt-oss's mxfp4 experts)")
        layer_types = tuple(d.get("layer_types") or ())
        if gpt_oss and not layer_types:  # transformers' default: sliding, full, sliding, ...
            layer_types = tuple(LAYER_TYPES[i % 2 == 0] for i in range(d["num_hidden_layers"]))
        return cls(
            architecture=arch,
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=d.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", arch in ("Qwen2ForCausalLM", "GptOssForCausalLM")),
            head_dim=d.get("head_dim") or 0,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_experts=d.get("num_experts") or d.get("num_local_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0),
            moe_intermediate_size=d.get("moe_intermediate_size") or (d["intermediate_size"] if mixtral or gpt_oss else 0),
            norm_topk_prob=d.get("norm_topk_prob", mixtral),
            sliding_window=(d.get("sliding_window") or 0) if layer_types else 0,
            layer_types=layer_types,
            swiglu_alpha=d.get("swiglu_alpha", 1.702),
            swiglu_limit=d.get("swiglu_limit", 7.0),
            expert_format="mxfp4" if quant is not None else "bf16",
        )

    def to_hf_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["architectures"] = [d.pop("architecture")]
        eos = d.pop("eos_token_ids")
        d["eos_token_id"] = list(eos)
        d["layer_types"] = list(d["layer_types"])
        return d
