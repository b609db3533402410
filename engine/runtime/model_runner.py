"""`ModelRunner`: runs one TP rank's steps over its parts (the model on its fusion op, the KV
cache, the decode CUDA graphs), which `engine.runtime.rank_parts` builds in that order; with
the settings, dtype and model-file helpers those builders use.

Every rank runs the same `StepPlan`s (broadcast by rank 0) and gets the same logits.
With ``fusion.deterministic`` (``--deterministic``) every forward and every graph capture runs
in batch-invariant mode (`layers.batch_invariant`): a sequence's logits do not depend on what
else is in its batch, and the fusion op keeps to its deterministic strategies. Its eager steps
read the whole request table through row ids, as the decode graphs do: the decode rows of a
mixed step (decodes riding along with prompt chunks, which attention then runs as a decode
batch) launch the graphs' decode kernel, of one shape whatever the step.
With ``enable_pdl`` (``--enable-pdl``, checked at start-up) every forward and every graph capture
launches the decode step's Triton kernels with programmatic dependent launch
(`layers.kernels.pdl`): the same bits, with a kernel's blocks scheduled while the one before
it still runs. Without it, decode steps of at most ``pdl_max_batch`` sequences (``--pdl-max-batch``,
their forwards and graph captures) take it at TP size 1 where it can run (`pdl_decode_bound`) and
where every MoE block's launches at that batch take part (`_pdl_for_decode`).
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Optional

import torch

from arfusion.engine.common.startup import StartupStages
from arfusion.engine.models.builtin import BUILTIN_MODELS, builtin_config
from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.forward_batch import KVCache
from arfusion.engine.runtime.cuda_graph_runner import CudaGraphRunner, capture_sizes
from arfusion.engine.runtime.logprobs import TokenLogprobs, prompt_logprobs
from arfusion.engine.runtime.sampler import StepLogits
from arfusion.engine.runtime.step_plan import RequestTable, StepPlan
from arfusion.engine.runtime.step_progress import StepProgress
from arfusion.engine.weights.dummy import dummy_weights
from arfusion.engine.weights.gguf_loader import ParsedGGUF
from arfusion.fusion import AllReduceFusion, FusionConfig, TensorParallelGroup
from arfusion.layers.batch_invariant import batch_invariant_mode, set_enabled
from arfusion.layers.kernels import l2_prefetch, pdl
from arfusion.layers.kernels.triton_support import triton_available

logger = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CPU_KV_SLOTS = 65536


@dataclass(frozen=True)
class RunnerSettings:
    """Plain values the runner needs (taken from ServerArgs by the launcher)."""

    model_path: str = "tiny"
    load_format: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    mxfp4_experts: str = "auto"  # MXFP4 experts: "keep", "dequantize", "tensor-cores" or "auto" (`keep_mxfp4`)
    context_length: Optional[int] = None
    mem_fraction_static: float = 0.85
    max_running_requests: int = 256
    cuda_graph_max_bs: int = 256
    disable_cuda_graph: bool = False
    norm_into_qkv: bool = False  # `ModelConfig.norm_into_qkv`
    norm_into_route: bool = False  # `ModelConfig.norm_into_route`
    disable_combine_into_norm: bool = False  # `ModelConfig.combine_into_norm` off
    rotary_into_attention: bool = False  # `ModelConfig.rotary_into_attention`
    prefetch_o_proj: bool = False  # every decode batch prefetches o_proj's weight (`prefetch_decode_bound`)
    prefetch_o_proj_max_batch: int = 1  # without prefetch_o_proj: decode batches up to this size prefetch (the same)
    enable_pdl: bool = False  # the decode step's Triton kernels with programmatic dependent launch (layers/kernels/pdl.py)
    pdl_max_batch: int = 1  # without enable_pdl: decode batches up to this size take it (`pdl_decode_bound`)
    fusion: FusionConfig = FusionConfig()
    kv_slots: Optional[int] = None  # fixed KV size (tests, CPU); None: from free GPU memory
    tokenizer_vocab_size: Optional[int] = None  # ids from this on (a padded LM head's rows) are never sampled


def pdl_decode_bound(settings: RunnerSettings, device: torch.device, tp_size: int) -> int:
    """Without ``enable_pdl``, the largest decode batch whose steps launch with PDL:
    ``settings.pdl_max_batch`` at TP size 1 where PDL can run, else 0 (none), the reason logged
    once (at larger TP sizes it is measured nowhere: there the collectives between the kernels
    break the chain, and ``--enable-pdl`` turns it on)."""
    if settings.enable_pdl or settings.pdl_max_batch == 0:
        return 0
    return _tp1_decode_bound(settings.pdl_max_batch, pdl.unsupported_reason(device), tp_size, "--enable-pdl",
                             "keep programmatic dependent launch off")


def prefetch_decode_bound(settings: RunnerSettings, device: torch.device, tp_size: int) -> int:
    """The largest decode batch that prefetches its o_proj weights into L2
    (`ModelConfig.prefetch_o_proj_max_batch`): every batch (``sys.maxsize``) with
    ``prefetch_o_proj``, at any TP size (where the prefetch cannot run, `l2_prefetch.ahead` logs
    why and runs without it); else ``settings.prefetch_o_proj_max_batch`` at TP size 1 where the
    prefetch can run, 0 (none) elsewhere, the reason logged once (it is measured at TP size 1
    only)."""
    if settings.prefetch_o_proj:
        return sys.maxsize
    if settings.prefetch_o_proj_max_batch == 0:
        return 0
    return _tp1_decode_bound(settings.prefetch_o_proj_max_batch, l2_prefetch.device_refusal(device), tp_size,
                             "--prefetch-o-proj", "prefetch no o_proj weight")


def _tp1_decode_bound(bound: int, refusal: Optional[str], tp_size: int, every_batch_flag: str, off: str) -> int:
    """``bound`` where the device does not refuse (``refusal`` None) and the TP size is 1, else 0
    with the reason logged ("decode batches up to ``bound`` ``off``: reason")."""
    if refusal is None and tp_size > 1:
        refusal = f"the TP size is {tp_size}; it is measured at TP size 1 only ({every_batch_flag} takes every batch)"
    if refusal is not None:
        logger.info("decode batches up to %d %s: %s", bound, off, refusal)
        return 0
    return bound


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass
class StartupContext:
    """What a rank's start-up shares with the process building it: the stages' clock and log
    (rank 0 logs them), and the model's GGUF file when that process parsed it already."""

    stages: StartupStages = field(default_factory=lambda: StartupStages(None))
    parsed: Optional[ParsedGGUF] = None


