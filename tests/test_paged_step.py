"""The model's step over the paged state (`Decoder.paged_step`): prefill slices, decode tokens
and multi-token windows of several sequences in one pass, each sequence in its own KDA state
slot and scattered pages, against the full-sequence forward of each sequence alone, with
garbage in every free page and free state slot before every step; and the planner's calls on
the engine's paged pool (`serving.executor`) against the slot engine, preemption included."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3text.inference.pages import PageAllocator
from k3text.inference.sampling import SamplingRow, config_sampling, host_sampling
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder
from k3text.models.state import DecodeState, StepRows, paged_state_shapes
from k3text.serving import executor as executor_lib

from helpers import assert_same_greedy, engine_for, tiny_config

SLOTS, PAGE, NUM_PAGES, TABLE, CHUNK, LONG_ROWS = 4, 8, 48, 16, 32, 2


@pytest.fixture(scope="module", params=[("k3-tiny", "false"), ("kimi-linear-tiny", "false"),
                                        ("k3-tiny", "true")], ids=lambda p: "-".join(p))
def model(request):
    """Unrolled layers (the state as per-layer lists) and scanned groups (stacked state)."""
    name, scan = request.param
    cfg = tiny_config(name, "max_target_length=128", f"scan_layers={scan}")
    return Decoder(cfg, Init(11))


@dataclasses.dataclass
class Seq:
    tokens: list[int]
    slot: int
    done: int = 0  # tokens through the model so far


class Driver:
    """Runs step plans [(sequence, tokens this step, 'short' | 'long')] through `paged_step`,
    keeping pages with a `PageAllocator` whose free list is shuffled, and poisoning every
    free page and free slot before each step."""

    def __init__(self, model: Decoder, seqs: list[Seq], width: int, seed: int = 0):
        self.model, self.seqs, self.width = model, seqs, width
        self.rng = np.random.default_rng(seed)
        self.pages = PageAllocator(NUM_PAGES, PAGE)
        self.pages._free = list(self.rng.permutation(NUM_PAGES - 1) + 1)
        shapes = paged_state_shapes(model.cfg, SLOTS, NUM_PAGES, PAGE)
        self.state = jax.tree.map(lambda s: jnp.asarray(self._garbage(s.shape, s.dtype)), shapes)
        self.step = nnx.jit(lambda m, short, long, state: m.paged_step(short, long, state))

    def _garbage(self, shape, dtype):
        if np.issubdtype(dtype, np.integer):
            return self.rng.integers(0, 100, shape).astype(dtype)
        return (self.rng.normal(size=shape) * 50).astype(dtype)

    def _poison(self, live_slots: set[int]) -> None:
        used = {p for i in range(len(self.seqs)) for p in self.pages.pages(i)}
        free_pages = np.asarray(sorted(set(range(NUM_PAGES)) - used), np.int32)
        free_slots = np.asarray(sorted(set(range(SLOTS)) - live_slots), np.int32)
        s = self.state
        pages = s.mla_cache.at[:, free_pages].set(
            self._garbage((s.mla_cache.shape[0], len(free_pages), *s.mla_cache.shape[2:]),
                          np.float32))
        kda = [a.at[:, free_slots].set(self._garbage((a.shape[0], len(free_slots),
                                                      *a.shape[2:]), np.float32))
               for a in (s.kda_recurrent, s.kda_conv)]
        self.state = DecodeState(*kda, pages, s.lengths)

    def rows(self, plan, kind: str, n: int, width: int) -> tuple[StepRows, list]:
        tokens = np.zeros((n, width), np.int32)
        slot = np.full(n, -1, np.int32)
        start, count = np.zeros(n, np.int32), np.zeros(n, np.int32)
        who = [None] * n
        entries = [(i, k) for i, k, what in plan if what == kind]
        for row, (i, k) in enumerate(entries):
            seq = self.seqs[i]
            row = seq.slot if kind == "short" else row  # short rows: one per slot, in order
            tokens[row, :k] = seq.tokens[seq.done:seq.done + k]
            slot[row], start[row], count[row], who[row] = seq.slot, seq.done, k, i
            self.pages.reserve(i, seq.done + k)
        table = self.pages.table(who, TABLE)
        rows = StepRows(*map(jnp.asarray, (tokens, slot, start, count, table)))
        # Short rows as the engine gives them: every slot in order, the slots left implicit.
        return (rows._replace(slot=None) if kind == "short" else rows), who

    def run(self, plan) -> dict[int, np.ndarray]:
        """One step; each sequence's logits at its last token of the step."""
        short, short_who = self.rows(plan, "short", SLOTS, self.width)
        has_long = any(what == "long" for *_, what in plan)
        long, long_who = (self.rows(plan, "long", LONG_ROWS, CHUNK) if has_long
                          else (None, []))
        self._poison({self.seqs[i].slot for i, *_ in plan}
                     | {s.slot for s in self.seqs if 0 < s.done < len(s.tokens)})
        short_logits, long_logits, self.state = self.step(self.model, short, long, self.state)
        out = {}
        for logits, who in ((short_logits, short_who), (long_logits, long_who)):
            for row, i in enumerate(who):
                if i is not None:
                    out[i] = np.asarray(logits[row])
        for i, k, _ in plan:
            self.seqs[i].done += k
        return out


