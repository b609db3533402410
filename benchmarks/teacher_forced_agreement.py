r"""Teacher-forced greedy agreement of the fused and the unfused all-reduce on a real model.

    torchrun --nproc_per_node=2 -m arfusion.benchmarks.teacher_forced_agreement --model-path /tmp/model.gguf \
        --tp-size 2 --gsm8k-data-path .data/gsm8k/test.jsonl --min-positions 20000 --output-file tf.json

Sequences: GSM8K test questions in file order, each the eval's few-shot prompt
(`benchmarks.gsm8k.scoring.build_prompt` with the first ``--num-shots`` train rows) followed by
the question's reference solution written as the shots are (reasoning, "The answer is N.").
Questions are taken until their solutions hold ``--min-positions`` tokens.

Per batch of ``--batch-size`` sequences the model runs once with fusion off and once on (the
server's fusion config: ``--allreduce-fusion-backend``, the packaged strategy table or
``--allreduce-fusion-table``), as the server runs it: the prompts in prefill steps of at most
``--max-prefill-tokens`` tokens, then one decode step of the whole batch per solution token
(CUDA graphs on GPU) whose input is the reference token, not the model's choice (teacher forcing). A position is one solution token: the fp32 logits
``[vocab]`` that predict it (after the prefill for the first, after the previous solution token
for the others), gathered over the TP ranks. The settings alternate between batches (off, on;
on, off; ...), so each batch takes one reconfiguration; the first setting's logits of a batch
are kept on the device for the comparison.

Reported over all positions: the greedy agreement (argmax off == argmax on), the mean and max
``|logits_on - logits_off|`` (over every vocabulary entry), the mean and max relative error
``||on - off|| / ||off||`` per position, each setting's agreement with the reference token, and
the disagreements with their margin in the unfused logits (top-1 minus the fused choice's
logit: small margins are near-ties). Exit status: 0 when the agreement is at least
``--min-agreement``, 1 when it is lower.

Run on every rank of a TP group (``torchrun`` sets RANK, WORLD_SIZE, LOCAL_RANK; without it,
one rank); every engine option of ``python -m arfusion.engine.launch_server`` is accepted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from arfusion.benchmarks.gsm8k import bench as gsm8k_bench
from arfusion.benchmarks.gsm8k import scoring

SHOWN_DISAGREEMENTS = 20


@dataclass(frozen=True)
class AgreementOptions:
    """What to compare: the GSM8K files, the shots, how many positions, sequences per batch."""

    gsm8k_data_path: str
    gsm8k_train_path: Optional[str] = None  # default: train.jsonl next to the test file
    num_shots: int = 8
    min_positions: int = 20000
    batch_size: int = 32


@dataclass(frozen=True)
class TeacherForcedSequence:
    """One question: its prompt token ids and its reference solution's token ids."""

    question: int  # index in the test file
    prompt: list[int]
    solution: list[int]


def build_sequences(tokenizer: Any, questions: Sequence[dict[str, str]], shots: Sequence[dict[str, str]],
                    min_positions: int) -> list[TeacherForcedSequence]:
    """The first questions whose solutions hold ``min_positions`` tokens in all. ``tokenizer``:
    the engine's (`encode(text, add_special_tokens)`); the prompt is encoded as the server encodes
    a completion prompt, the solution without special tokens. ValueError when the questions run out."""
    sequences, positions = [], 0
    for index, q in enumerate(questions):
        if positions >= min_positions:
            break
        opening = scoring.format_question(q["question"])
        solution = scoring.format_shot(q["question"], q["answer"])[len(opening):]
        sequences.append(TeacherForcedSequence(index, tokenizer.encode(scoring.build_prompt(shots, q["question"])),
                                               tokenizer.encode(solution, add_special_tokens=False)))
        positions += len(sequences[-1].solution)
    if positions < min_positions:
        raise ValueError(f"{len(questions)} questions hold {positions} solution tokens, fewer than {min_positions}")
    return sequences


