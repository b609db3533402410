"""What the tests of the decode folds (``--norm-into-qkv``, ``--norm-into-route``,
layers/pending_norm.py; ``--rotary-into-attention``; ``--prefetch-o-proj``) share: a host-fed
greedy run of a built-in model at TP1, call counters, a flag-off / flag-on pair of runs, and the
GPU tests' agreement check of flag-on against flag-off generations."""
from __future__ import annotations

from typing import Any

import torch


def greedy_run(model_path: str, prompts: int, prompt_len: int, steps: int, seed: int = 3, **settings: Any) -> dict:
    """``model_path`` (a built-in model) at TP1 with ``settings`` (`RunnerSettings` fields, over a
    context of 64, ``prompts`` running requests and 512 KV slots): greedy tokens and every step's
    logits (on the CPU) of ``prompts`` random prompts (``seed``), ``reductions`` the fusion op
    counted, ``config`` the runner's model config, ``graphs`` whether it captured CUDA graphs.
    Collective of the current TP group."""
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.scheduling.static_batch import StaticBatch, random_prompts
    from arfusion.layers.parallel_state import get_tp_group

    settings = {"context_length": 64, "max_running_requests": prompts, "kv_slots": 512, **settings}
    runner = build_runner(RunnerSettings(model_path=model_path, **settings), get_tp_group())
    batch = StaticBatch(runner, random_prompts(prompts, prompt_len, runner.config.vocab_size, seed=seed), steps + 1)
    logits = [batch.prefill(gather_logits=True).full.clone()]  # a graph's outputs are its static buffers
    tokens = [torch.argmax(logits[-1], -1).tolist()]
    for _ in range(steps):
        logits.append(batch.decode(tokens[-1], gather_logits=True).full.clone())
        tokens.append(torch.argmax(logits[-1], -1).tolist())
    out = {"tokens": tokens, "logits": torch.stack(logits).cpu(), "reductions": sum(runner.fusion.counts.values()),
           "config": runner.config, "graphs": runner.graphs is not None}
    runner.destroy()
    return out


def count_calls(cls: type, name: str, calls: dict) -> None:
    """Count the calls of ``cls.name`` in ``calls[name]`` (it still runs): patches the class."""
    original = getattr(cls, name)
    calls[name] = 0

    def counted(self, *args):
        calls[name] += 1
        return original(self, *args)

    setattr(cls, name, counted)


def counting(module: Any, name: str) -> list[int]:
    """Count the calls of ``module.name`` (a module-level function; it still runs) in the returned
    one-element list: patches the module for the rest of the process."""
    calls = [0]
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return calls


def flag_off_and_on(model_path: str, prompts: int, prompt_len: int, steps: int, flag: str, module: Any, name: str,
                    **settings: Any) -> dict:
    """`greedy_run` with the `RunnerSettings` field ``flag`` False, then True: ``{False: run,
    True: run}``, each run with ``calls``, how often ``module.name`` (a module-level function
    the flag's path calls; patched to count, it still runs) ran during it."""
    original = getattr(module, name)
    calls = counting(module, name)
    out: dict = {}
    try:
        for on in (False, True):
            calls[0] = 0
            out[on] = greedy_run(model_path, prompts, prompt_len, steps, **settings, **{flag: on})
            out[on]["calls"] = calls[0]
    finally:
        setattr(module, name, original)
    return out


def steps_in_agreement(off: dict, on: dict, max_rel_err: float) -> int:
    """The steps two greedy generations (``tokens``, ``logits`` per step) agree on before the first
    that differs: every compared step's logits within ``max_rel_err`` (relative L2, per row), and
    a differing step's changed tokens a near tie of the flag-off logits (top two within twice that
    error of the row's RMS); AssertionError otherwise."""
    compared = 0
    for step, (t_off, t_on) in enumerate(zip(off["tokens"], on["tokens"])):
        l_off, l_on = off["logits"][step], on["logits"][step]
        rel = ((l_on - l_off).norm(dim=-1) / l_off.norm(dim=-1)).max().item()
        assert rel <= max_rel_err, (step, rel)
        if t_off != t_on:
            flipped = [i for i, (a, b) in enumerate(zip(t_off, t_on)) if a != b]
            top2 = l_off[flipped].topk(2, dim=-1).values
            near_tie = 2 * max_rel_err * l_off[flipped].pow(2).mean(dim=-1).sqrt()
            assert bool((top2[:, 0] - top2[:, 1] <= near_tie).all()), (step, top2, near_tie)
            break
        compared += 1
    return compared
