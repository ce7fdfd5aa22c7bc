"""What the next engine call does, decided from the scheduler's state alone: a pure function
from `Queue` (the sequences waiting and running, the free state slots and pages) to a `Plan`
value, so the policy is tested without a device or a compiled program, and a multi-process
server broadcasts plans rather than method calls.

Policy, in order:
1. **Running sequences first.** Every sequence that is decoding gets the pages its next
   `steps` tokens need, and the oldest part-way prompts the pages of their next slices. When
   the pool cannot hold them, the newest sequence holding pages is preempted (its pages and
   slot freed; it waits again, ahead of every later arrival, to be recomputed from its prompt
   and the tokens it has produced: `Seq.requeued`), until the rest fit. A request never fails
   for lack of pages: the oldest sequence always fits alone (requests that could never fit are
   refused at admission, `fits`).
2. **Then prefill slices**, under `prefill_budget` tokens per call and `rows` slices of at most
   `chunk` tokens: sequences already part-way through their prompts first, then new ones in
   arrival order while a state slot and the pages for their first slice are free. A sequence
   starts decoding in the call whose slice ends its prompt (its first token is sampled there).
3. **Steps.** A call runs `steps` decode steps (the first with the slices beside it; the
   device's loop ends early once no slot is active), so one program shape serves every call.

Sequences are identified by an int, the order they arrived in (lower is older).
"""

from __future__ import annotations

import dataclasses

from k3text.inference.pages import pages_for


@dataclasses.dataclass(frozen=True)
class Seq:
    """One request as the planner sees it."""

    id: int
    prompt: int  # the request's prompt tokens
    max_tokens: int  # tokens it may generate in all
    generated: int = 0  # tokens generated so far (kept across a preemption)
    to_prefill: int = -1  # tokens to prefill: the prompt, after a preemption with the generated
    prefilled: int = 0  # of `to_prefill`, through the model
    decoded: int = 0  # decode steps since its prefill ended (each caches one more position)
    slot: int | None = None  # its KDA state slot while admitted
    pages: int = 0  # pages it holds

    def __post_init__(self):
        if self.to_prefill < 0:
            object.__setattr__(self, "to_prefill", self.prompt)

    @property
    def decoding(self) -> bool:
        return self.slot is not None and self.prefilled == self.to_prefill

    @property
    def cached(self) -> int:
        """Positions in its pages."""
        return self.prefilled + self.decoded

    @property
    def max_cached(self) -> int:
        """The most positions it can ever cache: its prompt and every token it may generate
        but the last (which no step reads)."""
        return self.prompt + self.max_tokens - 1

    def requeued(self) -> Seq:
        """As it waits again after a preemption: holding nothing, to be prefilled from scratch
        over its prompt and the tokens it generated (the next token sampled from the last of
        them, numbered as it would have been)."""
        return Seq(self.id, self.prompt, self.max_tokens, self.generated,
                   self.prompt + self.generated)


@dataclasses.dataclass(frozen=True)
class Limits:
    page_size: int
    steps: int  # decode steps per call
    chunk: int  # longest prefill slice
    rows: int  # prefill slices per call
    prefill_budget: int  # prefill tokens per call


@dataclasses.dataclass(frozen=True)
class Queue:
    waiting: tuple[Seq, ...]  # arrival order (preempted sequences back at the front)
    running: tuple[Seq, ...]  # admitted: prefilling or decoding
    free_slots: tuple[int, ...]
    free_pages: int


@dataclasses.dataclass(frozen=True)
class Slice:
    seq: int
    slot: int
    start: int
    count: int
    ends: bool  # the prompt's last slice: its first token is sampled in this call


@dataclasses.dataclass(frozen=True)
class Plan:
    preempt: tuple[int, ...] = ()  # sequences whose pages and slot are freed, re-queued
    admit: tuple[tuple[int, int], ...] = ()  # (sequence, slot)
    slices: tuple[Slice, ...] = ()
    decode: tuple[int, ...] = ()  # sequences decoding in this call
    steps: int = 0  # decode steps of the call
    reserve: tuple[tuple[int, int], ...] = ()  # (sequence, positions its pages must hold)

    @property
    def idle(self) -> bool:
        return not (self.slices or self.decode)


def fits(seq: Seq, limits: Limits, usable_pages: int) -> bool:
    """Whether the sequence, alone in the pool, could run to its last token: a request that
    cannot is refused before any work (a 400 naming max_tokens and the prompt)."""
    return pages_for(seq.max_cached, limits.page_size) <= usable_pages


def plan(queue: Queue, limits: Limits) -> Plan:
    """The next call (module docstring)."""
    page, steps = limits.page_size, limits.steps
    running = sorted(queue.running, key=lambda s: s.id)
    free_pages, free_slots = queue.free_pages, list(queue.free_slots)
    preempted: list[Seq] = []

    def need(seq: Seq, positions: int) -> int:
        return max(0, pages_for(positions, page) - seq.pages)

    def decode_target(seq: Seq) -> int:
        return min(seq.cached + steps, seq.max_cached)

    def slice_of(seq: Seq, budget: int) -> tuple[int, int]:
        """(tokens, positions its pages must hold) of the sequence's next slice; a prompt that
        ends there decodes the call's remaining steps too."""
        count = min(limits.chunk, seq.to_prefill - seq.prefilled, budget)
        end = seq.prefilled + count
        return count, (min(end + steps - 1, seq.max_cached) if end == seq.to_prefill
                       else end)

    def demand(running: list[Seq]) -> int:
        """Pages the running sequences' next call needs: every decoding one's steps and the
        oldest part-way prompts' next slices."""
        pages, budget = 0, limits.prefill_budget
        for seq in running:
            if seq.decoding:
                pages += need(seq, decode_target(seq))
        for seq in [s for s in running if not s.decoding][: limits.rows]:
            count, target = slice_of(seq, budget)
            if count <= 0:
                break
            budget -= count
            pages += need(seq, target)
        return pages

    # 1. The running sequences' next call, preempting the newest until it fits: the oldest
    # always makes progress.
    while running and demand(running) > free_pages:
        victim = running.pop()
        preempted.append(victim)
        free_pages += victim.pages
        free_slots.append(victim.slot)
    decoding = [s for s in running if s.decoding]
    reserve = [(s.id, decode_target(s)) for s in decoding]
    free_pages -= sum(need(s, decode_target(s)) for s in decoding)

    # 2. Prefill slices: part-way prompts first, then admissions in arrival order (nobody
    # overtakes an older sequence that does not fit); none in a call that had to preempt, or
    # what it freed would go straight back to a sequence that must then be preempted again.
    budget, slices, admit = limits.prefill_budget, [], []
    candidates = [s for s in running if not s.decoding]
    if not preempted:
        candidates += list(queue.waiting)
    for seq in candidates:
        if len(slices) == limits.rows or budget <= 0:
            break
        count, target = slice_of(seq, budget)
        ends = seq.prefilled + count == seq.to_prefill
        if (seq.slot is None and not free_slots) or need(seq, target) > free_pages:
            break
        slot = seq.slot
        if slot is None:
            slot = min(free_slots)
            free_slots.remove(slot)
            admit.append((seq.id, slot))
        free_pages -= need(seq, target)
        budget -= count
        slices.append(Slice(seq.id, slot, seq.prefilled, count, ends))
        reserve.append((seq.id, target))
    return Plan(tuple(s.id for s in preempted), tuple(admit), tuple(slices),
                tuple(s.id for s in decoding), steps, tuple(reserve))
