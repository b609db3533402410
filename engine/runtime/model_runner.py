"""`ModelRunner`: one TP rank's model, KV cache, fusion op and decode CUDA graphs.

Every rank runs the same `StepPlan`s (broadcast by rank 0) and gets the same logits.
Start-up order matters: the model's fusion op (no collective yet), the model built on it and its
weights (on every rank, or refused on every rank: `engine.runtime.load_agreement`), then the op's setup (workspace and buffers: a collective, before any graph capture),
then the KV cache from the memory left, then graphs (with the dispatch decisions already
cached, since capture runs the forward once per batch size). Each phase is a start-up stage
(`engine.common.startup`: rank 0 logs its start and end) and ``startup_s`` records its seconds;
rank 0 also logs the progress of the long ones (`engine.common.progress`: tensors and
bytes loaded, graphs captured); `engine.runtime.warm_up.warm_up` (rank 0, before serving) adds its own.
With ``fusion.deterministic`` (``--deterministic``) every forward and every graph capture runs
in batch-invariant mode (`layers.batch_invariant`): a sequence's logits do not depend on what
else is in its batch, and the fusion op keeps to its deterministic strategies. Its eager steps
read the whole request table through row ids, as the decode graphs do: the decode rows of a
mixed step (decodes riding along with prompt chunks, which attention then runs as a decode
batch) launch the graphs' decode kernel, of one shape whatever the step.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from arfusion.engine.common.progress import Progress, track
from arfusion.engine.common.startup import StartupStages
from arfusion.engine.models.builtin import BUILTIN_MODELS, builtin_config
from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.forward_batch import KVCache
from arfusion.engine.models.registry import build_model
from arfusion.engine.runtime.cuda_graph_runner import CudaGraphRunner, capture_sizes
from arfusion.engine.runtime.load_agreement import load_together
from arfusion.engine.runtime.logprobs import TokenLogprobs, prompt_logprobs
from arfusion.engine.runtime.sampler import StepLogits
from arfusion.engine.runtime.step_plan import RequestTable, StepPlan
from arfusion.engine.runtime.step_progress import StepProgress
from arfusion.engine.weights.dummy import dummy_weights
from arfusion.engine.weights.gguf_loader import ParsedGGUF
from arfusion.fusion import AllReduceFusion, FusionConfig, TensorParallelGroup, enable_capturable_collectives
from arfusion.layers.batch_invariant import batch_invariant_mode, set_enabled
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
    mxfp4_experts: str = "auto"  # MXFP4 experts: "keep", "dequantize" or "auto" (`keep_mxfp4`)
    context_length: Optional[int] = None
    mem_fraction_static: float = 0.85
    max_running_requests: int = 256
    cuda_graph_max_bs: int = 256
    disable_cuda_graph: bool = False
    fusion: FusionConfig = FusionConfig()
    kv_slots: Optional[int] = None  # fixed KV size (tests, CPU); None: from free GPU memory
    tokenizer_vocab_size: Optional[int] = None  # ids from this on (a padded LM head's rows) are never sampled


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


def keep_mxfp4(choice: str, device: torch.device, config: ModelConfig, tp_size: int) -> bool:
    """Whether MXFP4 experts stay MXFP4 in memory: "keep", "dequantize", or "auto": keep on a
    GPU with triton, where the weight-only MXFP4 MoE kernel runs, when each rank's slice of an
    expert's intermediate features is whole groups of 32 (gpt-oss at TP 1, 2, 3, 5, 6, 9, not 4:
    2880 / 4 = 22.5 groups); the CPU path dequantizes each expert at every use, so there it pays
    to dequantize once at load."""
    if choice == "auto":
        whole_groups = config.moe_intermediate_size % (32 * tp_size) == 0
        return device.type == "cuda" and triton_available() and whole_groups
    return choice == "keep"


def load_config_and_weights(settings: RunnerSettings, dtype: torch.dtype, device: torch.device, tp_size: int = 1,
                            parsed: Optional[ParsedGGUF] = None):
    """(ModelConfig, iterator of HF-named full tensors). Built-in names get dummy weights,
    generated on ``device`` (fast for 8B shapes on a GPU; MXFP4 experts drawn as bytes);
    ``parsed``: the GGUF file parsed already. A config with MXFP4 experts gets ``keep_mxfp4``
    from ``settings.mxfp4_experts`` (`keep_mxfp4`)."""
    if settings.model_path in BUILTIN_MODELS:
        if settings.load_format not in ("auto", "dummy"):
            raise ValueError(f"built-in model {settings.model_path!r} has dummy weights only, not {settings.load_format!r}")
        config = _expert_form(builtin_config(settings.model_path), settings, device, tp_size)
        return config, dummy_weights(config, seed=settings.seed, dtype=dtype, device=device)
    from arfusion.engine.weights.loader import load_model_weights

    config, weights = load_model_weights(settings.model_path, settings.load_format, dtype, settings.seed,
                                         parsed)
    return _expert_form(config, settings, device, tp_size), weights


def _expert_form(config: ModelConfig, settings: RunnerSettings, device: torch.device, tp_size: int) -> ModelConfig:
    if config.expert_format != "mxfp4":
        return config
    return dataclasses.replace(config, keep_mxfp4=keep_mxfp4(settings.mxfp4_experts, device, config, tp_size))


def check_model_files(settings: RunnerSettings, parsed: Optional[ParsedGGUF] = None) -> ModelConfig:
    """The model's config, after the checks every rank's load makes before it reads a tensor
    (each file complete, the config valid, every tensor's name and shape the model's, none
    missing): once, in the launcher, before any TP worker starts. `ModelFileError` naming the
    file; only the tensors' values (NaN, inf) are left for the load to check."""
    return load_config_and_weights(settings, torch.float32, torch.device("cpu"), parsed=parsed)[0]


