"""The scheduler over the paged pool (`serve_engine: paged`): requests in, the planner's calls
run by the executor, tokens out.

Each iteration of the scheduler thread:
1. cancelled requests leave the queue or their slot and pages (`PagedExecutor.abort`);
2. waiting requests move into the executor's queue, at most one per slot ahead of admission
   (the rest stay in this queue, which `max_queued_requests` bounds);
3. one call: `PagedExecutor.step` plans it (`serving.planner`: running sequences first,
   preemption when pages run out, prefill slices under `serve_prefill_token_budget`, admission
   by free state slots and pages) and runs it (`serve_steps_per_call` decode steps, the first
   beside the prefill slices);
4. each request's new tokens are delivered (`SchedulerThread._deliver_ids`: text, stop
   strings, stop ids, log-probabilities); a request the host stops (a stop string, a broken
   token) frees its slot and pages before the next call.

A failing engine call fails the requests it ran (its pool was donated to it) and the executor
starts again from an empty pool; the waiting requests stay queued.
"""

from __future__ import annotations

import time

import numpy as np

from k3text.config import Config
from k3text.inference.engine import Engine
from k3text.inference.pages import pool_size
from k3text.inference.sampling import host_sampling
from k3text.serving.executor import NeverFits, Output, PagedExecutor
from k3text.serving.metrics import Metrics
from k3text.serving.scheduler import Request, SchedulerThread, _failure, log, prefill_rows
from k3text.tokenizer import Tokenizer


def paged_executor(cfg: Config, engine: Engine) -> PagedExecutor:
    """The executor of a server's paged pool (`pool_size`, the scheduler's keys)."""
    num_pages, page = pool_size(cfg)
    return PagedExecutor(engine, cfg.global_batch_size, num_pages, page,
                         cfg.serve_steps_per_call, prefill_rows(cfg),
                         cfg.serve_prefill_token_budget, cfg.serve_max_logprobs)


class PagedScheduler(SchedulerThread):
    def __init__(self, cfg: Config, engine: Engine, tokenizer: Tokenizer | None,
                 metrics: Metrics | None = None, on_stuck=None):
        super().__init__(cfg, engine, tokenizer, metrics, on_stuck)
        self.executor: PagedExecutor | None = None
        self._running: dict[int, Request] = {}  # executor id -> request (queued there or held)
        self._steps_seen = 0
        self._preemptions_seen = 0

    def _setup(self) -> None:
        self.executor = paged_executor(self.cfg, self.engine)
        self.metrics.pages_total.set(self.executor.pages.usable_pages)

    def healthy(self) -> bool:
        """The scheduler thread runs and holds a pool."""
        return self._thread is not None and self._thread.is_alive() \
            and self.executor is not None and self.executor.pool is not None

    def _working(self) -> bool:
        return bool(self._running)

    def _cancel_everything(self) -> None:  # under _cv, on the scheduler thread
        for r in [*self._waiting, *self._running.values()]:
            r.cancelled = True

    # ---- one iteration --------------------------------------------------------------------

    def iterate(self) -> None:
        self._drop_cancelled()
        self._take_waiting()
        if not self._running:  # what was cancelled has left: the gauges say so
            self._update_gauges()
            return
        executor = self.executor
        began = time.perf_counter()
        try:
            plan, outputs = executor.step()
        except Exception as e:  # the pool was donated to the call
            self._fail_all(_failure(e, "engine call", "while running a step"))
            return
        seconds = time.perf_counter() - began
        (self.metrics.decode_seconds if plan.decode else self.metrics.prefill_seconds).inc(
            seconds)
        self.metrics.decode_steps.inc(executor.steps_run - self._steps_seen)
        self._steps_seen = executor.steps_run
        self.metrics.preemptions.inc(executor.preemptions - self._preemptions_seen)
        self._preemptions_seen = executor.preemptions
        for output in outputs:
            self._deliver_output(self._running[output.id], output)
        self._update_gauges()

    def _drop_cancelled(self) -> None:
        self._drop_cancelled_waiting()
        for r in [r for r in self._running.values() if r.cancelled]:
            self._end(r, "cancelled", on_device=True)

    def _take_waiting(self) -> None:
        """Move waiting requests into the executor's queue while it holds fewer than one per
        slot: enough for the planner to fill every slot that frees up."""
        executor = self.executor
        while len(executor.waiting) < self.num_slots:
            with self._cv:
                if not self._waiting:
                    return
                r = self._waiting.popleft()
            self._begin(r)
            row = host_sampling([self._sampling_row(r)], self.cfg.vocab_size)
            try:
                r.seq = executor.submit(r.prompt_ids, r.params.max_tokens, r.stop_ids, row,
                                        scored=r.params.prompt_logprobs is not None)
            except NeverFits as e:  # the API refuses these with a 400 first
                self._finish(r, "error", f"the request does not fit the page pool: {e}")
                continue
            self._running[r.seq] = r

    def _deliver_output(self, r: Request, output: Output) -> None:
        if r.done:
            return
        if r.first_token_at is None:
            self.metrics.prompt_tokens.inc(len(r.prompt_ids))
        if not output.tokens:  # the device holds nothing for it: never leave it hanging
            log.error("request %d is inactive on the device", r.id)
            self._end(r, "error", on_device=False, error="internal error: the slot stopped")
            return
        if output.prompt_scores is not None:  # sent with the first tokens, its top N only
            top = r.params.prompt_logprobs
            r.prompt_scores = output.prompt_scores._replace(
                top_ids=output.prompt_scores.top_ids[:, :top],
                top_logprobs=output.prompt_scores.top_logprobs[:, :top])
        ids, lps, top_ids, top_lps = zip(*output.tokens, strict=True)
        r.produced += len(ids)
        self._deliver_ids(r, list(ids), list(lps), np.asarray(top_ids), np.asarray(top_lps),
                          device_done=output.done)

    def _end(self, r: Request, reason: str, on_device: bool, error: str | None = None) -> None:
        """`r` ends: its slot and pages are freed (a slot the device still runs is stopped
        before the next call)."""
        if self._running.get(r.seq) is r:
            del self._running[r.seq]
            self.executor.abort(r.seq)
        self._finish(r, reason, error)

    def _fail_all(self, message: str) -> None:
        """After a failed call: every request it ran fails, and the executor starts again from
        an empty pool (the queued ones wait on)."""
        executor = self.executor
        failed = set(executor.occupant) - {None}
        for rid in failed:
            self._finish(self._running.pop(rid), "error", message)
        try:
            executor.reset()
        except Exception as e:
            executor.pool = None  # /health answers 503 from here on
            if isinstance(e, ConnectionError):
                log.error("%s; the server takes no more requests", e)
            else:
                log.exception("could not allocate a new page pool; the server takes no more "
                              "requests and /health answers 503")
            with self._cv:
                self._accepting = False
                waiting = [*self._waiting, *self._running.values()]
                self._waiting.clear()
            self._running.clear()
            for r in waiting:
                self._finish(r, "error", message)
        self._update_gauges()

    def _update_gauges(self) -> None:
        m, executor = self.metrics, self.executor
        held = sum(r is not None for r in executor.occupant)
        m.running.set(held)
        m.slots_used.set(held)
        m.pages_used.set(executor.pages_used)
        with self._cv:
            m.waiting.set(len(self._waiting) + len(executor.waiting))