def full_forward(model: Decoder, tokens: list[int]) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, t: m.forward(t))(model, jnp.asarray([tokens])))[0]


def test_slices_decode_tokens_and_windows_in_one_step_equal_each_sequence_alone(model):
    rng = np.random.default_rng(0)
    cfg = model.cfg
    lengths = (47, 70, 5, 12)  # every token each sequence takes through the plans
    seqs = [Seq(rng.integers(3, cfg.vocab_size, n).tolist(), slot) for n, slot
            in zip(lengths, (2, 0, 3, 1), strict=True)]
    want = [full_forward(model, s.tokens) for s in seqs]
    driver = Driver(model, seqs, width=1)
    plans = [
        [(0, 32, "long"), (2, 4, "long")],  # two prompts' first slices
        [(0, 13, "long"), (1, 32, "long"), (2, 1, "short")],  # a decode token rides along
        [(1, 32, "long"), (2, 0, "short"), (3, 10, "long")],
        [(0, 1, "short"), (1, 6, "long"), (3, 1, "short")],
        [(0, 1, "short"), (3, 1, "short")],  # decode only: no long rows at all
    ]
    checked = 0
    for plan in plans:
        got = driver.run(plan)
        for i, k, _ in plan:
            if k:
                at = seqs[i].done - 1
                np.testing.assert_allclose(got[i], want[i][at], atol=2e-4, rtol=0,
                                           err_msg=f"sequence {i} at {at}")
                checked += 1
    assert checked == 12
    driver.pages.check()


@pytest.mark.parametrize("width", [3])
def test_a_window_of_tokens_equals_them_one_at_a_time(model, width):
    """A short row of W tokens (a draft window to verify) gives each sequence's logits at its
    last token as the full forward does; a row of fewer than W real tokens pads the rest."""
    rng = np.random.default_rng(1)
    cfg = model.cfg
    tokens = [rng.integers(3, cfg.vocab_size, 20).tolist() for _ in range(2)]
    want = [full_forward(model, t) for t in tokens]
    seqs = [Seq(tokens[0], 1), Seq(tokens[1], 3)]
    driver = Driver(model, seqs, width=width, seed=2)
    driver.run([(0, 9, "long"), (1, 14, "long")])
    # Sequence 1 sits the first window out (a count-0 row of a live sequence: its state kept).
    for plan in ([(0, 3, "short")], [(0, 2, "short"), (1, 3, "short")],
                 [(0, 1, "short"), (1, 3, "short")]):
        got = driver.run(plan)
        for i, _, _ in plan:
            np.testing.assert_allclose(got[i], want[i][seqs[i].done - 1], atol=2e-4, rtol=0)


def _cfg(name: str, *overrides: str):
    return tiny_config(name, "max_prefill_predict_length=192", "max_target_length=256",
                       "prefill_chunk_size=64", "max_decode_steps=6", "ignore_eos=true",
                       *overrides)


@pytest.mark.parametrize("name", ["k3-tiny", "kimi-linear-tiny"])
def test_the_planned_paged_engine_decodes_as_the_slot_engine_does(name):
    """The planner's calls on the paged pool (`serving.executor.generate`: prompts prefilled in
    slices straight into their slots and pages, started slots decoding beside the others'
    slices, then decode calls) against `decode_batch` (prefill, insert, generate over fixed
    slot rows), with a page pool of little more than half the positions the fixed rows
    reserve: same tokens and log-probabilities, no preemption needed."""
    cfg = _cfg(name)
    engine = engine_for(cfg, seed=7)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 70, 1, 129)]
    num_pages, page = 40, 16
    assert num_pages * page < 0.7 * len(prompts) * 256
    want = engine.decode_batch(prompts, top_n=2)
    got, executor = executor_lib.generate(engine, prompts, num_pages, page, top_n=2)
    assert executor.preemptions == 0
    assert_same_greedy(got.output_ids, want.output_ids, want.output_top_logprobs,
                       got.output_logprobs, want.output_logprobs)
    np.testing.assert_allclose(np.asarray(got.output_top_logprobs),
                               np.asarray(want.output_top_logprobs), atol=1e-4, rtol=0)
    executor.pages.check()
    assert executor.pages.free_pages == num_pages - 1