def keep_mxfp4(choice: str, device: torch.device) -> bool:
    """Whether MXFP4 experts stay MXFP4 in memory: "keep", "dequantize", or "auto": keep on a
    GPU with triton, where the weight-only MXFP4 MoE kernel runs (a rank's share of an expert is
    padded to whole groups of 32 where I / tp is not: `layers.moe.gpt_oss_moe.rank_share`); the
    CPU path dequantizes each expert at every use, so there it pays to dequantize once at load.
    "tensor-cores" keeps them too (`ModelConfig.mxfp4_tensor_cores`)."""
    if choice == "auto":
        return device.type == "cuda" and triton_available()
    return choice in ("keep", "tensor-cores")


def load_config_and_weights(settings: RunnerSettings, dtype: torch.dtype, device: torch.device,
                            parsed: Optional[ParsedGGUF] = None):
    """(ModelConfig, iterator of HF-named full tensors). Built-in names get dummy weights,
    generated on ``device`` (fast for 8B shapes on a GPU; MXFP4 experts drawn as bytes);
    ``parsed``: the GGUF file parsed already. A config with MXFP4 experts gets ``keep_mxfp4``
    from ``settings.mxfp4_experts`` (`keep_mxfp4`); every config gets ``settings.norm_into_qkv``,
    ``settings.norm_into_route``, ``settings.rotary_into_attention`` and
    ``settings.disable_combine_into_norm``."""
    if settings.model_path in BUILTIN_MODELS:
        if settings.load_format not in ("auto", "dummy"):
            raise ValueError(f"built-in model {settings.model_path!r} has dummy weights only, not {settings.load_format!r}")
        config = _run_form(builtin_config(settings.model_path), settings, device)
        return config, dummy_weights(config, seed=settings.seed, dtype=dtype, device=device)
    from arfusion.engine.weights.loader import load_model_weights

    config, weights = load_model_weights(settings.model_path, settings.load_format, dtype, settings.seed,
                                         parsed)
    return _run_form(config, settings, device), weights