class ModelRunner:
    def __init__(self, settings: RunnerSettings, group: TensorParallelGroup,
                 startup: Optional[StartupContext] = None) -> None:
        self.settings = settings
        self.group = group
        self.device = group.device
        self.deterministic = settings.fusion.deterministic
        set_enabled(self.deterministic)
        startup = startup or StartupContext()
        self.stages = startup.stages
        self._parsed = startup.parsed  # used by the load, then dropped
        self.progress = StepProgress(self.device)  # which steps began / finished (the dist-timeout watchdog)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.graphs: Optional[CudaGraphRunner] = None
        with self.stages.stage("weights", self.synchronize):
            load_together(group, self._load_model)  # a collective: every rank loads, or every rank raises
        self._parsed = None
        try:
            self._set_up_after_load(settings)
        except BaseException:
            self.destroy()  # the op's workspaces and any graphs, before the caller tears the group down
            raise

    def _set_up_after_load(self, settings: RunnerSettings) -> None:
        """The fusion op's workspaces, the KV cache and the decode graphs, in that order."""
        group = self.group
        with self.stages.stage("fusion setup", self.synchronize):
            self.fusion.setup()
        with self.stages.stage("KV cache", self.synchronize):
            self.max_rows = settings.max_running_requests
            self.kv_cache = self.model.allocate_kv_cache(self._kv_slots())
            self.table = RequestTable(self.max_rows, self.context_len, self.device)
        self._step_rows: Optional[torch.Tensor] = None  # device table rows of the last forward's sequences
        self._step_greedy: Optional[torch.Tensor] = None  # the last forward's greedy tokens, if it sampled none
        with self.stages.stage("graphs", self.synchronize):
            if self.device.type == "cuda" and not settings.disable_cuda_graph:
                max_bs = min(settings.cuda_graph_max_bs, self.max_rows)
                # ranks sharing a GPU reduce over gloo, which copies through the host and cannot be
                # captured: decode graphs take a symmetric-memory stand-in for the group's
                # collectives (the unfused reductions, the embedding's all-reduce, the greedy
                # tokens' all-gather), sized for the largest captured batch
                reason = (enable_capturable_collectives(group, self._capturable_bytes(max_bs)) if group.shares_gpu
                          else None)
                if reason is None:
                    self.graphs = self._capture_graphs(max_bs)
                else:
                    logger.warning("decode runs without CUDA graphs: the TP ranks share a GPU, their gloo collectives "
                                   "cannot be captured and the symmetric-memory stand-in is unavailable (%s)", reason)

    def _load_model(self) -> None:
        """This rank's config, context length, fusion op (no collective yet) and model with its
        weights. ValueError (`ModelFileError` for the files) for a model that cannot run."""
        config, weights = load_config_and_weights(self.settings, self.dtype, self.device, self.group.world_size,
                                                  self._parsed)
        self.config: ModelConfig = config
        requested = self.settings.context_length or config.max_position_embeddings  # cut to the KV cache by `_kv_slots`
        if requested > config.max_position_embeddings:
            raise ValueError(f"context_length {requested} exceeds the model's max_position_embeddings {config.max_position_embeddings}")
        self.context_len = requested
        self.fusion = AllReduceFusion(self.group, self.settings.fusion, config.hidden_size, self.dtype)
        self.model = build_model(config, self.fusion, self.dtype, self.device)
        vocab = self.settings.tokenizer_vocab_size
        if vocab is not None and vocab < config.vocab_size:
            self.model.lm_head.mask_ids_from(vocab)
            if self.group.rank == 0:
                logger.info("the LM head's %d rows past the tokenizer's %d ids are never sampled (logit -inf)",
                            config.vocab_size - vocab, vocab)
        # Qwen3-MoE's and Mixtral's MoE layers are batch-invariant in this mode (layers/moe/), so is
        # gpt-oss's torch path; its Triton experts are not yet
        if (self.deterministic and config.architecture == "GptOssForCausalLM" and self.device.type == "cuda"
                and triton_available() and self.group.rank == 0):
            logger.warning("deterministic mode: gpt-oss's expert kernel on the GPU (layers/moe/kernels/"
                           "triton_mxfp4_moe.py) picks its tiles by the rows per expert, so this model's outputs may "
                           "still depend on the batch")
        expected = type(self.model).hf_weight_shapes(config)
        total_bytes = sum(math.prod(shape) for shape in expected.values()) * self.dtype.itemsize
        progress = Progress("loading weights", len(expected), "tensors", total_bytes, enabled=self.group.rank == 0)
        self.model.load_weights(track(weights, progress, lambda item: item[1].numel() * item[1].element_size()))
        self.model.eval()

    @property
    def startup_s(self) -> dict[str, float]:
        """Seconds per start-up stage so far, in order (the runner's, then the warm-up's)."""
        return self.stages.seconds

    def synchronize(self) -> None:
        """Wait until the device has finished the work queued so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _capturable_bytes(self, max_bs: int) -> int:
        """Bytes per rank of the largest collective a decode graph of ``max_bs`` runs: a
        ``[batch, hidden]`` activation all-reduce (the greedy tokens' pairs are smaller); at
        least 1 MiB, so that a small model's buffer has room to spare."""
        return max(capture_sizes(max_bs)[-1] * max(self.config.hidden_size * self.dtype.itemsize, 8), 1 << 20)

    def _capture_graphs(self, max_bs: int) -> CudaGraphRunner:
        """Collective: reserve the fusion workspace for the largest decode batch, then capture."""
        self.fusion.reserve(capture_sizes(max_bs)[-1])
        with batch_invariant_mode(self.deterministic):
            return CudaGraphRunner(self.model, self.kv_cache, self.table, self.device, max_bs,
                                   log_progress=self.group.rank == 0)

    @property
    def num_kv_slots(self) -> int:
        return self.kv_cache.num_slots

    def _kv_slots(self) -> int:
        """Slots every rank can afford (the minimum over ranks, so all agree). On a GPU the KV
        cache gets ``mem_fraction_static`` of the device's memory, less what is in use; ranks
        sharing one GPU split that budget evenly (they measure together, before any of them
        allocates its cache). A context length the user did not set (the model's) is cut to what
        the slots hold, with the reason logged. RuntimeError on every rank, naming the rank, when
        some rank has room for fewer than 2 slots."""
        per_slot = KVCache.bytes_per_slot(self.config.num_hidden_layers, self.model.num_kv_heads_local,
                                          self.config.head_dim, self.dtype)
        want = self.max_rows * self.context_len + 1
        if self.settings.kv_slots is not None:
            slots, source = self.settings.kv_slots, f"kv_slots {self.settings.kv_slots}"
        elif self.device.type == "cuda":
            sharers = self.group.ranks_on_this_gpu
            if self.group.shares_gpu:  # the same on every rank: a collective for all or none
                self.group.all_agree(True)  # every rank's weights are loaded, no KV cache yet
            free, total = torch.cuda.mem_get_info(self.device)
            budget = (total * self.settings.mem_fraction_static - (total - free)) / sharers
            slots = int(budget // per_slot)
            source = (f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB with mem_fraction_static "
                      f"{self.settings.mem_fraction_static}")
        else:
            slots, source = CPU_KV_SLOTS, f"the CPU's {CPU_KV_SLOTS} slots"
        # every rank learns every rank's count, so a rank short of memory fails all ranks together
        offers = self.group.all_gather_object((min(slots, want), source))
        slots = min(offer for offer, _ in offers)
        if slots < 2:  # slot 0 is scratch: no room for a single token
            short = min(range(len(offers)), key=lambda r: offers[r][0])
            raise RuntimeError(f"no memory left for the KV cache on TP rank {short}: {offers[short][1]}")
        if self.settings.context_length is None and self.context_len > slots - 1:  # slot 0 is scratch
            why = ("the KV cache is set to that size" if self.settings.kv_slots is not None
                   else f"--mem-fraction-static {self.settings.mem_fraction_static} of the GPU's memory holds no more"
                   if self.device.type == "cuda" else "the CPU's KV cache holds no more")
            if self.group.rank == 0:
                logger.warning("context length cut from the model's %d to %d tokens: %s (--context-length sets it)",
                               self.context_len, slots - 1, why)
            self.context_len = slots - 1
        return slots

    def reconfigure_fusion(self, config: FusionConfig) -> None:
        """Collective: give the model's fusion op a new config (e.g. off -> on in one benchmark
        run) and recapture the decode graphs, which baked the old decisions in. Batch-invariant
        mode follows ``config.deterministic``."""
        if self.graphs is not None:
            self.graphs.destroy()
        self.deterministic = config.deterministic
        set_enabled(self.deterministic)
        self.fusion.reconfigure(config)
        if self.graphs is not None:
            self.graphs = self._capture_graphs(self.graphs.sizes[-1])

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
            return self._forward(plan)

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
        if self.graphs is not None:
            self.graphs.destroy()
            self.graphs = None
        self.fusion.destroy()
