"""Runs the planner's plans on the engine's paged pool: the host's books (requests, their
tokens, the page allocator, the state slots), one engine call per plan, and the tokens each
call produced handed back per request.

`PagedExecutor.submit` queues a request; `step` asks `planner.plan` for the next call, applies
it (preemptions: pages and slot freed, the slot stopped on the device; admissions; page
reservations), runs it (`Engine.paged_step` when it carries prefill slices, else
`Engine.paged_generate`) and books what came back; `generate` runs a batch of prompts to the
end (the offline driver's shape). A preempted request is recomputed from its prompt and the
tokens it had produced (`paged_step_program`), so its output is the one it would have had.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from k3text.config import ConfigError
from k3text.inference.engine import Engine, Generation, Tokens, check_prompts
from k3text.inference.pages import PageAllocator
from k3text.inference.sampling import SlotSampling, config_sampling
from k3text.models.state import cache_length
from k3text.serving import planner


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    stop_ids: np.ndarray  # [MAX_STOP_IDS]
    params: SlotSampling  # one row
    seq: planner.Seq
    out: list[tuple[int, float, list[int], list[float]]] = dataclasses.field(default_factory=list)
    done: bool = False


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
        self.preemptions = 0
        self.calls = 0

    # ---- requests -------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], max_tokens: int, stop_ids: np.ndarray,
               params: SlotSampling) -> int:
        """Queue a request; returns its id. One that could never fit the page pool is refused
        (ConfigError naming the sizes) before anything is queued."""
        rid = len(self.requests)
        seq = planner.Seq(rid, len(prompt), max_tokens)
        if not planner.fits(seq, self.limits, self.pages.usable_pages):
            raise ConfigError(
                f"a prompt of {len(prompt)} tokens with max_tokens={max_tokens} needs "
                f"{-(-seq.max_cached // self.limits.page_size)} pages of "
                f"{self.limits.page_size} tokens, more than the pool's "
                f"{self.pages.usable_pages}")
        self.requests[rid] = Request(list(prompt), max_tokens, stop_ids, params, seq)
        self.waiting.append(rid)
        return rid

    @property
    def busy(self) -> bool:
        return any(not r.done for r in self.requests.values())

    # ---- one call -------------------------------------------------------------------------

    def _queue(self) -> planner.Queue:
        running = tuple(self.requests[r].seq for r in self.occupant if r is not None)
        return planner.Queue(tuple(self.requests[r].seq for r in self.waiting), running,
                             tuple(self.free_slots), self.pages.free_pages)

    def _set(self, rid: int, **changes) -> None:
        request = self.requests[rid]
        request.seq = dataclasses.replace(request.seq, **changes)

    def step(self) -> planner.Plan:
        """Plan the next call, run it, book its tokens."""
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
            return plan
        self.calls += 1
        table = self.pages.table(self.occupant, self.width)
        if plan.slices:
            long, ends, limits, stop, params, prompt_len, resumed = self._long_rows(plan)
            self.pool, step, first, rest = self.engine.paged_step(
                self.pool, table, long, ends, limits, stop, params, top_n=self.top_n,
                n_steps=plan.steps, prompt_len=prompt_len, resumed=resumed)
            self._book(step)
            for row, piece in enumerate(plan.slices):
                request = self.requests[piece.seq]
                self._set(piece.seq, prefilled=request.seq.prefilled + piece.count)
                if piece.ends:
                    self._emit(piece.seq, first, row, None, decoded=False)
                    if not first.active[row]:
                        self._finish(piece.seq)
            if rest is not None:
                self._book(rest)
        else:
            self.pool, rest = self.engine.paged_generate(self.pool, table, plan.steps,
                                                         self.top_n)
            self._book(rest)
        return plan

    def _long_rows(self, plan: planner.Plan) -> tuple:
        """`Engine.paged_step`'s long-row arguments for the plan's slices."""
        rows, chunk = self.limits.rows, self.limits.chunk
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
            ids = request.prompt + [t[0] for t in request.out]
            tokens[row, :piece.count] = ids[piece.start:piece.start + piece.count]
            slot[row], start[row], count[row] = piece.slot, piece.start, piece.count
            ends[row], who[row] = piece.ends, piece.seq
            prompt_len[row], resumed[row] = len(request.prompt), request.seq.generated
            limits[row], stop[row], params[row] = (request.max_tokens, request.stop_ids,
                                                   request.params)
        long = (tokens, slot, start, count, self.pages.table(who, self.width))
        rows_params = jax.tree.map(lambda *a: np.concatenate(a), *params)
        return long, ends, limits, stop, rows_params, prompt_len, resumed

    def _emit(self, rid: int, tokens: Tokens, row: int, column: int | None,
              decoded: bool) -> None:
        pick = (lambda a: a[row]) if column is None else (lambda a: a[row, column])
        request = self.requests[rid]
        request.out.append((int(pick(tokens.ids)), float(pick(tokens.logprobs)),
                            pick(tokens.top_ids).tolist(), pick(tokens.top_logprobs).tolist()))
        seq = request.seq
        self._set(rid, generated=seq.generated + 1, decoded=seq.decoded + decoded)

    def _book(self, tokens: Tokens) -> None:
        """A decode loop's tokens [S, n] into their slots' requests; a slot that stopped ends
        its request."""
        for slot, rid in enumerate(self.occupant):
            if rid is None or not self.requests[rid].seq.decoding:
                continue
            for column in range(int(tokens.count[slot])):
                self._emit(rid, tokens, slot, column, decoded=True)
            if not tokens.active[slot]:
                self._finish(rid)

    def _finish(self, rid: int) -> None:
        request = self.requests[rid]
        request.done = True
        self.pages.release(rid)
        self.occupant[request.seq.slot] = None
        self.free_slots.append(request.seq.slot)


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
    t0 = time.perf_counter()
    while executor.busy:
        executor.step()
    seconds = time.perf_counter() - t0
    eos = None if cfg.ignore_eos else cfg.eos_token_id
    outs = [executor.requests[i].out for i in range(len(prompts))]
    ids = [[t[0] for t in out] for out in outs]
    return Generation(
        [list(p) for p in prompts], ids, [[t[1] for t in out] for out in outs],
        ["eos" if eos is not None and o[-1] == eos else "length" for o in ids], 0.0, seconds,
        max(map(len, ids)),
        *(([[t[2] for t in out] for out in outs], [[t[3] for t in out] for out in outs])
          if top_n else (None, None))), executor