def prefill_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive indices of ``lengths`` grouped into prefill steps of at most ``max_tokens``
    tokens, as the server's scheduler packs prompts (a longer prompt takes a step alone)."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if not groups or total + n > max_tokens:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def teacher_forced_logits(runner: Any, batch: Sequence[TeacherForcedSequence], max_prefill_tokens: int,
                          ) -> Iterator[torch.Tensor]:
    """Collective: for step s = 0, 1, ... the fp32 logits ``[B, vocab]`` that predict solution
    token s of every sequence: the prompts' last positions (prefill steps of at most
    ``max_prefill_tokens`` tokens), then one decode step of the whole batch per fed reference
    token. Rows of sequences whose solution is shorter are fed their last token again and are to
    be ignored. A yielded tensor may be overwritten by the next step: clone it to keep it."""
    from arfusion.engine.runtime.step_plan import StepPlan
    from arfusion.engine.scheduling.kv_pool import RowAllocator, SlotAllocator

    steps = max(len(s.solution) for s in batch)
    rows, slot_pool = RowAllocator(runner.max_rows), SlotAllocator(runner.num_kv_slots)
    table_rows = [rows.allocate() for _ in batch]
    slots = [slot_pool.allocate(len(s.prompt) + steps) for s in batch]
    seq_lens = [len(s.prompt) for s in batch]
    first = []
    for group in prefill_groups(seq_lens, max_prefill_tokens):
        plan = StepPlan("extend", rows=[table_rows[i] for i in group], new_tokens=[batch[i].prompt for i in group],
                        new_slots=[slots[i][:seq_lens[i]] for i in group], seq_lens=[seq_lens[i] for i in group],
                        gather_logits=True)
        first.append(runner.forward(plan).full.clone())
    yield torch.cat(first)
    for step in range(steps - 1):
        seq_lens = [n + 1 for n in seq_lens]
        plan = StepPlan("decode", rows=table_rows, new_tokens=[[s.solution[min(step, len(s.solution) - 1)]] for s in batch],
                        new_slots=[[slot[n - 1]] for slot, n in zip(slots, seq_lens)], seq_lens=seq_lens,
                        gather_logits=True)
        yield runner.forward(plan).full


@dataclass
class AgreementStats:
    """Running sums over the compared positions (see the module docstring for the definitions)."""

    positions: int = 0
    agreeing: int = 0
    reference_hits: dict[str, int] = field(default_factory=lambda: {"off": 0, "on": 0})
    abs_err_sum: float = 0.0
    abs_err_count: int = 0
    max_abs_err: float = 0.0
    rel_err_sum: float = 0.0
    max_rel_err: float = 0.0
    disagreements: list[dict[str, Any]] = field(default_factory=list)

    def add(self, off: torch.Tensor, on: torch.Tensor, targets: torch.Tensor, rows: Sequence[int],
            where: Sequence[tuple[int, int]]) -> None:
        """Count the positions ``rows`` of one step: logits ``off``/``on`` ``[B, V]``, the reference
        tokens ``targets [B]``, ``where[i]``: (question, position in its solution) of row ``rows[i]``."""
        index = torch.tensor(list(rows), device=off.device)
        off, on, targets = off[index].float(), on[index].float(), targets.to(off.device)[index]
        diff = (on - off).abs()
        off_top, on_top = off.argmax(-1), on.argmax(-1)
        rel = (on - off).norm(dim=-1) / off.norm(dim=-1)
        self.positions += len(rows)
        self.agreeing += int((off_top == on_top).sum())
        self.reference_hits["off"] += int((off_top == targets).sum())
        self.reference_hits["on"] += int((on_top == targets).sum())
        self.abs_err_sum += float(diff.double().sum())
        self.abs_err_count += diff.numel()
        self.max_abs_err = max(self.max_abs_err, float(diff.max()))
        self.rel_err_sum += float(rel.double().sum())
        self.max_rel_err = max(self.max_rel_err, float(rel.max()))
        for i in torch.nonzero(off_top != on_top).flatten().tolist():
            margin = float(off[i, off_top[i]] - off[i, on_top[i]])
            self.disagreements.append({"question": where[i][0], "position": where[i][1], "off_token": int(off_top[i]),
                                       "on_token": int(on_top[i]), "off_margin": margin})

    def summary(self) -> dict[str, Any]:
        """The reported numbers (the first `SHOWN_DISAGREEMENTS` disagreements listed)."""
        n = max(self.positions, 1)
        margins = [d["off_margin"] for d in self.disagreements]
        return {
            "positions": self.positions, "agreeing": self.agreeing, "agreement": self.agreeing / n,
            "mean_abs_logit_err": self.abs_err_sum / max(self.abs_err_count, 1), "max_abs_logit_err": self.max_abs_err,
            "mean_rel_err": self.rel_err_sum / n, "max_rel_err": self.max_rel_err,
            "reference_accuracy": {k: v / n for k, v in self.reference_hits.items()},
            "num_disagreements": len(self.disagreements), "max_disagreement_margin": max(margins, default=None),
            "disagreements": self.disagreements[:SHOWN_DISAGREEMENTS],
        }


