"""`ServerArgs`: every engine and server option, validated in one place.

The CLI is generated from the fields: ``--field-name`` for each field, the field's description
as help text followed by its default, ``choices`` from ``Literal`` types, ``--flag`` for
booleans. The fields are declared in sections (model, parallelism, fusion, scheduling, server);
`SECTIONS` names the first field of each, and ``--help`` shows one argument group per section;
the options that act on a GPU only (`GPU_ONLY`) begin their help with ``[GPU only]``.
Values are never rewritten; a value that cannot work raises an error naming the field.
"""
from __future__ import annotations

import argparse
import typing
from typing import Any, Collection, Literal, Mapping, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from arfusion.fusion.config import DEFAULT_CACHE_SIZE

# The fused op's backends (fusion's FUSION_BACKENDS, which tests/test_server_args.py keeps equal),
# spelled out: a type checker accepts only literal values inside Literal[...].
FusionBackend = Literal["flashinfer", "torch"]


class ServerArgsError(ValueError):
    """An invalid option; the message names the option."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks; an option whose help does not state its default gets
    ``(default: X)`` from its parser default, unless that is None or False (nothing to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class ServerArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)

    # Model
    model_path: str = Field("tiny", description="HF model directory, a .gguf file, or a built-in config with dummy weights (tiny, llama3-8b, qwen2.5-0.5b, tiny-moe, qwen3-30b-a3b, mixtral-8x7b, gpt-oss-20b, gpt-oss-120b)")
    tokenizer_path: Optional[str] = Field(None, description="Tokenizer directory or tokenizer.json (default: from the model)")
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = Field("auto", description="Weight format; dummy = seeded random weights from the config")
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field("auto", description="Activation and weight dtype (auto: bfloat16 on GPU, float32 on CPU)")
    mxfp4_experts: Literal["auto", "keep", "dequantize", "tensor-cores"] = Field("auto", description="MoE experts stored in MXFP4 (gpt-oss): keep them MXFP4 in memory (a weight-only MXFP4 MoE kernel, 4.25 bits a weight) or dequantize them to --dtype at load (auto: keep on a GPU with triton, dequantize elsewhere; a TP rank's share of an expert that is not whole groups of 32 is padded with zeros); tensor-cores: keep them and run them at every batch on the tensor-core launches of layers/moe/kernels/gluon_mxfp4_experts.py, which keep takes from 2 tokens a call (8 slots) and at every batch with --deterministic (GPU only)")
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="Where to run (auto: cuda when available)")
    context_length: Optional[int] = Field(None, ge=16, description="Maximum tokens per sequence, prompt plus output (default: the model's maximum, cut to what the KV cache holds, with the reason logged)")
    served_model_name: Optional[str] = Field(None, description="Model name reported by the API (default: model_path)")
    seed: int = Field(0, description="Seed for dummy weights and sampling")

    # Parallelism
    tp_size: int = Field(1, ge=1, le=64, description="Tensor-parallel size: one process per rank (on GPUs, one GPU per rank, ranks sharing them when the node has fewer; on the CPU, the ranks reduce over gloo and share the cores)")
    nnodes: int = Field(1, ge=1, description="Number of nodes the TP group spans")
    node_rank: int = Field(0, ge=0, description="This node's rank among nnodes")
    dist_init_addr: Optional[str] = Field(None, description="host:port of node 0 for the torch.distributed rendezvous")
    dist_timeout: float = Field(120.0, gt=0, description="Seconds before a stuck collective fails instead of hanging")

    # Fusion
    enable_flashinfer_allreduce_fusion: bool = Field(False, description="Fuse each TP all-reduce with the residual add and RMSNorm that follow it")
    allreduce_fusion_backend: FusionBackend = Field("flashinfer", description="flashinfer: the trtllm fused kernel (sm90/sm100 GPUs); torch: the same math in one function on any device")
    allreduce_fusion_max_tokens: int = Field(2048, ge=1, le=65536, description="Largest batch (tokens) the fused path takes; sizes the IPC workspace")
    allreduce_fusion_cache_size: int = Field(DEFAULT_CACHE_SIZE, ge=1, description="Entries in the (layer_id, batch_size) fusion-decision LRU cache (layers x distinct batch sizes that stay cached)")
    allreduce_fusion_table: Optional[str] = Field(None, description="Measured strategy table: JSON from python -m arfusion.engine.tune_fusion, or 'none' for no table; configurations it lacks use the built-in rule (default: the one shipped in fusion/dispatch/tables)")
    allreduce_fusion_disable_pdl: bool = Field(False, description="Launch the flashinfer fused kernel without programmatic dependent launch")
    disable_allreduce_fusion_tuning: bool = Field(False, description="Do not measure the fusion strategies at start-up when no strategy table holds this GPU, TP size, hidden size and dtype (the built-in rule decides)")
    allreduce_fusion_tuning_cache_dir: Optional[str] = Field(None, description="Where start-up tuning caches its measured tables (default: ~/.cache/arfusion)")
    norm_into_qkv: bool = Field(False, description="At TP size 1, run the residual add + RMSNorm before attention inside the q/k/v projection's launch for batches of at most 32 tokens (decode): one Triton launch (layers/kernels/triton_norm_matmul.py) instead of the norm's and cuBLAS's; larger batches, the CPU and --deterministic keep the separate norm, each reason logged once; measured slower on qwen3-30b-a3b (docs/results.md), off by default")
    norm_into_route: bool = Field(False, description="At TP size 1, run the residual add + RMSNorm after attention inside a MoE layer's routing launch for the batches its one-launch path takes (one token: decode at batch 1): one Triton launch (layers/moe/kernels/triton_route_norm.py) instead of the norm's and the routing's; dense layers, larger batches, the CPU and --deterministic keep the separate norm, each reason logged once; measured slower on qwen3-30b-a3b (docs/results.md), off by default")
    disable_combine_into_norm: bool = Field(False, description="At TP size 1 a MoE layer (gpt-oss, Qwen3-MoE, Mixtral) hands its experts' rows and routing weights to the next norm, which forms the top-k combine, the residual add and the RMSNorm in one Triton launch (layers/moe/kernels/triton_topk_combine.py) instead of gpt-oss's combine launch and the norm's, or of the sum over a token's slots inside the bf16 experts' down launch (measured: docs/results.md); this option keeps the combine with the experts; --deterministic, the CPU and larger TP sizes always do")
    rotary_into_attention: bool = Field(False, description="Run a decode batch's rotary embedding (with Qwen3's per-head q/k norm) and KV-cache write inside the attention's split launch (layers/kernels/triton_rotary_decode_attention.py) instead of a launch of their own before it, at any TP size; prefill and mixed batches, the CPU and --deterministic keep the rotary launch, each reason logged once; measured slower on qwen3-30b-a3b (docs/results.md), off by default")
    prefetch_o_proj: bool = Field(False, description="In a decode batch, prefetch each layer's attention output projection weight into L2 on a side stream while its rotary and attention launches run (layers/kernels/l2_prefetch.py; sm90 or newer), so that the projection reads it from L2: the same bits; prefill and mixed batches keep no prefetch, a GPU older than sm90 and the CPU none, the reason logged once; for every decode batch; without it, the decode batches of at most prefetch_o_proj_max_batch sequences prefetch (1 by default: larger batches lost time on llama3-8b, docs/results.md)")
    prefetch_o_proj_max_batch: int = Field(1, ge=0, description="At TP size 1, decode batches of at most this many sequences prefetch each layer's o_proj weight into L2 as the prefetch_o_proj option does for every decode batch, where the prefetch can run (sm90 or newer with triton; elsewhere, and at larger TP sizes, none, the reason logged once; its measured effect at batch 1 and 8 is in docs/results.md); the same output bits either way; 0: only with the prefetch_o_proj option")
    deterministic: bool = Field(False, description="Batch-invariant inference: a request's output (tokens, logprobs, prompt scores) has the same bits whatever else is batched with it and however its prompt is chunked; all-reduce fusion stays on (every fused strategy follows one numeric recipe)")

    # Memory and scheduling
    mem_fraction_static: float = Field(0.85, gt=0, lt=1, description="Fraction of GPU memory for weights and KV cache")
    max_running_requests: int = Field(256, ge=1, description="Most requests decoded together")
    max_prefill_tokens: int = Field(8192, ge=16, description="Most tokens one prefill step takes")
    chunked_prefill_size: int = Field(8192, ge=-1, description="Most tokens one forward step prefills: a longer prompt is prefilled in chunks over several steps, and the running requests' decode tokens ride along in the same forward (one token each, counted in this size); -1 or 0 disables chunking (whole prompts, in steps without decodes)")
    step_time_target_ms: float = Field(200.0, ge=0, description="Target duration of a forward step that prefills prompt chunks (with chunked prefill): each step takes as many prompt tokens as fit this time by the step cost measured at start-up and after every step, so that no long prompt holds the running streams or a new short request for longer; at most --chunked-prefill-size tokens. Where one step's fixed cost (a large model on a few CPU cores) exceeds it, a step's prompt tokens still cost as much as that fixed cost; 0: no target, every step takes up to --chunked-prefill-size tokens")
    cuda_graph_max_bs: int = Field(256, ge=1, description="Largest decode batch captured in a CUDA graph")
    disable_cuda_graph: bool = Field(False, description="Run decode eagerly")
    enable_pdl: bool = Field(False, description="Launch the Triton kernels of a decode step (o projection, rotary + q/k norm + KV store, decode attention, MoE routing, the MoE experts for a few tokens) with programmatic dependent launch: a kernel's blocks may be scheduled while the kernel before it runs, and wait on the GPU for its results (meant to shorten the idle time between kernels); the same output bits as without it; NVIDIA sm90 (Hopper) or newer, refused at start-up elsewhere (layers/kernels/pdl.py)")
    pdl_max_batch: int = Field(1, ge=0, description="At TP size 1, decode batches of at most this many sequences launch the step's Triton kernels with programmatic dependent launch, as --enable-pdl does for every batch, where it can run (NVIDIA sm90 or newer with triton; elsewhere, and at larger TP sizes, it stays off and the reason is logged once) and where every MoE layer's experts take their matrix-vector launches at that batch (not their grouped ones, which take no part): measured 1.8 to 3.4 percent faster at batch 1 on llama3-8b, qwen3-30b-a3b and gpt-oss-20b; 4 gains 2 percent at batches 2 and 4 on qwen3-30b-a3b but costs llama3-8b 2.5 percent on an H200 (docs/results.md); the same output bits either way; 0: only with --enable-pdl")
    skip_server_warmup: bool = Field(False, description="Skip the start-up warm-up (forwards of every shape class the server runs: Triton kernels, eager decode sizes, sampling), so the first requests pay those first-use costs")
    disable_overlap_schedule: bool = Field(False, description="Read each step's tokens on the host before launching the next step (without it, step n+1 is launched first, so the GPU does not wait for the host)")

    # Server
    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(30000, ge=1, le=65535, description="HTTP port")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Logging level")
    shutdown_timeout: float = Field(10.0, ge=0, description="Seconds that requests in flight may run on after SIGTERM/SIGINT (new ones get 503); the rest are then ended with an error")
    max_request_bytes: Optional[int] = Field(None, ge=1, description="Largest request body in bytes: a larger one is answered 413 before it is read or parsed (default: 64 bytes per token of the context length, at least 1 MiB)")
    request_head_timeout: float = Field(10.0, gt=0, description="Seconds a client has to send a request's line and headers, counted from the connection (first request) or from the request's first byte (later ones): a head still incomplete then is answered 408 and the connection closed")
    request_body_timeout: float = Field(60.0, gt=0, description="Seconds a client has to send a request's whole body, counted from the end of its headers (a body shorter than its Content-Length, or sent a few bytes at a time): a body still incomplete then is answered 408 and the connection closed")
    allow_special_tokens_in_messages: bool = Field(False, description="Tokenize special tokens' text in chat messages (content, name) as the special tokens themselves, so that a message can hold control tokens such as <|im_start|>: for trusted callers only (off: only the chat template's own text yields special tokens, message text is tokenized as text)")
    max_connections: int = Field(1000, ge=1, description="Most open HTTP connections: a connection beyond them is answered 503 and closed at once (keep it below the process's open-file limit, ulimit -n)")
    body_parsers: int = Field(1, ge=0, description="Processes that parse and validate request bodies over --body-parser-min-bytes before the server's process does: a body refused as malformed or invalid (a field over its limit) is answered from there, never parsed where the scheduler runs; a valid one is passed on and parsed as before (0: every body is parsed in the server's process)")
    body_parser_min_bytes: int = Field(64 * 1024, ge=0, description="Bodies over this many bytes go to the body parsers first")
    body_parser_queue: int = Field(8, ge=0, description="Large bodies that may wait for a body parser: one more, while every parser is busy, is answered 503")

    @model_validator(mode="after")
    def _check_combinations(self) -> "ServerArgs":
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be < nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (host:port of node 0) is required when nnodes > 1")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} must be divisible by nnodes {self.nnodes}")
        if self.dist_init_addr is not None and self.dist_init_addr.rpartition(":")[2].isdigit() is False:
            raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if self.device == "cpu" and self.allreduce_fusion_backend == "flashinfer" and self.enable_flashinfer_allreduce_fusion:
            raise ValueError("allreduce_fusion_backend 'flashinfer' needs a GPU; with device cpu use 'torch'")
        if self.device == "cpu" and self.enable_pdl:
            raise ValueError("enable_pdl needs an NVIDIA GPU of sm90 or newer; with device cpu leave it off")
        if self.mxfp4_experts == "tensor-cores" and self.device == "cpu":
            raise ValueError("mxfp4_experts 'tensor-cores' runs on a GPU; with device cpu use keep or dequantize")
        return self

    @property
    def tp_size_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @classmethod
    def from_cli(cls, argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> "ServerArgs":
        """Parse ``argv`` (default: sys.argv[1:]); raises `ServerArgsError` naming the option."""
        return cls.from_namespace(cls.build_parser(prog).parse_args(argv))

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> "ServerArgs":
        """The options given in ``namespace`` (a parser from `build_parser`, perhaps with a
        tool's own flags added: those are ignored here); raises `ServerArgsError`."""
        given = {k: v for k, v in vars(namespace).items() if k in cls.model_fields and v is not None}
        return cls.validated(**given)

    @classmethod
    def validated(cls, **values: Any) -> "ServerArgs":
        """``ServerArgs(**values)`` with errors as `ServerArgsError` naming each bad option."""
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                loc = ".".join(str(p) for p in err["loc"])
                name = _flag(loc) if loc else "options"
                problems.append(f"{name}: {err['msg']}")
            raise ServerArgsError("invalid server arguments: " + "; ".join(problems)) from None

    @classmethod
    def build_parser(cls, prog: Optional[str] = None, description: str = "arfusion engine server",
                     fields: Optional[Collection[str]] = None,
                     defaults: Optional[Mapping[str, tuple[Any, str]]] = None) -> argparse.ArgumentParser:
        """A parser with one argument group per section; every option defaults to None (not
        given), and its help states the field's default. A tool may add its own groups.

        ``fields`` (default: all) are the fields the tool uses: only they get a flag (a section
        without one gets no group). ``defaults`` maps a field to the ``(value, why)`` the tool
        applies instead of the field's default: the option then defaults to that value, and its
        help says ``(default: value, why)``. An unknown field name raises ValueError."""
        unknown = sorted(set(fields or ()).union(defaults or {}).difference(cls.model_fields))
        if unknown:
            raise ValueError(f"not ServerArgs fields: {', '.join(unknown)}")
        defaults = defaults or {}
        parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
        section, groups = "", {}
        for name, field in cls.model_fields.items():
            section = SECTIONS.get(name, section)
            if fields is not None and name not in fields:
                continue
            if section not in groups:
                groups[section] = parser.add_argument_group(section)
            group = groups[section]
            if name in defaults:
                value, why = defaults[name]
                default_text = f"(default: {value}, {why})"
            else:
                value, default_text = None, _default_text(field.default, field.description or "")
            mark = GPU_ONLY_MARK if name in GPU_ONLY else ""
            help_text = f"{mark} {field.description} {default_text}".strip()
            kwargs: dict[str, Any] = {"default": value, "help": help_text}
            annotation = field.annotation
            if annotation is bool:
                group.add_argument(_flag(name), action="store_true", **kwargs)
                continue
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            inner = args[0] if typing.get_origin(annotation) is typing.Union else annotation
            if typing.get_origin(inner) is Literal:
                kwargs["choices"] = list(typing.get_args(inner))
            elif inner in (int, float):
                kwargs["type"] = inner
            group.add_argument(_flag(name), **kwargs)
        return parser


# Options that act on a GPU only (on the CPU they change nothing, or are refused): --help marks them.
GPU_ONLY = frozenset({"allreduce_fusion_disable_pdl", "mem_fraction_static", "cuda_graph_max_bs", "disable_cuda_graph",
                      "norm_into_qkv", "norm_into_route", "disable_combine_into_norm", "rotary_into_attention",
                      "prefetch_o_proj",
                      "prefetch_o_proj_max_batch", "enable_pdl", "pdl_max_batch"})
GPU_ONLY_MARK = "[GPU only]"

# The first field of each section, in field order: --help groups the options by section.
SECTIONS = {
    "model_path": "model",
    "tp_size": "parallelism",
    "enable_flashinfer_allreduce_fusion": "fusion",
    "mem_fraction_static": "scheduling",
    "host": "server",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_text(default: Any, description: str) -> str:
    """``(default: X)`` for the help of a field; nothing when the description already states
    its default (what None means, for instance)."""
    if "(default" in description:
        return ""
    if default is None:
        return "(default: not set)"
    if isinstance(default, bool):
        return f"(default: {'on' if default else 'off'})"
    return f"(default: {default})"
