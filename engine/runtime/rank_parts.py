"""The builders of one TP rank's parts, each entered on an `contextlib.ExitStack` with its own
teardown as it is built, so that closing the stack (or a failure at any stage) tears down
exactly what was built, in reverse:

    enter_group      the TP process group (`layers.parallel_state.init_tensor_parallel`);
                     teardown: `destroy_tensor_parallel`
    enter_fusion_op  the model's `AllReduceFusion` (no collective yet); teardown: ``peers_done()``
                     (rank 0: its local workers have exited, so no peer still maps this rank's
                     fused workspace), then the op's ``destroy()``
    enter_model      inside one load agreement (`engine.runtime.load_agreement`: every rank loads
                     or every rank refuses) the config, the fusion op and the model built on it
                     with its weights; then the op's ``setup()`` (workspace and buffers: a
                     collective, before any graph capture). The model's tensors go with it
    enter_kv_cache   the KV cache sized from the memory left, agreed by all ranks (`kv_slots`),
                     and the request table; their tensors go with them
    enter_graphs     the decode CUDA graphs (on a GPU, unless disabled), with the capturable
                     collectives' stand-in of ranks sharing a GPU; teardown: the graphs (the
                     stand-in goes with the group, after ``peers_done()``)

`build_runner` builds a `ModelRunner` over these parts on an ExitStack of its own (tests and
benchmarks); `engine.runtime.rank_stack.build_rank` enters the same builders on its caller's.
Each stage after the group is a start-up stage (`engine.common.startup`: rank 0 logs its start
and end; ``startup_s`` records its seconds).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from contextlib import ExitStack
from typing import Callable, Optional

import torch

from arfusion.engine.common.progress import Progress, track
from arfusion.engine.models.forward_batch import KVCache
from arfusion.engine.models.registry import build_model
from arfusion.engine.runtime.cuda_graph_runner import capture_sizes
from arfusion.engine.runtime.load_agreement import load_together
from arfusion.engine.runtime.model_runner import (CPU_KV_SLOTS, KVPart, LoadedModel, ModelRunner, RunnerSettings,
                                                  StartupContext, load_config_and_weights, prefetch_decode_bound,
                                                  resolve_dtype)
from arfusion.engine.runtime.step_plan import RequestTable
from arfusion.fusion import AllReduceFusion, FusionConfig, TensorParallelGroup, enable_capturable_collectives
from arfusion.layers.batch_invariant import set_enabled
from arfusion.layers.kernels import pdl
from arfusion.layers.kernels.triton_support import triton_available
from arfusion.layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel

logger = logging.getLogger(__name__)


def enter_group(stack: ExitStack, world_size: int, rank: int, init_method: str, device: torch.device,
                node_rank: int = 0, timeout_s: float = 120.0) -> TensorParallelGroup:
    """Rank ``rank``'s TP group of ``world_size`` ranks on ``device`` (the rendezvous at
    ``init_method``, bounded by ``timeout_s``: `layers.parallel_state.init_tensor_parallel`)."""
    group = init_tensor_parallel(world_size, rank, init_method, device=device, node_rank=node_rank,
                                 timeout_s=timeout_s)
    stack.callback(destroy_tensor_parallel)
    return group


def enter_fusion_op(stack: ExitStack, group: TensorParallelGroup, config: FusionConfig, hidden: int,
                    dtype: torch.dtype, peers_done: Callable[[], None] = lambda: None) -> AllReduceFusion:
    """A fusion op over ``group`` for ``[tokens, hidden]`` activations of ``dtype`` (no
    collective yet); on teardown ``peers_done()``, then the op's ``destroy()``."""
    op = AllReduceFusion(group, config, hidden, dtype)

    def destroy() -> None:
        try:
            peers_done()
        finally:
            op.destroy()

    stack.callback(destroy)
    return op


def enter_model(stack: ExitStack, settings: RunnerSettings, group: TensorParallelGroup,
                peers_done: Callable[[], None] = lambda: None,
                startup: Optional[StartupContext] = None) -> LoadedModel:
    """Collective: the model of ``settings`` on its fusion op (`enter_fusion_op`) with its
    weights, on every rank or refused on every rank (`LoadRefused`; ValueError, `ModelFileError`
    for the files, on the rank that found the problem), then the op's ``setup()``. Sets
    batch-invariant mode to ``settings.fusion.deterministic``."""
    startup = startup or StartupContext()
    set_enabled(settings.fusion.deterministic)
    device = group.device
    dtype = resolve_dtype(settings.dtype, device)
    synchronize = _synchronizer(device)
    with startup.stages.stage("weights", synchronize):
        loaded = load_together(group, lambda: _load(stack, settings, group, dtype, peers_done, startup))
    with startup.stages.stage("fusion setup", synchronize):
        loaded.fusion.setup()
    return loaded