def _run_form(config: ModelConfig, settings: RunnerSettings, device: torch.device) -> ModelConfig:
    """``config`` with the run's choices: ``keep_mxfp4`` and ``mxfp4_tensor_cores`` for MXFP4
    experts, ``norm_into_qkv``, ``norm_into_route``, ``rotary_into_attention``, ``combine_into_norm``."""
    if config.expert_format == "mxfp4":
        config = dataclasses.replace(config, keep_mxfp4=keep_mxfp4(settings.mxfp4_experts, device),
                                     mxfp4_tensor_cores=settings.mxfp4_experts == "tensor-cores")
    folds = ("norm_into_qkv", "norm_into_route", "rotary_into_attention")
    return dataclasses.replace(config, **{name: True for name in folds if getattr(settings, name)},
                               combine_into_norm=not settings.disable_combine_into_norm)


def check_model_files(settings: RunnerSettings, parsed: Optional[ParsedGGUF] = None) -> ModelConfig:
    """The model's config, after the checks every rank's load makes before it reads a tensor
    (each file complete, the config valid, every tensor's name and shape the model's, none
    missing): once, in the launcher, before any TP worker starts. `ModelFileError` naming the
    file; only the tensors' values (NaN, inf) are left for the load to check."""
    return load_config_and_weights(settings, torch.float32, torch.device("cpu"), parsed=parsed)[0]


@dataclass(frozen=True)
class LoadedModel:
    """A rank's model with its weights, on its fusion op (`engine.runtime.rank_parts.enter_model`)."""

    config: ModelConfig
    fusion: AllReduceFusion
    model: torch.nn.Module
    dtype: torch.dtype
    context_len: int  # requested: the settings' or the model's, before the KV cache cuts it


@dataclass(frozen=True)
class KVPart:
    """A rank's KV cache and request table (`engine.runtime.rank_parts.enter_kv_cache`)."""

    kv_cache: KVCache
    table: RequestTable
    max_rows: int
    context_len: int  # what the KV cache holds