def _compare_batch(runner: Any, batch: Sequence[TeacherForcedSequence], first: Any, second: Any,
                   max_prefill_tokens: int, stats: AgreementStats) -> dict[str, Any]:
    """Collective: run ``batch`` with fusion config ``first`` (its logits kept) then ``second`` (one
    of them enabled), add every position to ``stats``; returns the fused op's status after its run."""
    label = {True: "on", False: "off"}
    if runner.fusion.config != first:
        runner.reconfigure_fusion(first)
    kept = [logits.clone() for logits in teacher_forced_logits(runner, batch, max_prefill_tokens)]
    status = runner.fusion.status()
    runner.reconfigure_fusion(second)
    for step, logits in enumerate(teacher_forced_logits(runner, batch, max_prefill_tokens)):
        rows = [i for i, s in enumerate(batch) if step < len(s.solution)]
        targets = torch.tensor([s.solution[min(step, len(s.solution) - 1)] for s in batch])
        pair = {label[first.enabled]: kept[step], label[second.enabled]: logits}
        stats.add(pair["off"], pair["on"], targets, rows, [(batch[i].question, step) for i in rows])
    return status if first.enabled else runner.fusion.status()


def measure(server: Any, options: AgreementOptions) -> dict[str, Any]:
    """Collective over the TP group (`engine.runtime.rank_parts.enter_group` first, on every
    rank): load the model of ``server`` (a `ServerArgs`), compare fusion off and on over the
    GSM8K sequences of ``options``; returns the summary (the same on every rank) with the fused
    op's status after the last fused run (its ``reductions`` count eager calls only: a replayed
    CUDA graph does not pass through Python), the number of sequences and the wall time."""
    from arfusion.engine.launch_config import fusion_config, runner_settings
    from arfusion.engine.runtime.rank_parts import enter_runner
    from arfusion.engine.tokenizers.serving import load_serving_tokenizer
    from arfusion.layers.parallel_state import get_tp_group

    start = time.perf_counter()
    test_path, train_path = gsm8k_bench.resolve_paths(options.gsm8k_data_path, options.gsm8k_train_path)
    shots = gsm8k_bench.load_jsonl(train_path)[: options.num_shots] if options.num_shots else []
    tokenizer = load_serving_tokenizer(server.model_path, server.tokenizer_path)
    sequences = build_sequences(tokenizer, gsm8k_bench.load_jsonl(test_path), shots, options.min_positions)
    # a batch runs until its longest solution ends, its other sequences fed filler tokens
    context = max(len(s.prompt) for s in sequences) + max(len(s.solution) for s in sequences)
    rows = min(options.batch_size, len(sequences))
    off = replace(fusion_config(server), enabled=False)
    on = replace(off, enabled=True)
    settings = replace(runner_settings(server), fusion=off, context_length=context, max_running_requests=rows,
                       cuda_graph_max_bs=rows, kv_slots=rows * context + 1)
    stats = AgreementStats()
    with ExitStack() as stack:
        runner = enter_runner(stack, settings, get_tp_group())
        for b, first in enumerate(range(0, len(sequences), rows)):
            order = (off, on) if b % 2 == 0 else (on, off)
            fused_status = _compare_batch(runner, sequences[first:first + rows], *order, server.max_prefill_tokens, stats)
    return {**stats.summary(), "sequences": len(sequences), "model_path": server.model_path, "tp_size": server.tp_size,
            "dtype": str(runner.dtype), "fused_status": fused_status, "options": asdict(options),
            "wall_s": time.perf_counter() - start}


