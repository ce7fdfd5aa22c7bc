"""The scheduler's policy as a pure function (`serving.planner.plan`), run without a device: a
fake executor applies each plan to a `PageAllocator` and advances the sequences as the engine
would, over workloads that fit, that exhaust the pages mid-decode (preemption) and that arrive
while others run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from k3text.inference.pages import PageAllocator, pages_for
from k3text.serving.planner import Limits, Plan, Queue, Seq, fits, plan

LIMITS = Limits(page_size=4, steps=3, chunk=8, rows=2, prefill_budget=12)


class FakeExecutor:
    """Applies plans as the engine and scheduler would: pages reserved (a reservation the
    planner did not leave room for raises `OutOfPages`), slices advanced, every decoding
    sequence given `steps` tokens (fewer where it reaches max_tokens or its stop)."""

    def __init__(self, num_pages: int, slots: int, limits: Limits, stops: dict[int, int]):
        self.pages = PageAllocator(num_pages, limits.page_size)
        self.limits, self.stops = limits, stops
        self.free_slots = list(range(slots))
        self.waiting: list[Seq] = []
        self.running: dict[int, Seq] = {}
        self.finished: dict[int, Seq] = {}
        self.preemptions = 0
        self.calls = 0

    def queue(self) -> Queue:
        return Queue(tuple(self.waiting), tuple(self.running.values()),
                     tuple(self.free_slots), self.pages.free_pages)

    def _limit(self, seq: Seq) -> int:
        return min(seq.max_tokens, self.stops.get(seq.id, seq.max_tokens))

    def apply(self, p: Plan) -> None:
        self.calls += 1
        for sid in p.preempt:
            seq = self.running.pop(sid)
            self.pages.release(sid)
            self.free_slots.append(seq.slot)
            # Ahead of every later arrival (ids are arrival order).
            self.waiting.insert(sum(s.id < sid for s in self.waiting), seq.requeued())
            self.preemptions += 1
        for sid, slot in p.admit:
            seq = next(s for s in self.waiting if s.id == sid)
            self.waiting.remove(seq)
            self.free_slots.remove(slot)
            self.running[sid] = dataclasses.replace(seq, slot=slot)
        for sid, positions in p.reserve:
            self.pages.reserve(sid, positions)
        for sid in set(self.running):  # pages held, as the planner will see them
            self.running[sid] = dataclasses.replace(self.running[sid],
                                                    pages=len(self.pages.pages(sid)))
        decoding = {sid: p.steps for sid in p.decode}
        for sl in p.slices:
            seq = self.running[sl.seq]
            assert (sl.slot, sl.start) == (seq.slot, seq.prefilled)
            seq = dataclasses.replace(seq, prefilled=seq.prefilled + sl.count)
            if sl.ends:
                seq = dataclasses.replace(seq, generated=seq.generated + 1)
                decoding[sl.seq] = p.steps - 1
            self.running[sl.seq] = seq
        for sid, steps in decoding.items():
            seq = self.running[sid]
            for _ in range(steps):
                if seq.generated >= self._limit(seq):
                    break
                assert seq.cached + 1 <= self.pages.capacity(sid), "decoded past its pages"
                seq = dataclasses.replace(seq, decoded=seq.decoded + 1,
                                          generated=seq.generated + 1)
            self.running[sid] = seq
            if seq.generated >= self._limit(seq):
                self.finished[sid] = self.running.pop(sid)
                self.pages.release(sid)
                self.free_slots.append(seq.slot)
        self.pages.check()

    def run(self, arrivals: dict[int, list[Seq]], max_calls: int = 2000) -> None:
        for call in range(max_calls):
            self.waiting.extend(arrivals.get(call, []))
            if not (self.waiting or self.running) and call > max(arrivals):
                return
            self.apply(plan(self.queue(), self.limits))
        raise AssertionError(f"not done after {max_calls} calls: {self.queue()}")


def test_decoding_comes_first_and_a_prompt_starts_decoding_in_the_call_that_ends_it():
    running = (Seq(0, prompt=5, max_tokens=10, generated=2, prefilled=5, decoded=1, slot=0,
                   pages=2),)
    waiting = (Seq(1, prompt=20, max_tokens=4), Seq(2, prompt=3, max_tokens=4))
    p = plan(Queue(waiting, running, free_slots=(1, 2), free_pages=10), LIMITS)
    assert p.decode == (0,) and p.steps == 3 and not p.preempt
    # Sequence 1's first slice (the chunk), then sequence 2's within the budget of 12.
    assert [(s.seq, s.slot, s.start, s.count, s.ends) for s in p.slices] == [
        (1, 1, 0, 8, False), (2, 2, 0, 3, True)]
    assert p.admit == ((1, 1), (2, 2))
    # 0 decodes 3 more (6 + 3 = 9 positions), 1 holds its slice, 2 its prompt + 2 steps.
    assert dict(p.reserve) == {0: 9, 1: 8, 2: 5}


def test_a_sequence_at_its_last_token_reserves_no_further():
    seq = Seq(0, prompt=4, max_tokens=3, generated=2, prefilled=4, decoded=1, slot=0, pages=2)
    assert seq.max_cached == 6
    assert dict(plan(Queue((), (seq,), (), 0), LIMITS).reserve) == {0: 6}


def test_admission_is_in_arrival_order_and_waits_for_pages():
    waiting = (Seq(0, prompt=16, max_tokens=2), Seq(1, prompt=1, max_tokens=1))
    p = plan(Queue(waiting, (), free_slots=(0, 1), free_pages=1), LIMITS)
    assert p.idle and not p.admit  # 0's first slice needs 2 pages; 1 may not overtake it
    assert plan(Queue((), (), (), 5), LIMITS).idle


def test_out_of_pages_mid_decode_preempts_the_newest():
    old = Seq(0, prompt=8, max_tokens=20, generated=5, prefilled=8, decoded=4, slot=0, pages=3)
    new = Seq(1, prompt=8, max_tokens=20, generated=2, prefilled=8, decoded=1, slot=1, pages=3)
    p = plan(Queue((), (old, new), free_slots=(), free_pages=0), LIMITS)
    assert p.preempt == (1,) and p.decode == (0,)
    assert dict(p.reserve)[0] == 15 and not p.slices  # its pages back, 1 waits for them
    again = new.requeued()
    assert (again.to_prefill, again.generated, again.slot, again.pages) == (10, 2, None, 0)
    assert again.max_cached == new.max_cached


def test_part_way_prompts_that_run_out_of_pages_preempt_the_newer_one():
    a = Seq(0, prompt=32, max_tokens=2, prefilled=8, slot=0, pages=2)
    b = Seq(1, prompt=32, max_tokens=2, prefilled=8, slot=1, pages=2)
    p = plan(Queue((), (a, b), free_slots=(), free_pages=1), LIMITS)
    assert p.preempt == (1,)
    assert [(s.seq, s.start, s.count) for s in p.slices][0] == (0, 8, 8)


@pytest.mark.parametrize("num_pages", [200, 24])
def test_every_request_finishes_and_pages_never_run_out(num_pages):
    """48 requests of mixed length arriving over time, random stops, 8 state slots; with 23
    usable pages (8 running sequences average 7 pages each, 56 in all) preemption keeps the
    pool from running out and every request still gets all its tokens."""
    rng = np.random.default_rng(0)
    arrivals: dict[int, list[Seq]] = {}
    stops = {}
    for sid in range(48):
        seq = Seq(sid, prompt=int(rng.integers(1, 30)), max_tokens=int(rng.integers(1, 25)))
        assert fits(seq, LIMITS, num_pages - 1)
        arrivals.setdefault(int(rng.integers(0, 40)), []).append(seq)
        if rng.random() < 0.3:
            stops[sid] = int(rng.integers(1, seq.max_tokens + 1))
    arrivals = {call: sorted(seqs, key=lambda s: s.id) for call, seqs in arrivals.items()}
    # Ids in arrival order, as the scheduler numbers them.
    order = [s for call in sorted(arrivals) for s in arrivals[call]]
    renumber = {s.id: i for i, s in enumerate(order)}
    arrivals = {call: [dataclasses.replace(s, id=renumber[s.id]) for s in seqs]
                for call, seqs in arrivals.items()}
    stops = {renumber[k]: v for k, v in stops.items()}
    executor = FakeExecutor(num_pages, slots=8, limits=LIMITS, stops=stops)
    executor.run(arrivals)
    assert len(executor.finished) == 48
    for sid, seq in executor.finished.items():
        assert seq.generated == min(seq.max_tokens, stops.get(sid, seq.max_tokens))
    assert executor.pages.free_pages == num_pages - 1
    if num_pages == 24:
        assert executor.preemptions > 0
    else:
        assert executor.preemptions == 0


def test_a_request_that_could_never_fit_is_refused():
    assert not fits(Seq(0, prompt=60, max_tokens=10), LIMITS, usable_pages=17)
    assert fits(Seq(0, prompt=60, max_tokens=9), LIMITS, usable_pages=17)
    assert pages_for(60 + 9 - 1, 4) == 17