@dataclass(frozen=True)
class RunnerLimits:
    """What a scheduler may plan for: rows of sequences at once, tokens per sequence, KV slots."""

    max_rows: int
    context_len: int
    kv_slots: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class ModelRunner:
    """Runs steps over a rank's parts (built by `engine.runtime.rank_parts`: the model on its
    fusion op, the KV cache, then the decode graphs, which `capture_graphs` adds)."""

    def __init__(self, settings: RunnerSettings, group: TensorParallelGroup, loaded: LoadedModel, kv: KVPart,
                 stages: Optional[StartupStages] = None) -> None:
        self.settings = settings
        self.group = group
        self.device = group.device
        self.deterministic = settings.fusion.deterministic
        self.enable_pdl = settings.enable_pdl
        self.pdl_decode_max = pdl_decode_bound(settings, self.device, group.world_size)
        self.stages = stages or StartupStages(None)
        self.progress = StepProgress(self.device)  # which steps began / finished (the dist-timeout watchdog)
        self.dtype = loaded.dtype
        self.config = loaded.config
        self.fusion = loaded.fusion
        self.model = loaded.model
        self._moe_blocks = [m for m in self.model.modules() if callable(getattr(m, "takes_pdl", None))]
        self._moe_pdl: dict[tuple[int, bool], bool] = {}  # (batch, deterministic) -> every MoE block takes PDL
        self.kv_cache = kv.kv_cache
        self.table = kv.table
        self.max_rows = kv.max_rows
        self.context_len = kv.context_len
        self.graphs: Optional[CudaGraphRunner] = None
        self._step_rows: Optional[torch.Tensor] = None  # device table rows of the last forward's sequences
        self._step_greedy: Optional[torch.Tensor] = None  # the last forward's greedy tokens, if it sampled none
        self._own_parts = ExitStack()  # the parts `build_runner` built for this runner alone

    @property
    def limits(self) -> RunnerLimits:
        """What the scheduler plans within (`engine.scheduling.step_runner.StepRunner`)."""
        return RunnerLimits(self.max_rows, self.context_len, self.num_kv_slots, self.config.vocab_size,
                            tuple(self.config.eos_token_ids))

    @property
    def startup_s(self) -> dict[str, float]:
        """Seconds per start-up stage so far, in order (the runner's, then the warm-up's)."""
        return self.stages.seconds

    def synchronize(self) -> None:
        """Wait until the device has finished the work queued so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture_graphs(self, max_bs: int) -> None:
        """Collective: reserve the fusion workspace for the largest decode batch, then capture
        the decode graphs of batch sizes up to ``max_bs`` (which replace any before)."""
        self.drop_graphs()
        self.fusion.reserve(capture_sizes(max_bs)[-1])
        with batch_invariant_mode(self.deterministic):
            self.graphs = CudaGraphRunner(self.model, self.kv_cache, self.table, self.device, max_bs,
                                          pdl_for_size=self._pdl_for_decode, log_progress=self.group.rank == 0)

    def drop_graphs(self) -> None:
        """Destroy the decode graphs, if any (later decode steps run eagerly)."""
        if self.graphs is not None:
            self.graphs.destroy()
            self.graphs = None

    @property
    def num_kv_slots(self) -> int:
        return self.kv_cache.num_slots

    def raise_if_failed(self) -> None:
        """Raise when the fusion op gave up on a peer (the steps since then are garbage)."""
        self.fusion.raise_if_failed()

    def clear_fusion_cache(self) -> None:
        """Drop the fusion op's cached dispatch decisions (rebuilt on the next steps)."""
        self.fusion.cache_clear()

    def own(self, parts: ExitStack) -> None:
        """Take ``parts`` (the teardown of this runner's parts), closed by `destroy`."""
        self._own_parts = parts

    def reconfigure_fusion(self, config: FusionConfig) -> None:
        """Collective: give the model's fusion op a new config (e.g. off -> on in one benchmark
        run) and recapture the decode graphs, which baked the old decisions in. Batch-invariant
        mode follows ``config.deterministic``."""
        sizes = self.graphs.sizes if self.graphs is not None else None
        self.drop_graphs()
        self.deterministic = config.deterministic
        set_enabled(self.deterministic)
        self.fusion.reconfigure(config)
        if sizes is not None:
            self.capture_graphs(sizes[-1])

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> StepLogits:
        """The greedy tokens of the plan's sequences, with their fp32 logits ``[B, vocab]`` if
        ``plan.gather_logits`` and (rank 0) the log-probabilities of the prompt tokens its
        ``prompt_logprobs`` sequences score (a collective either way; records the plan's KV slots). A decode
        step replayed from a CUDA graph returns the graph's static output buffers: the values
        are valid until the next forward (copy them to keep them). Follow it with
        `commit_tokens` when the plan's next tokens are to come from the device. Begins a step
        of ``progress`` (`engine.runtime.step_progress`), which `commit_tokens` ends."""
        self.progress.begin()
        with batch_invariant_mode(self.deterministic):
            pdl_on = self.enable_pdl or plan.kind == "decode" and self._pdl_for_decode(plan.batch_size)
            with pdl.pdl_mode(pdl_on):
                return self._forward(plan)

    def _pdl_for_decode(self, batch_size: int) -> bool:
        """Whether a decode step (or graph) of ``batch_size`` sequences launches with PDL: always
        with ``enable_pdl``; else up to ``pdl_decode_max`` sequences where every MoE block's
        launches take part at that batch (`layers.moe.routed_experts.experts_take_pdl`; read in
        the run's batch-invariant mode, which may choose other expert launches)."""
        if self.enable_pdl:
            return True
        if batch_size > self.pdl_decode_max:
            return False
        key = (batch_size, self.deterministic)
        if key not in self._moe_pdl:  # shapes and mode decide the experts' launches: asked once
            self._moe_pdl[key] = all(block.takes_pdl(batch_size) for block in self._moe_blocks)
        return self._moe_pdl[key]

    def _forward(self, plan: StepPlan) -> StepLogits:
        prompt: tuple[TokenLogprobs, ...] = ()
        if plan.kind == "decode" and self.graphs is not None and self.graphs.can_run(plan.batch_size):
            logits, self._step_rows = self.graphs.replay(plan)
        elif plan.prompt_logprobs:
            batch, self._step_rows = self.table.apply(plan, whole_table=self.deterministic)
            hidden = self.model.hidden_states(batch, self.kv_cache)
            logits = self.model.last_token_logits(batch, hidden)
            prompt = self._prompt_logprobs(plan, hidden)
        else:
            batch, self._step_rows = self.table.apply(plan, whole_table=self.deterministic)
            logits = self.model(batch, self.kv_cache)
        self._step_greedy = None if plan.gather_logits else logits.greedy_tokens
        return StepLogits(logits.greedy_tokens, logits.gather() if plan.gather_logits else None, prompt)

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> tuple[TokenLogprobs, ...]:
        """Collective: for each of the plan's ``prompt_logprobs`` sequences, the log-probabilities
        of the prompt tokens its chunk's rows score (`engine.runtime.logprobs`); rank 0 gets them,
        the other ranks ``()``. ``hidden``: the step's ``[T, hidden]``, sequences packed in order."""
        starts = [0]
        for slots in plan.new_slots:
            starts.append(starts[-1] + len(slots))
        rank0 = self.group.rank == 0
        out = []
        for spec in plan.prompt_logprobs:
            targets = spec.targets(plan.host_tokens(spec.seq))
            if not targets:
                raise ValueError(f"sequence {spec.seq} asks for prompt log-probabilities but scores no prompt token")
            rows = hidden[starts[spec.seq]:starts[spec.seq] + len(targets)]
            result = prompt_logprobs(rows, targets, spec.top_k, self.model.lm_head.local_logits,
                                     self.config.vocab_size, rank0)
            if result is not None:
                out.append(result)
        return tuple(out)

    @torch.inference_mode()
    def commit_tokens(self, tokens: Optional[torch.Tensor]) -> torch.Tensor:
        """Collective over the TP group, after `forward`: rank 0's next tokens (int64 ``[B]`` on
        the device, one per sequence of the last forward; other ranks pass None) become every
        rank's, and each sequence's row records its token in the table's ``last_tokens`` (read
        by the next ``tokens_on_device`` decode plan). A step that sampled nothing (its plan did
        not gather the logits) left the same greedy tokens on every rank: rank 0 must commit
        that step's ``greedy_tokens`` tensor itself (what `sample` returns for it), and no
        broadcast is needed. Stream-ordered: nothing waits for the GPU. Returns the tokens."""
        if self._step_rows is None:
            raise RuntimeError("commit_tokens needs a forward step first")
        rows, self._step_rows = self._step_rows, None
        greedy, self._step_greedy = self._step_greedy, None
        if self.group.rank == 0:
            if tokens is None or tokens.shape != rows.shape or tokens.dtype != torch.int64:
                got = None if tokens is None else (tuple(tokens.shape), tokens.dtype)
                raise ValueError(f"rank 0 must commit {rows.numel()} int64 tokens for the last step, got {got}")
            if greedy is not None and tokens is not greedy:
                raise ValueError("the last step sampled nothing (its plan did not gather the logits): commit its "
                                 "greedy_tokens, which every rank already holds")
            tokens = tokens.to(self.device)
        elif greedy is not None:
            tokens = greedy
        else:
            tokens = torch.empty_like(rows)
        if greedy is None:
            self.group.broadcast(tokens, src=0)
        self.table.commit_tokens(rows, tokens)
        self.progress.end()
        return tokens

    def destroy(self) -> None:
        """Tear down the parts `engine.runtime.rank_parts.build_runner` built for this runner
        (graphs, then the fusion op); a rank's runner has none: its rank's stack owns its parts."""
        self._own_parts.close()