def _load(stack: ExitStack, settings: RunnerSettings, group: TensorParallelGroup, dtype: torch.dtype,
          peers_done: Callable[[], None], startup: StartupContext) -> LoadedModel:
    """This rank's config, context length, fusion op and model with its weights. ValueError
    (`ModelFileError` for the files) for a model that cannot run, for ``settings.enable_pdl``
    on a device where the kernels cannot launch with PDL (`layers.kernels.pdl.require_supported`),
    or for MXFP4 experts on tensor cores (``--mxfp4-experts tensor-cores``) without a GPU and
    triton."""
    device = group.device
    if settings.enable_pdl:
        pdl.require_supported(device)
    config, weights = load_config_and_weights(settings, dtype, device, startup.parsed)
    config = dataclasses.replace(config, prefetch_o_proj_max_batch=prefetch_decode_bound(settings, device,
                                                                                          group.world_size))
    if config.mxfp4_tensor_cores and (device.type != "cuda" or not triton_available()):
        raise ValueError("--mxfp4-experts tensor-cores runs the experts on a GPU with triton; here use keep or "
                         "dequantize")
    requested = settings.context_length or config.max_position_embeddings  # cut to the KV cache by `kv_slots`
    if requested > config.max_position_embeddings:
        raise ValueError(f"context_length {requested} exceeds the model's max_position_embeddings {config.max_position_embeddings}")
    fusion = enter_fusion_op(stack, group, settings.fusion, config.hidden_size, dtype, peers_done)
    model = build_model(config, fusion, dtype, device)
    vocab = settings.tokenizer_vocab_size
    if vocab is not None and vocab < config.vocab_size:
        model.lm_head.mask_ids_from(vocab)
        if group.rank == 0:
            logger.info("the LM head's %d rows past the tokenizer's %d ids are never sampled (logit -inf)",
                        config.vocab_size - vocab, vocab)
    # Qwen3-MoE's and Mixtral's MoE layers are batch-invariant in this mode (layers/moe/), so is
    # gpt-oss's torch path, its Triton experts in bf16 form and its MXFP4 experts on the tensor-core
    # launches, which this mode takes for bf16 activations; the grouped launches that serve other
    # dtypes give bits that depend on the batch (tests/gpu/test_gpt_oss_batch_invariant.py)
    if (settings.fusion.deterministic and config.architecture == "GptOssForCausalLM" and config.keep_mxfp4
            and device.type == "cuda" and triton_available() and dtype != torch.bfloat16 and group.rank == 0):
        logger.warning("deterministic mode: gpt-oss's MXFP4 experts in %s run the grouped launches (layers/moe/"
                       "kernels/triton_mxfp4_moe.py; the tensor-core ones take bf16), which do not give a token the "
                       "same bits in every batch (measured), so this model's outputs may depend on the batch; "
                       "--dtype bfloat16 or --mxfp4-experts dequantize avoid it", str(dtype).removeprefix("torch."))
    expected = type(model).hf_weight_shapes(config)
    total_bytes = sum(math.prod(shape) for shape in expected.values()) * dtype.itemsize
    progress = Progress("loading weights", len(expected), "tensors", total_bytes, enabled=group.rank == 0)
    model.load_weights(track(weights, progress, lambda item: item[1].numel() * item[1].element_size()))
    model.eval()
    return LoadedModel(config, fusion, model, dtype, requested)


def enter_kv_cache(stack: ExitStack, settings: RunnerSettings, group: TensorParallelGroup, loaded: LoadedModel,
                   startup: Optional[StartupContext] = None) -> KVPart:
    """Collective: the KV cache of `kv_slots` slots and the request table of
    ``settings.max_running_requests`` rows. Nothing to tear down but its tensors, which go with it."""
    startup = startup or StartupContext()
    with startup.stages.stage("KV cache", _synchronizer(group.device)):
        max_rows = settings.max_running_requests
        slots, context_len = kv_slots(settings, group, loaded, max_rows)
        kv_cache = loaded.model.allocate_kv_cache(slots)
        return KVPart(kv_cache, RequestTable(max_rows, context_len, group.device), max_rows, context_len)


