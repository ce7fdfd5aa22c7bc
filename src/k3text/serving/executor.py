"""Runs the planner's plans on the engine's paged pool: the host's books (requests, their
tokens, the page allocator, the state slots), one engine call per plan, and the tokens each
call produced handed back per request.

`PagedExecutor.submit` queues a request; `step` asks `planner.plan` for the next call, applies
it (preemptions: pages and slot freed, the slot stopped on the device; admissions; page
reservations), runs it (`Engine.paged_step` when it carries prefill slices, else
`Engine.paged_generate`) and returns what each request produced in it (`Output`); `abort` ends
a request early (cancelled, or stopped by the host: a stop string). `generate` runs a batch of
prompts to the end (the offline driver's shape). A preempted request is recomputed from its
prompt and the tokens it had produced (`paged_step_program`), so its output is the one it
would have had.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from k3text.inference.engine import Engine, Generation, Tokens, check_prompts
from k3text.inference.pages import PageAllocator
from k3text.inference.sampling import PromptScores, SlotSampling, config_sampling
from k3text.models.state import cache_length
from k3text.serving import planner

Token = tuple[int, float, list[int], list[float]]  # id, log-probability, top ids, top lps


class NeverFits(ValueError):
    """A request the page pool could not hold even alone."""


@dataclasses.dataclass
class Output:
    """What one call produced for one request: its new tokens, and whether the device stopped
    it (a stop id, or its max_tokens reached): it holds nothing from here on."""

    id: int
    tokens: list[Token]
    done: bool
    # With its first token, for a request that scores its prompt: each prompt token after
    # the first scored at the position before it (host arrays over len(prompt) - 1 tokens).
    prompt_scores: PromptScores | None = None


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    stop_ids: np.ndarray  # [MAX_STOP_IDS]
    params: SlotSampling  # one row
    seq: planner.Seq
    generated: list[int] = dataclasses.field(default_factory=list)  # recomputed if preempted
    scored: bool = False  # its prompt's positions are scored (`prompt_logprobs`)
    # position -> its scores (log-probability, rank, top ids, top log-probabilities), as the
    # slices go; sent with its first token, once.
    scores: dict[int, tuple] = dataclasses.field(default_factory=dict)


class PagedExecutor:
    def __init__(self, engine: Engine, slots: int, num_pages: int, page_size: int,
                 steps: int, prefill_rows: int, prefill_budget: int | None = None,
                 top_n: int = 0):
        cfg = engine.cfg
        self.engine, self.slots, self.top_n = engine, slots, top_n
        self.limits = planner.Limits(page_size, steps, cfg.prefill_chunk_size, prefill_rows,
                                     prefill_budget or prefill_rows * cfg.prefill_chunk_size)
        self.pages = PageAllocator(num_pages, page_size)
        self.width = -(-cache_length(cfg) // page_size)  # table entries per sequence
        self.pool = engine.new_paged_pool(slots, num_pages, page_size)
        self.requests: dict[int, Request] = {}
        self.waiting: list[int] = []  # arrival order (ids are arrival order)
        self.free_slots = list(range(slots))
        self.occupant: list[int | None] = [None] * slots
        self._to_stop: list[int] = []  # slots freed by the host, still active on the device
        self._outputs: dict[int, Output] = {}  # the call being booked
        self._next_id = 0  # ids in arrival order
        self.preemptions = 0
        self.steps_run = 0  # decode steps the device ran, over every call

    # ---- requests -------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], max_tokens: int, stop_ids: np.ndarray,
               params: SlotSampling, scored: bool = False) -> int:
        """Queue a request; returns its id. With `scored` every position of its prompt is
        scored against the token after it (`Output.prompt_scores`). One that could never fit
        the page pool is refused (`NeverFits`, naming the sizes) before anything is queued."""
        rid = self._next_id
        seq = planner.Seq(rid, len(prompt), max_tokens)
        if not planner.fits(seq, self.limits, self.pages.usable_pages):
            raise NeverFits(
                f"a prompt of {len(prompt)} tokens with max_tokens={max_tokens} needs "
                f"{-(-seq.max_cached // self.limits.page_size)} pages of "
                f"{self.limits.page_size} tokens, more than the pool's "
                f"{self.pages.usable_pages}")
        self.requests[rid] = Request(list(prompt), max_tokens, stop_ids, params, seq,
                                     scored=scored)
        self.waiting.append(rid)
        self._next_id += 1
        return rid

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.occupant)

    def abort(self, rid: int) -> None:
        """End request `rid` now (cancelled, or stopped by the host): it leaves the queue, or
        frees its pages and slot, which the device stops before the next call."""
        request = self.requests.get(rid)
        if request is None:  # finished already
            return
        if rid in self.waiting:
            self.waiting.remove(rid)
            del self.requests[rid]
            return
        self._to_stop.append(request.seq.slot)
        self._finish(rid)

    def reset(self) -> list[int]:
        """After a failed call (its pool was donated to it): a new pool, every running request
        ended; returns their ids. The waiting ones stay queued."""
        running = [r for r in self.occupant if r is not None]
        for rid in running:
            self._finish(rid)
        self._to_stop = []
        self.pool = None  # the failed call's buffers go before new ones are allocated
        self.pool = self.engine.new_paged_pool(self.slots, self.pages.num_pages,
                                               self.limits.page_size)
        return running

    @property
    def pages_used(self) -> int:
        return self.pages.usable_pages - self.pages.free_pages

    # ---- one call -------------------------------------------------------------------------

    def _queue(self) -> planner.Queue:
        running = tuple(self.requests[r].seq for r in self.occupant if r is not None)
        return planner.Queue(tuple(self.requests[r].seq for r in self.waiting), running,
                             tuple(self.free_slots), self.pages.free_pages)

    def _set(self, rid: int, **changes) -> None:
        request = self.requests[rid]
        request.seq = dataclasses.replace(request.seq, **changes)

    def step(self) -> tuple[planner.Plan, list[Output]]:
        """Plan the next call and run it: the plan, and what each request produced in it
        (requests the device stopped have left the executor)."""
        if self._to_stop:  # before the call: a freed slot's row must not decode again
            stopped, self._to_stop = self._to_stop, []
            self.pool = self.engine.release(self.pool, stopped)
        plan = planner.plan(self._queue(), self.limits)
        if plan.preempt:
            stopped = []
            for rid in plan.preempt:
                seq = self.requests[rid].seq
                self.pages.release(rid)
                self.occupant[seq.slot] = None
                self.free_slots.append(seq.slot)
                stopped.append(seq.slot)
                self.requests[rid].seq = seq.requeued()
                self.waiting.insert(sum(w < rid for w in self.waiting), rid)
                self.preemptions += 1
            self.pool = self.engine.release(self.pool, stopped)
        for rid, slot in plan.admit:
            self.waiting.remove(rid)
            self.free_slots.remove(slot)
            self.occupant[slot] = rid
            self._set(rid, slot=slot)
        for rid, positions in plan.reserve:
            self.pages.reserve(rid, positions)
        for rid in (r for r in self.occupant if r is not None):
            self._set(rid, pages=len(self.pages.pages(rid)))
        if plan.idle:
            if self.busy:
                raise RuntimeError(f"the planner left {len(self.waiting)} waiting requests "
                                   f"with nothing running: {self._queue()}")
            return plan, []
        self._outputs = {}
        table = self.pages.table(self.occupant, self.width)
        if plan.slices:
            targets = self._targets(plan)
            long, ends, limits, stop, params, prompt_len, resumed = self._long_rows(
                plan, self._width(plan, targets is not None))
            self.pool, step, first, rest, scores = self.engine.paged_step(
                self.pool, table, long, ends, limits, stop, params, top_n=self.top_n,
                n_steps=plan.steps, prompt_len=prompt_len, resumed=resumed, targets=targets)
            self._book(step)
            for row, piece in enumerate(plan.slices):
                request = self.requests[piece.seq]
                self._set(piece.seq, prefilled=request.seq.prefilled + piece.count)
                if scores is not None and request.scored:
                    for i in range(piece.count):
                        if piece.start + i < len(request.prompt) - 1:
                            request.scores[piece.start + i] = tuple(a[row, i] for a in scores)
                if piece.ends:
                    self._emit(piece.seq, first, row, None, decoded=False)
                    if request.scored and request.scores is not None:
                        self._outputs[piece.seq].prompt_scores = _gathered(request.scores,
                                                                           scores)
                        request.scores = None  # sent
                    if not first.active[row]:
                        self._finish(piece.seq)
            if rest is not None:
                self._book(rest)
        else:
            self.pool, rest = self.engine.paged_generate(self.pool, table, plan.steps,
                                                         self.top_n)
            self._book(rest)
        return plan, list(self._outputs.values())

    def _width(self, plan: planner.Plan, scored: bool) -> int:
        """The long rows' width for the plan's slices: the narrowest of `prefill_buckets` that
        holds the longest slice, else a whole chunk (so a short prompt does not pay for a
        chunk of padding); a whole chunk when any slice is scored (one scoring program)."""
        longest = max(piece.count for piece in plan.slices)
        return self.limits.chunk if scored else self.engine.chunk_width(longest)

    def _long_rows(self, plan: planner.Plan, width: int) -> tuple:
        """`Engine.paged_step`'s long-row arguments for the plan's slices, `width` wide."""
        rows, chunk = self.limits.rows, width
        tokens = np.zeros((rows, chunk), np.int32)
        slot, start, count = (np.full(rows, -1, np.int32), np.zeros(rows, np.int32),
                              np.zeros(rows, np.int32))
        ends = np.zeros(rows, bool)
        prompt_len, resumed = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        limits = np.ones(rows, np.int32)
        stop = np.tile(self.engine.stop_ids(), (rows, 1))
        params = [config_sampling(self.engine.cfg, 1)] * rows
        who: list[int | None] = [None] * rows
        for row, piece in enumerate(plan.slices):
            request = self.requests[piece.seq]
            ids = request.prompt + request.generated
            tokens[row, :piece.count] = ids[piece.start:piece.start + piece.count]
            slot[row], start[row], count[row] = piece.slot, piece.start, piece.count
            ends[row], who[row] = piece.ends, piece.seq
            prompt_len[row], resumed[row] = len(request.prompt), request.seq.generated
            limits[row], stop[row], params[row] = (request.max_tokens, request.stop_ids,
                                                   request.params)
        long = (tokens, slot, start, count, self.pages.table(who, self.width))
        rows_params = jax.tree.map(lambda *a: np.concatenate(a), *params)
        return long, ends, limits, stop, rows_params, prompt_len, resumed

    def _targets(self, plan: planner.Plan) -> np.ndarray | None:
        """The token after each position of the plan's slices whose requests score their
        prompts ([rows, chunk]; past the prompt any id), or None when none does."""
        pieces = [(row, piece) for row, piece in enumerate(plan.slices)
                  if self.requests[piece.seq].scored
                  and self.requests[piece.seq].scores is not None]
        if not pieces:
            return None
        targets = np.zeros((self.limits.rows, self.limits.chunk), np.int32)
        for row, piece in pieces:
            after = self.requests[piece.seq].prompt[piece.start + 1:piece.start + piece.count + 1]
            targets[row, :len(after)] = after
        return targets

    def _emit(self, rid: int, tokens: Tokens, row: int, column: int | None,
              decoded: bool) -> None:
        pick = (lambda a: a[row]) if column is None else (lambda a: a[row, column])
        token = (int(pick(tokens.ids)), float(pick(tokens.logprobs)),
                 pick(tokens.top_ids).tolist(), pick(tokens.top_logprobs).tolist())
        self._outputs.setdefault(rid, Output(rid, [], False)).tokens.append(token)
        request = self.requests[rid]
        request.generated.append(token[0])
        seq = request.seq
        self._set(rid, generated=seq.generated + 1, decoded=seq.decoded + decoded)

    def _book(self, tokens: Tokens) -> None:
        """A decode loop's tokens [S, n] into their slots' requests; a slot that stopped ends
        its request."""
        self.steps_run += tokens.steps
        for slot, rid in enumerate(self.occupant):
            if rid is None or not self.requests[rid].seq.decoding:
                continue
            for column in range(int(tokens.count[slot])):
                self._emit(rid, tokens, slot, column, decoded=True)
            if not tokens.active[slot]:
                self._finish(rid)

    def _finish(self, rid: int) -> None:
        """`rid` holds nothing from here on (the device stopped it, or the host: `abort`)."""
        request = self.requests.pop(rid)
        self.pages.release(rid)
        self.occupant[request.seq.slot] = None
        self.free_slots.append(request.seq.slot)
        self._outputs.setdefault(rid, Output(rid, [], False)).done = True


def _gathered(scores: dict[int, tuple], call: PromptScores) -> PromptScores:
    """A prompt's scores by position (0 .. len - 2) as host arrays over its positions; `call`
    (a call's scores) gives the dtypes and shapes when there are none."""
    positions = sorted(scores)
    return PromptScores(*(np.stack([scores[p][k] for p in positions]) if positions
                          else field[0, :0] for k, field in enumerate(call)))


def generate(engine: Engine, prompts: Sequence[Sequence[int]], num_pages: int, page_size: int,
             slots: int | None = None, max_steps: int | None = None, seed: int | None = None,
             steps_per_call: int = 4, prefill_rows: int = 2, top_n: int = 0,
             params: Sequence[SlotSampling] | None = None,
             ) -> tuple[Generation, PagedExecutor]:
    """`Engine.decode_batch`'s job through the planner and the paged pool: every prompt
    submitted at once (prompt i sampled with `params[i]`, one row each; by default the
    config's sampling seeded `seed + i`), calls run until all are done."""
    cfg = engine.cfg
    max_steps = cfg.max_decode_steps if max_steps is None else max_steps
    check_prompts(cfg, prompts, max_steps)
    seed = cfg.seed if seed is None else seed
    executor = PagedExecutor(engine, slots or len(prompts), num_pages, page_size,
                             steps_per_call, prefill_rows, top_n=top_n)
    stop = engine.stop_ids()
    for i, prompt in enumerate(prompts):
        executor.submit(prompt, max_steps, stop, config_sampling(cfg, 1, [seed + i])
                        if params is None else params[i])
    outs: list[list[Token]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    while executor.busy:
        for output in executor.step()[1]:
            outs[output.id] += output.tokens
    seconds = time.perf_counter() - t0
    eos = None if cfg.ignore_eos else cfg.eos_token_id
    ids = [[t[0] for t in out] for out in outs]
    return Generation(
        [list(p) for p in prompts], ids, [[t[1] for t in out] for out in outs],
        ["eos" if eos is not None and o[-1] == eos else "length" for o in ids], 0.0, seconds,
        max(map(len, ids)),
        *(([[t[2] for t in out] for out in outs], [[t[3] for t in out] for out in outs])
          if top_n else (None, None))), executor
