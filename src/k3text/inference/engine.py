"""The inference engine: one model on one mesh, serving a fixed pool of decode slots.

The shape of MaxText's engine API; every method is pure (state in, state out), the caller owns
the pool:
- `prefill(prompts)` -> `Prefix`: the prompts right-padded into one batch and run through one
  compiled chunk program `prefill_chunk_size` tokens at a time (`prefill_chunk` runs one chunk,
  so a scheduler can interleave a long prompt's chunks with decode calls); the last chunk runs
  at the narrowest of `prefill_buckets` that holds what is left (`chunk_width`), so a short
  prompt does not pay for a whole chunk of padding. A prefix holds the
  logits at each prompt's last token and each sequence's whole decode state (KDA recurrent and
  conv states, MLA latent rows, length). Padding is a no-op on every state, so a ragged batch
  gives each sequence exactly what it would get alone. With `prefill_context_parallelism` = N a
  prompt longer than one chunk is prefilled N chunks per call instead (`prefill_slices`: chunk
  r in row r, the rows over the batch mesh axes; `Decoder.prefill` carries the sequence across
  them).
- `insert(pool, prefix, slots, limits, stop_ids, params, top_n)`: writes prefix rows into pool
  slots, every array of the slot overwritten (a slot never shows its former occupant's state), and
  samples each sequence's first token with its own parameters. Rows given slot -1 are padding:
  their writes are dropped, never landing in a real slot.
- `generate(pool, n_steps)`: up to `n_steps` decode steps for every slot in one device call (a
  `lax.while_loop` that ends early once no slot is active): per-slot sampling, stop ids and
  token limits; returns each slot's tokens and log-probabilities (chosen and top-N).
- `release(pool, slots)`: marks slots free.

Beside them, the paged pool that replaces them (docs/serving.md, "The paged pool"): KDA state
slots and a pool of MLA pages (`new_paged_pool`), `paged_step` (every decoding slot's next
token and prefill slices written straight into their slots and pages, first tokens sampled in
the same call, then the decode loop) and `paged_generate`; `serving.executor` runs the
planner's plans on them.

Every program has fixed shapes (the slot count, whole prefill chunks or `prefill_buckets`, one
prefill batch size per caller), so requests coming and going never recompile; a log line names
each shape as it compiles, and `warm_up` compiles them all.
`decode_batch(prompts)` is the offline driver's call: prefill, insert into a pool of `batch`
slots, generate to the end.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from k3text import sharding
from k3text.config import Config, ConfigError
from k3text.inference import prefix_cache, sampling, weights
from k3text.inference.prefix_cache import STORE_AXES, PrefixCache, PrefixStore
from k3text.inference.sampling import SlotSampling
from k3text.layers.initializers import Init
from k3text.models.decoder import (
    Decoder,
    is_per_layer,
    per_layer_form,
    per_layer_state,
    split_for_unrolled,
    stacked_state,
)
from k3text.models.state import (
    PAGED_STATE_AXES,
    STATE_AXES,
    DecodeState,
    StepRows,
    cache_length,
    paged_state_shapes,
    state_shapes,
)

log = logging.getLogger("k3text.engine")

MAX_STOP_IDS = 8  # stop token ids per slot (eos included); a fixed width keeps one program


class Prefix(NamedTuple):
    """Prefilled sequences: logits [P, vocab] at each one's last token, and their state [P]."""

    logits: jax.Array
    state: DecodeState


class Slots(NamedTuple):
    """Per-slot bookkeeping of the pool, all with leading axis [S]."""

    tokens: jax.Array  # int32: the last token, the next step's input
    active: jax.Array  # bool: still generating
    produced: jax.Array  # int32: tokens generated so far (the next token's number)
    limit: jax.Array  # int32: tokens this sequence may generate in all
    stop_ids: jax.Array  # [S, MAX_STOP_IDS] int32, -1 = unused
    counts: jax.Array  # [S, vocab] int32: each token's count in the output so far (penalties)
    sampling: SlotSampling
    # [S, F] int32: prompt tokens still to go through the decode steps, in order (-1 = none;
    # `insert_prompts`); while any is left the step's logits are a prompt position's, not sampled
    feed: jax.Array


class Pool(NamedTuple):
    state: DecodeState
    slots: Slots


class Tokens(NamedTuple):
    """Host arrays of tokens produced for each slot by one call.

    `insert`: [P] (first tokens of the inserted rows); `generate`: [S, n] with `count` [S]
    valid entries per slot, in order."""

    ids: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray  # [..., top_n]
    top_logprobs: np.ndarray
    count: np.ndarray  # tokens per row (insert: 1)
    active: np.ndarray  # [S] or [P]: still generating after this call
    steps: int = 1  # decode steps the call ran


SLOT_AXES = Slots(tokens=("batch",), active=("batch",), produced=("batch",), limit=("batch",),
                  stop_ids=("batch", None), counts=("batch", None),
                  sampling=sampling.SAMPLING_AXES, feed=("batch", None))


class Later[T]:
    """A dispatched device call's results, brought to the host on the first `get()`, so the
    host can prepare (and dispatch) the next call while this one runs."""

    def __init__(self, device_results: Any, to_host: Callable[[Any], T]):
        self._device, self._convert = device_results, to_host
        self._host: T | None = None

    @classmethod
    def done(cls, host_results: T) -> Later[T]:
        """Results already on the host."""
        later = cls(None, lambda _: host_results)
        later._host = host_results
        return later

    def get(self) -> T:
        if self._device is not None:
            self._host = self._convert(_to_host(self._device))
            self._device = None
        return self._host


@dataclasses.dataclass
class Generation:
    """Per-prompt results of one `decode_batch` call (host numpy)."""

    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    output_logprobs: list[list[float]]
    finish_reasons: list[str]
    prefill_seconds: float  # time to first token (prefill and the first tokens sampled)
    decode_seconds: float  # the decode loop (all remaining steps)
    decode_steps: int  # tokens of the longest sequence: the first plus the loop's steps
    # With `decode_batch(top_n=N)`: each token's N most likely tokens and their
    # log-probabilities, most likely first.
    output_top_ids: list[list[list[int]]] | None = None
    output_top_logprobs: list[list[list[float]]] | None = None

    @property
    def generated_tokens(self) -> int:
        return sum(len(o) for o in self.output_ids)