def kv_slots(settings: RunnerSettings, group: TensorParallelGroup, loaded: LoadedModel,
             max_rows: int) -> tuple[int, int]:
    """(slots, context length): the slots every rank can afford (the minimum over ranks, so all
    agree). On a GPU the KV cache gets ``mem_fraction_static`` of the device's memory, less what
    is in use once the caching allocator's unused blocks are released; ranks sharing one GPU split
    that budget evenly (they measure together, before any of them allocates its cache). A context
    length the user did not set (the model's) is cut to what the slots hold, with the reason
    logged. RuntimeError on every rank, naming the rank, when some rank has room for fewer than 2
    slots."""
    config, dtype, device, context_len = loaded.config, loaded.dtype, group.device, loaded.context_len
    per_slot = KVCache.bytes_per_slot(config.num_hidden_layers, loaded.model.num_kv_heads_local, config.head_dim, dtype)
    want = max_rows * context_len + 1
    if settings.kv_slots is not None:
        slots, source = settings.kv_slots, f"kv_slots {settings.kv_slots}"
    elif device.type == "cuda":
        # What the caching allocator still holds of the load's freed temporaries (a full tensor
        # drawn or read before its rank's share is copied out: GiBs for gpt-oss-120b) counts as
        # used to mem_get_info: hand it back first, on every rank before any of them measures.
        torch.cuda.empty_cache()
        sharers = group.ranks_on_this_gpu
        if group.shares_gpu:  # the same on every rank: a collective for all or none
            group.all_agree(True)  # every rank's weights are loaded and its cache emptied, no KV cache yet
        free, total = torch.cuda.mem_get_info(device)
        budget = (total * settings.mem_fraction_static - (total - free)) / sharers
        slots = int(budget // per_slot)
        source = (f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB with mem_fraction_static "
                  f"{settings.mem_fraction_static}")
    else:
        slots, source = CPU_KV_SLOTS, f"the CPU's {CPU_KV_SLOTS} slots"
    # every rank learns every rank's count, so a rank short of memory fails all ranks together
    offers = group.all_gather_object((min(slots, want), source))
    slots = min(offer for offer, _ in offers)
    if slots < 2:  # slot 0 is scratch: no room for a single token
        short = min(range(len(offers)), key=lambda r: offers[r][0])
        raise RuntimeError(f"no memory left for the KV cache on TP rank {short}: {offers[short][1]}")
    if settings.context_length is None and context_len > slots - 1:  # slot 0 is scratch
        why = ("the KV cache is set to that size" if settings.kv_slots is not None
               else f"--mem-fraction-static {settings.mem_fraction_static} of the GPU's memory holds no more"
               if device.type == "cuda" else "the CPU's KV cache holds no more")
        if group.rank == 0:
            logger.warning("context length cut from the model's %d to %d tokens: %s (--context-length sets it)",
                           context_len, slots - 1, why)
        context_len = slots - 1
    if group.rank == 0:
        logger.info("KV cache: %d token slots (%.2f GiB a rank) from %s", slots, slots * per_slot / 2**30,
                    offers[0][1])
    return slots, context_len


def enter_graphs(stack: ExitStack, settings: RunnerSettings, runner: ModelRunner) -> None:
    """Collective: capture ``runner``'s decode CUDA graphs (on a GPU, unless
    ``settings.disable_cuda_graph``); ranks sharing a GPU first get the capturable collectives'
    stand-in (freed by `destroy_tensor_parallel`). Teardown: the runner's graphs."""
    group = runner.group
    with runner.stages.stage("graphs", runner.synchronize):
        stack.callback(runner.drop_graphs)
        if group.device.type != "cuda" or settings.disable_cuda_graph:
            return
        max_bs = min(settings.cuda_graph_max_bs, runner.max_rows)
        # ranks sharing a GPU reduce over gloo, which copies through the host and cannot be
        # captured: decode graphs take a symmetric-memory stand-in for the group's collectives
        # (the unfused reductions, the embedding's all-reduce, the greedy tokens' all-gather),
        # sized for the largest captured batch
        reason = enable_capturable_collectives(group, _capturable_bytes(runner, max_bs)) if group.shares_gpu else None
        if reason is None:
            runner.capture_graphs(max_bs)
        else:
            logger.warning("decode runs without CUDA graphs: the TP ranks share a GPU, their gloo collectives "
                           "cannot be captured and the symmetric-memory stand-in is unavailable (%s)", reason)


def _capturable_bytes(runner: ModelRunner, max_bs: int) -> int:
    """Bytes per rank of the largest collective a decode graph of ``max_bs`` runs: a
    ``[batch, hidden]`` activation all-reduce (the greedy tokens' pairs are smaller); at least
    1 MiB, so that a small model's buffer has room to spare."""
    return max(capture_sizes(max_bs)[-1] * max(runner.config.hidden_size * runner.dtype.itemsize, 8), 1 << 20)


def enter_runner(stack: ExitStack, settings: RunnerSettings, group: TensorParallelGroup,
                 peers_done: Callable[[], None] = lambda: None,
                 startup: Optional[StartupContext] = None) -> ModelRunner:
    """The fusion op and model, the KV cache and the graphs in that order (each registering its
    teardown on ``stack``), and the `ModelRunner` running steps over them."""
    startup = startup or StartupContext()
    loaded = enter_model(stack, settings, group, peers_done, startup)
    kv = enter_kv_cache(stack, settings, group, loaded, startup)
    runner = ModelRunner(settings, group, loaded, kv, startup.stages)
    enter_graphs(stack, settings, runner)
    return runner


def build_runner(settings: RunnerSettings, group: TensorParallelGroup,
                 startup: Optional[StartupContext] = None) -> ModelRunner:
    """Collective: a `ModelRunner` over parts built by `enter_runner` on an ExitStack of its own,
    which the runner's ``destroy()`` closes (a failure while building closes it at once)."""
    with ExitStack() as stack:
        runner = enter_runner(stack, settings, group, startup=startup)
        runner.own(stack.pop_all())
    return runner


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits until ``device`` has finished the work queued so far."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
