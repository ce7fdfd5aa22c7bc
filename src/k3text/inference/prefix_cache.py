"""Prefix caching for a hybrid model: MLA latent blocks and KDA state checkpoints.

A KDA layer's state after N tokens summarises all N, so a cached prefix is more than its MLA
latent rows: it needs every KDA layer's recurrent and conv state at the prefix's end. Prompts
are cut into blocks of `prefix_cache_block` tokens (a whole number of prefill chunks); each
cached block is one entry of a preallocated device store holding
- the block's MLA latent rows, every MLA layer: [n_mla, block, latent];
- every KDA layer's recurrent and conv state at the block's end boundary (a checkpoint).

A host-side tree over token blocks (`BlockTree`; a child is keyed by its parent and its block's
exact tokens, so two prefixes never share an entry by a hash collision) finds a prompt's longest
cached run of blocks. On a hit the prefill row gets the latent rows of every matched block and
the KDA checkpoint of the last one, both from the same boundary, and only the rest of the prompt
is prefilled. A partial block never matches, and a hit always leaves at least one token to
prefill (its logits sample the first output token).

Entries are immutable once written: a request that extends a shared prefix copies it into its
own prefill row and writes its new blocks to new entries, so nothing shared is ever modified
(copy-on-write by construction). Reference counts keep the block a prefill is building on from
being evicted; eviction takes the least recently used unreferenced leaf, so a chain is never
cut in the middle. The store's size is fixed by `prefix_cache_bytes` per device: it never
holds more, and a workload larger than it just evicts.

Every block's checkpoint is a snapshot of the row's state after the chunk that ends the block,
taken by the same programs a cold prefill runs, so outputs with the cache on equal outputs with
it off exactly when the prefill groups are the same.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from k3text import sharding
from k3text.config import Config, ConfigError
from k3text.models.state import STATE_AXES, DecodeState, cache_length, state_shapes

log = logging.getLogger("k3text.prefix_cache")


class PrefixStore(NamedTuple):
    """The device side of the cache: `entries` cached blocks."""

    mla: jax.Array  # [n_mla, entries, block, latent] in mla_cache_dtype
    kda_recurrent: jax.Array  # [n_kda, entries, H, K, V] float32: the state at the block's end
    kda_conv: jax.Array  # [n_kda, entries, W-1, 3, H*K]


STORE_AXES = PrefixStore(
    mla=("layers", None, None, "kv_lora"),
    kda_recurrent=("layers", None, "heads", None, None),
    kda_conv=("layers", None, None, None, "heads"),
)


def block_size(cfg: Config) -> int:
    """Tokens per cached block: `prefix_cache_block`, 0 meaning one prefill chunk."""
    return cfg.prefix_cache_block or cfg.prefill_chunk_size


def store_shapes(cfg: Config, entries: int) -> PrefixStore:
    state = state_shapes(cfg, entries, cache_len=block_size(cfg))
    return PrefixStore(state.mla_cache, state.kda_recurrent, state.kda_conv)


def entry_bytes(cfg: Config, ctx: sharding.MeshContext) -> dict[str, int]:
    """Bytes of one cached block on the device holding the most of it, by part."""
    shapes = store_shapes(cfg, 1)
    out = {}
    for name, shape, axes in zip(PrefixStore._fields, shapes, STORE_AXES, strict=True):
        out[name] = sharding.shard_bytes(ctx.sharding(axes), shape.shape, shape.dtype)
    return out


def store_entries(cfg: Config, ctx: sharding.MeshContext) -> int:
    """How many blocks `prefix_cache_bytes` holds per device."""
    one = sum(entry_bytes(cfg, ctx).values())
    entries = cfg.prefix_cache_bytes // one
    if entries < 1:
        raise ConfigError(
            f"prefix_cache_bytes={cfg.prefix_cache_bytes:,} holds no cached block: one block of "
            f"{block_size(cfg)} tokens (its MLA rows and a KDA checkpoint) takes {one:,} bytes "
            f"per device")
    return int(entries)


def store_bytes_per_device(store: PrefixStore) -> int:
    """The bytes the store's arrays hold on the device holding the most of them."""
    per_device: dict[object, int] = {}
    for array in store:
        for shard in array.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


# ---- the programs (pure; the engine jits them) ------------------------------------------------


