"""The server over the paged pool (`serve_engine: paged`): the scheduler thread driving the
planner and the executor, with a page pool too small for its requests, against each request
decoded alone; then the real server process with the shipped model."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_step import full_forward

from k3text.config import ConfigError, load_config
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder
from k3text.serving.paged_scheduler import PagedScheduler
from k3text.serving.scheduler import Finished, Request, SamplingParams

from helpers import assert_same_greedy, engine_for, tiny_config
from serving import CPU, SHIPPED, Server, offline_decode, run_scheduler


def _config(*overrides: str):
    return tiny_config("k3-tiny", "max_prefill_predict_length=48", "max_target_length=64",
                       "prefill_chunk_size=16", "kda_chunk_size=16", "per_device_batch_size=4",
                       "serve_engine=paged", "pagedattn_tokens_per_page=8",
                       "serve_steps_per_call=3", "serve_prefill_batch=2",
                       "serve_prefill_token_budget=32", "prefill_buckets=[8]", *overrides)


class _Poisoning:
    """The engine, writing large garbage into every free page and every free state slot of the
    pool just before each call (the executor has planned it: what is free now, nothing may
    read)."""

    def __init__(self, engine):
        self._engine = engine
        self.scheduler: PagedScheduler | None = None
        self.poisoned = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _poison(self, pool):
        executor = self.scheduler.executor
        held = {p for rid in executor.requests for p in executor.pages.pages(rid)}
        pages = [p for p in range(1, executor.pages.num_pages) if p not in held]
        slots = [s for s, rid in enumerate(executor.occupant) if rid is None]
        self.poisoned += len(pages) + len(slots)

        def fill(field, rows):
            # A per-layer pool holds the rows on axis 0 of each array; a stacked one on axis 1.
            axis = 0 if isinstance(field, list | tuple) else 1
            where = (slice(None),) * axis + (jnp.asarray(rows),)
            return jax.tree.map(lambda a: a.at[where].set(jnp.asarray(3e4, a.dtype)), field) \
                if rows else field

        state = pool.state
        return pool._replace(state=state._replace(
            kda_recurrent=fill(state.kda_recurrent, slots), kda_conv=fill(state.kda_conv, slots),
            mla_cache=fill(state.mla_cache, pages)))

    def paged_step(self, pool, *args, **kwargs):
        return self._engine.paged_step(self._poison(pool), *args, **kwargs)

    def paged_generate(self, pool, *args, **kwargs):
        return self._engine.paged_generate(self._poison(pool), *args, **kwargs)


def _serve(engine, cfg, requests, poison: bool = True):
    """Every request through an in-process paged scheduler, all submitted at once; per
    request (ids, log-probabilities, top log-probabilities, finish reason)."""
    if poison:
        engine = _Poisoning(engine)
    scheduler = PagedScheduler(cfg, engine, None)
    if poison:
        engine.scheduler = scheduler
    return run_scheduler(scheduler, requests), scheduler


def test_requests_through_a_pool_that_runs_out_each_equal_their_solo_decode():
    """24 requests of mixed lengths (prompts of 1-40 tokens, 1-20 new tokens, greedy and
    seeded sampling) through 4 slots and 13 pages of 8 tokens (two of the longest requests
    fill it): sequences are preempted mid-decode and recomputed, garbage is written into every
    free page and slot before every call, and each output equals the request decoded alone
    (`Engine.decode_batch`, greedy or with the request's seed), log-probabilities included;
    every page comes back."""
    cfg = _config("pagedattn_num_pages=13", "ignore_eos=true")
    engine = engine_for(cfg, seed=3)
    rng = np.random.default_rng(4)
    requests = []
    for i in range(24):
        prompt = rng.integers(3, cfg.vocab_size, int(rng.integers(1, 41))).tolist()
        seeded = i % 3 == 0
        requests.append((prompt, SamplingParams(
            max_tokens=int(rng.integers(1, 21)), temperature=0.8 if seeded else 0.0,
            seed=int(rng.integers(1 << 30)) if seeded else None, logprobs=2)))
    results, scheduler = _serve(engine, cfg, requests)
    assert scheduler.engine.poisoned > 0
    executor = scheduler.executor
    assert executor.preemptions > 0, "the workload should run the pool out"
    assert scheduler.metrics.preemptions._value.get() == executor.preemptions
    executor.pages.check()
    assert executor.pages.free_pages == executor.pages.usable_pages and not executor.requests
    greedy, sampled = cfg.replace(decode_sampling_strategy="greedy"), cfg.replace(
        decode_sampling_strategy="weighted", decode_sampling_temperature=0.8)
    solo = {"greedy": engine_for(greedy, seed=3), "sampled": engine_for(sampled, seed=3)}
    for i, ((prompt, params), got) in enumerate(zip(requests, results, strict=True)):
        assert got["reason"] == "length", (i, got["reason"])
        kind = "sampled" if params.seed is not None else "greedy"
        # Run to the longest limit and cut (each token drawn by its position: the first n are
        # the run to n), so one decode program serves every request.
        want = solo[kind].decode_batch([prompt], max_steps=20, top_n=2, seed=params.seed)
        n = params.max_tokens
        if kind == "sampled":
            assert got["ids"] == want.output_ids[0][:n], f"request {i}"
        else:
            assert_same_greedy([got["ids"]], [want.output_ids[0][:n]],
                               [want.output_top_logprobs[0][:n]], [got["lps"]],
                               [want.output_logprobs[0][:n]], where=f"request {i}: ")
        np.testing.assert_allclose(got["lps"], want.output_logprobs[0][:n], atol=1e-4,
                                   err_msg=f"request {i}")


def test_stop_strings_cancellation_and_stop_ids_free_their_pages():
    """A stop id ends a request on the device, a cancelled one leaves its slot and pages at
    once; the requests after them run in the freed room, and the books balance."""
    cfg = _config()
    engine = engine_for(cfg, seed=3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, 12).tolist() for _ in range(6)]
    # Greedy outputs decide which token to stop on: the third token of request 0.
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    free_run, _ = _serve(engine, cfg, [(p, greedy) for p in prompts], poison=False)
    stop_on = free_run[0]["ids"][2]
    assert stop_on not in free_run[0]["ids"][:2]
    params = [dataclasses.replace(greedy, stop_token_ids=(stop_on,))] + [greedy] * 5
    scheduler = PagedScheduler(cfg, engine, None)
    events: list[list] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def sink(i):
        def receive(event):
            events[i].append(event)
            if isinstance(event, Finished):
                done[i].set()
        return receive

    scheduler.start()
    try:
        jobs = [Request(p, s, sink(i)) for i, (p, s) in enumerate(zip(prompts, params,
                                                                       strict=True))]
        with scheduler._cv:
            scheduler.submit(*jobs)
            scheduler.cancel(jobs[1])
        for d in done:
            assert d.wait(600)
    finally:
        scheduler.stop()
    finished = [e[-1] for e in events]
    assert finished[0].reason == "stop" and finished[0].stop_reason == stop_on
    assert [t for e in events[0][:-1] for t in e.ids] == free_run[0]["ids"][:2]
    assert finished[1].reason == "cancelled"
    for i in range(2, 6):
        assert finished[i].reason == "length"
        assert [t for e in events[i][:-1] for t in e.ids] == free_run[i]["ids"]
    executor = scheduler.executor
    executor.pages.check()
    assert executor.pages.free_pages == executor.pages.usable_pages
    assert executor.free_slots and all(r is None for r in executor.occupant)


def test_a_request_the_page_pool_could_never_hold_is_a_400_naming_max_tokens():
    """The pool, not max_target_length, is the limit when it is the smaller: 5 pages of 16
    hold one sequence of 65 positions (4 usable pages and its uncached last token)."""
    from k3text.serving.protocol import Protocol, RequestError
    from k3text.serving.text import ChatTemplate

    cfg = load_config(CPU, ["serve_engine=paged", "pagedattn_tokens_per_page=16",
                            "pagedattn_num_pages=5"])
    protocol = Protocol(cfg, None, "k3-small", ChatTemplate(None))
    body = {"model": "k3-small", "prompt": [5] * 10}
    assert protocol.completion({**body, "max_tokens": 55}).choices()[0][2].max_tokens == 55
    with pytest.raises(RequestError, match=r"prompt \(10 tokens\) \+ max_tokens \(56\) exceeds "
                       r"the page pool's 65 tokens \(pagedattn_num_pages=5") as refused:
        protocol.completion({**body, "max_tokens": 56})
    assert refused.value.param == "max_tokens"


def test_prompt_scores_through_slices_and_preemptions_equal_the_full_forward():
    """Requests for `prompt_logprobs` among plain ones, prompts of 1 to 45 tokens (up to three
    16-token slices), through a pool that preempts: each prompt token's log-probability, rank
    and top 2 equal the full forward's log-softmax at the position before it (the model run
    over the whole prompt at once), and the generated tokens are unchanged by the scoring."""
    cfg = _config("pagedattn_num_pages=13", "ignore_eos=true")
    model = Decoder(cfg, Init(3))
    engine = engine_for(cfg, model=model)
    rng = np.random.default_rng(5)
    requests = []
    for i in range(7):
        prompt = rng.integers(3, cfg.vocab_size, [1, 45, 17, 30, 8, 40, 26][i]).tolist()
        requests.append((prompt, SamplingParams(max_tokens=int(rng.integers(1, 16)),
                                                temperature=0.0, logprobs=2,
                                                prompt_logprobs=2 if i % 2 == 0 else None)))
    results, scheduler = _serve(engine, cfg, requests)
    assert scheduler.executor.preemptions > 0
    plain, _ = _serve(engine, cfg, [(p, dataclasses.replace(s, prompt_logprobs=None))
                                    for p, s in requests], poison=False)
    for i, ((prompt, params), got) in enumerate(zip(requests, results, strict=True)):
        assert got["ids"] == plain[i]["ids"], f"request {i}"
        if params.prompt_logprobs is None:
            assert "prompt" not in got
            continue
        scores = got["prompt"]
        logp = jax.nn.log_softmax(jnp.asarray(full_forward(model, prompt)), axis=-1)
        logp = np.asarray(logp)[:-1]  # position p scores token p + 1
        after = np.asarray(prompt[1:], np.int64)
        assert scores.logprobs.shape == (len(prompt) - 1,)
        want = logp[np.arange(len(after)), after]
        np.testing.assert_allclose(scores.logprobs, want, atol=1e-4, err_msg=f"request {i}")
        np.testing.assert_array_equal(scores.ranks,
                                      1 + np.sum(logp > want[:, None] + 1e-5, axis=-1))
        np.testing.assert_allclose(scores.top_logprobs, -np.sort(-logp, axis=-1)[:, :2],
                                   atol=1e-4)


@pytest.mark.parametrize(("overrides", "message"), [
    (["pagedattn_tokens_per_page=0"], "pagedattn_tokens_per_page must be a positive multiple"),
    (["pagedattn_num_pages=1"], "pagedattn_num_pages must be 0"),
    (["enable_prefix_caching=true"],
     "serve_engine=paged does not serve with enable_prefix_caching yet"),
])
def test_an_inconsistent_page_pool_is_one_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(*overrides)


# --------------------------------------------------------------------------------------------
# The server process.
# --------------------------------------------------------------------------------------------


def test_64_concurrent_requests_through_a_pool_of_8_sequences_equal_their_solo_decode(
        tmp_path):
    """The shipped model's server on the paged pool: 20 slots but pages for 8 sequences at
    max_target_length (8 x 128 positions in 16-token pages), 64 concurrent greedy requests of
    mixed length: every one finishes, equal to its offline decode; the pool ran out mid-decode
    (preemptions in /metrics); a request that could never fit is a 400 naming max_tokens; the
    start-up log says what it compiles."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 500, int(rng.integers(2, 60))).tolist() for _ in range(64)]
    limits = [int(rng.integers(1, 128 - len(p))) for p in prompts]
    server = Server(CPU, *SHIPPED, "per_device_batch_size=20", "serve_prefill_batch=4",
                    "serve_engine=paged", "pagedattn_tokens_per_page=16",
                    "pagedattn_num_pages=65", "ignore_eos=true")
    try:
        assert any(re.search(r"warm-up (\d+)/\1: .* ready in", line) for line in server.lines)

        def one(i):
            r = httpx.post(f"{server.url}/v1/completions", timeout=600, json={
                "model": "k3-small", "prompt": prompts[i], "max_tokens": limits[i],
                "temperature": 0, "logprobs": 1, "return_token_ids": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["token_ids"], choice["logprobs"]["token_logprobs"]

        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            served = list(pool.map(one, range(64)))
        metrics = httpx.get(f"{server.url}/metrics").text
        preempted = float(re.search(r"^k3text_preemptions_total (\S+)", metrics, re.M)[1])
        assert preempted > 0, "64 requests should run 8 sequences' pages out"
        assert re.search(r"^k3text_pages_used 0\.0$", metrics, re.M)
    finally:
        server.stop()
    # The offline driver runs every prompt together to the longest limit (batched equals solo:
    # tested with the slot engine), each cut at its own limit (greedy: its first tokens are
    # the same); a longer cache, so the longest prompt and limit fit.
    records = offline_decode(tmp_path, CPU, prompts, max(limits), *SHIPPED, "ignore_eos=true",
                             "per_device_batch_size=64", "max_target_length=256")
    for i, ((ids, lps), record) in enumerate(zip(served, records, strict=True)):
        n = limits[i]
        tops = [[lp for _, lp in top] for top in record["output_top_logprobs"][:n]]
        assert_same_greedy([ids], [record["output_ids"][:n]], [tops], [lps],
                           [record["output_logprobs"][:n]], where=f"request {i}: ")


def test_a_cancel_with_nothing_else_running_leaves_the_gauges_at_zero():
    """The last running request cancelled mid-decode: its slot and pages are freed, and the
    gauges /metrics shows say so (nothing else runs to refresh them)."""
    cfg = _config("ignore_eos=true")
    scheduler = PagedScheduler(cfg, engine_for(cfg, seed=3), None)
    first, done = threading.Event(), threading.Event()

    def sink(event):
        (done if isinstance(event, Finished) else first).set()

    scheduler.start()
    try:
        job = Request([5, 6, 7], SamplingParams(max_tokens=40, temperature=0.0), sink)
        scheduler.submit(job)
        assert first.wait(600)
        scheduler.cancel(job)
        assert done.wait(600)
        metrics = scheduler.metrics
        deadline = time.monotonic() + 30
        while metrics.slots_used._value.get() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [metrics.running._value.get(), metrics.slots_used._value.get(),
                metrics.pages_used._value.get()] == [0, 0, 0]
    finally:
        scheduler.stop()
