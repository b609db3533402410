"""Start-up warm-up: one forward of every shape class the server can run, before it serves, so
that no request pays a first-use cost (a Triton kernel compiled or loaded, a fusion strategy's
kernels and decision, a sampling kernel).

Shape classes. Triton compiles a kernel once per specialization: its constexprs (decode
attention's split count and key block, from the batch and context width) and, for every integer
argument, whether it is 1 or divisible by 16, for every pointer whether it is 16-byte aligned
(the plan's integers travel packed in one tensor whose fields `RequestTable.apply` starts on
16-byte boundaries, so that one is a single class). So the plans cover: extend batches of 1-3, 16 and 17
sequences with odd, even and 16-divisible token counts and context widths; a mixed batch (decodes
riding along with a prefill chunk that has a cached prefix), with odd, even and 16-divisible
sequence counts;
eager decode at the batch sizes no CUDA graph holds; steps that gather the logits and sample
with a temperature. On a device that compiles (CUDA), also the token-count ladder up to the
largest extend step: for every power of two 2^k, 2^k - 1 and 2^k - 2 tokens (each fusion
strategy's token bucket, with all three integer classes). Decode batches the graphs hold were
run by their capture already.

State: every plan uses the request table's padding row and KV slot 0, the scratch slot that
padded decode rows write anyway, so the table and every other KV slot are left as they were;
the padding row's last committed token is restored by a last step. Deterministic: the plans
depend on the shapes only, and sampling uses a generator of fixed seed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from arfusion.engine.common.progress import Progress
from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.runtime.cuda_graph_runner import capture_sizes
from arfusion.engine.runtime.model_runner import ModelRunner
from arfusion.engine.runtime.sampler import sample
from arfusion.engine.runtime.step_plan import StepPlan

SCRATCH_SLOT = 0
# new tokens per sequence; the last two: a sequence count of 16 and of 17 (a serving step of many
# prompts, or many decodes riding along, has these integer classes too)
EXTEND_CLASSES = ([1], [7], [16], [5, 12], [16, 16], [3, 9, 20], [2] * 16, [1] * 17)
# (riding decodes, the chunk's cached prefix, its new tokens)
MIXED_CLASSES = ((2, 20, 12), (3, 3, 13), (15, 20, 12), (16, 3, 1))
DECODE_WIDTHS = (16, 17)  # context widths of eager decode steps
SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)


@dataclass(frozen=True)
class WarmUpShapes:
    """What decides the shapes the server can run."""

    context_len: int  # longest sequence (the request table's width)
    max_extend_tokens: int  # most tokens of one extend step
    max_decode_batch: int  # most sequences of one decode step (request rows)
    graph_max_batch: int  # largest decode batch a CUDA graph holds; 0: no graphs
    ladder: bool  # also the token-count ladder (devices that compile kernels)
    pad_row: int  # the request table's padding row
    vocab_size: int


def warm_up_plans(shapes: WarmUpShapes) -> list[StepPlan]:
    """The warm-up plans in order, each within the shapes' limits (see the module docstring)."""
    plans = [_extend(shapes, lens) for lens in EXTEND_CLASSES]
    if shapes.ladder:
        plans += [_extend(shapes, _split(tokens, shapes.context_len)) for tokens in _ladder(shapes.max_extend_tokens)]
    plans += [_mixed(shapes, *mixed, gather=False) for mixed in MIXED_CLASSES]
    plans.append(_mixed(shapes, *MIXED_CLASSES[0], gather=True))
    for batch in _eager_decode_batches(shapes):
        plans += [_decode(shapes, batch, width, gather=False) for width in DECODE_WIDTHS]
    plans += [_decode(shapes, batch, DECODE_WIDTHS[0], gather=True) for batch in (1, shapes.max_decode_batch)]
    return [p for p in plans if _fits(shapes, p)]


def warm_up(runner: ModelRunner, max_extend_tokens: int) -> None:
    """Collective, on TP rank 0 before serving, while the other ranks wait in their plan loop:
    run one step of every shape class the server can run with extend steps of up to
    ``max_extend_tokens`` tokens (`warm_up_plans`), so that none compiles or loads anything on
    first use. Writes only the scratch KV slot 0; the request table and every other slot are
    left as they were. A start-up stage (``runner.stages``: logged, ``runner.startup_s["warm-up"]``);
    logs its progress (`Progress`)."""
    with runner.stages.stage("warm-up", runner.synchronize):
        _warm_up(runner, max_extend_tokens)


def _warm_up(runner: ModelRunner, max_extend_tokens: int) -> None:
    graph_max_batch = runner.graphs.sizes[-1] if runner.graphs is not None else 0
    shapes = WarmUpShapes(context_len=runner.context_len, max_extend_tokens=max_extend_tokens,
                          max_decode_batch=runner.max_rows, graph_max_batch=graph_max_batch,
                          ladder=runner.device.type == "cuda", pad_row=runner.table.pad_row,
                          vocab_size=runner.config.vocab_size)
    plans = warm_up_plans(shapes)
    progress = Progress("warming up", len(plans), "steps")
    run_plans(runner, plans, progress)
    progress.finish()


