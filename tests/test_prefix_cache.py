"""Prefix caching (MLA latent blocks + KDA state checkpoints): the block tree's matching,
reference counts and eviction; and through the scheduler, randomized workloads with shared
prefixes of every kind, evictions mid-run and poisoned free slots and freed blocks, whose outputs
with the cache on equal those with it off, on one device and on 8 devices in both MoE modes;
the store never holds more than its budget; the offline driver reuses blocks across prompts."""

from __future__ import annotations

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3text import decode
from k3text.inference.prefix_cache import (
    BlockTree,
    PrefixCache,
    entry_bytes,
    store_bytes_per_device,
)
from k3text.serving.scheduler import Finished, Request, SamplingParams, Scheduler

from helpers import assert_same_greedy, engine_for, tiny_config
from serving import run_scheduler

BLOCK = 16


# ---- the tree (host only) ---------------------------------------------------------------------


def _grow(tree: BlockTree, prompt: list[int]) -> list:
    """Cache every whole block of `prompt` (as a prefill would), returning the chain."""
    chain, node = [], tree.root
    for i in range(len(prompt) // tree.block):
        node, _ = tree.child(node, tuple(prompt[i * tree.block:(i + 1) * tree.block]))
        assert node is not None
        chain.append(node)
    return chain


def test_a_match_is_whole_blocks_and_leaves_the_last_token_to_prefill():
    tree = BlockTree(4, entries=8)
    _grow(tree, list(range(12)))  # three blocks
    assert len(tree.match(list(range(13)))) == 3
    assert len(tree.match(list(range(12)))) == 2  # the whole prompt: its last token is run
    assert len(tree.match(list(range(11)))) == 2  # ends mid-block: the last full boundary
    assert len(tree.match(list(range(3)))) == 0  # shorter than a block
    assert len(tree.match([0, 1, 2, 3, 9, 5, 6, 7, 8])) == 1  # diverges in block 2
    node, new = tree.child(tree.root, (0, 1, 2, 3))
    assert not new and node is tree.match(list(range(5)))[0]  # an existing block is shared


def test_eviction_takes_the_oldest_unreferenced_leaf_and_never_cuts_a_chain():
    tree = BlockTree(2, entries=4)
    a = _grow(tree, [1, 1, 2, 2, 3, 3])  # a chain of three
    b = _grow(tree, [7, 7])
    a[2].refs += 1  # a prefill builds on it
    # Full: the only unreferenced leaf is b (a[0] and a[1] have children).
    node, new = tree.child(b[0], (8, 8))
    assert node is None and not new  # b is the parent: kept; nothing else may go
    node, new = tree.child(tree.root, (9, 9))
    assert new and tree.evictions == 1 and not tree.match([7, 7, 0])
    assert len(tree.match([1, 1, 2, 2, 3, 3, 0])) == 3
    a[2].refs -= 1
    tree.match([9, 9, 0])  # used more recently than a's leaf
    node, new = tree.child(tree.root, (5, 5))
    assert new and len(tree.match([1, 1, 2, 2, 3, 3, 0])) == 2  # a's leaf went first
    assert len(tree.match([9, 9, 0])) == 1
    tree.clear()  # after a failed call consumed the store: nothing cached, every entry free
    assert tree.cached_blocks == 0 and sorted(tree.free_entries()) == [0, 1, 2, 3]
    assert not tree.match([1, 1, 2, 2, 0]) and tree.evictions == 2


def test_a_chain_begun_before_a_reset_caches_nothing_after_it():
    """A prefill group whose chains began before the cache was reset (a failed call consumed
    the store) goes on running: its later blocks must not take entries under blocks the reset
    forgot, where nothing could ever match them, nor give back references it no longer holds."""
    saved = []

    class Engine:  # the device side: record which entries are written
        def new_store(self, entries):
            return "store"

        def save_blocks(self, store, prefix, entries, end):
            saved.append(entries.tolist())
            return store

    cache = PrefixCache.__new__(PrefixCache)  # the host logic alone, without a mesh
    cache.engine, cache.block, cache.entries, cache.max_blocks = Engine(), 4, 8, 4
    cache.tree, cache.store = BlockTree(4, 8), "store"
    cache.hit_tokens = cache.prompt_tokens = 0
    prompt = list(range(12))
    _, start, chains = cache.begin(None, [prompt])
    cache.after_chunk(None, chains, 4)
    assert start == 0 and len(saved) == 1 and cache.tree.cached_blocks == 1
    cache.reset()
    cache.after_chunk(None, chains, 8)
    cache.end(chains[0])
    assert len(saved) == 1 and cache.tree.cached_blocks == 0
    assert sorted(cache.tree.free_entries()) == list(range(8))
    _, _, fresh = cache.begin(None, [prompt])  # a new chain after the reset caches again
    cache.after_chunk(None, fresh, 4)
    assert cache.tree.cached_blocks == 1 and fresh[0].tail.refs == 1


# ---- through the scheduler ---------------------------------------------------------------------


def _config(*overrides: str):
    return tiny_config("k3-tiny", "max_prefill_predict_length=80", "max_target_length=96",
                       "prefill_chunk_size=16", "kda_chunk_size=16", "per_device_batch_size=3",
                       "serve_steps_per_call=2", "serve_prefill_token_budget=32",
                       "ignore_eos=true", *overrides)


def workload(vocab: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts sharing prefixes of every kind: shorter than a block, ending mid-block, exactly
    on a boundary, the whole prompt again, several levels deep; and unrelated ones."""
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(3, vocab, n).tolist()  # noqa: E731
    system, other = ids(64), ids(40)
    turn = system[:32] + ids(20)
    prompts = [system[:10] + ids(6), system[:24] + ids(9), system[:32] + ids(3), system[:48],
               system[:48], turn, turn + ids(17), turn + ids(1), system + ids(16), ids(37),
               other, other[:32] + ids(5), system[:16], ids(5), other + ids(30), system[:33]]
    order = rng.permutation(len(prompts)).tolist()
    out = []
    for i in order + order[:4]:  # some come back after evictions
        seeded = rng.random() < 0.25
        params = SamplingParams(max_tokens=int(rng.integers(2, 5)),
                                temperature=0.8 if seeded else 0.0,
                                seed=int(rng.integers(1 << 30)) if seeded else None,
                                logprobs=2, ignore_eos=True)
        out.append((prompts[i], params))
    return out


class _Poisoning:
    """The engine, filling every free slot of the pool and every free store entry with large
    garbage just before a call could read or reuse them."""

    def __init__(self, engine):
        self._engine = engine
        self.scheduler: Scheduler | None = None
        self.poisoned = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _fill(self, tree, rows, axis):
        if not rows:
            return tree
        self.poisoned += len(rows)
        index = jnp.asarray(rows)

        def garbage(a):
            if a.ndim <= axis:
                return a
            where = (slice(None),) * axis + (index,)
            value = 3e4 if a.dtype.kind == "f" else 97
            return a.at[where].set(jnp.asarray(value, a.dtype))

        return jax.tree.map(garbage, tree)

    def insert(self, pool, prefix, slots, *args, **kwargs):
        taken = set(self.scheduler.decoding())
        free = [s for s in range(pool.slots.tokens.shape[0]) if s not in taken]
        state = pool.state
        # Stacked fields hold the slots on axis 1; a per-layer pool's arrays on axis 0.
        poisoned = {name: self._fill(field, free, axis=0 if isinstance(field, list) else 1)
                    for name, field in state._asdict().items() if name != "lengths"}
        lengths = state.lengths.at[jnp.asarray(free)].set(97) if free else state.lengths
        pool = pool._replace(state=state._replace(**poisoned, lengths=lengths))
        return self._engine.insert(pool, prefix, slots, *args, **kwargs)

    def _free_entries(self, cache, writing=()):
        return sorted(set(cache.tree.free_entries()) | {int(e) for e in writing if e >= 0})

    def save_blocks(self, store, prefix, entries, end):
        store = self._fill(store, self._free_entries(self.scheduler.prefix_cache, entries), 1)
        return self._engine.save_blocks(store, prefix, entries, end)

    def restore_prefix(self, prefix, store, entries, lengths):
        store = self._fill(store, self._free_entries(self.scheduler.prefix_cache), 1)
        return self._engine.restore_prefix(prefix, store, entries, lengths)


def serve(engine, cfg, requests, poison: bool = False, prefill_engine=None):
    """Every request through an in-process scheduler, all submitted at once; per request its
    (token ids, log-probabilities, top log-probabilities) and the scheduler."""
    if poison:
        engine = _Poisoning(engine)
    scheduler = Scheduler(cfg, engine, None, prefill_engine=prefill_engine)
    if poison:
        engine.scheduler = scheduler
    results = run_scheduler(scheduler, requests)
    assert all(r["reason"] == "length" for r in results), [r["reason"] for r in results]
    return results, scheduler


def greedy_tops(results):
    """`serve` results' top log-probabilities for `assert_same_greedy`, only for greedy
    requests: a near tie says nothing of a sampled token, whose parting always fails."""
    return [r["top"] if r["greedy"] else [] for r in results]


def check_equal(cold, warm):
    # Tokens identical (but from a near tie on); log-probabilities within the serving tolerance
    # (1e-4): a token's step may run in a different program in the two runs (a plain decode
    # call, or one with a chunk riding along), which XLA fuses differently, ~1e-5 apart.
    for i, (a, b) in enumerate(zip(cold, warm, strict=True)):
        [same] = assert_same_greedy([b["ids"]], [a["ids"]], greedy_tops([a]), [b["lps"]],
                                    [a["lps"]], where=f"request {i}: ")
        np.testing.assert_allclose(b["top"][:same], a["top"][:same], atol=1e-4, rtol=0,
                                   err_msg=f"request {i}")


def _sharded(cfg, mode):
    return cfg.replace(ici_tensor_parallelism=2, ici_expert_parallelism=4, moe_ep_mode=mode)


@pytest.mark.parametrize("mesh", ["one device", "8 devices, local", "8 devices, all_to_all"])
def test_outputs_with_the_cache_equal_outputs_without_it(mesh):
    """Cold (cache off) and warm (on, a budget of 6 blocks: evictions mid-run) runs of one
    randomized workload; the warm run poisons free slots and freed blocks before each use."""
    cfg = _config()
    if mesh != "one device":
        cfg = _sharded(cfg, mesh.split(", ")[1])
    if mesh.endswith("local"):  # groups of two prompts resume at their common cached prefix
        cfg = cfg.replace(serve_prefill_batch=2)
    engine = engine_for(cfg, seed=5)
    requests = workload(cfg.vocab_size, seed=len(mesh))
    cold, _ = serve(engine, cfg, requests)
    one_block = sum(entry_bytes(cfg, engine.ctx).values())
    budget = 6 * one_block + one_block // 2
    warm_cfg = cfg.replace(enable_prefix_caching=True, prefix_cache_bytes=budget)
    warm, scheduler = serve(engine, warm_cfg, requests, poison=True)
    check_equal(cold, warm)
    cache = scheduler.prefix_cache
    held = store_bytes_per_device(cache.store)
    assert cache.entries == 6 and held <= budget, (held, budget)
    assert cache.tree.evictions > 0, "the workload should outgrow the budget"
    assert cache.hit_tokens >= 8 * BLOCK, cache.summary()
    assert scheduler.engine.poisoned > 0
    metrics = scheduler.metrics
    assert metrics.prefix_hit_tokens._value.get() == cache.hit_tokens
    assert metrics.prefix_evictions._value.get() == cache.tree.evictions
    assert metrics.prefix_hit_rate._value.get() == cache.hit_tokens / cache.prompt_tokens


def test_a_prompt_whose_last_chunk_rides_a_decode_call_caches_its_last_block():
    """A prompt of exactly two blocks, prefilled while another request decodes (a budget of one
    chunk: each chunk rides a decode call), leaves both blocks cached, as a prompt prefilled
    apart does: the chunk that ends it caches its block before the row leaves for its slot."""
    cfg = _config("enable_prefix_caching=true", "prefix_cache_bytes=10000000",
                  "serve_prefill_token_budget=16")
    engine = engine_for(cfg, seed=5)
    rng = np.random.default_rng(3)
    scheduler = Scheduler(cfg, engine, None)
    decoding, done = threading.Event(), [threading.Event(), threading.Event()]

    def sink(i):
        def receive(event):
            if isinstance(event, Finished):
                done[i].set()
            elif i == 0:
                decoding.set()
        return receive

    scheduler.start()
    try:
        scheduler.submit(Request(rng.integers(3, cfg.vocab_size, 5).tolist(),
                                 SamplingParams(max_tokens=40, ignore_eos=True), sink(0)))
        assert decoding.wait(120)
        scheduler.submit(Request(rng.integers(3, cfg.vocab_size, 2 * BLOCK).tolist(),
                                 SamplingParams(max_tokens=2, ignore_eos=True), sink(1)))
        assert done[1].wait(120) and done[0].wait(120)
    finally:
        scheduler.stop()
    assert scheduler.prefix_cache.tree.cached_blocks == 2


def test_a_restored_prefix_is_the_cold_prefix_exactly():
    """The state after restoring a cached prefix and prefilling the rest equals the cold
    prefill's state array for array, for hits of one and three blocks, and for a second
    prompt extending a shared prefix (the shared blocks are not rewritten)."""
    cfg = _config("enable_prefix_caching=true", "prefix_cache_bytes=10000000")
    engine = engine_for(cfg, seed=7)
    cache = PrefixCache(cfg, engine)
    rng = np.random.default_rng(1)
    shared = rng.integers(3, cfg.vocab_size, 50).tolist()
    for prompt in (shared, shared[:20] + [4, 5], shared + [9, 9], shared[:48] + [3] * 16):
        cold = engine.prefill([prompt], 1)
        warm = engine.prefill([prompt], 1, cache)
        for a, b in zip(jax.tree.leaves(cold), jax.tree.leaves(warm), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert cache.hit_tokens == 0 + 16 + 48 + 48, cache.summary()
    assert cache.tree.cached_blocks == 3 + 0 + 0 + 1  # shared[:48] once, then its 4th block


def test_the_offline_driver_reuses_shared_prefixes(tmp_path, capsys):
    cfg = _config("max_decode_steps=4", "per_device_batch_size=4", "progress=false",
                  "return_log_prob=true", "return_top_logprobs=2")
    rng = np.random.default_rng(2)
    system = rng.integers(3, cfg.vocab_size, 40).tolist()
    prompts = [system + rng.integers(3, cfg.vocab_size, n).tolist() for n in (3, 8, 1, 20, 5)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    cold = decode.run(cfg.replace(prompts_file=str(path)))
    warm = decode.run(cfg.replace(prompts_file=str(path), enable_prefix_caching=True))
    printed = capsys.readouterr().out
    # Two batches of four and one: every prompt after the first reuses the 32-token prefix.
    assert "prefix cache: 128 of" in printed, printed
    # The cold run prefills a batch together, the cached one prompt by prompt: the matmul
    # shapes differ, so the sums do, in the last bits.
    assert_same_greedy([b["output_ids"] for b in warm], [a["output_ids"] for a in cold],
                       [[[lp for _, lp in top] for top in a["output_top_logprobs"]]
                        for a in cold],
                       [b["output_logprobs"] for b in warm], [a["output_logprobs"] for a in cold])


def test_the_memory_tool_prints_the_cost_of_a_block(capsys):
    """For K3 on v7x-16: one KDA checkpoint (69 layers of 96 x 128 x 128 fp32 recurrent state
    plus the conv state) before sharding, and how many blocks the budget holds."""
    from k3text.config import CONFIG_DIR, load_config
    from k3text.tools import memory

    path = str(CONFIG_DIR / "inference" / "v7x16.yml")
    assert memory.main([path, "prefix_cache_bytes=4294967296"]) == 0
    printed = capsys.readouterr().out
    cfg = load_config(path)
    lin = cfg.linear_attn_config
    kda = cfg.structure.num_kda
    recurrent = kda * lin.num_heads * lin.head_dim ** 2 * 4
    conv = kda * (lin.short_conv_kernel_size - 1) * 3 * lin.num_heads * lin.head_dim * 2
    assert recurrent == 69 * 96 * 128 * 128 * 4
    assert f"{recurrent + conv:,} B" in printed, printed
    ctx = memory.mesh_context(cfg)
    one = sum(entry_bytes(cfg, ctx).values())
    row = next(line for line in printed.splitlines()
               if line.startswith(f"{cfg.prefill_chunk_size:,} *"))
    assert row.split()[-2] == f"{4 * 2**30 // one:,}", row