class Engine:
    def __init__(self, cfg: Config, model: Decoder, ctx: sharding.MeshContext):
        self.cfg = cfg
        self.ctx = ctx
        self.graphdef, self.params = nnx.split(model)
        if not model.cfg.scan_layers:  # the model's config decides how its layers run
            self.params = split_for_unrolled(self.params, split_experts=ctx.size("exp") == 1)
        # The programs take the large parameters as flat buffers and hold the small ones as
        # constants (`weights.py`): far cheaper to dispatch than the State's hundreds of
        # Variables.
        self._weights, self.layout = weights.flatten(self.graphdef, self.params)
        self._jit_programs()

    def _jit_programs(self) -> None:
        """The engine's own jitted programs: a trace reads the mesh context it runs under (the
        activation constraints), so an engine on another mesh must not reuse these traces (nor
        the shardings `_global` keeps)."""
        cfg = self.cfg
        self._shardings: dict[tuple, jax.sharding.NamedSharding] = {}
        bound = functools.partial
        self._prefill_chunk = jax.jit(bound(prefill_chunk_program, self.layout),
                                      donate_argnames=("prefix",))
        self._prefill_slices = jax.jit(bound(prefill_chunk_program, self.layout, slices=True),
                                       donate_argnames=("prefix",))
        self._prefill_scored = jax.jit(bound(scored_prefill_chunk_program, self.layout),
                                       static_argnames=("top_n",), donate_argnames=("prefix",))
        self._insert = jax.jit(packed_insert_program, static_argnames=("layout", "top_n"),
                               donate_argnames=("pool",))
        self._insert_prompts = jax.jit(packed_insert_prompts_program,
                                       static_argnames=("layout",), donate_argnames=("pool",))
        self._generate = jax.jit(bound(generate_program, cfg, self.layout),
                                 static_argnames=("max_steps", "top_n"),
                                 donate_argnames=("pool",))
        self._release = jax.jit(release_program, donate_argnames=("pool",))
        self._decode_and_prefill = jax.jit(bound(packed_decode_and_prefill_program, cfg,
                                                 self.layout),
                                           static_argnames=("layout", "top_n", "n_steps"),
                                           donate_argnames=("pool", "prefix"))
        self._paged_step = jax.jit(bound(packed_paged_step_program, cfg, self.layout),
                                   static_argnames=("layout", "top_n", "n_steps", "scored"),
                                   donate_argnames=("pool",))
        self._paged_generate = jax.jit(bound(paged_generate_program, cfg, self.layout),
                                       static_argnames=("max_steps", "top_n"),
                                       donate_argnames=("pool",))
        self._restore = jax.jit(prefix_cache.restore_program, donate_argnames=("state",))
        self._save = jax.jit(prefix_cache.save_program, donate_argnames=("store",))
        self._step = jax.jit(bound(_step_program, cfg, self.layout),
                             donate_argnames=("state",))
        self._zeros: dict[tuple[str, int], Callable[[], Any]] = {}
        self._shapes_seen: set[tuple[str, str]] = set()

    # ---- placement ------------------------------------------------------------------------

    def _global(self, host: np.ndarray, logical: tuple) -> jax.Array:
        """A global array from a host array every process holds in full."""
        host = np.asarray(host)
        target = self._shardings.get(logical)
        if target is None:
            target = self._shardings[logical] = self.ctx.sharding(logical)
        return jax.make_array_from_callback(host.shape, target, lambda index: host[index])

    def _global_rows(self, arrays: Sequence[np.ndarray]) -> tuple[jax.Array, RowLayout]:
        """Host arrays with a leading batch-row axis, as one global array (`pack_rows`)."""
        packed, layout = pack_rows(arrays)
        return self._global(packed, ("batch", None)), layout

    def _zero(self, kind: str, batch: int, shapes: Any, axes: Any) -> Any:
        make = self._zeros.get((kind, batch))
        if make is None:  # one compiled program per batch size, not one per call
            shardings = sharding.tree_shardings(axes, shapes, self.ctx)
            make = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                           out_shardings=shardings)
            self._zeros[(kind, batch)] = make
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            try:
                return make()
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                shardings = sharding.tree_shardings(axes, shapes, self.ctx)
                need = sum(sharding.shard_bytes(sh, s.shape, s.dtype) for s, sh in
                           zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True))
                unit = "slots" if kind in ("pool", "slots") else "rows"
                what, lower = (
                    (f"the prefix cache's store of {batch:,} blocks", "prefix_cache_bytes")
                    if kind == "store" else
                    (f"the decode state for {batch} {unit} of {cache_length(self.cfg):,} "
                     f"positions", "max_target_length or per_device_batch_size"))
                raise ConfigError(
                    f"{what} needs {need / 2**30:,.2f} GiB per device, more than the device "
                    f"could allocate; lower {lower} (python -m k3text.tools.memory CONFIG shows "
                    f"the trade-off)") from None

    def new_state(self, batch: int) -> DecodeState:
        """Zero decode state for `batch` slots, created directly in its sharding."""
        return self._zero("state", batch, state_shapes(self.cfg, batch), STATE_AXES)

    def new_prefix(self, batch: int) -> Prefix:
        """An empty prefix of `batch` rows, to run `prefill_chunk` on."""
        logits = jax.ShapeDtypeStruct((batch, self.cfg.vocab_size), jnp.float32)
        return Prefix(self._zero("logits", batch, logits, ("batch", "vocab")),
                      self.new_state(batch))

    def new_pool(self, slots: int) -> Pool:
        """An empty pool of `slots` decode slots (all free)."""
        shapes, axes = pool_shapes(self.cfg, slots), pool_axes(self.cfg)
        return Pool(self._zero("pool", slots, shapes.state, axes.state),
                    self._zero("slots", slots, shapes.slots, SLOT_AXES))

    def new_store(self, entries: int) -> PrefixStore:
        """An empty prefix-cache store of `entries` blocks (`inference/prefix_cache.py`)."""
        return self._zero("store", entries, prefix_cache.store_shapes(self.cfg, entries),
                          STORE_AXES)

    def _note_shape(self, program: str, shape: str) -> None:
        """Log the first call of a program at a shape: the call that compiles it."""
        if (program, shape) not in self._shapes_seen:
            self._shapes_seen.add((program, shape))
            log.info("compiling %s for %s (once per shape)", program, shape)

    def on_mesh(self, ctx: sharding.MeshContext) -> Engine:
        """This engine's model and programs on another mesh of the same shape (a server's
        prefill mesh, `serve_prefill_apart`), its parameters copied there."""
        if ctx.mesh.shape != self.ctx.mesh.shape:
            raise ConfigError(f"a mesh of shape {dict(ctx.mesh.shape)} cannot hold this "
                              f"engine's parameters, placed for {dict(self.ctx.mesh.shape)}")
        other = copy.copy(self)
        other.ctx = ctx
        other.params = _onto(ctx, self.params)  # each buffer copied once, shared as here
        other._weights, _ = weights.flatten(self.graphdef, other.params)
        other._jit_programs()
        return other

    def adopt(self, tree: Any) -> Any:
        """Arrays another engine placed on a mesh of the same shape (`on_mesh`) copied onto
        this engine's mesh, each in the same partition."""
        return _onto(self.ctx, tree)

    # ---- public API -----------------------------------------------------------------------

    def chunk_width(self, remaining: int) -> int:
        """Tokens of the prefill call that runs a prompt's next `remaining` tokens: the
        smallest of `prefill_buckets` that holds them, else a whole chunk."""
        return next((b for b in self.buckets if b >= remaining), self.cfg.prefill_chunk_size)

    @property
    def buckets(self) -> tuple[int, ...]:
        """The `prefill_buckets` narrower than a chunk (the others never run)."""
        return tuple(b for b in self.cfg.prefill_buckets if b < self.cfg.prefill_chunk_size)

    def prefill_chunk(self, prefix: Prefix, tokens: np.ndarray, valid: np.ndarray,
                      start: int) -> Prefix:
        """Run one chunk (tokens and valid [P, width], host arrays, at absolute positions from
        `start`; width `prefill_chunk_size` or one of `prefill_buckets`) into `prefix`, which
        is consumed."""
        self._note_shape("prefill chunk", "{} x {} tokens".format(*tokens.shape))
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            return self._prefill_chunk(self._weights, self._global(tokens, ("batch", None)),
                                       self._global(valid, ("batch", None)), prefix,
                                       np.int32(start))

    def prefill_scored(self, prefix: Prefix, tokens: np.ndarray, valid: np.ndarray,
                       start: int, targets: np.ndarray, top_n: int,
                       ) -> tuple[Prefix, sampling.PromptScores]:
        """`prefill_chunk` (at the whole chunk width) with every position's distribution
        scored against the token that follows it, `targets` [P, width] (the prompt's next
        tokens; any id where there is none): the next token's log-probability and rank, and the
        `top_n` likeliest, as host arrays [P, width] (vLLM's `prompt_logprobs`). Every position
        goes through the LM head, so only the requests that ask for this pay for it."""
        prefix, scores = self.dispatch_prefill_scored(prefix, tokens, valid, start, targets,
                                                      top_n)
        return prefix, scores.get()

    def dispatch_prefill_scored(self, prefix: Prefix, tokens: np.ndarray, valid: np.ndarray,
                                start: int, targets: np.ndarray, top_n: int,
                                ) -> tuple[Prefix, Later[sampling.PromptScores]]:
        """`prefill_scored`, returning as soon as the call is dispatched: its scores come to
        the host on `get()`. One process only (several fetch in lockstep, `_to_host`)."""
        self._note_shape("scored prefill chunk", "{} x {} tokens, top {}".format(
            *tokens.shape, top_n))
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            prefix, scores = self._prefill_scored(
                self._weights, self._global(tokens, ("batch", None)),
                self._global(valid, ("batch", None)), prefix, np.int32(start),
                self._global(targets.astype(np.int32), ("batch", None)), top_n=top_n)
        return prefix, Later(scores, lambda out: sampling.PromptScores(*out))  # fetched by get()

    def prefill_slices(self, prefix: Prefix, tokens: np.ndarray, valid: np.ndarray,
                       start: int) -> Prefix:
        """Context-parallel prefill of one sequence: its next `prefill_context_parallelism`
        chunks in one call, chunk r in row r (tokens and valid [N, prefill_chunk_size], host
        arrays, row r at absolute positions from start + r x chunk), into `prefix` (N rows,
        each holding the sequence), which is consumed."""
        self._note_shape("context-parallel prefill", "{} x {} tokens".format(*tokens.shape))
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            return self._prefill_slices(self._weights, self._global(tokens, ("batch", None)),
                                        self._global(valid, ("batch", None)), prefix,
                                        np.int32(start))

    def context_parallel(self, prompts: Sequence[Sequence[int]],
                         cache: PrefixCache | None = None) -> bool:
        """Whether `prefill` runs these prompts context-parallel: one prompt longer than one
        chunk, no prefix cache, and `prefill_context_parallelism` > 1."""
        cfg = self.cfg
        return (cfg.prefill_context_parallelism > 1 and cache is None and len(prompts) == 1
                and len(prompts[0]) > cfg.prefill_chunk_size)

    def prefill(self, prompts: Sequence[Sequence[int]], batch: int | None = None,
                cache: PrefixCache | None = None) -> Prefix:
        """Prefill `prompts` into a prefix of `batch` rows (default: one per prompt; extra rows
        stay empty): the logits at each prompt's last token and each sequence's state. With a
        prefix `cache`, the group's longest common cached prefix is restored instead of
        prefilled, and every block the prompts complete is cached.

        When `context_parallel(prompts, cache)`, the prompt is prefilled
        `prefill_context_parallelism` chunks per call instead, into a prefix of that many rows
        (`batch` is ignored), each holding the sequence: insert row 0."""
        cfg = self.cfg
        if self.context_parallel(prompts, cache):
            return self._prefill_context_parallel(prompts[0])
        batch = batch or len(prompts)
        if not prompts or min(map(len, prompts)) == 0 or batch < len(prompts):
            raise ConfigError(f"prefill needs 1 to {batch} prompts of at least one token each, "
                              f"got {len(prompts)} of {sorted(map(len, prompts))} tokens")
        chunk = cfg.prefill_chunk_size
        longest = max(len(p) for p in prompts)
        padded = -(-longest // chunk) * chunk
        if padded > cache_length(cfg):
            raise ConfigError(f"prompt of {longest} tokens needs {padded} cache positions, "
                              f"more than {cache_length(cfg)}")
        tokens = np.full((batch, padded), cfg.pad_token_id, np.int32)
        valid = np.zeros((batch, padded), bool)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
            valid[i, : len(p)] = True
        prefix, resume, chains = self.new_prefix(batch), 0, []
        if cache is not None:
            rows = [*prompts, *[None] * (batch - len(prompts))]
            prefix, resume, chains = cache.begin(prefix, rows)
        try:
            for start in range(resume, padded, chunk):
                part = slice(start, start + self.chunk_width(longest - start))
                prefix = self.prefill_chunk(prefix, tokens[:, part], valid[:, part], start)
                if cache is not None:
                    cache.after_chunk(prefix, chains, part.stop)
        finally:
            for chain in chains:
                cache.end(chain)
        return prefix

    def _prefill_context_parallel(self, prompt: Sequence[int]) -> Prefix:
        cfg = self.cfg
        rows, chunk = cfg.prefill_context_parallelism, cfg.prefill_chunk_size
        window = rows * chunk
        padded = -(-len(prompt) // window) * window
        if -(-len(prompt) // chunk) * chunk > cache_length(cfg):
            raise ConfigError(f"prompt of {len(prompt)} tokens is longer than the "
                              f"{cache_length(cfg)} cache positions")
        tokens = np.full(padded, cfg.pad_token_id, np.int32)
        tokens[: len(prompt)] = prompt
        valid = np.arange(padded) < len(prompt)
        prefix = self.new_prefix(rows)
        for start in range(0, padded, window):
            part = slice(start, start + window)
            prefix = self.prefill_slices(prefix, tokens[part].reshape(rows, chunk),
                                         valid[part].reshape(rows, chunk), start)
        return prefix

    def stop_ids(self, extra: Sequence[int] = (), ignore_eos: bool = False) -> np.ndarray:
        """A slot's stop-id row: eos (unless `ignore_eos` here or in the config) and `extra`,
        -1 padded."""
        ignore = ignore_eos or self.cfg.ignore_eos
        ids = ([] if ignore else [self.cfg.eos_token_id]) + list(extra)
        ids = list(dict.fromkeys(ids))
        if len(ids) > MAX_STOP_IDS:
            raise ConfigError(f"at most {MAX_STOP_IDS} stop token ids per request "
                              f"(eos included), got {len(ids)}")
        return np.asarray(ids + [-1] * (MAX_STOP_IDS - len(ids)), np.int32)

    def insert(self, pool: Pool, prefix: Prefix, slots: Sequence[int], limits: Sequence[int],
               stop_ids: np.ndarray, params: SlotSampling, top_n: int = 0,
               ) -> tuple[Pool, Tokens]:
        """Insert prefix row i into slot `slots[i]` (-1: a padding row, written nowhere), to
        generate at most `limits[i]` tokens; samples each row's first token. `pool` is
        consumed. Returns the new pool and the first tokens [P]."""
        rows = prefix.logits.shape[0]
        self._note_shape("insert", f"{rows} rows into {pool.slots.tokens.shape[0]} slots")
        packed, layout = self._global_rows(_row_arguments(slots, limits, stop_ids, params))
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            pool, out = self._insert(pool, prefix, packed, layout=layout, top_n=top_n)
            first, lp, top_ids, top_lps, active = _to_host(out)
        return pool, Tokens(first, lp, top_ids, top_lps, np.ones(rows, np.int32), active)

    def insert_prompts(self, pool: Pool, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                       limits: Sequence[int], stop_ids: np.ndarray, params: SlotSampling,
                       ) -> Pool:
        """Start prompt i in slot `slots[i]` (-1: a padding row, written nowhere) without a
        prefill: every array of the slot is reset (a fresh sequence) and the prompt goes through
        the decode steps one token a step, at most `feed_width` tokens; the step that reads its
        last token samples its first output token. Where a prefill chunk stalls every slot for
        its call, this costs only the slot's own steps. `pool` is consumed."""
        width = feed_width(self.cfg)
        tokens = np.full((len(prompts), width), -1, np.int32)
        for i, prompt in enumerate(prompts):
            if len(prompt) > width:
                raise ValueError(f"a prompt of {len(prompt)} tokens does not go through the "
                                 f"decode steps (serve_decode_prompt_tokens={width})")
            tokens[i, :len(prompt)] = prompt
        self._note_shape("insert prompts", f"{len(prompts)} rows into "
                                           f"{pool.slots.tokens.shape[0]} slots")
        packed, layout = self._global_rows([tokens, *_row_arguments(slots, limits, stop_ids,
                                                                      params)])
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            return self._insert_prompts(pool, packed, layout=layout)

    def generate(self, pool: Pool, n_steps: int, top_n: int = 0) -> tuple[Pool, Tokens]:
        """Up to `n_steps` decode steps for every slot in one device call (fewer when every
        slot stops first). `pool` is consumed."""
        pool, tokens = self.dispatch_generate(pool, n_steps, top_n)
        return pool, tokens.get()

    def dispatch_generate(self, pool: Pool, n_steps: int, top_n: int = 0,
                          ) -> tuple[Pool, Later[Tokens]]:
        """`generate`, returning as soon as the call is dispatched: its tokens come to the
        host on `get()`. One process only (several fetch in lockstep, `_to_host`)."""
        self._note_shape("generate", f"{pool.slots.tokens.shape[0]} slots x {n_steps} steps")
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            pool, out = self._generate(self._weights, pool, max_steps=n_steps, top_n=top_n)
        return pool, Later(out, _tokens)

    def decode_and_prefill(self, pool: Pool, prefix: Prefix, tokens: np.ndarray,
                           valid: np.ndarray, start: int, slots: Sequence[int],
                           limits: Sequence[int], stop_ids: np.ndarray, params: SlotSampling,
                           top_n: int = 0, n_steps: int = 1,
                           ) -> tuple[Pool, Prefix, Tokens, Tokens, Tokens | None]:
        """One decode step for every slot with a prefill chunk riding along in the same call
        (`prefill_chunk`'s arguments), then `insert` of the prefix rows given a slot (-1: none;
        their prompts have not ended, or they are padding), then `n_steps` - 1 more decode
        steps for every slot, as `generate` runs them. `pool` and `prefix` are consumed.
        Returns the pool, the prefix, the first step's tokens as `generate` gives them (the
        slots inserted were free during it), the inserted rows' first tokens, and the tokens of
        the steps after it (None for `n_steps` 1)."""
        pool, prefix, tokens = self.dispatch_decode_and_prefill(
            pool, prefix, tokens, valid, start, slots, limits, stop_ids, params, top_n, n_steps)
        return pool, prefix, *tokens.get()

    def dispatch_decode_and_prefill(
            self, pool: Pool, prefix: Prefix, tokens: np.ndarray, valid: np.ndarray, start: int,
            slots: Sequence[int], limits: Sequence[int], stop_ids: np.ndarray,
            params: SlotSampling, top_n: int = 0, n_steps: int = 1,
    ) -> tuple[Pool, Prefix, Later[tuple[Tokens, Tokens, Tokens | None]]]:
        """`decode_and_prefill`, returning as soon as the call is dispatched: its three token
        results come to the host on `get()`. One process only, as `dispatch_generate`."""
        self._note_shape("decode + prefill", "{} slots x {} steps + {} x {} tokens".format(
            pool.slots.tokens.shape[0], n_steps, *tokens.shape))
        packed, layout = self._global_rows([np.asarray(tokens, np.int32),
                                            np.asarray(valid, bool),
                                            *_row_arguments(slots, limits, stop_ids, params)])
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            pool, prefix, out, first, rest = self._decode_and_prefill(
                self._weights, pool, prefix, packed, np.int32(start), layout=layout,
                top_n=top_n, n_steps=n_steps)
        rows = prefix.logits.shape[0]

        def tokens_of(host_out: tuple) -> tuple[Tokens, Tokens, Tokens | None]:
            step, first, rest = host_out
            return (_tokens(step), Tokens(*first[:4], np.ones(rows, np.int32), first[4]),
                    None if rest is None else _tokens(rest))

        return pool, prefix, Later((out, first, rest), tokens_of)

    # ---- the paged pool (beside the programs above, which it replaces) ---------------------

    def new_paged_pool(self, slots: int, num_pages: int, page_size: int) -> Pool:
        """An empty paged pool: `slots` KDA state slots and sampling rows, and `num_pages` MLA
        pages of `page_size` positions (`models.state.paged_state_shapes`)."""
        shapes, axes = (paged_pool_shapes(self.cfg, slots, num_pages, page_size),
                        paged_pool_axes(self.cfg))
        return Pool(self._zero(f"paged {num_pages} x {page_size}", slots, shapes.state,
                               axes.state),
                    self._zero("slots", slots, shapes.slots, SLOT_AXES))

    def paged_step(self, pool: Pool, table: np.ndarray, long: Sequence[np.ndarray],
                   ends: np.ndarray, limits: Sequence[int], stop_ids: np.ndarray,
                   params: SlotSampling, top_n: int = 0, n_steps: int = 1,
                   prompt_len: np.ndarray | None = None, resumed: np.ndarray | None = None,
                   targets: np.ndarray | None = None,
                   ) -> tuple[Pool, Tokens, Tokens, Tokens | None, sampling.PromptScores | None]:
        """`paged_step_program`: every active slot's next token (its pages `table` [S, max
        pages], host array) with the prefill rows `long` (the host arrays of a `StepRows`,
        [P, C] tokens) in one call, rows that `ends` their prompt starting their slots with
        `limits`, `stop_ids` and `params`; then `n_steps` - 1 decode steps. `pool` is consumed.
        Rows recomputing a preempted sequence give its `prompt_len` and the tokens it had
        generated, `resumed` (`paged_step_program`; by default every row a fresh prompt).
        With `targets` [P, C] (a prompt whose positions are scored, `prompt_logprobs`) every
        long-row position is scored against the token after it, in a program of its own.
        Returns the pool, the first step's tokens, the long rows' first tokens, the tokens of
        the steps after it (None for `n_steps` 1) and the scores (host arrays [P, C], or
        None)."""
        rows = long[0].shape
        prompt_len = np.full(rows[0], 2**30) if prompt_len is None else prompt_len
        resumed = np.zeros(rows[0]) if resumed is None else resumed
        scored = targets is not None
        self._note_shape("paged step", "{} slots x {} steps + {} x {} tokens{}".format(
            pool.slots.tokens.shape[0], n_steps, *rows, ", scored" if scored else ""))
        packed, layout = self._global_rows([*(np.asarray(a, np.int32) for a in long),
                                            np.asarray(ends, bool),
                                            np.asarray(prompt_len, np.int32),
                                            np.asarray(resumed, np.int32),
                                            *_row_arguments(long[1], limits, stop_ids,
                                                            params)[1:],
                                            *([np.asarray(targets, np.int32)] if scored
                                              else [])])
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            pool, out, first, rest, scores = self._paged_step(
                self._weights, pool, self._global(np.asarray(table, np.int32), ("batch", None)),
                packed, layout=layout, top_n=top_n, n_steps=n_steps, scored=scored)
            out, first, rest, scores = _to_host((out, first, rest, scores))
        return (pool, _tokens(out), Tokens(*first[:4], np.ones(rows[0], np.int32), first[4]),
                None if rest is None else _tokens(rest),
                None if scores is None else sampling.PromptScores(*scores))

    def paged_generate(self, pool: Pool, table: np.ndarray, n_steps: int, top_n: int = 0,
                       ) -> tuple[Pool, Tokens]:
        """`generate` over the paged pool, the slots' pages `table` [S, max pages] (reserved
        for every step beforehand). `pool` is consumed."""
        self._note_shape("paged generate", f"{pool.slots.tokens.shape[0]} slots x {n_steps} "
                                           f"steps")
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            pool, out = self._paged_generate(
                self._weights, pool, self._global(np.asarray(table, np.int32), ("batch", None)),
                max_steps=n_steps, top_n=top_n)
        return pool, _tokens(_to_host(out))

    def release(self, pool: Pool, slots: Sequence[int]) -> Pool:
        """Mark `slots` free (their state is left; the next `insert` overwrites all of it);
        -1 entries are ignored."""
        free = np.zeros(pool.slots.tokens.shape[0], bool)
        free[[s for s in slots if s >= 0]] = True  # -1: a padding row, as `insert` takes it
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            return self._release(pool, self._global(free, ("batch",)))

    def restore_prefix(self, prefix: Prefix, store: PrefixStore, entries: np.ndarray,
                       lengths: np.ndarray) -> Prefix:
        """Cached blocks into prefix rows (`prefix_cache.restore_program`); `prefix` is
        consumed."""
        self._note_shape("prefix restore", "{} rows x {} blocks".format(*entries.shape))
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            state = self._restore(prefix.state, store, self._global(entries, ("batch", None)),
                                  self._global(lengths, ("batch",)))
        return prefix._replace(state=state)

    def save_blocks(self, store: PrefixStore, prefix: Prefix, entries: np.ndarray,
                    end: int) -> PrefixStore:
        """Each prefix row's block ending at `end` into its store entry (-1: none); `store` is
        consumed."""
        self._note_shape("prefix save", f"{entries.shape[0]} rows")
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            return self._save(store, prefix.state, self._global(entries, ("batch",)),
                              np.int32(end))

    def step(self, tokens: jax.Array, state: DecodeState, key: jax.Array,
             ) -> tuple[jax.Array, jax.Array, jax.Array, DecodeState]:
        """One decode step for tokens [B]: (sampled next tokens [B], their log-probabilities
        [B], the logits [B, vocab], new state). `key` seeds this step's draws (with the
        `decode_sampling_*` keys): pass a new one each step, as `jax.random.split` gives."""
        # A key made on one device is committed there; the program runs on the whole mesh.
        key = jax.device_put(key, self.ctx.sharding(()))
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            return self._step(self._weights, tokens, state, key)

    def prefill_widths(self, prompts: Sequence[Sequence[int]]) -> set[int]:
        """The chunk widths `prefill(prompts)` runs (without a prefix cache, and not
        context-parallel): whole chunks, then the narrowest bucket that holds what is left."""
        longest, chunk = max(len(p) for p in prompts), self.cfg.prefill_chunk_size
        padded = -(-longest // chunk) * chunk
        return {self.chunk_width(longest - start) for start in range(0, padded, chunk)}

    def warm_up(self, batch: int, max_steps: int | None = None, prefill_batch: int | None = None,
                top_n: int = 0, serving: bool = False,
                widths: Sequence[int] | None = None, prefill_engine: Engine | None = None,
                ) -> float:
        """Compile (or load from the compilation cache) the programs `decode_batch` (or, with
        `serving`, a server's scheduler) runs for `batch` slots, by running them on nothing:
        one chunk of padding at each of `widths` (default: every bucket and the whole chunk;
        `prefill_widths` says which a set of prompts runs), inserted as padding rows, and a
        decode call with no active slot, which stops before its first step; for a server also
        the decode call with each chunk width riding along (`serve_steps_per_call` steps), the
        scored chunk of `prefill_scored` and, with `serve_decode_prompt_tokens`,
        `insert_prompts`.
        Running them, not only compiling, also pays each program's one-time cost of its first
        execution, which would otherwise land in the first real call. With a `prefill_engine`
        (`serve_prefill_apart`) the prefill programs compile there and no chunk rides a decode
        call. Returns the seconds it took, so callers can report compile time apart from
        throughput."""
        cfg = self.cfg
        max_steps = cfg.max_decode_steps - 1 if max_steps is None else max_steps
        prefill_batch = prefill_batch or batch
        widths = sorted(set(widths or (*self.buckets, cfg.prefill_chunk_size)))
        t0 = time.perf_counter()
        prefiller = prefill_engine or self
        prefix = prefiller.new_prefix(prefill_batch)
        for width in widths:
            chunk = np.full((prefill_batch, width), cfg.pad_token_id, np.int32)
            prefix = prefiller.prefill_chunk(prefix, chunk, np.zeros(chunk.shape, bool), 0)
        prefixes = [prefix]
        if serving:  # a request for `prompt_logprobs`: two whole chunks, then its insert
            chunk = np.full((prefill_batch, cfg.prefill_chunk_size), cfg.pad_token_id, np.int32)
            scored = prefiller.new_prefix(prefill_batch)
            for _ in range(2):
                scored, _ = prefiller.prefill_scored(scored, chunk, np.zeros(chunk.shape, bool),
                                                     0, np.zeros_like(chunk), top_n)
            prefixes.append(scored)
        rows = cfg.prefill_context_parallelism
        if rows > 1:  # the context-parallel call long prompts take, and its insert
            window = np.full((rows, cfg.prefill_chunk_size), cfg.pad_token_id, np.int32)
            prefixes.append(prefiller.prefill_slices(prefiller.new_prefix(rows), window,
                                                     np.zeros(window.shape, bool), 0))
        if prefill_engine is not None:
            prefixes = [self.adopt(p) for p in prefixes]
        pool = self.new_pool(batch)
        for padding in prefixes:
            n = padding.logits.shape[0]
            pool, _ = self.insert(pool, padding, [-1] * n, [1] * n,
                                  np.tile(self.stop_ids(), (n, 1)),
                                  sampling.config_sampling(cfg, n), top_n)
        if serving and cfg.serve_decode_prompt_tokens and prefill_engine is None:
            pool = self.insert_prompts(pool, [[]] * prefill_batch, [-1] * prefill_batch,
                                       [1] * prefill_batch,
                                       np.tile(self.stop_ids(), (prefill_batch, 1)),
                                       sampling.config_sampling(cfg, prefill_batch))
        prefix = prefixes[0]
        pool, _ = self.generate(pool, max(max_steps, 1), top_n)
        if serving and prefill_engine is None:
            for width in widths:
                chunk = np.full((prefill_batch, width), cfg.pad_token_id, np.int32)
                pool, prefix, *_ = self.decode_and_prefill(
                    pool, prefix, chunk, np.zeros(chunk.shape, bool), 0, [-1] * prefill_batch,
                    [1] * prefill_batch, np.tile(self.stop_ids(), (prefill_batch, 1)),
                    sampling.config_sampling(cfg, prefill_batch), top_n,
                    cfg.serve_steps_per_call)
        return time.perf_counter() - t0

    def warm_up_paged(self, slots: int, num_pages: int, page_size: int, rows: int,
                      steps: int, top_n: int = 0) -> float:
        """Compile (or load from the compilation cache) and run once on nothing the programs a
        paged server runs: `paged_step` with `rows` prefill rows beside `slots` decode rows, at
        each of `prefill_buckets` and a whole chunk (and its scoring form, a whole chunk, for
        `prompt_logprobs`), and the decode-only `paged_generate`, all of `steps` steps (no
        slot is active: their loops stop at once), each with a progress line. Returns the
        seconds it took."""
        cfg = self.cfg
        t0 = time.perf_counter()
        pool = self.new_paged_pool(slots, num_pages, page_size)
        width = -(-cache_length(cfg) // page_size)
        table = np.zeros((slots, width), np.int32)

        def step(pool: Pool, tokens: int, scored: bool = False) -> Pool:
            padding = (np.zeros((rows, tokens), np.int32), np.full(rows, -1, np.int32),
                       np.zeros(rows, np.int32), np.zeros(rows, np.int32),
                       np.zeros((rows, width), np.int32))
            return self.paged_step(pool, table, padding, np.zeros(rows, bool), [1] * rows,
                                   np.tile(self.stop_ids(), (rows, 1)),
                                   sampling.config_sampling(cfg, rows), top_n, steps,
                                   targets=padding[0] if scored else None)[0]

        chunk = cfg.prefill_chunk_size
        programs = (
            *((f"the step (decode rows beside prefill slices of {tokens} tokens)",
               lambda pool, tokens=tokens: step(pool, tokens))
              for tokens in (*self.buckets, chunk)),
            ("the step scoring its prompts' positions (prompt_logprobs)",
             lambda pool: step(pool, chunk, scored=True)),
            ("the decode-only loop", lambda pool: self.paged_generate(pool, table, steps,
                                                                      top_n)[0]))
        for i, (name, run) in enumerate(programs, 1):
            began = time.perf_counter()
            log.info("warm-up %d/%d: %s ...", i, len(programs), name)
            pool = run(pool)
            log.info("warm-up %d/%d: %s ready in %.1f s", i, len(programs), name,
                     time.perf_counter() - began)
        return time.perf_counter() - t0

    def decode_batch(self, prompts: Sequence[Sequence[int]], batch: int | None = None,
                     max_steps: int | None = None, seed: int | None = None,
                     limits: Sequence[int] | None = None,
                     cache: PrefixCache | None = None, top_n: int = 0) -> Generation:
        """Decode `prompts` together (the offline driver): prefill them in one batch, insert
        them into a pool of `batch` slots, generate until every one stops. Prompt i samples
        with seed `seed + i` (default `cfg.seed`) and generates at most `limits[i]` tokens
        (default `max_steps`, itself by default `max_decode_steps`). With a prefix `cache`
        each prompt is prefilled on its own, in order, so it can reuse the blocks of the
        prompts before it (and of earlier calls); so is every prompt when any is prefilled
        context-parallel (`context_parallel`). With `top_n`, each token's `top_n` highest
        log-probabilities come too, and their tokens (`Generation.output_top_logprobs`,
        `output_top_ids`)."""
        cfg = self.cfg
        max_steps = cfg.max_decode_steps if max_steps is None else max_steps
        if not prompts:
            raise ConfigError("decode_batch needs at least one prompt")
        if batch is not None and batch < len(prompts):
            raise ConfigError(f"{len(prompts)} prompts do not fit a pool of {batch} slots")
        limits = [max_steps] * len(prompts) if limits is None else list(limits)
        if len(limits) != len(prompts) or min(limits) < 1:
            raise ConfigError(f"limits must give each of the {len(prompts)} prompts at least "
                              f"one token, got {limits}")
        if max(limits) > max_steps:
            raise ConfigError(f"a limit of {max(limits)} tokens is above max_steps={max_steps}")
        check_prompts(cfg, prompts, max(limits))
        batch = batch or len(prompts)
        seed = cfg.seed if seed is None else seed
        t0 = time.perf_counter()
        rows = range(batch)
        slots = [i if i < len(prompts) else -1 for i in rows]
        stop = np.tile(self.stop_ids(), (batch, 1))
        params = sampling.config_sampling(cfg, batch, [seed + i for i in rows])
        if cache is None and not any(self.context_parallel([p]) for p in prompts):
            pool, first = self.insert(self.new_pool(batch), self.prefill(prompts, batch),
                                      slots, limits + [1] * (batch - len(prompts)), stop,
                                      params, top_n)
        else:
            pool, first = self._insert_one_by_one(prompts, batch, limits, stop, params, cache,
                                                  top_n)
        t1 = time.perf_counter()
        steps = 1
        rest = Tokens(np.zeros((batch, 0), np.int32), np.zeros((batch, 0), np.float32),
                      np.zeros((batch, 0, top_n), np.int32),
                      np.zeros((batch, 0, top_n), np.float32), np.zeros(batch, np.int32),
                      first.active, 0)
        if max_steps > 1 and first.active[: len(prompts)].any():
            pool, rest = self.generate(pool, max_steps - 1, top_n)
            steps += rest.steps
        t2 = time.perf_counter()
        eos = None if cfg.ignore_eos else cfg.eos_token_id
        outputs, lps, top_ids, tops, reasons = [], [], [], [], []
        for i in range(len(prompts)):
            n = int(rest.count[i])
            ids = [int(first.ids[i]), *(int(t) for t in rest.ids[i, :n])]
            outputs.append(ids)
            lps.append([float(first.logprobs[i]), *(float(x) for x in rest.logprobs[i, :n])])
            top_ids.append([first.top_ids[i].tolist(), *rest.top_ids[i, :n].tolist()])
            tops.append([first.top_logprobs[i].tolist(), *rest.top_logprobs[i, :n].tolist()])
            reasons.append("eos" if eos is not None and ids[-1] == eos else "length")
        return Generation([list(p) for p in prompts], outputs, lps, reasons, t1 - t0, t2 - t1,
                          steps, *((top_ids, tops) if top_n else (None, None)))


    def _insert_one_by_one(self, prompts: Sequence[Sequence[int]], batch: int,
                           limits: Sequence[int], stop: np.ndarray, params: SlotSampling,
                           cache: PrefixCache | None, top_n: int) -> tuple[Pool, Tokens]:
        """Prompt i prefilled alone (through `cache`, or context-parallel) and inserted into
        slot i from its prefix's row 0; the first tokens of all `batch` rows (padding rows
        inactive)."""
        pool = self.new_pool(batch)
        ids, lps = np.zeros(batch, np.int32), np.zeros(batch, np.float32)
        top_ids, top = np.zeros((batch, top_n), np.int32), np.zeros((batch, top_n), np.float32)
        active = np.zeros(batch, bool)
        for i, prompt in enumerate(prompts):
            prefix = self.prefill([prompt], self.ctx.size("batch"), cache)
            rows = prefix.logits.shape[0]  # the other rows of a context-parallel prefix: padding
            row = jax.tree.map(lambda a, i=i, n=rows: np.repeat(a[i:i + 1], n, axis=0), params)
            pool, one = self.insert(pool, prefix, [i] + [-1] * (rows - 1),
                                    [limits[i]] + [1] * (rows - 1),
                                    np.repeat(stop[i:i + 1], rows, axis=0), row, top_n)
            ids[i], lps[i], top_ids[i], top[i], active[i] = (
                one.ids[0], one.logprobs[0], one.top_ids[0], one.top_logprobs[0], one.active[0])
        return pool, Tokens(ids, lps, top_ids, top, np.ones(batch, np.int32), active)


# ---- a call's host arguments in one transfer -----------------------------------------------

class RowLayout(NamedTuple):
    """Where each array sits in `pack_rows`'s buffer: per array its dtype's name, its shape
    after the row axis, and its first and last word. Static (hashable): part of a program."""

    fields: tuple[tuple[str, tuple[int, ...], int, int], ...]

    @classmethod
    def of(cls, arrays: Sequence[Any]) -> RowLayout:
        """The layout of arrays (or ShapeDtypeStructs) with one leading row axis."""
        fields, at = [], 0
        for a in arrays:
            itemsize = np.dtype(a.dtype).itemsize
            if itemsize not in (1, 4):
                raise TypeError(f"pack_rows takes 1- and 4-byte types, not {np.dtype(a.dtype)}")
            size = int(np.prod(a.shape[1:], dtype=np.int64))
            words = -(-size // 4) if itemsize == 1 else size
            fields.append((np.dtype(a.dtype).name, tuple(a.shape[1:]), at, at + words))
            at += words
        return cls(tuple(fields))

    @property
    def words(self) -> int:
        return self.fields[-1][3] if self.fields else 0


def pack_rows(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, RowLayout]:
    """Host arrays with one leading row axis as one int32 [rows, words] buffer, so a call's
    per-row arguments reach the devices in one transfer rather than one each (a riding call's
    17 transfers cost the host more than the call's own dispatch). 4-byte types keep their
    bits; 1-byte types (uint8, bool) go four to a word, little-endian."""
    layout = RowLayout.of(arrays)
    rows = arrays[0].shape[0]
    if any(a.shape[0] != rows for a in arrays):
        raise ValueError(f"pack_rows takes arrays of one row count, got "
                         f"{[a.shape[0] for a in arrays]}")
    packed = np.zeros((rows, layout.words), "<i4")
    as_bytes = packed.view(np.uint8)
    for a, (_, tail, first, last) in zip(arrays, layout.fields, strict=True):
        # Little-endian, as the words are read back (a no-op on every host jax runs on).
        flat = np.ascontiguousarray(a, a.dtype.newbyteorder("<")).reshape(
            rows, int(np.prod(tail, dtype=np.int64)))
        if flat.dtype.itemsize == 1:
            as_bytes[:, 4 * first: 4 * first + flat.shape[1]] = flat.view(np.uint8)
        else:
            packed[:, first:last] = flat.view("<i4")
    return packed, layout


def unpack_rows(packed: jax.Array, layout: RowLayout) -> list[jax.Array]:
    """`pack_rows`'s arrays back out of its buffer, on the devices (slices and bit casts)."""
    rows, out = packed.shape[0], []
    for dtype, tail, first, last in layout.fields:
        words = packed[:, first:last]
        size = int(np.prod(tail, dtype=np.int64))
        if np.dtype(dtype).itemsize == 1:
            shifts = jnp.arange(4, dtype=jnp.int32) * 8
            raw = ((words[:, :, None] >> shifts) & 0xFF).reshape(rows, 4 * (last - first))
            raw = raw[:, :size]
            value = raw != 0 if dtype == "bool" else raw.astype(dtype)
        else:
            value = jax.lax.bitcast_convert_type(words, jnp.dtype(dtype))
        out.append(value.reshape(rows, *tail))
    return out


# ---- the programs (pure; the engine jits them with its graphdef bound) -------------------------


def _merge(graphdef: Any, params: Any) -> Decoder:
    """The model, from its graph and parameters, or from a `weights.WeightLayout` and the flat
    buffers the engine passes."""
    if isinstance(graphdef, weights.WeightLayout):
        graphdef, params = graphdef.graphdef, weights.unflatten(graphdef, params)
    return nnx.merge(graphdef, params)


def prefill_chunk_program(graphdef: Any, params: Any, tokens: jax.Array, valid: jax.Array,
                          prefix: Prefix, start: jax.Array, slices: bool = False) -> Prefix:
    """One prefill chunk (tokens and valid [P, C] at absolute positions from `start`) into
    `prefix`; rows whose prompt has no token in the chunk keep their logits. `slices`: the rows
    are consecutive chunks of one sequence (`Decoder.prefill`)."""
    logits, state = _merge(graphdef, params).prefill(tokens, valid, prefix.state, start,
                                                      slices=slices)
    ends_here = jnp.any(valid, axis=1)
    if slices:
        ends_here = jnp.broadcast_to(jnp.any(ends_here), ends_here.shape)
    return Prefix(jnp.where(ends_here[:, None], logits, prefix.logits), state)


def scored_prefill_chunk_program(graphdef: Any, params: Any, tokens: jax.Array,
                                 valid: jax.Array, prefix: Prefix, start: jax.Array,
                                 targets: jax.Array, top_n: int,
                                 ) -> tuple[Prefix, sampling.PromptScores]:
    """`prefill_chunk_program` with the LM head over every position, each scored against
    `targets` (`sampling.score_next`)."""
    logits, state = _merge(graphdef, params).prefill(tokens, valid, prefix.state, start,
                                                      every_position=True)
    count = jnp.sum(valid, axis=1)
    last = logits[jnp.arange(tokens.shape[0]), jnp.maximum(count - 1, 0)]
    return (Prefix(jnp.where((count > 0)[:, None], last, prefix.logits), state),
            sampling.score_next(logits, targets, top_n))


def check_prompts(cfg: Config, prompts: Sequence[Sequence[int]], steps: int,
                  names: Sequence[str] | None = None) -> None:
    """That each prompt fits the engine `cfg` builds with `steps` decode steps after it: the
    config alone decides, so a driver checks before any weight is loaded. `names[i]` says where
    prompt i came from (default "prompt i")."""
    for i, p in enumerate(prompts):
        name = names[i] if names is not None else f"prompt {i}"
        if not p:
            raise ConfigError(f"{name} is empty")
        if len(p) > cfg.max_prefill_predict_length:
            raise ConfigError(f"{name} has {len(p)} tokens, more than "
                              f"max_prefill_predict_length={cfg.max_prefill_predict_length}")
        if len(p) + steps > cfg.max_target_length:
            raise ConfigError(f"{name} ({len(p)} tokens) + max_decode_steps={steps} exceeds "
                              f"max_target_length={cfg.max_target_length}")
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ConfigError(f"{name} has token ids outside [0, vocab_size="
                              f"{cfg.vocab_size}): {bad[:5]}")


def insert_program(pool: Pool, prefix: Prefix, slots: jax.Array, limit: jax.Array,
                   stop_ids: jax.Array, params: SlotSampling, top_n: int,
                   ) -> tuple[Pool, tuple]:
    """Prefix row i into slot `slots[i]` (every array of the slot written; -1: dropped), with
    its first token sampled. Returns the pool and (first, logprob, top ids, top logprobs,
    active) per row."""
    new, out = _started(prefix.logits, limit, stop_ids, params, top_n, pool.slots.feed.shape[1])
    return _write_slots(pool, slots, prefix.state, new), out


def _started(logits: jax.Array, limit: jax.Array, stop_ids: jax.Array, params: SlotSampling,
             top_n: int, feed: int, produced: jax.Array | None = None,
             counts: jax.Array | None = None) -> tuple[Slots, tuple]:
    """The slot rows of sequences whose prompts ended with `logits` [P, vocab], each one's next
    token sampled with its own parameters, and (token, logprob, top ids, top logprobs,
    active). A sequence resumed after a preemption has `produced` [P] tokens already (the
    next is drawn as that number) and their `counts` [P, vocab]; by default none."""
    rows, vocab = logits.shape
    produced = jnp.zeros(rows, jnp.int32) if produced is None else produced
    counts = jnp.zeros((rows, vocab), jnp.int32) if counts is None else counts
    first, lp, top_ids, top_lps = sampling.sample_slots(
        logits, params, produced, top_n, stop_ids,
        sampling.History(counts, sampling.prompt_tokens(params, vocab)))
    active = ~(_is_stop(first, stop_ids) | (produced + 1 >= limit))
    new = Slots(tokens=first, active=active, produced=produced + 1, limit=limit,
                stop_ids=stop_ids, counts=_counted(counts, first, jnp.ones(rows, bool)),
                sampling=params, feed=jnp.full((rows, feed), -1, jnp.int32))
    return new, (first, lp, top_ids, top_lps, active)


def insert_prompts_program(pool: Pool, prompts: jax.Array, slots: jax.Array, limit: jax.Array,
                           stop_ids: jax.Array, params: SlotSampling) -> Pool:
    """Prompt row i (`prompts` [rows, F], -1 past its end) into slot `slots[i]` with a zero
    state, to go through the decode steps (`Engine.insert_prompts`)."""
    rows, vocab = prompts.shape[0], pool.slots.counts.shape[1]
    feed = jnp.concatenate([prompts[:, 1:], jnp.full((rows, 1), -1, jnp.int32)], axis=1)
    new = Slots(tokens=prompts[:, 0], active=jnp.ones(rows, bool),
                produced=jnp.zeros(rows, jnp.int32), limit=limit, stop_ids=stop_ids,
                counts=jnp.zeros((rows, vocab), jnp.int32), sampling=params, feed=feed)
    return _write_slots(pool, slots, None, new)


def _write_slots(pool: Pool, slots: jax.Array, state: DecodeState | None, new: Slots) -> Pool:
    """Rows written into slots `slots` (-1: a padding row, dropped), every array of each slot:
    `state` the rows' decode state (None: zeros, a sequence not begun), `new` their `Slots`."""
    # Padding rows carry slot -1: moved past the end, their writes are dropped.
    at = jnp.where(slots < 0, pool.slots.tokens.shape[0], slots)

    def put(field, whole, part):
        if isinstance(whole, list):  # a per-layer pool: layer l of the rows into array l
            return [w.at[at].set(0 if part is None else part[layer].astype(w.dtype),
                                 mode="drop") for layer, w in enumerate(whole)]
        index = at if field == "lengths" else (slice(None), at)
        return whole.at[index].set(0 if part is None else part.astype(whole.dtype), mode="drop")

    parts = state if state is not None else [None] * len(DecodeState._fields)
    state = DecodeState(*(put(f, w, p) for f, w, p in
                          zip(DecodeState._fields, pool.state, parts, strict=True)))
    put_slot = lambda whole, part: whole.at[at].set(part.astype(whole.dtype), mode="drop")
    return Pool(state, jax.tree.map(put_slot, pool.slots, new))


def generate_program(cfg: Config, graphdef: Any, params: Any, pool: Pool, max_steps: int,
                     top_n: int) -> tuple[Pool, tuple]:
    """Up to `max_steps` decode steps for every slot, ending early when none is active.
    Returns the pool and (tokens [S, max_steps], logprobs, top ids, top logprobs, tokens per
    slot, active after, steps run)."""
    return _decode_loop(cfg, _merge(graphdef, params), pool, max_steps, top_n)


def _decode_loop(cfg: Config, model: Decoder, pool: Pool, max_steps: int,
                 top_n: int, table: jax.Array | None = None) -> tuple[Pool, tuple]:
    """`max_steps` decode steps of every active slot (`generate_program`); with a page
    `table` [S, max pages] the pool is paged and each step is `Decoder.paged_step`."""
    slots = pool.slots

    def cond(carry):
        step, active = carry[0], carry[2]
        return (step < max_steps) & jnp.any(active)

    in_prompt = sampling.prompt_tokens(slots.sampling, slots.counts.shape[1])  # once a call

    def body(carry):
        tokens, active, state = carry[1], carry[2], carry[-1]
        if table is None:
            return _advance(cfg, slots, in_prompt, top_n, carry, *model.decode(tokens, state))
        logits, _, state = model.paged_step(_decode_rows(tokens, active, state, table), None,
                                            state)
        return _advance(cfg, slots, in_prompt, top_n, carry, logits, state)

    # Unrolled layers carry each layer's state as its own array. A pool already in that form
    # (`pool_shapes`) is updated in place; a stacked one is split here and stacked back.
    restack = not cfg.scan_layers and not is_per_layer(pool.state)
    state = per_layer_state(pool.state) if restack else pool.state
    carry = jax.lax.while_loop(cond, body, _first_carry(cfg, slots, state, max_steps, top_n))
    steps, tokens, active, produced, out, lps, top_ids, top_lps, counts, feed, state = carry
    if restack:
        state = stacked_state(state)
    new_slots = slots._replace(tokens=tokens, active=active, produced=produced, counts=counts,
                               feed=feed)
    return Pool(state, new_slots), (out, lps, top_ids, top_lps, produced - slots.produced,
                                    active, steps)


def decode_and_prefill_program(cfg: Config, graphdef: Any, params: Any, pool: Pool,
                               prefix: Prefix, tokens: jax.Array, valid: jax.Array,
                               start: jax.Array, slots: jax.Array, limit: jax.Array,
                               stop_ids: jax.Array, sampling_params: SlotSampling, top_n: int,
                               n_steps: int) -> tuple[Pool, Prefix, tuple, tuple, tuple]:
    """One decode step for every slot with one prefill chunk riding along (`prefill_chunk_program`
    on `prefix`, through `Decoder.decode_and_prefill`), then prefix row i inserted into slot
    `slots[i]` (`insert_program`; -1: not yet, or padding), then `n_steps` - 1 more decode steps
    (`generate_program`'s loop, the inserted slots decoding too). Returns the pool, the prefix,
    the first step's outputs as `generate_program` gives them for one step (the inserted slots
    were free during it), the insert's first tokens, and the outputs of the steps after it (or
    None for `n_steps` 1)."""
    model = _merge(graphdef, params)
    s = pool.slots
    logits, state, chunk_logits, prefix_state = model.decode_and_prefill(
        s.tokens, pool.state, tokens, valid, prefix.state, start)
    carry = _advance(cfg, s, sampling.prompt_tokens(s.sampling, s.counts.shape[1]), top_n,
                     _first_carry(cfg, s, pool.state, 1, top_n), logits, state)
    steps, last, active, produced, out, lps, top_ids, top_lps, counts, feed, state = carry
    pool = Pool(state, s._replace(tokens=last, active=active, produced=produced, counts=counts,
                                  feed=feed))
    ends_here = jnp.any(valid, axis=1)
    prefix = Prefix(jnp.where(ends_here[:, None], chunk_logits, prefix.logits), prefix_state)
    pool, first = insert_program(pool, prefix, slots, limit, stop_ids, sampling_params, top_n)
    rest = None
    if n_steps > 1:  # in the same call: one dispatch per scheduler iteration, not two
        pool, rest = _decode_loop(cfg, model, pool, n_steps - 1, top_n)
    return pool, prefix, (out, lps, top_ids, top_lps, produced - s.produced, active, steps), \
        first, rest


def _decode_rows(tokens: jax.Array, active: jax.Array, state: DecodeState,
                 table: jax.Array) -> StepRows:
    """Every slot's next token as a one-token row of its own, in slot order (inactive slots:
    count 0, no state change)."""
    return StepRows(tokens[:, None], None, state.lengths, active.astype(jnp.int32), table)


def paged_step_program(cfg: Config, graphdef: Any, params: Any, pool: Pool, table: jax.Array,
                       long: StepRows, ends: jax.Array, prompt_len: jax.Array,
                       resumed: jax.Array, limit: jax.Array, stop_ids: jax.Array,
                       sampling_params: SlotSampling, top_n: int, n_steps: int,
                       targets: jax.Array | None = None,
                       ) -> tuple[Pool, tuple, tuple, tuple | None, Any]:
    """One step over the paged pool: every active slot's next token (the slots' page rows
    `table` [S, max pages]) and the prefill slices of `long` in one pass
    (`Decoder.paged_step`); each long row that `ends` its prompt starts its slot: the first
    token sampled with the row's own `limit`, `stop_ids` and `sampling_params`. Then
    `n_steps` - 1 more decode steps of every active slot, as `generate_program` runs them,
    with the pages `table` already holds. Returns the pool, the first step's outputs as
    `generate_program` gives them for one step, the long rows' first tokens, and the outputs
    of the steps after it (None for `n_steps` 1), and with `targets` [P, C] (the token after
    each long-row position) every long-row position scored against its target
    (`sampling.score_next`; else None).

    A sequence recomputed after a preemption is prefilled over its prompt (`prompt_len`
    tokens) and the `resumed` tokens it had generated: those count in its output history as
    its slices pass (the penalties read them), and its next token is drawn as number
    `resumed`, so its output is the one it would have had without the preemption."""
    model = _merge(graphdef, params)
    s = pool.slots
    logits, long_logits, state = model.paged_step(
        _decode_rows(s.tokens, s.active, pool.state, table), long, pool.state,
        every_long_position=targets is not None)
    scores = None
    if targets is not None:
        scores = sampling.score_next(long_logits, targets, top_n)
        long_logits = long_logits[jnp.arange(long.count.shape[0]),
                                  jnp.maximum(long.count - 1, 0)]
    # The step already moved only the lengths of the rows it ran (the long rows' included,
    # which the carry's "unchanged" lengths must not undo).
    carry = _advance(cfg, s, sampling.prompt_tokens(s.sampling, s.counts.shape[1]), top_n,
                     _first_carry(cfg, s, state, 1, top_n), logits, state)
    steps, last, active, produced, out, lps, top_ids, top_lps, counts, feed, state = carry
    pool = Pool(state, s._replace(tokens=last, active=active, produced=produced, counts=counts,
                                  feed=feed))
    history = _regenerated_counts(pool.slots.counts, long, prompt_len)
    pool = pool._replace(slots=pool.slots._replace(counts=pool.slots.counts.at[
        jnp.where(long.count > 0, long.slot, s.tokens.shape[0])].set(history, mode="drop")))
    new, first = _started(long_logits, limit, stop_ids, sampling_params, top_n,
                          s.feed.shape[1], resumed, history)
    at = jnp.where(ends, long.slot, s.tokens.shape[0])  # rows still mid-prompt: dropped
    put = lambda whole, part: whole.at[at].set(part.astype(whole.dtype), mode="drop")  # noqa: E731
    pool = pool._replace(slots=jax.tree.map(put, pool.slots, new))
    rest = None
    if n_steps > 1:
        pool, rest = _decode_loop(cfg, model, pool, n_steps - 1, top_n, table)
    return (pool, (out, lps, top_ids, top_lps, produced - s.produced, active, steps), first,
            rest, scores)


def _regenerated_counts(counts: jax.Array, long: StepRows, prompt_len: jax.Array,
                        ) -> jax.Array:
    """[P, vocab]: each long row's output-token counts once its slice is through: its slot's
    counts so far (none at position 0), plus its tokens past its prompt (a resumed sequence's
    generated tokens, being recomputed)."""
    rows, width = long.tokens.shape
    held = jnp.where((long.start == 0)[:, None], 0, counts[jnp.maximum(long.slot, 0)])
    at = long.start[:, None] + jnp.arange(width)[None, :]
    generated = (jnp.arange(width)[None, :] < long.count[:, None]) & (at >= prompt_len[:, None])
    return held.at[jnp.arange(rows)[:, None], long.tokens].add(generated.astype(held.dtype))


def packed_paged_step_program(cfg: Config, graphdef: Any, params: Any, pool: Pool,
                              table: jax.Array, packed: jax.Array, layout: RowLayout, top_n: int,
                              n_steps: int, scored: bool = False,
                              ) -> tuple[Pool, tuple, tuple, tuple | None, Any]:
    """`paged_step_program` on the long rows, their `ends` and their `_row_arguments` (less
    the slots, which the rows carry), packed by `pack_rows`; `scored`: the long rows' targets
    last."""
    fields = unpack_rows(packed, layout)
    targets = fields.pop() if scored else None
    long, (ends, prompt_len, resumed, limit, stop_ids), rows = (fields[:5], fields[5:10],
                                                                fields[10:])
    return paged_step_program(cfg, graphdef, params, pool, table, StepRows(*long), ends,
                              prompt_len, resumed, limit, stop_ids, SlotSampling(*rows), top_n,
                              n_steps, targets)


def paged_generate_program(cfg: Config, graphdef: Any, params: Any, pool: Pool,
                           table: jax.Array, max_steps: int, top_n: int) -> tuple[Pool, tuple]:
    """`generate_program` over the paged pool."""
    return _decode_loop(cfg, _merge(graphdef, params), pool, max_steps, top_n, table)


def _row_arguments(slots: Sequence[int], limits: Sequence[int], stop_ids: np.ndarray,
                   params: SlotSampling) -> list[np.ndarray]:
    """`insert`'s per-row host arguments, in the order its packed programs unpack them."""
    return [np.asarray(slots, np.int32), np.asarray(limits, np.int32),
            np.asarray(stop_ids, np.int32), *(np.asarray(a) for a in params)]


def packed_insert_program(pool: Pool, prefix: Prefix, packed: jax.Array, layout: RowLayout,
                           top_n: int) -> tuple[Pool, tuple]:
    """`insert_program` on `_row_arguments` packed by `pack_rows`."""
    slots, limit, stop_ids, *params = unpack_rows(packed, layout)
    return insert_program(pool, prefix, slots, limit, stop_ids, SlotSampling(*params), top_n)


def packed_insert_prompts_program(pool: Pool, packed: jax.Array, layout: RowLayout) -> Pool:
    """`insert_prompts_program` on the prompts and `_row_arguments`, packed by `pack_rows`."""
    prompts, slots, limit, stop_ids, *params = unpack_rows(packed, layout)
    return insert_prompts_program(pool, prompts, slots, limit, stop_ids, SlotSampling(*params))


def packed_decode_and_prefill_program(cfg: Config, graphdef: Any, params: Any, pool: Pool,
                                       prefix: Prefix, packed: jax.Array, start: jax.Array,
                                       layout: RowLayout, top_n: int, n_steps: int,
                                       ) -> tuple[Pool, Prefix, tuple, tuple, tuple]:
    """`decode_and_prefill_program` on the chunk's tokens and valid mask, then
    `_row_arguments`, packed by `pack_rows`."""
    tokens, valid, slots, limit, stop_ids, *rows = unpack_rows(packed, layout)
    return decode_and_prefill_program(cfg, graphdef, params, pool, prefix, tokens, valid, start,
                                      slots, limit, stop_ids, SlotSampling(*rows), top_n,
                                      n_steps)


def _first_carry(cfg: Config, slots: Slots, state: DecodeState, max_steps: int,
                 top_n: int) -> tuple:
    """The decode loop's carry before its first step: (step, last tokens, active, produced,
    tokens out [S, max_steps], their logprobs, top ids, top logprobs, output token counts,
    prompt tokens still to feed, state)."""
    n = slots.tokens.shape[0]
    return (jnp.int32(0), slots.tokens, slots.active, slots.produced,
            jnp.full((n, max_steps), cfg.pad_token_id, jnp.int32),
            jnp.zeros((n, max_steps), jnp.float32), jnp.zeros((n, max_steps, top_n), jnp.int32),
            jnp.zeros((n, max_steps, top_n), jnp.float32), slots.counts, slots.feed, state)


def _advance(cfg: Config, slots: Slots, in_prompt: jax.Array, top_n: int, carry: tuple,
             logits: jax.Array, new_state: DecodeState) -> tuple:
    """The carry after one decode step that gave `logits` and `new_state`: each active slot's
    token sampled with its own parameters (`in_prompt`: its prompt's tokens, unpacked once
    per call) and recorded, stops and limits applied; a slot still feeding its prompt
    (`insert_prompts`) takes its next prompt token instead, and records nothing."""
    step, tokens, active, produced, out, lps, top_ids, top_lps, counts, feed, state = carry
    # Free slots run too (fixed shapes) but their length stays put, so their cache writes stay
    # in range; `insert` overwrites everything a free slot holds.
    state = new_state._replace(lengths=jnp.where(active, new_state.lengths, state.lengths))
    feeding = active & (feed[:, 0] >= 0)
    emits = active & ~feeding
    sampled, lp, t_ids, t_lps = sampling.sample_slots(
        logits, slots.sampling, produced, top_n, slots.stop_ids,
        sampling.History(counts, in_prompt))
    # Each slot's tokens of the call are kept in order from column 0 (a slot that fed its
    # prompt in the first steps starts later): a select per row, elementwise, so a batch split
    # over devices stays split.
    here = emits[:, None] & (jnp.arange(out.shape[1]) == (produced - slots.produced)[:, None])
    out = jnp.where(here, sampled[:, None], out)
    lps = jnp.where(here, lp[:, None], lps)
    top_ids = jnp.where(here[..., None], t_ids[:, None], top_ids)
    top_lps = jnp.where(here[..., None], t_lps[:, None], top_lps)
    produced = produced + emits.astype(jnp.int32)
    finished = emits & (_is_stop(sampled, slots.stop_ids) | (produced >= slots.limit))
    counts = _counted(counts, sampled, emits)
    tokens = jnp.where(feeding, feed[:, 0], jnp.where(active, sampled, tokens))
    feed = jnp.concatenate([feed[:, 1:], jnp.full_like(feed[:, :1], -1)], axis=1)
    return (step + 1, tokens, active & ~finished, produced, out, lps, top_ids, top_lps, counts,
            feed, state)


def _counted(counts: jax.Array, tokens: jax.Array, where: jax.Array) -> jax.Array:
    """`counts` [S, vocab] with each row's token counted once more where `where` holds: an
    elementwise pass (it fuses with the penalties' own), row by row, so a batch split over
    devices stays split."""
    hit = jnp.arange(counts.shape[1]) == tokens[:, None]
    return counts + (hit & where[:, None]).astype(counts.dtype)


def release_program(pool: Pool, free: jax.Array) -> Pool:
    return pool._replace(slots=pool.slots._replace(active=pool.slots.active & ~free))


def _step_program(cfg: Config, graphdef: Any, params: Any, tokens: jax.Array,
                  state: DecodeState, key: jax.Array) -> tuple:
    logits, state = _merge(graphdef, params).decode(tokens, state)
    next_tokens, logprobs = sampling.sample(cfg, logits, key)
    return next_tokens, logprobs, logits, state


def pool_shapes(cfg: Config, slots: int) -> Pool:
    """ShapeDtypeStructs of a pool of `slots` slots. With unrolled layers (`scan_layers`
    false) its state is kept per layer (`per_layer_form`): the decode loop carries each layer's
    arrays as they are, where splitting a stacked pool copied the whole state every call."""
    i32 = lambda *shape: jax.ShapeDtypeStruct((slots, *shape), jnp.int32)  # noqa: E731
    return Pool(_pool_state_form(cfg, state_shapes(cfg, slots), STATE_AXES)[0],
                Slots(tokens=i32(), active=jax.ShapeDtypeStruct((slots,), jnp.bool_),
                      produced=i32(), limit=i32(), stop_ids=i32(MAX_STOP_IDS),
                      counts=i32(cfg.vocab_size),
                      sampling=sampling.sampling_shapes(slots, cfg.vocab_size),
                      feed=i32(feed_width(cfg))))


def feed_width(cfg: Config) -> int:
    """The pool's `feed` columns: the longest prompt `Engine.insert_prompts` takes (one unused
    column when `serve_decode_prompt_tokens` is 0)."""
    return max(cfg.serve_decode_prompt_tokens, 1)


def pool_axes(cfg: Config) -> Pool:
    """The logical axes of `pool_shapes(cfg, ...)`."""
    return Pool(_pool_state_form(cfg, state_shapes(cfg, 1), STATE_AXES)[1], SLOT_AXES)


def paged_pool_shapes(cfg: Config, slots: int, num_pages: int, page_size: int) -> Pool:
    """ShapeDtypeStructs of a paged pool: `slots` state slots and sampling rows, `num_pages`
    MLA pages of `page_size` positions (`models.state.paged_state_shapes`)."""
    return Pool(_pool_state_form(cfg, paged_state_shapes(cfg, slots, num_pages, page_size),
                                 PAGED_STATE_AXES)[0], pool_shapes(cfg, slots).slots)


def paged_pool_axes(cfg: Config) -> Pool:
    """The logical axes of `paged_pool_shapes(cfg, ...)`."""
    return Pool(_pool_state_form(cfg, paged_state_shapes(cfg, 1, 2, 1), PAGED_STATE_AXES)[1],
                SLOT_AXES)


def _pool_state_form(cfg: Config, shapes: DecodeState, axes: DecodeState,
                     ) -> tuple[DecodeState, DecodeState]:
    return (shapes, axes) if cfg.scan_layers else per_layer_form(shapes, axes)


def _tokens(out: tuple) -> Tokens:
    """A decode loop's host outputs (`generate_program`'s tuple) as Tokens."""
    ids, lps, top_ids, top_lps, count, active, steps = out
    return Tokens(ids, lps, top_ids, top_lps, count, active, int(steps))


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


def _to_host(tree: Any) -> Any:
    """Fetch results to every host (all-gathering across processes when there are several)."""
    if jax.process_count() > 1:
        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


def _onto(ctx: sharding.MeshContext, tree: Any) -> Any:
    """`tree`'s arrays copied onto `ctx.mesh`, each in its partition on the mesh it was on."""
    return jax.tree.map(lambda a: jax.device_put(
        a, jax.sharding.NamedSharding(ctx.mesh, a.sharding.spec)), tree)


def place_model(model: Decoder, ctx: sharding.MeshContext) -> Decoder:
    """The model with every parameter placed in its logical-axis sharding on `ctx.mesh`.

    Each process puts only the slices its own devices hold (`make_array_from_callback` asks the
    sharding's `addressable_devices_indices_map`), never deriving placement from process ids or
    device order."""
    graphdef, state = nnx.split(model)
    shardings = sharding.state_shardings(state, ctx)
    flat_state = nnx.to_flat_state(state)
    flat_shardings = dict(nnx.to_flat_state(shardings))
    placed = []
    for path, var in flat_state:
        host = np.asarray(var.get_value())
        target = flat_shardings[path]
        placed.append((path, var.replace(
            jax.make_array_from_callback(host.shape, target, lambda index, h=host: h[index]))))
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


def build_engine(cfg: Config) -> tuple[Engine, sharding.MeshContext]:
    """The mesh, the parameters in their shardings (from `load_parameters_path`, else random
    from `init_seed`, said loudly), and the engine over them."""
    ctx = sharding.MeshContext(sharding.make_mesh(cfg), cfg.logical_axis_rules)
    if cfg.load_parameters_path:
        from k3text.checkpoint import load_model

        model = load_model(cfg, ctx, cfg.load_parameters_path)
    else:
        log.warning("no load_parameters_path: decoding RANDOM weights (init_seed=%d); the "
                    "outputs are noise. Set load_parameters_path to a checkpoint.",
                    cfg.init_seed)
        model = place_model(Decoder(cfg, Init(cfg.init_seed)), ctx)
    return Engine(cfg, model, ctx), ctx


def enable_compilation_cache(cfg: Config) -> None:
    """Reuse compiled programs across runs (`compilation_cache_dir`): the second run of a
    command skips XLA compiles. A cache the embedding program already configured is left in
    place."""
    if cfg.compilation_cache_dir and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir",
                          os.path.expanduser(cfg.compilation_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