def restore_program(state: DecodeState, store: PrefixStore, entries: jax.Array,
                    lengths: jax.Array) -> DecodeState:
    """Row p gets its first `lengths[p]` positions from the store: the MLA rows of blocks
    `entries[p, :lengths[p] // block]` and the KDA state at the end of the last of them. Rows of
    length 0 keep what they hold. entries [P, max blocks] (-1 = unused), lengths [P]."""
    _, rows, positions, _ = state.mla_cache.shape
    block = store.mla.shape[2]
    safe = jnp.maximum(entries, 0)
    # Position by position (block, offset): the gathered rows take the cache's own layout, so
    # a cache split by sequence gathers only each device's positions.
    at = jnp.arange(positions)
    gathered = store.mla[:, safe[:, at // block], (at % block)[None, :]]
    gathered = sharding.constrain(gathered, STATE_AXES.mla_cache)
    kept = jnp.arange(positions)[None, :] < lengths[:, None]
    mla = jnp.where(kept[None, :, :, None], gathered.astype(state.mla_cache.dtype),
                    state.mla_cache)
    last = safe[jnp.arange(rows), jnp.maximum(lengths // block - 1, 0)]
    hit = lengths > 0

    def checkpoint(stored, current):
        mask = hit.reshape((1, rows) + (1,) * (current.ndim - 2))
        return jnp.where(mask, stored[:, last].astype(current.dtype), current)

    return DecodeState(kda_recurrent=checkpoint(store.kda_recurrent, state.kda_recurrent),
                       kda_conv=checkpoint(store.kda_conv, state.kda_conv),
                       mla_cache=mla, lengths=jnp.where(hit, lengths, state.lengths))


def save_program(store: PrefixStore, state: DecodeState, entries: jax.Array,
                 end: jax.Array) -> PrefixStore:
    """Row p's block ending at position `end` (its MLA rows and its KDA state, which must be the
    state at `end`) into store entry `entries[p]`; rows with -1 write nowhere."""
    block = store.mla.shape[2]
    at = jnp.where(entries < 0, store.mla.shape[1], entries)  # past the end: dropped
    rows = jax.lax.dynamic_slice_in_dim(state.mla_cache, end - block, block, axis=2)

    def put(whole, part):
        return whole.at[:, at].set(part.astype(whole.dtype), mode="drop")

    return PrefixStore(put(store.mla, rows), put(store.kda_recurrent, state.kda_recurrent),
                       put(store.kda_conv, state.kda_conv))


# ---- the host-side index ----------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Block:
    """A cached block: the tokens of one block after its parent's, in store entry `entry`."""

    tokens: tuple[int, ...]
    entry: int
    parent: Block | None
    depth: int  # blocks from the root, this one included
    children: dict[tuple[int, ...], Block] = dataclasses.field(default_factory=dict)
    refs: int = 0
    last_used: int = 0


class BlockTree:
    """A radix tree over whole token blocks, one store entry per node, with reference counts
    and LRU eviction of unreferenced leaves."""

    def __init__(self, block: int, entries: int):
        self.block = block
        self.entries = entries
        self.evictions = 0
        self.generation = -1
        self.clear()

    def clear(self) -> None:
        """Forget every block (their entries all free again); the eviction count stays. A
        chain begun before is dead from now on (`generation`): its blocks are gone, and one
        cached under them would take an entry nothing could ever match."""
        self.generation += 1
        self.root = Block((), -1, None, 0)
        self._free = list(range(self.entries))
        self._blocks: set[Block] = set()
        self._clock = itertools.count(1)

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    def match(self, prompt: Sequence[int]) -> list[Block]:
        """The longest chain of cached blocks prompt starts with, leaving at least its last
        token uncached."""
        chain, node = [], self.root
        for i in range((len(prompt) - 1) // self.block):
            node = node.children.get(tuple(prompt[i * self.block:(i + 1) * self.block]))
            if node is None:
                break
            node.last_used = next(self._clock)
            chain.append(node)
        return chain

    def child(self, parent: Block, tokens: tuple[int, ...]) -> tuple[Block | None, bool]:
        """`parent`'s child for `tokens`: (the block, whether it is new and needs writing). A
        new block takes a free entry, evicting the least recently used unreferenced leaf if
        none is free; (None, False) when every entry is referenced or has children."""
        node = parent.children.get(tokens)
        if node is not None:
            node.last_used = next(self._clock)
            return node, False
        if not self._free and not self._evict_one(keep=parent):
            return None, False
        node = Block(tokens, self._free.pop(), parent, parent.depth + 1,
                     last_used=next(self._clock))
        parent.children[tokens] = node
        self._blocks.add(node)
        return node, True

    def _evict_one(self, keep: Block) -> bool:
        leaves = [b for b in self._blocks if not b.children and b.refs == 0 and b is not keep]
        if not leaves:
            return False
        victim = min(leaves, key=lambda b: b.last_used)
        del victim.parent.children[victim.tokens]
        self._blocks.remove(victim)
        self._free.append(victim.entry)
        self.evictions += 1
        return True

    def free_entries(self) -> list[int]:
        return list(self._free)


class CacheEngine(Protocol):
    """What the cache needs of the engine (`inference.engine.Engine`, or the multi-process
    leader in front of it); a prefix is the engine's `Prefix`."""

    ctx: sharding.MeshContext

    def new_store(self, entries: int) -> PrefixStore: ...

    def new_prefix(self, batch: int) -> Any: ...

    def restore_prefix(self, prefix: Any, store: PrefixStore, entries: np.ndarray,
                       lengths: np.ndarray) -> Any: ...

    def save_blocks(self, store: PrefixStore, prefix: Any, entries: np.ndarray,
                    end: int) -> PrefixStore: ...


@dataclasses.dataclass
class Chain:
    """One prefill row's place in the tree: the deepest block of its prompt cached so far (held
    by a reference), and whether caching it went on (it stops when no entry can be had)."""

    prompt: Sequence[int]
    tail: Block
    generation: int  # the tree's `generation` when the chain began
    open: bool = True


class PrefixCache:
    """The cache a prefill loop consults: `begin` restores a group's longest common cached
    prefix into its rows, `after_chunk` caches the blocks the last chunk completed, `end` lets
    a row's blocks go. Device work goes through the engine (`restore_prefix`, `save_blocks`),
    so a multi-process leader engine broadcasts it like every other call."""

    def __init__(self, cfg: Config, engine: CacheEngine):
        self.cfg = cfg
        self.engine = engine
        self.block = block_size(cfg)
        self.entries = store_entries(cfg, engine.ctx)
        self.max_blocks = -(-cache_length(cfg) // self.block)
        self.store = engine.new_store(self.entries)
        self.tree = BlockTree(self.block, self.entries)
        self.one_entry_bytes = sum(entry_bytes(cfg, engine.ctx).values())
        self.hit_tokens = 0  # prompt tokens restored instead of prefilled
        self.prompt_tokens = 0  # prompt tokens of the rows that looked
        log.info("prefix cache: %d blocks of %d tokens, %s bytes per block per device",
                 self.entries, self.block, f"{self.one_entry_bytes:,}")

    @property
    def cached_bytes(self) -> int:
        """Bytes per device the cached blocks take (the store itself is allocated whole)."""
        return self.tree.cached_blocks * self.one_entry_bytes

    def summary(self) -> str:
        share = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return (f"prefix cache: {self.hit_tokens} of {self.prompt_tokens} prompt tokens reused "
                f"({share:.1%}) | {self.tree.cached_blocks} of {self.entries} blocks cached "
                f"({self.cached_bytes / 2**20:,.1f} MiB per device) | "
                f"{self.tree.evictions} evictions")

    def warm_up(self, rows: int) -> None:
        """Compile the restore and save programs for prefixes of `rows` rows by running them on
        nothing (no row restored, no entry written)."""
        prefix = self.engine.new_prefix(rows)
        prefix = self.engine.restore_prefix(prefix, self.store,
                                            np.full((rows, self.max_blocks), -1, np.int32),
                                            np.zeros(rows, np.int32))
        self.store = self.engine.save_blocks(self.store, prefix, np.full(rows, -1, np.int32),
                                             self.block)

    def begin(self, prefix: Any, prompts: Sequence[Sequence[int] | None],
              ) -> tuple[Any, int, list[Chain | None]]:
        """Restore into `prefix` (rows of `prompts`; None = padding) the longest prefix every
        row has cached, as whole blocks. Returns the prefix, the position prefill resumes at
        (shared by the group's rows, since a prefill chunk has one start), and each row's
        chain."""
        matches = [self.tree.match(p) if p is not None else None for p in prompts]
        live = [m for m in matches if m is not None]
        common = min((len(m) for m in live), default=0)
        chains: list[Chain | None] = []
        for p, m in zip(prompts, matches, strict=True):
            if p is None:
                chains.append(None)
                continue
            tail = m[common - 1] if common else self.tree.root
            tail.refs += 1
            chains.append(Chain(p, tail, self.tree.generation))
            self.prompt_tokens += len(p)
        start = common * self.block
        if common:
            entries = np.full((len(prompts), self.max_blocks), -1, np.int32)
            lengths = np.zeros(len(prompts), np.int32)
            for row, m in enumerate(matches):
                if m is not None:
                    entries[row, :common] = [b.entry for b in m[:common]]
                    lengths[row] = start
            prefix = self.engine.restore_prefix(prefix, self.store, entries, lengths)
            self.hit_tokens += start * len(live)
        return prefix, start, chains

    def after_chunk(self, prefix: Any, chains: Sequence[Chain | None], end: int) -> None:
        """Cache the blocks ending at `end` (the position after the chunk just run) of the rows
        whose prompts reach it."""
        if end % self.block:
            return
        entries = np.full(len(chains), -1, np.int32)
        for row, chain in enumerate(chains):
            if chain is None or not chain.open or len(chain.prompt) < end:
                continue
            if chain.generation != self.tree.generation:  # begun before a reset
                chain.open = False
                continue
            if chain.tail.depth != end // self.block - 1:  # a block before this one is missing
                chain.open = False
                continue
            node, new = self.tree.child(chain.tail, tuple(chain.prompt[end - self.block:end]))
            if node is None:
                chain.open = False
                continue
            if new:
                entries[row] = node.entry
            chain.tail.refs -= 1
            node.refs += 1
            chain.tail = node
        if (entries >= 0).any():
            self.store = self.engine.save_blocks(self.store, prefix, entries, end)

    def end(self, chain: Chain | None) -> None:
        """The row is inserted, cancelled or failed: its blocks may be evicted again."""
        if chain is not None and chain.generation == self.tree.generation \
                and chain.tail.refs > 0:
            chain.tail.refs -= 1

    def reset(self) -> None:
        """Forget everything (after a failed call consumed the store) and start empty."""
        self.tree.clear()
        self.store = None
        self.store = self.engine.new_store(self.entries)