def format_result(result: dict[str, Any]) -> str:
    """A few readable lines of `measure`'s summary."""
    ref = result["reference_accuracy"]
    lines = [
        f"teacher-forced greedy agreement, fusion on vs off: {result['agreement']:.5f} "
        f"({result['agreeing']} of {result['positions']} positions, {result['sequences']} GSM8K sequences, "
        f"{result['model_path']}, TP{result['tp_size']}, {result['dtype']})",
        f"logits |on - off|: mean {result['mean_abs_logit_err']:.3e}, max {result['max_abs_logit_err']:.3e}; "
        f"relative ||on - off|| / ||off|| per position: mean {result['mean_rel_err']:.3e}, max {result['max_rel_err']:.3e}",
        f"argmax = reference token: off {ref['off']:.4f}, on {ref['on']:.4f}",
        f"disagreements: {result['num_disagreements']}, largest margin in the unfused logits: {result['max_disagreement_margin']}",
        f"fused reductions by strategy: {result['fused_status'].get('reductions')}; wall {result['wall_s']:.1f} s",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """`ServerArgs`' flags (the engine is configured as a server is) plus this tool's own."""
    from arfusion.server_args import ServerArgs

    parser = ServerArgs.build_parser(prog="python -m arfusion.benchmarks.teacher_forced_agreement")
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("teacher-forced agreement")
    g.add_argument("--gsm8k-data-path", required=True, help="GSM8K test JSON lines")
    g.add_argument("--gsm8k-train-path", help="GSM8K train JSON lines for the shots (default: train.jsonl next to the test file)")
    g.add_argument("--num-shots", type=int, default=8, help="few-shot examples in every prompt (default: 8)")
    g.add_argument("--min-positions", type=int, default=20000, help="compared positions at least (default: 20000)")
    g.add_argument("--batch-size", type=int, default=32, help="sequences per batch (default: 32)")
    g.add_argument("--min-agreement", type=float, default=0.99, help="exit 1 below this agreement (default: 0.99)")
    g.add_argument("--output-file", help="write the result as JSON (rank 0)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from arfusion.engine.runtime.rank_parts import enter_group
    from arfusion.layers.parallel_state import default_device
    from arfusion.server_args import ServerArgs

    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.enable_flashinfer_allreduce_fusion:
        parser.error("--enable-flashinfer-allreduce-fusion: this tool runs fusion off and on itself")
    server = ServerArgs.from_namespace(ns)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world != server.tp_size:
        parser.error(f"--tp-size {server.tp_size} but {world} processes: run it under torchrun --nproc_per_node={server.tp_size}")
    use_cuda = server.device == "cuda" or (server.device == "auto" and torch.cuda.is_available())
    device = default_device(int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    options = AgreementOptions(ns.gsm8k_data_path, ns.gsm8k_train_path, ns.num_shots, ns.min_positions, ns.batch_size)
    with ExitStack() as stack:
        enter_group(stack, world, rank, "env://", device, timeout_s=server.dist_timeout)
        result = measure(server, options)
    if rank == 0:
        print(format_result(result), flush=True)
        if ns.output_file:
            Path(ns.output_file).write_text(json.dumps(result, indent=2))
    return 0 if result["agreement"] >= ns.min_agreement else 1


if __name__ == "__main__":
    sys.exit(main())