def run_plans(runner: ModelRunner, plans: list[StepPlan], progress: Optional[Progress] = None) -> list[float]:
    """Collective, on TP rank 0 while the other ranks wait in their plan loop (they run each
    broadcast plan and commit its tokens, as for the scheduler's steps): broadcast, run and
    commit every plan (sampling with a temperature where it gathers the logits), then restore
    the padding row's last committed token with one more step. Returns each plan's seconds (the
    device synchronized after each), when the device is done; advances ``progress`` by one per plan."""
    if runner.group.rank != 0:
        raise RuntimeError("the warm-up is driven by TP rank 0; the other ranks run its plans in their plan loop")
    pad_row = runner.table.pad_row
    saved = runner.table.last_tokens[pad_row:pad_row + 1].clone()
    generator = torch.Generator().manual_seed(0)
    restore = StepPlan("decode", rows=[pad_row], new_slots=[[SCRATCH_SLOT]], seq_lens=[1], tokens_on_device=True,
                       gather_logits=True)
    seconds = []
    for plan in plans + [restore]:
        start = time.perf_counter()
        if runner.group.world_size > 1:
            runner.group.broadcast_object(plan)
        logits = runner.forward(plan)
        if plan is restore:
            tokens = saved
        elif plan.gather_logits:
            tokens = sample(logits, [SAMPLING] * plan.batch_size, [generator] * plan.batch_size)
        else:
            tokens = logits.greedy_tokens
        runner.commit_tokens(tokens)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        seconds.append(time.perf_counter() - start)
        if progress is not None and plan is not restore:
            progress.advance()
    return seconds[:-1]


def _ladder(max_tokens: int) -> list[int]:
    """Token counts t, t - 1 and t - 2 for every power of two t below ``max_tokens`` and for
    ``max_tokens`` itself (ascending, each once, all >= 1)."""
    tops = [1 << k for k in range(max_tokens.bit_length()) if 1 << k < max_tokens] + [max_tokens]
    return sorted({t - d for t in tops for d in range(3) if t - d >= 1})


def _split(tokens: int, context_len: int) -> list[int]:
    """``tokens`` as sequences of at most ``context_len`` tokens."""
    return [context_len] * (tokens // context_len) + ([tokens % context_len] if tokens % context_len else [])


def _eager_decode_batches(shapes: WarmUpShapes) -> list[int]:
    """Decode batch sizes that run eagerly: past the largest graph, or (no graphs) every capture
    size where kernels compile, else the smallest and the largest batch."""
    if shapes.graph_max_batch:
        beyond = [shapes.graph_max_batch + 1, shapes.max_decode_batch]
        return sorted({b for b in beyond if b <= shapes.max_decode_batch})
    if shapes.ladder:
        return capture_sizes(shapes.max_decode_batch)
    return sorted({1, shapes.max_decode_batch})


def _prompt(shapes: WarmUpShapes, n: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 104729 + 13) % shapes.vocab_size for i in range(n)]


def _extend(shapes: WarmUpShapes, new_lens: list[int]) -> StepPlan:
    return StepPlan("extend", rows=[shapes.pad_row] * len(new_lens),
                    new_tokens=[_prompt(shapes, n, i) for i, n in enumerate(new_lens)],
                    new_slots=[[SCRATCH_SLOT] * n for n in new_lens], seq_lens=list(new_lens))


def _mixed(shapes: WarmUpShapes, decodes: int, prefix: int, new: int, gather: bool) -> StepPlan:
    """``decodes`` decode rows (their tokens read on the device, context width ``prefix``) and a
    chunk of ``new`` tokens after a cached prefix of ``prefix``."""
    return StepPlan("extend", rows=[shapes.pad_row] * (decodes + 1), new_tokens=[_prompt(shapes, new, decodes)],
                    new_slots=[[SCRATCH_SLOT]] * decodes + [[SCRATCH_SLOT] * new],
                    seq_lens=[prefix] * decodes + [prefix + new], tokens_on_device=True, gather_logits=gather)


def _decode(shapes: WarmUpShapes, batch: int, width: int, gather: bool) -> StepPlan:
    return StepPlan("decode", rows=[shapes.pad_row] * batch, new_slots=[[SCRATCH_SLOT]] * batch,
                    seq_lens=[width] * batch, tokens_on_device=True, gather_logits=gather)


def _fits(shapes: WarmUpShapes, plan: StepPlan) -> bool:
    """Whether the server could run a step of this shape."""
    tokens = sum(len(s) for s in plan.new_slots)
    limit = shapes.max_decode_batch if plan.kind == "decode" else shapes.max_extend_tokens
    return tokens <= limit and plan.batch_size <= shapes.max_decode_batch and max(plan.seq_lens) <= shapes.context_len
