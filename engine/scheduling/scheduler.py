"""`Scheduler`: the loop that runs continuous batching on TP rank 0 (a thread beside the HTTP
server). It takes requests from an inbox (`submit`, `abort`, `stop` are called from other
threads), asks its `SchedulePolicy` (`engine.scheduling.policy`: admission, chunking, mixed
batches) for the next step, and runs it: rank 0 broadcasts each `StepPlan` to the other ranks,
which run the same forward, then the sampled tokens on the device (`ModelRunner.commit_tokens`),
where the next decode step reads them. A chunk that does not end its prompt samples nothing (its
row's token is dropped; its generator is not drawn).

Overlap schedule (the default, as SGLang's): step n+1 is planned and launched before step n's
tokens reach the host, so the GPU never waits for the host's bookkeeping (detokenizing, stop
checks, planning, the plan broadcast). The scheduler therefore learns one step late that a
request finished: that request runs one more step whose token is dropped (its KV slot lies
within the reservation, since a request is never launched past ``max_tokens``), and its first
token is emitted after the next step's launch. ``overlap=False`` reads each step's tokens
before planning the next.

Step sizes: every step is timed (`StepTimer`) and its time, when its tokens are taken in,
updates the policy's `StepBudget`, which sizes the prompt chunks of the next steps so that a
step lasts about ``step_time_target_s``.

Heartbeat: the other ranks wait for each plan in a collective bounded by ``--dist-timeout``;
an idle rank 0 broadcasts an "idle" plan every ``heartbeat_s`` (the server: `idle_plan_interval_s`)
so that an idle server's workers do not time out. Gloo's send waits for the peer's receive, so an
idle plan to a worker that stopped waits too, and fails after ``--dist-timeout``: an idle server
whose worker stops ends either through that failure or through the watchdog's heartbeat rule,
whichever comes first (both name the stopped rank).

Log-probabilities: a prefill chunk of a request that asked for its prompt's log-probabilities
(``echo``) scores its prompt tokens (`StepPlan.prompt_logprobs`); they travel to the host with the
step's tokens, as do the sampled tokens' log-probabilities (`StepSampler`), and reach the client
with its first token. A request of ``max_tokens`` 0 ends after its prefill, its token dropped.

Isolation: a fault while sampling or taking in the tokens of one request fails that request
alone (its client gets `EngineError` 500) and the step goes on for the others. A fault of a
whole step (the forward, a collective) stops the scheduler: ``on_failure`` is told (the
launcher brings the server down, and logs the one line that names the culprit, say a TP worker
that died, first), then every request left gets `EngineError` 500; the fault's traceback is
logged at debug level here and kept in ``failure_traceback``. A scheduler that was stopped ends
the requests left with `EngineError` 503.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from arfusion.engine.common.generation import EngineError, TokenizerLike
from arfusion.engine.runtime.step_cost import StepTimer, StepTiming
from arfusion.engine.runtime.step_plan import StepPlan
from arfusion.engine.scheduling.pending_tokens import PendingTokens
from arfusion.engine.scheduling.policy import SchedulePolicy
from arfusion.engine.scheduling.request import Request
from arfusion.engine.scheduling.step_runner import StepRunner
from arfusion.engine.scheduling.step_sampler import StepSampler, host_logprobs

logger = logging.getLogger(__name__)


def idle_plan_interval_s(dist_timeout: float) -> float:
    """Seconds between two "idle" plans of an idle server with ``--dist-timeout dist_timeout``:
    a quarter of it, so that a worker's wait for the next plan never comes near its bound."""
    return dist_timeout / 4


@dataclass
class LaunchedStep:
    """A step whose tokens are on their way to the host, and the requests they belong to."""

    requests: list[Optional[Request]]  # the request of each row's token; None: a chunk that samples nothing
    tokens: PendingTokens  # with the sampled tokens' log-probabilities (if any), then the prompts' below
    logprob_rows: list[int]  # the rows whose sampled tokens' log-probabilities came along
    prompts: list[tuple[Request, list[int]]]  # requests whose prompt tokens (these) the step scored
    timing: StepTiming  # how long the step took
    new_tokens: int  # the step's new tokens (decodes and prompt tokens)
    prompt_tokens: int  # of which from prompts