@pytest.mark.parametrize("strategy", ["weighted", "penalties"])
def test_a_pool_that_runs_out_mid_decode_preempts_and_every_output_is_unchanged(strategy):
    """Six prompts through a pool of 12 pages of 8 tokens (each sequence needs up to 5; six
    at once need 30): sequences are preempted mid-decode and recomputed from their prompt and
    the tokens they had, and every output equals the one from a pool that never runs out:
    sampled ones (each token drawn by its number, whatever the preemptions), and greedy ones
    under frequency, presence and repetition penalties (the recomputed tokens counted again)."""
    sampled = "weighted" if strategy == "weighted" else "greedy"
    cfg = _cfg("k3-tiny", "max_decode_steps=12", f"decode_sampling_strategy={sampled}",
               "decode_sampling_temperature=0.8")
    engine = engine_for(cfg, seed=3)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (20, 3, 27, 9, 14, 25)]
    params = None
    if strategy == "penalties":
        params = [host_sampling([SamplingRow(0.0, 0, 1.0, i, frequency_penalty=1.5,
                                             presence_penalty=0.5, repetition_penalty=1.3,
                                             prompt=tuple(p))], cfg.vocab_size)
                  for i, p in enumerate(prompts)]
    want, roomy = executor_lib.generate(engine, prompts, 64, 8, top_n=2, params=params)
    got, tight = executor_lib.generate(engine, prompts, 13, 8, params=params)
    assert roomy.preemptions == 0 and tight.preemptions > 0
    assert [len(o) for o in got.output_ids] == [12] * 6
    if strategy == "weighted":
        assert got.output_ids == want.output_ids
    else:
        assert_same_greedy(got.output_ids, want.output_ids, want.output_top_logprobs,
                           got.output_logprobs, want.output_logprobs)
    if strategy == "penalties":  # they change the outputs: the counts carried through matter
        plain, _ = executor_lib.generate(engine, prompts, 64, 8)
        assert plain.output_ids != want.output_ids
    tight.pages.check()
    assert tight.pages.free_pages == 12


def test_a_request_that_can_never_fit_the_pool_is_refused_up_front():
    cfg = _cfg("k3-tiny")
    engine = engine_for(cfg, seed=3)
    executor = executor_lib.PagedExecutor(engine, slots=2, num_pages=5, page_size=8, steps=2,
                                          prefill_rows=1)
    with pytest.raises(executor_lib.NeverFits,
                       match="needs 5 pages of 8 tokens, more than the pool.s 4"):
        executor.submit(list(range(3, 33)), 10, engine.stop_ids(),
                        config_sampling(cfg, 1))
    assert not executor.requests and not executor.waiting


@pytest.mark.parametrize("mode", ["local", "all_to_all"])
def test_pages_split_over_8_devices_decode_as_one_device(mode):
    """Tensor 2 x expert 4, each page's offsets split 8 ways (`cache_seq`), both MoE modes."""
    cfg = tiny_config("k3-tiny", "max_prefill_predict_length=112", "max_target_length=128",
                      "prefill_chunk_size=16", "kda_chunk_size=16", "max_decode_steps=8",
                      "ignore_eos=true")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (100, 37, 5)]
    want = engine_for(cfg, seed=4).decode_batch(prompts, batch=4, top_n=2)
    split = engine_for(cfg.replace(ici_tensor_parallelism=2, ici_expert_parallelism=4,
                                   moe_ep_mode=mode), seed=4)
    assert split.ctx.size("cache_seq") == 8
    pool = split.new_paged_pool(4, 24, 16)
    assert {s.data.shape[2] for s in pool.state.mla_cache.addressable_shards} == {2}
    got, _ = executor_lib.generate(split, prompts, 24, 16, slots=4)
    assert_same_greedy(got.output_ids, want.output_ids, want.output_top_logprobs,
                       got.output_logprobs, want.output_logprobs)
