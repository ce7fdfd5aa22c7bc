"""The host-side scheduler: requests in, a pool of decode slots kept busy, tokens out.

One thread owns the engine and the pool and loops over iterations:
1. requests cancelled (client gone, shutdown) leave the queue or free their slot; prompts of
   at most `serve_decode_prompt_tokens` tokens at the head of the queue go into free slots with
   no prefill (`Engine.insert_prompts`), fed through the decode steps one token a step;
2. while any slot decodes, one decode call of `serve_steps_per_call` steps for every slot:
   while a group is being prefilled, its next chunk rides the first step
   (`Engine.decode_and_prefill`: the token-wise layers run once over both) and the rows whose
   prompts that chunk ends are inserted after it, decoding in the steps after; otherwise
   `generate`;
3. prefill under a token budget (`serve_prefill_token_budget`, the riding chunk included; at
   least one call when nothing decodes; a group's last call at the narrowest of
   `prefill_buckets` that holds what is left of its prompts): the request being prefilled
   advances chunk by chunk, a new one starts when a slot is free, and a finished prefix is
   inserted into its slot, which also samples its first token — so a long prompt never stalls
   the running sequences for its whole length. With `enable_prefix_caching` a group starts
   from its longest cached prefix (`inference/prefix_cache.py`) and caches each block its
   chunks complete. A context-parallel group's calls never ride, nor do those of prompts that
   ask for their own log-probabilities (`prompt_logprobs`): they are grouped only with each
   other, prefilled whole chunks at a time through `Engine.dispatch_prefill_scored`, past the
   prefix cache, and each one's scores go out with its first tokens.
With `serve_prefill_apart` (one process) prompts are prefilled by a second engine on a mesh of
its own: each iteration first inserts the prefixes it has finished (copied onto the decode mesh)
into free slots and dispatches the next chunks without waiting, then makes its decode call, which
no chunk rides; a group is taken from the queue before any slot is free, and its rows take slots
as they are inserted.
With `serve_overlap` (one process) step 2 dispatches its call and then delivers the call the
previous iteration dispatched, so the host's delivery runs while the device decodes; each call's
tokens go to the requests that held its slots when it was dispatched (docs/serving.md).
Tokens go back to each request's `sink` (called on this thread) as `Delta`s and one `Finished`.
A slot is freed in the iteration its request finishes, stops or is cancelled.

Admission checks (a prompt within `max_prefill_predict_length`, prompt + max_tokens within
`max_target_length`, ids inside the vocabulary) belong to the caller; the scheduler refuses
what it cannot hold (`QueueFull` beyond `max_queued_requests`, `Unavailable` once stopping).
A failing engine call fails the requests it touched and is logged; the loop goes on.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from k3text.config import Config
from k3text.inference.engine import MAX_STOP_IDS, Engine, Later, Pool, Prefix, Tokens
from k3text.inference.prefix_cache import Chain, PrefixCache
from k3text.inference.sampling import PromptScores, SamplingRow, host_sampling
from k3text.serving.metrics import Metrics
from k3text.serving.text import TextStream
from k3text.tokenizer import Tokenizer

log = logging.getLogger("k3text.serve")


def _failure(error: Exception, call: str, during: str) -> str:
    """Log a failed engine call and return what its requests are told. Devices or processes
    out of reach (a ConnectionError, e.g. `multihost.PeersLost`) are named in one line, the
    same words the client gets; anything else is an internal error, logged with its
    traceback."""
    if isinstance(error, ConnectionError):
        log.error("%s failed: %s", call, error)
        return f"{call} failed: {error}"
    log.error("%s failed", call, exc_info=error)
    return f"internal error {during}"


def _prompt_scores(job: _Prefill, row: int) -> PromptScores:
    """Row `row`'s prompt tokens after the first, each scored at the position before it, with
    the top N its request asked for (host arrays [tokens], top [tokens, N])."""
    r = job.rows[row]
    n, top = len(r.prompt_ids) - 1, r.params.prompt_logprobs
    scores = [later.get() for later in job.scores]  # computed, as the prefix it came with
    whole = PromptScores(*(np.concatenate(part, axis=1)[row, :n] for part in zip(*scores,
                                                                                 strict=True)))
    return whole._replace(top_ids=whole.top_ids[:, :top], top_logprobs=whole.top_logprobs[:, :top])


def _rows_of(job: _Prefill, ready: list[int]) -> list[Request | None]:
    """The rows `ready` of `job`, every other row None."""
    return [r if i in ready else None for i, r in enumerate(job.rows)]


def prefill_rows(cfg: Config) -> int:
    """The rows of the scheduler's prefill program, the most prompts one group takes:
    `serve_prefill_batch`, capped at the slot count and rounded up to a multiple of the batch
    mesh axes' size (the rows split over them, one or more per shard)."""
    shards = cfg.axis_size("batch")
    return -(-min(cfg.serve_prefill_batch, cfg.global_batch_size) // shards) * shards


class QueueFull(Exception):
    """`max_queued_requests` requests are already waiting."""


class Unavailable(Exception):
    """The scheduler is not running (starting up or shutting down)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one found
    stop_token_ids: tuple[int, ...] = ()  # besides eos (unless ignore_eos)
    logprobs: int | None = None  # None: none; N: the chosen token's and the top N
    ignore_eos: bool = False  # generate through eos (benchmarks)
    min_tokens: int = 0  # no stop id or stop string ends the output before this many tokens
    include_stop_str: bool = False  # the stop string or stop id found stays in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # None: none; N: each prompt token's log-probability and rank, and the top N at its place
    # (vLLM's prompt_logprobs). The prompt is then prefilled with other such prompts only, past
    # the prefix cache.
    prompt_logprobs: int | None = None


@dataclasses.dataclass
class Delta:
    """New output of a request: tokens (stop tokens left out), their log-probabilities, the top
    N (token, log-probability) per token when asked, and the text now safe to send. The first
    delta of a request that asked for `prompt_logprobs` carries them (`prompt`: host arrays
    over the prompt's tokens after the first, each scored given the tokens before it)."""

    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None
    text: str
    prompt: PromptScores | None = None


@dataclasses.dataclass
class Finished:
    reason: str  # stop | length | cancelled | error
    prompt_tokens: int
    completion_tokens: int  # every generated token, stop tokens included
    error: str | None = None
    # What stopped it (vLLM's `stop_reason`): the stop string or stop token id; None for eos
    # and every other reason.
    stop_reason: str | int | None = None


Event = Delta | Finished
_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    cancelled: bool = False
    # Owned by the scheduler thread.
    slot: int = -1
    seq: int = -1  # its id in the paged executor (`serve_engine: paged`)
    generated: int = 0
    first_token_at: float | None = None
    text: TextStream | None = None
    stop_ids: np.ndarray | None = None  # the slot's stop-id row
    produced: int = 0  # tokens the device produced for it, as far as delivered
    stop_reason: str | int | None = None  # `Finished.stop_reason`
    prompt_scores: PromptScores | None = None  # sent with its first tokens
    handed_over: bool = False  # its slot went to another request before its last tokens came
    # Prompt tokens it still feeds through decode steps (`serve_decode_prompt_tokens`) after the
    # calls dispatched so far, and whether the last call dispatched for it fed any.
    to_feed: int = 0
    fed_in_flight: bool = False
    done: bool = False


@dataclasses.dataclass
class _InFlight:
    """A decode call dispatched and not yet delivered."""

    tokens: Later  # generate's Tokens, or decode_and_prefill's (step, first, rest)
    owners: list[tuple[int, Request]]  # (slot, request) decoding during the call
    job: _Prefill | None = None  # the group whose chunk rode the call
    inserted: list[tuple[int, Request]] = dataclasses.field(default_factory=list)  # (row, r)
    dispatch_seconds: float = 0.0


@dataclasses.dataclass
class _Prefill:
    """A group of up to `serve_prefill_batch` prompts prefilled together, one row each; a row
    is inserted into its slot as soon as its own prompt has ended."""

    rows: list[Request | None]  # None: a padding row (or one already inserted or cancelled)
    prefix: Prefix
    tokens: np.ndarray  # [rows, whole chunks of the longest prompt]; context-parallel: [1, ...]
    valid: np.ndarray
    start: int = 0
    chains: list[Chain | None] = dataclasses.field(default_factory=list)  # prefix-cache rows
    slices: bool = False  # one prompt prefilled context-parallel, a chunk per row per call
    # Prompts whose positions are scored (`prompt_logprobs`), a whole chunk per call: the
    # token after each position, and the scores of the chunks run so far.
    scored: bool = False
    targets: np.ndarray | None = None
    scores: list[Later[PromptScores]] = dataclasses.field(default_factory=list)

    @property
    def live(self) -> list[Request]:
        return [r for r in self.rows if r is not None]


class SchedulerThread:
    """What every scheduler shares: the queue, the thread and its watchdog, stopping, and
    delivery of a request's tokens (text, stop strings, stop ids, log-probabilities). A
    subclass runs the engine: `_setup` (before the thread starts), `iterate` (one iteration),
    `_working` (whether anything is admitted), `_cancel_everything`, `_end` and `_fail_all`."""

    def __init__(self, cfg: Config, engine: Engine, tokenizer: Tokenizer | None,
                 metrics: Metrics | None = None,
                 on_stuck: Callable[[float], None] | None = None):
        """`on_stuck(seconds)`: called once, from a watchdog thread, when an iteration has run
        longer than `serve_iteration_timeout` (a device call or a collective that never
        returns, which nothing can interrupt); None: only logged."""
        self.cfg = cfg
        self.engine = engine
        self.on_stuck = on_stuck
        self.tokenizer = tokenizer
        self.num_slots = cfg.global_batch_size
        self.metrics = metrics or Metrics(self.num_slots)
        self.top_n = cfg.serve_max_logprobs
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._accepting = False
        self._stopping = False
        self._in_flight = 0  # submitted and not yet finished (under _cv)
        self._thread: threading.Thread | None = None
        self._iteration_began: float | None = None  # monotonic time; None between iterations

    # ---- any thread -----------------------------------------------------------------------

    def submit(self, *requests: Request) -> None:
        """Queue `requests` (the choices of one API request): all of them, or with no room
        for all, none (`QueueFull`)."""
        with self._cv:
            if not self._accepting:
                raise Unavailable("the server is not accepting requests (starting or stopping)")
            if len(self._waiting) + len(requests) > self.cfg.max_queued_requests:
                self.metrics.requests.labels("rejected").inc(len(requests))
                need = f"; {len(requests)} more do not fit" if len(requests) > 1 else ""
                raise QueueFull(f"{len(self._waiting)} requests are already waiting "
                                f"(max_queued_requests={self.cfg.max_queued_requests}){need}")
            self._waiting.extend(requests)
            self._in_flight += len(requests)
            self.metrics.waiting.set(len(self._waiting))
            self._cv.notify()

    def cancel(self, request: Request) -> None:
        """Cancel a request (its client is gone); its slot is freed within one iteration."""
        with self._cv:
            request.cancelled = True
            self._cv.notify()


    def start(self) -> None:
        """Start the scheduler thread (the engine's programs should be compiled already)."""
        self._setup()
        with self._cv:
            self._accepting = True
        self._thread = threading.Thread(target=self._run, name="k3text-scheduler", daemon=True)
        self._thread.start()
        if self.cfg.serve_iteration_timeout > 0:
            threading.Thread(target=self._watch, name="k3text-watchdog", daemon=True).start()

    def stop_accepting(self) -> None:
        with self._cv:
            self._accepting = False

    def busy(self) -> bool:
        """Whether any submitted request has not finished yet."""
        with self._cv:
            return self._in_flight > 0

    def iteration_seconds(self) -> float:
        """How long the scheduler thread's current iteration has run (0 between them)."""
        began = self._iteration_began
        return 0.0 if began is None else time.monotonic() - began

    def _watch(self) -> None:
        """Watchdog: a device call or collective that never returns holds the scheduler thread
        for ever (a process of a multi-process job that is alive but stuck never fails its
        peers' collectives), and only the process ending frees what waits on it."""
        limit = self.cfg.serve_iteration_timeout
        while self._thread is not None and self._thread.is_alive():
            time.sleep(min(1.0, limit / 4))
            seconds = self.iteration_seconds()
            if seconds > limit:
                log.error("a scheduler iteration has run %.0f s (serve_iteration_timeout=%g): a "
                          "device, or another process of this job, is stuck", seconds, limit)
                if self.on_stuck is not None:
                    self.on_stuck(seconds)
                return

    def stop(self, timeout: float = 0.0, wind_down: float = 60.0) -> bool:
        """Stop admitting, let in-flight requests finish for up to `timeout` seconds, then have
        the scheduler thread cancel what is left and end. Returns whether it ended within
        `wind_down` seconds more; if not, it is inside a device call that does not return,
        which no one can interrupt."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=wind_down)
            return not self._thread.is_alive()
        return True

    # ---- the scheduler thread -------------------------------------------------------------


    # ---- the scheduler thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # however the thread ends, no request is left waiting for it
            with self._cv:
                self._accepting = False
                waiting = list(self._waiting)
                self._waiting.clear()
            for r in waiting:
                self._finish(r, "error", "internal error: the scheduler stopped")

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._waiting or self._working()):
                    self._cv.wait(timeout=0.5)
                if self._stopping:
                    if not (self._waiting or self._working()):
                        return
                    self._cancel_everything()
            self._iteration_began = time.monotonic()
            try:
                self.iterate()
            except Exception as e:  # never let one iteration end the server
                self._fail_all(_failure(e, "scheduler iteration", "in the scheduler"))
            finally:
                self._iteration_began = None

    def _begin(self, r: Request) -> None:
        """`r` leaves the queue: its text stream and its slot's stop ids."""
        r.text = TextStream(self.tokenizer, r.params.stop, r.params.min_tokens,
                            r.params.include_stop_str)
        r.stop_ids = self.engine.stop_ids(r.params.stop_token_ids, r.params.ignore_eos)


    def _drop_cancelled_waiting(self) -> None:
        """Cancelled requests leave the queue."""
        with self._cv:
            gone = [r for r in self._waiting if r.cancelled]
            for r in gone:
                self._waiting.remove(r)
        for r in gone:
            self._finish(r, "cancelled")

    def _sampling_row(self, r: Request) -> SamplingRow:
        """`r`'s sampling as the device's per-slot rows take it (a fresh seed if it gave
        none)."""
        p = r.params
        return SamplingRow(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
            seed=p.seed if p.seed is not None else secrets.randbits(64),
            min_tokens=p.min_tokens, logit_bias=p.logit_bias, min_p=p.min_p,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            # Only the repetition penalty reads the prompt's tokens.
            prompt=tuple(r.prompt_ids) if p.repetition_penalty != 1.0 else ())

    def _deliver_ids(self, r: Request, ids: list[int], lps: list[float], top_ids: np.ndarray,
                     top_lps: np.ndarray, device_done: bool) -> None:
        """New tokens of `r` (at least one) to its client, and `r` ended if they finish it:
        `device_done` when the device stopped it (a stop id, or its max_tokens); a stop string
        found in the text, or non-finite log-probabilities, end it here (`_end` with
        `on_device`: its slot still runs)."""
        broken = next((i for i, lp in enumerate(lps) if not math.isfinite(lp)), None)
        if broken is not None:  # NaN or inf logits: nothing sampled from them is an answer
            log.error("request %d: the model gave non-finite logits at its token %d",
                      r.id, r.produced - len(ids) + broken)
            self._end(r, "error", on_device=not device_done,
                      error="internal error: the model produced non-finite logits (NaN or "
                            "inf); its weights or activations are broken")
            return
        now = time.monotonic()
        if r.first_token_at is None:
            r.first_token_at = now
            self.metrics.ttft.observe(now - r.arrival)
        stops = set(r.stop_ids.tolist()) - {-1}
        hit_stop_id = device_done and ids[-1] in stops
        # The stop id is left out of the output, unless the stop is to stay in it.
        dropped = hit_stop_id and not r.params.include_stop_str
        keep = len(ids) - dropped
        n_top = r.params.logprobs or 0
        top = None
        if r.params.logprobs is not None:
            top = [list(zip(top_ids[i, :n_top].tolist(), top_lps[i, :n_top].tolist(),
                            strict=True)) for i in range(keep)]
        text = r.text.add(ids[:keep], final=device_done)
        keep = r.text.kept  # fewer when a stop string ended the text early
        generated = keep + (dropped and not r.text.stopped)  # a stop id counts as usage
        r.generated += generated
        self.metrics.generation_tokens.inc(generated)  # what usage counts, not what was cut
        self._send(r, Delta(ids[:keep], lps[:keep], top[:keep] if top is not None else None,
                            text, prompt=r.prompt_scores))
        r.prompt_scores = None  # sent with the first tokens
        if r.text.stopped:
            r.stop_reason = r.text.stopped_by
            self._end(r, "stop", on_device=not device_done)
        elif device_done:
            eos = ids[-1] == self.cfg.eos_token_id and not (r.params.ignore_eos
                                                            or self.cfg.ignore_eos)
            if hit_stop_id and not eos:  # a stop id asked for, not the model's own end
                r.stop_reason = ids[-1]
            self._end(r, "stop" if hit_stop_id else "length", on_device=False)

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.done:
            return
        r.done = True
        with self._cv:
            self._in_flight -= 1
        now = time.monotonic()
        self.metrics.requests.labels(reason).inc()
        if reason in ("stop", "length"):
            self.metrics.e2e.observe(now - r.arrival)
            if r.first_token_at is not None and r.generated > 1:
                self.metrics.tpot.observe((now - r.first_token_at) / (r.generated - 1))
        self._send(r, Finished(reason, len(r.prompt_ids), r.generated, error,
                               r.stop_reason if reason == "stop" else None))

    def _send(self, r: Request, event: Event) -> None:
        try:
            r.sink(event)
        except Exception:  # a sink whose client is gone must not stop the loop
            log.debug("sink of request %d failed", r.id, exc_info=True)



class Scheduler(SchedulerThread):
    """The fixed slot rows' scheduler (`serve_engine: slots`; module docstring)."""

    def __init__(self, cfg: Config, engine: Engine, tokenizer: Tokenizer | None,
                 metrics: Metrics | None = None, prefill_engine: Engine | None = None,
                 on_stuck: Callable[[float], None] | None = None):
        super().__init__(cfg, engine, tokenizer, metrics, on_stuck)
        # `serve_prefill_apart`: prompts are prefilled by an engine on a mesh of their own, its
        # calls dispatched without waiting, while this one decodes.
        self.prefiller = prefill_engine or engine
        self._apart = prefill_engine is not None
        self.prefill_batch = prefill_rows(cfg)
        # Scheduler-thread state.
        self._pool: Pool | None = None
        self._free = list(range(self.num_slots))
        self._decoding: dict[int, Request] = {}  # slot -> request
        self._prefill: _Prefill | None = None
        self._to_release: list[int] = []
        # With `serve_overlap` the decode call dispatched last, delivered once the next one is
        # dispatched (one process only: several fetch results in lockstep with each call).
        self._overlap = cfg.serve_overlap and jax.process_count() == 1
        self._in_flight_call: _InFlight | None = None
        self._delivering: _InFlight | None = None  # the call whose tokens are being delivered
        self.prefix_cache: PrefixCache | None = None
        self._cache_seen = (0, 0, 0)  # the cache's (hits, queried, evictions) in the metrics

    # ---- any thread -----------------------------------------------------------------------

    def _setup(self) -> None:
        self._pool = self.engine.new_pool(self.num_slots)
        if self.cfg.enable_prefix_caching:
            self.prefix_cache = PrefixCache(self.cfg, self.prefiller)
            self.prefix_cache.warm_up(self.prefill_batch)

    def _working(self) -> bool:
        return bool(self._prefill or self._decoding or self._in_flight_call)

    def healthy(self) -> bool:
        """The scheduler thread runs and holds a pool."""
        return self._thread is not None and self._thread.is_alive() and self._pool is not None

    def _cancel_everything(self) -> None:  # under _cv, on the scheduler thread
        for r in [*self._waiting, *self._holding(),
                  *(self._prefill.live if self._prefill else [])]:
            r.cancelled = True

    def iterate(self) -> None:
        """One scheduler iteration (cancellations, decoding with a chunk riding along, prefill
        under the budget)."""
        self._drop_cancelled()
        self._release_pending()  # before any insert: a freed slot may be refilled below
        if self._apart:
            # Prefixes that are ready go in, and the next chunks go out, before the decode call:
            # they run on the prefill mesh while it decodes.
            self._hand_over_finishing_slots()
            self._prefill_within_budget(0)
            if self._decoding or self._in_flight_call:
                self._decode()
        else:
            self._start_short_prompts()
            spent = self._decode() if self._decoding or self._in_flight_call else 0
            self._prefill_within_budget(spent)
        self._update_gauges()

    def decoding(self) -> dict[int, Request]:
        """slot -> request of the slots decoding on the device: the rows an in-flight call
        inserts included (they join `_decoding` when its tokens are delivered)."""
        pending = self._in_flight_call.inserted if self._in_flight_call else []
        return self._decoding | {r.slot: r for _, r in pending}

    def _holding(self) -> list[Request]:
        """Every unfinished request a slot is decoding for, or was until it was handed over
        early, once each: unlike `decoding`, a request whose slot already went to another row
        (inserted by the in-flight call, or on the prefill mesh's side at once) is here while a
        call still decodes for it, as is a row of the call being delivered that has not joined."""
        calls = [c for c in (self._in_flight_call, self._delivering) if c is not None]
        held = [*self._decoding.values(),
                *(r for c in calls for _, r in (*c.owners, *c.inserted))]
        return list({id(r): r for r in held if not r.done}.values())

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len({id(r) for r in [*self._holding(),
                                           *(self._prefill.live if self._prefill else [])]}))
        m.slots_used.set(self.num_slots - len(self._free))
        with self._cv:
            m.waiting.set(len(self._waiting))
        cache = self.prefix_cache
        if cache is not None:
            now = (cache.hit_tokens, cache.prompt_tokens, cache.tree.evictions)
            for counter, new, old in zip((m.prefix_hit_tokens, m.prefix_queried_tokens,
                                          m.prefix_evictions), now, self._cache_seen,
                                         strict=True):
                counter.inc(new - old)
            self._cache_seen = now
            m.prefix_cached_bytes.set(cache.cached_bytes)
            if cache.prompt_tokens:
                m.prefix_hit_rate.set(cache.hit_tokens / cache.prompt_tokens)
            m.prefix_cached_blocks.set(cache.tree.cached_blocks)

    def _drop_cancelled(self) -> None:
        self._drop_cancelled_waiting()
        if self._prefill is not None:
            for i, r in enumerate(self._prefill.rows):
                if r is not None and r.cancelled:
                    self._prefill.rows[i] = None  # its row runs on as padding
                    self._end_chain(self._prefill, i)
                    self._free_slot(r.slot, on_device=False)
                    self._finish(r, "cancelled")
            if not self._prefill.live:
                self._prefill = None
        for r in list(self._decoding.values()):
            if r.cancelled:
                self._end(r, "cancelled", on_device=True)

    def _prefill_within_budget(self, spent: int) -> None:
        """Prefill chunks until this iteration's token budget is spent (`spent` tokens already
        rode the decode call; at least one call when none did). Apart (`serve_prefill_apart`)
        the calls are dispatched without waiting, and the rows they end are inserted in a later
        iteration, once their prefix has been computed."""
        chunk = self.cfg.prefill_chunk_size
        budget = self.cfg.serve_prefill_token_budget
        while True:
            if self._prefill is None:
                self._prefill = self._start_prefill()
                if self._prefill is None:
                    return
            job = self._prefill
            if self._apart and self._ready_rows(job, job.start):
                if not self._computed(job.prefix):
                    return
                self._insert_finished_rows(job)
                if self._prefill is not job:  # the insert failed, and failed every request
                    return
                if not job.live:
                    self._prefill = None
                    continue
                if len(self._ready_rows(job, job.start)) == len(job.live):
                    return  # every row waits for a slot
            rows = len(job.rows)
            if job.slices:
                width = cost = chunk * rows  # prompt tokens one call advances
            elif job.scored:
                width, cost = chunk, chunk * len(job.live)
            else:
                width = self.engine.chunk_width(max(len(r.prompt_ids) for r in job.live)
                                                - job.start)
                cost = width * len(job.live)
            if spent and spent + cost > budget:
                return
            if not self._apart and self.decoding() and not spent and not job.slices \
                    and not job.scored:
                return  # a job started after decoding ended; its first chunk rides next time
            began = time.perf_counter()
            try:
                part = slice(job.start, job.start + width)
                if job.slices:
                    job.prefix = self.prefiller.prefill_slices(
                        job.prefix, job.tokens[0, part].reshape(rows, chunk),
                        job.valid[0, part].reshape(rows, chunk), job.start)
                elif job.scored:  # the top N of every N asked: one program for all
                    job.prefix, scores = self.prefiller.dispatch_prefill_scored(
                        job.prefix, job.tokens[:, part], job.valid[:, part], job.start,
                        job.targets[:, part], self.top_n)
                    job.scores.append(scores)
                else:
                    job.prefix = self.prefiller.prefill_chunk(job.prefix, job.tokens[:, part],
                                                              job.valid[:, part], job.start)
            except Exception as e:
                message = _failure(e, "prefill", "during prefill")
                self._prefill = None
                for i in range(len(job.rows)):
                    self._end_chain(job, i)
                for r in job.live:
                    self._free_slot(r.slot, on_device=False)
                    self._finish(r, "error", message)
                continue
            spent += cost
            job.start += width
            self._cache_blocks(job)
            if not self._apart:
                self._insert_finished_rows(job)  # waits for the chunk when a row is ready
            self.metrics.prefill_seconds.inc(time.perf_counter() - began)
            if not job.live:
                self._prefill = None
                return

    def _computed(self, prefix: Prefix) -> bool:
        """Whether the prefill mesh has computed `prefix`; with nothing decoding there is
        nothing else to do, so this waits for it instead of asking again."""
        if self._decoding or self._in_flight_call:
            return prefix.logits.is_ready()
        prefix.logits.block_until_ready()
        return True

    def _start_prefill(self) -> _Prefill | None:
        """A new group from the waiting requests, one per free slot; None if there is none. A
        prompt at the head of the queue that `Engine.context_parallel` takes is prefilled alone,
        `prefill_context_parallelism` chunks per call."""
        cfg = self.cfg
        # Apart, a group is prefilled ahead, before any slot is free: its rows take slots when
        # they are inserted, so a finished prefix waits for a slot rather than a slot for it.
        free = self.num_slots if self._apart else len(self._free)

        def scored(r: Request) -> bool:  # grouped with its kind only, every position scored
            return r.params.prompt_logprobs is not None

        def parallel(r: Request) -> bool:  # prefilled alone, context-parallel
            return self.prefix_cache is None and not scored(r) \
                and self.prefiller.context_parallel([r.prompt_ids])

        with self._cv:
            if not (self._waiting and free) or self._decodes_prompt(self._waiting[0]):
                return None
            slices = parallel(self._waiting[0])
            kind = scored(self._waiting[0])
        batch = cfg.prefill_context_parallelism if slices else self.prefill_batch
        prefix = self.prefiller.new_prefix(batch)  # before any request leaves the queue
        rows: list[Request | None] = []
        with self._cv:
            # A group stops at a prompt that runs context-parallel, or that is scored where the
            # group is not (or the other way round): it goes next.
            while self._waiting and len(rows) < min(free, 1 if slices else batch) \
                    and not (rows and (parallel(self._waiting[0])
                                       or scored(self._waiting[0]) != kind)) \
                    and not self._decodes_prompt(self._waiting[0]):
                rows.append(self._waiting.popleft())
        if not rows:
            return None
        chunk = cfg.prefill_chunk_size
        longest = max(len(r.prompt_ids) for r in rows)
        window = chunk * batch if slices else chunk  # the prompt in whole calls
        tokens = np.full((1 if slices else batch, -(-longest // window) * window),
                         cfg.pad_token_id, np.int32)
        valid = np.zeros(tokens.shape, bool)
        for i, r in enumerate(rows):
            tokens[i, : len(r.prompt_ids)] = r.prompt_ids
            valid[i, : len(r.prompt_ids)] = True
            r.slot = -1 if self._apart else self._free.pop(0)
            self._begin(r)
        rows += [None] * (batch - len(rows))
        job = _Prefill(rows, prefix, tokens, valid, slices=slices)
        if kind:  # the token after each position; past the prompt, any id
            job.scored, job.targets = True, np.zeros(tokens.shape, np.int32)
            for i, r in enumerate(job.live):
                job.targets[i, : len(r.prompt_ids) - 1] = r.prompt_ids[1:]
            return job  # restored positions would have no scores: no prefix cache
        if self.prefix_cache is not None:
            try:
                job.prefix, job.start, job.chains = self.prefix_cache.begin(
                    prefix, [r.prompt_ids if r else None for r in rows])
            except Exception as e:  # the prefix was consumed: these requests cannot go on
                message = _failure(e, "prefix-cache restore", "restoring a cached prefix")
                for r in job.live:
                    self._free_slot(r.slot, on_device=False)
                    self._finish(r, "error", message)
                self._reset_prefix_cache()
                return None
        return job

    def _cache_blocks(self, job: _Prefill) -> None:
        """Cache the blocks the chunk just run completed; a failure only empties the cache."""
        if self.prefix_cache is None:
            return
        try:
            self.prefix_cache.after_chunk(job.prefix, job.chains, job.start)
        except Exception:
            log.exception("prefix-cache save failed; the cache starts again empty")
            self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        try:
            self.prefix_cache.reset()
        except Exception:
            log.exception("could not allocate a new prefix-cache store; caching is off")
            self.prefix_cache = None

    def _end_chain(self, job: _Prefill, row: int) -> None:
        """Row `row` of `job` is done with the prefix cache (inserted, cancelled, failed)."""
        if self.prefix_cache is not None and row < len(job.chains):
            self.prefix_cache.end(job.chains[row])
            job.chains[row] = None

    def _insert_args(self, rows: Sequence[Request | None]) -> tuple:
        """`Engine.insert`'s per-row arguments (slots, limits, stop ids, sampling) for `rows`;
        None is a padding row (slot -1)."""

        params = [self._sampling_row(r) if r else (0.0, 0, 1.0, 0) for r in rows]
        stop = np.stack([r.stop_ids if r else np.full(MAX_STOP_IDS, -1, np.int32)
                         for r in rows])
        return ([r.slot if r else -1 for r in rows], [r.params.max_tokens if r else 1
                                                       for r in rows],
                stop, host_sampling(params, self.cfg.vocab_size))

    def _insert_finished_rows(self, job: _Prefill) -> None:
        """Insert the rows whose prompts ended within the chunks run so far (apart, as many as
        there are free slots)."""
        ready = self._ready_rows(job, job.start)
        if self._apart:
            for i in ready:
                if job.rows[i].slot < 0 and self._free:
                    job.rows[i].slot = self._free.pop(0)
            ready = [i for i in ready if job.rows[i].slot >= 0]
        if not ready:
            return
        if any(r.slot in self._to_release for r in job.live):
            self._release_pending()  # a release after the insert would stop these requests
            if self._prefill is not job:  # the release failed and failed every request
                return
        prefix = self.engine.adopt(job.prefix) if self._apart else job.prefix
        try:
            self._pool, first = self.engine.insert(
                self._pool, prefix, *self._insert_args(_rows_of(job, ready)), self.top_n)
        except Exception as e:
            self._fail_all(_failure(e, "insert", "while inserting a request"))
            return
        self._inserted(job, ready, first)

    @staticmethod
    def _ready_rows(job: _Prefill, end: int) -> list[int]:
        """The live rows of `job` whose prompts end within its first `end` tokens."""
        return [i for i, r in enumerate(job.rows)
                if r is not None and len(r.prompt_ids) <= end]

    def _inserted(self, job: _Prefill, ready: list[int], first: Tokens) -> None:
        """Rows `ready` of `job` are in their slots: they decode from now on."""
        rows = [(i, r) for i, r in zip(ready, self._take_rows(job, ready), strict=True)]
        for _, r in rows:  # held from here, so a failure while they join still ends them
            self._decoding[r.slot] = r
        self._joined(rows, first)

    def _take_rows(self, job: _Prefill, ready: list[int]) -> list[Request]:
        """Rows `ready` of `job` leave it for their slots."""
        taken = []
        for i in ready:
            if job.scored:
                job.rows[i].prompt_scores = _prompt_scores(job, i)
            taken.append(job.rows[i])
            job.rows[i] = None
            self._end_chain(job, i)
        return taken

    def _joined(self, rows: list[tuple[int, Request]], first: Tokens) -> None:
        """Requests (prefix row, request) inserted into their slots decode from now on; their
        first tokens are row i of `first`."""
        for i, r in rows:
            self.metrics.prompt_tokens.inc(len(r.prompt_ids))
            self._decoding[r.slot] = r
            self._deliver(r, first, i)

    def _decode(self) -> int:
        """The iteration's decode call: `serve_steps_per_call` steps for every slot, the first
        with the next prefill chunk riding along when a group is waiting
        (`_decode_with_chunk`); with `serve_overlap`, the call dispatched before it is delivered
        once this one runs. Returns the prompt tokens that rode."""
        owners = list(self.decoding().items())
        if not any(not r.done for _, r in owners):  # only an in-flight call to deliver
            self._dispatched(None)
            return 0
        self._hand_over_finishing_slots()
        if not self._apart:
            if self._start_short_prompts():
                owners = list(self.decoding().items())
            if self._prefill is None:
                self._prefill = self._start_prefill()
            job = self._prefill
            if job is not None and not job.slices and not job.scored:
                return self._decode_with_chunk(job, owners)
        began = time.perf_counter()
        try:
            self._pool, tokens = self.engine.dispatch_generate(
                self._pool, self.cfg.serve_steps_per_call, self.top_n)
        except Exception as e:
            self._fail_all(_failure(e, "decode call", "during decoding"))
            return 0
        self._dispatched(_InFlight(tokens, owners, dispatch_seconds=time.perf_counter() - began))
        return 0

    def _decode_with_chunk(self, job: _Prefill, owners: list[tuple[int, Request]]) -> int:
        """`serve_steps_per_call` decode steps for every slot in one call, the first with the
        next chunk of `job` riding along; the rows whose prompts it ends are inserted after
        that step and decode in the steps after it. Returns the prompt tokens it ran."""
        width = self.engine.chunk_width(max(len(r.prompt_ids) for r in job.live) - job.start)
        ready = self._ready_rows(job, job.start + width)
        if any(job.rows[i].slot in self._to_release for i in ready):
            self._release_pending()  # a release after the insert would stop these requests
            if self._prefill is not job:  # the release failed and failed every request
                return 0
        part, cost = slice(job.start, job.start + width), width * len(job.live)
        began = time.perf_counter()
        try:
            self._pool, job.prefix, tokens = self.engine.dispatch_decode_and_prefill(
                self._pool, job.prefix, job.tokens[:, part], job.valid[:, part], job.start,
                *self._insert_args(_rows_of(job, ready)), self.top_n, self.cfg.serve_steps_per_call)
        except Exception as e:  # the pool and the prefix were donated to the call
            self._fail_all(_failure(e, "decode call with a prefill chunk", "during decoding"))
            return 0
        call = _InFlight(tokens, owners, job, dispatch_seconds=time.perf_counter() - began)
        job.start += width
        self._cache_blocks(job)  # before the rows it ends leave the job, their chains with them
        call.inserted = list(zip(ready, self._take_rows(job, ready), strict=True))
        if not job.live:
            self._prefill = None
        self._dispatched(call)
        return cost

    def _decodes_prompt(self, r: Request) -> bool:
        """Whether `r`'s prompt skips prefill, going through the decode steps instead
        (`serve_decode_prompt_tokens`)."""
        return not self._apart and len(r.prompt_ids) <= self.cfg.serve_decode_prompt_tokens \
            and r.params.prompt_logprobs is None

    def _start_short_prompts(self) -> bool:
        """Waiting prompts at the head of the queue that skip prefill (`_decodes_prompt`) go
        into free slots, to go through the next decode calls' steps (`Engine.insert_prompts`).
        Returns whether any did."""
        started = False
        while True:
            rows: list[Request] = []
            with self._cv:  # in arrival order: a longer prompt at the head goes first
                while self._waiting and self._free and len(rows) < self.prefill_batch \
                        and self._decodes_prompt(self._waiting[0]):
                    rows.append(self._waiting.popleft())
                    rows[-1].slot = self._free.pop(0)
            if not rows:
                return started
            for r in rows:
                self._begin(r)
                r.to_feed = len(r.prompt_ids) - 1
                self._decoding[r.slot] = r  # held from here, so a failure below still ends it
            padded = [*rows, *[None] * (self.prefill_batch - len(rows))]
            try:
                self._pool = self.engine.insert_prompts(
                    self._pool, [r.prompt_ids if r else [] for r in padded],
                    *self._insert_args(padded))
            except Exception as e:
                self._fail_all(_failure(e, "insert", "while inserting a request"))
                return False
            for r in rows:
                self.metrics.prompt_tokens.inc(len(r.prompt_ids))
            started = True

    def _hand_over_finishing_slots(self) -> None:
        """Free the slots of requests the in-flight call certainly ends (their limit falls
        within its steps): the device stops them itself before any later call, so a new
        request may take the slot now instead of one call after their tokens are delivered."""
        call = self._in_flight_call
        if call is None:
            return
        steps = self.cfg.serve_steps_per_call
        # Inserted rows get their first token and `steps` - 1 more in the call.
        for r, produced in [*((r, r.produced) for _, r in call.owners),
                            *((r, 0) for _, r in call.inserted)]:
            # A row that fed prompt tokens in the call produces fewer than `steps` in it.
            if not (r.done or r.handed_over or r.fed_in_flight) \
                    and produced + steps >= r.params.max_tokens:
                r.handed_over = True
                self._free_slot(r.slot, on_device=False)

    def _dispatched(self, call: _InFlight | None) -> None:
        """`call` was dispatched (None: none this iteration): deliver the call before it, and
        without `serve_overlap` this one too."""
        if call is not None:
            for _, r in call.owners:
                r.fed_in_flight = r.to_feed > 0
                r.to_feed = max(0, r.to_feed - self.cfg.serve_steps_per_call)
        previous, self._in_flight_call = self._in_flight_call, None
        if previous is not None:
            self._in_flight_call = call  # failing, previous's delivery fails this call as well
            self._delivering = previous  # until its rows have joined, whatever fails
            self._deliver_call(previous)
            self._delivering = None
            if self._in_flight_call is not call:
                return
        self._in_flight_call = call if self._overlap else None
        if call is not None and not self._overlap:
            self._delivering = call
            self._deliver_call(call)
            self._delivering = None

    def _deliver_call(self, call: _InFlight) -> None:
        """A decode call's tokens to the requests that were decoding in it, then to the rows
        it inserted (their first tokens, and the steps after the insert)."""
        began = time.perf_counter()
        try:
            result = call.tokens.get()
        except Exception as e:  # the pool was donated to the call
            self._fail_all(_failure(e, "decode call", "during decoding"),
                           [r for _, r in call.inserted])
            return
        # A call with a chunk riding along does both kinds of work: its time counts as
        # decoding (the prefill counter keeps the separate prefill calls). With overlap, only
        # the time the host waited for it.
        self.metrics.decode_seconds.inc(call.dispatch_seconds + time.perf_counter() - began)
        if call.job is None:
            self._delivered(result, call.owners)
            return
        step, first, rest = result
        self._delivered(step, call.owners)
        self._joined(call.inserted, first)
        if rest is not None:
            self._delivered(rest, call.owners + [(r.slot, r) for _, r in call.inserted])

    def _delivered(self, out: Tokens, decoding: list[tuple[int, Request]]) -> None:
        """A decode call's tokens to the requests `decoding` (slot, request) that are still
        running."""
        self.metrics.decode_steps.inc(out.steps)
        for slot, r in decoding:
            if not r.done:
                self._deliver(r, out, slot)

    def _deliver(self, r: Request, out: Tokens, row: int) -> None:
        """Send row `row` of `out` to `r`, and end `r` if it finished."""
        n = int(out.count[row])
        r.produced += n
        ids = np.atleast_1d(out.ids[row])[:n].tolist()
        lps = np.atleast_1d(out.logprobs[row])[:n].tolist()
        top_ids = np.atleast_2d(out.top_ids[row])[:n]  # insert rows hold one token
        top_lps = np.atleast_2d(out.top_logprobs[row])[:n]
        if not ids:
            if not out.active[row]:  # the device holds nothing for it: never leave it hanging
                log.error("request %d in slot %d is inactive on the device", r.id, r.slot)
                self._end(r, "error", on_device=False, error="internal error: the slot stopped")
            return
        self._deliver_ids(r, ids, lps, top_ids, top_lps, device_done=not bool(out.active[row]))

    def _end(self, r: Request, reason: str, on_device: bool, error: str | None = None) -> None:
        if self._decoding.get(r.slot) is r:
            del self._decoding[r.slot]
        if not r.handed_over:  # else the slot is free already, perhaps another request's
            self._free_slot(r.slot, on_device)
        self._finish(r, reason, error)

    def _free_slot(self, slot: int, on_device: bool) -> None:
        if slot < 0:  # a row prefilled ahead, not given a slot yet
            return
        if slot in self._free:  # freed twice would hand it to two requests
            log.error("slot %d freed twice", slot)
            return
        if on_device:
            self._to_release.append(slot)
        self._free.append(slot)
        self._free.sort()

    def _release_pending(self) -> None:
        if self._to_release:
            slots, self._to_release = self._to_release, []
            try:
                self._pool = self.engine.release(self._pool, slots)
            except Exception as e:
                self._fail_all(_failure(e, "release", "while freeing slots"))

    def _fail_all(self, message: str, also: Sequence[Request] = ()) -> None:
        """After a failed pool call the pool's buffers are gone: fail every request holding a
        slot (and `also`: rows a failed call was inserting) and start from an empty pool. The
        prefix cache starts empty too: a store saved from a failed call's outputs may hold
        them."""
        victims = [*self._holding(), *also]
        self._in_flight_call = self._delivering = None
        if self._prefill is not None:
            victims += self._prefill.live
            for i in range(len(self._prefill.rows)):
                self._end_chain(self._prefill, i)
        self._decoding.clear()
        self._prefill = None
        self._to_release = []
        self._free = list(range(self.num_slots))
        for r in victims:
            self._finish(r, "error", message)
        # Its buffers went to the call that failed, or go now, before a new pool is allocated;
        # /health reads the pool, so it stays set (and healthy) unless no new one can be had.
        for a in jax.tree.leaves(self._pool):
            if not a.is_deleted():
                a.delete()
        try:
            self._pool = self.engine.new_pool(self.num_slots)
        except Exception as e:
            # Nothing can be served without a pool: the waiting requests end now, and new ones
            # are refused (503) rather than queued for ever.
            self._pool = None
            if isinstance(e, ConnectionError):  # the devices are out of reach, said once
                log.error("%s; the server takes no more requests", e)
            else:
                log.exception("could not allocate a new slot pool; the server takes no more "
                              "requests and /health answers 503")
            with self._cv:
                self._accepting = False
                waiting = list(self._waiting)
                self._waiting.clear()
            for r in waiting:
                self._finish(r, "error", message)
        if self.prefix_cache is not None and self._pool is not None:
            self._reset_prefix_cache()
        self._update_gauges()