class Scheduler:
    def __init__(self, runner: StepRunner, tokenizer: TokenizerLike, max_prefill_tokens: int, seed: int = 0,
                 on_failure: Callable[[str], None] = lambda reason: logger.error("scheduler failed: %s", reason),
                 overlap: bool = True,
                 heartbeat_s: float = 30.0, chunked_prefill_size: int = -1, step_time_target_s: float = 0.0,
                 timer: Optional[StepTimer] = None) -> None:
        self.runner = runner
        self.group = runner.group
        self.tokenizer = tokenizer
        self.limits = limits = runner.limits
        self.eos_ids = tuple(tokenizer.eos_token_ids) + limits.eos_token_ids
        self.policy = SchedulePolicy(limits.kv_slots, limits.max_rows, limits.context_len, max_prefill_tokens,
                                     chunked_prefill_size, step_time_target_s)
        self.timer = timer if timer is not None else StepTimer(runner.device)
        self.seed = seed
        self.overlap = overlap
        self.launched: deque[LaunchedStep] = deque()
        self._inbox: "queue.Queue[tuple[str, object]]" = queue.Queue()
        self._stopped = threading.Event()
        self.failure: Optional[str] = None
        self.failure_traceback: Optional[str] = None  # the failed step's traceback
        self._on_failure = on_failure  # the launcher brings the server down (peers may wait on us)
        self.steps = 0
        self.heartbeat_s = heartbeat_s
        self.sampler = StepSampler(limits.vocab_size, runner.device, self.eos_ids, self._fail)
        self._idle_wait_s = min(0.5, heartbeat_s / 2)
        self._last_broadcast = time.monotonic()

    # ---- called from other threads ----
    def submit(self, req: Request) -> None:
        """Queue a request; ValueError (naming the numbers) if it can never fit."""
        self.policy.check_fits(req)
        vocab = self.limits.vocab_size
        outside = [t for t, _ in req.params.logit_bias if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"logit_bias: token ids out of range [0, {vocab}): {outside[:8]}")
        if self._stopped.is_set():
            raise RuntimeError(f"the scheduler has stopped{': ' + self.failure if self.failure else ''}")
        seed = req.params.seed if req.params.seed is not None else self.seed * 1_000_003 + req.rid
        try:
            req.generator = torch.Generator().manual_seed(seed)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"seed {seed} cannot seed a generator: {exc}") from None
        self._inbox.put(("add", req))

    def abort(self, rid: int) -> None:
        self._inbox.put(("abort", rid))

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put(("wake", None))

    @property
    def alive(self) -> bool:
        return not self._stopped.is_set()

    def load(self) -> dict[str, int]:
        policy = self.policy
        return {"running": len(policy.running), "waiting": len(policy.waiting), "free_kv_slots": policy.slots.available,
                "steps": self.steps}

    # ---- the scheduler thread ----
    def run_forever(self) -> None:
        """Step until `stop`, then tell the other ranks to shut down; on a failed step, report
        it to ``on_failure`` (the other ranks may be gone) instead. Either way every request
        left gets an `EngineError`."""
        try:
            while not self._stopped.is_set():
                self._drain_inbox(block=not (self.policy.waiting or self.policy.running or self.launched))
                if not self._stopped.is_set() and not self.step():
                    self._heartbeat()
        except Exception as exc:  # fail loudly: every waiting client gets an error, the server reports unhealthy
            self.failure = f"{type(exc).__name__}: {exc}"
            self.failure_traceback = traceback.format_exc()
            logger.debug("scheduler failed; the server stops serving", exc_info=True)  # on_failure logs the error
            self._stopped.set()
        finally:
            if self.failure is not None:
                self._on_failure(self.failure)
                error = EngineError(500, f"the engine failed: {self.failure}")
            else:
                error = EngineError(503, "the server is shutting down")
            self._drain_inbox(block=False)
            for req in list(self.policy.running) + list(self.policy.waiting):
                self._fail(req, error)
            if self.failure is None and self.group.world_size > 1:
                self._broadcast(StepPlan("shutdown"))

    def _heartbeat(self) -> None:
        """Broadcast an "idle" plan if no plan went out for ``heartbeat_s``."""
        if self.group.world_size > 1 and time.monotonic() - self._last_broadcast >= self.heartbeat_s:
            self._broadcast(StepPlan("idle"))

    def _broadcast(self, plan: StepPlan) -> None:
        self.group.broadcast_object(plan)
        self._last_broadcast = time.monotonic()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self._idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                self.policy.waiting.append(payload)  # type: ignore[arg-type]
            elif kind == "abort":
                self._abort(payload)  # type: ignore[arg-type]
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _abort(self, rid: object) -> None:
        for req in [r for r in list(self.policy.waiting) + self.policy.running if r.rid == rid]:
            if req in self.policy.running:
                req.finish_reason = "abort"  # a launched step's token for it is dropped
            self._retire(req)

    def step(self) -> bool:
        """Launch one forward step (if any is due), then take in the tokens of every launched
        step but the newest (with overlap) or of all (without); False when nothing happened."""
        plan, reqs = self.policy.next_step()
        if plan is not None:
            self._launch(plan, reqs)
        in_flight = 1 if self.overlap and plan is not None else 0
        took_in = bool(self.launched)
        while len(self.launched) > in_flight:
            self._take_in(self.launched.popleft())
        return plan is not None or took_in

    def _launch(self, plan: StepPlan, reqs: list[Request]) -> None:
        """Broadcast the plan, run it, sample, commit the tokens on every rank and start their copy
        (and the log-probabilities') to the host; no host sync."""
        timing = self.timer.begin()
        if self.group.world_size > 1:
            self._broadcast(plan)
        logits = self.runner.forward(plan)
        samplers = [r if r.prefill_done else None for r in reqs]
        sampled = self.sampler.sample(logits, samplers)
        tokens = self.runner.commit_tokens(sampled.tokens)
        timing.end()
        for req in samplers:
            if req is not None:
                req.tokens_in_flight += 1
        logprobs = ([sampled.logprobs] if sampled.logprobs is not None else []) + list(logits.prompt)
        prompts = [(reqs[p.seq], p.targets(plan.host_tokens(p.seq))) for p in plan.prompt_logprobs]
        self.launched.append(LaunchedStep(samplers, PendingTokens(tokens, logprobs), sampled.logprob_rows, prompts,
                                          timing, sum(len(s) for s in plan.new_slots),
                                          sum(len(t) for t in plan.new_tokens)))
        self.steps += 1

    def _take_in(self, step: LaunchedStep) -> None:
        """Append a launched step's tokens (and log-probabilities) to their requests, emit them,
        and retire the requests that finished (a request that finished or was aborted since the
        launch drops its token). A request whose token cannot be taken in (detokenizing, stop
        checks) fails alone; a fused reduction that gave up on a peer fails the scheduler."""
        tokens, logprobs = step.tokens.get(), step.tokens.logprobs()
        self.runner.raise_if_failed()  # a peer that stalled made the step's tokens garbage
        if self.policy.budget is not None:
            self.policy.budget.observe(step.new_tokens, step.prompt_tokens, step.timing.seconds())
        sampled = {}
        if step.logprob_rows:
            rows = step.logprob_rows
            values = host_logprobs(logprobs[0], [tokens[i] for i in rows],
                                   [step.requests[i].params.logprobs for i in rows])
            sampled = dict(zip(rows, values))
        for (req, targets), values in zip(step.prompts, logprobs[1 if step.logprob_rows else 0:]):
            if req.finish_reason is None:
                req.prompt_logprobs += host_logprobs(values, targets, [req.params.prompt_logprobs] * len(targets))
        for i, (req, token) in enumerate(zip(step.requests, tokens)):
            if req is None:
                continue
            req.tokens_in_flight -= 1
            if req.finish_reason is not None:
                continue
            try:
                if req.params.max_tokens == 0:  # the prompt scored, nothing to generate
                    req.finish_reason = "length"
                else:
                    req.output_ids.append(token)
                    if req.params.logprobs is not None:
                        req.output_logprobs.append(sampled[i])
                    req.check_finished(self.eos_ids, self.limits.context_len)
                req.emit(req.release(self.tokenizer))
            except Exception as exc:
                logger.exception("request %d failed while taking in its token", req.rid)
                self._fail(req, EngineError(500, f"the request failed in the engine: {type(exc).__name__}: {exc}"))
                continue
            if req.finish_reason is not None:
                self._retire(req)

    def _retire(self, req: Request) -> None:
        """``req`` has finished, failed or was aborted: free its token history, KV slots and row."""
        self.sampler.release(req)
        self.policy.retire(req)

    def _fail(self, req: Request, error: EngineError) -> None:
        """End ``req`` with ``error``: its slots are freed and a launched step's token for it dropped."""
        self._retire(req)
        req.finish_reason = "error"
        req.emit(error)

