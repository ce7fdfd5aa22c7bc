"""The inference engine: chunked prefill and an on-device decode loop for one model on one mesh.

- `prefill(prompts)`: right-pads the prompts into one batch and runs `prefill_chunk_size`
  chunks through one compiled chunk function, carrying the decode state (KDA recurrent and conv
  states, MLA latent cache) between chunks. Padding is a no-op on every state, so a ragged batch
  gives each sequence exactly what it would get alone.
- `generate(prompts)`: prefill, then the whole decode loop as one compiled `lax.while_loop`:
  sample, feed back, stop when every sequence has hit `eos_id` or the step budget. One host call
  runs all steps (no per-step Python dispatch).
- `step(...)`: one jitted decode step for callers that schedule their own steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from k3text import sharding
from k3text.config import Config, ConfigError
from k3text.inference import sampling
from k3text.inference.state import STATE_AXES, DecodeState, cache_length, state_shapes
from k3text.models.decoder import Decoder, per_layer_state, split_for_unrolled, stacked_state


@dataclasses.dataclass
class Generation:
    """Per-prompt results of one `generate` call (host numpy)."""

    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    output_logprobs: list[list[float]]
    finish_reasons: list[str]
    prefill_seconds: float  # time to first token (logits of every prompt's last token)
    decode_seconds: float  # the decode loop (all remaining steps)
    decode_steps: int  # loop iterations actually run

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
        self._prefill_chunk = jax.jit(self._prefill_chunk_impl, donate_argnames=("state",))
        self._loop = jax.jit(self._loop_impl, static_argnames=("max_steps",),
                             donate_argnames=("state",))
        self._step = jax.jit(self._step_impl, donate_argnames=("state",))
        self._zero_state: dict[int, Callable[[], DecodeState]] = {}

    # ---- placement ------------------------------------------------------------------------

    def _global(self, host: np.ndarray, logical: tuple) -> jax.Array:
        """A global array from a host array every process holds in full."""
        target = self.ctx.sharding(logical)
        return jax.make_array_from_callback(host.shape, target, lambda index: host[index])

    def new_state(self, batch: int) -> DecodeState:
        """Zero decode state for `batch` slots, created directly in its sharding."""
        make = self._zero_state.get(batch)
        if make is None:  # one compiled program per batch size, not one per call
            shapes = state_shapes(self.cfg, batch)
            shardings = sharding.tree_shardings(STATE_AXES, shapes, self.ctx)
            make = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                           out_shardings=shardings)
            self._zero_state[batch] = make
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            try:
                return make()
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                shapes = state_shapes(self.cfg, batch)
                shardings = sharding.tree_shardings(STATE_AXES, shapes, self.ctx)
                need = sum(sharding.shard_bytes(sh, s.shape, s.dtype) for s, sh in
                           zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True))
                raise ConfigError(
                    f"the decode state for {batch} slots of {cache_length(self.cfg):,} positions "
                    f"needs {need / 2**30:,.2f} GiB per device, more than the device could "
                    f"allocate; lower max_target_length or per_device_batch_size "
                    f"(python -m k3text.tools.memory CONFIG shows the trade-off)") from None

    # ---- compiled pieces ------------------------------------------------------------------

    def _model(self, params: Any) -> Decoder:
        return nnx.merge(self.graphdef, params)

    def _prefill_chunk_impl(self, params, tokens, valid, state, start, last_logits):
        logits, state = self._model(params).prefill(tokens, valid, state, start)
        ends_here = jnp.any(valid, axis=1)
        return jnp.where(ends_here[:, None], logits, last_logits), state

    def _step_impl(self, params, tokens, state, key):
        logits, state = self._model(params).decode(tokens, state)
        next_tokens, logprobs = sampling.sample(self.cfg, logits, key)
        return next_tokens, logprobs, logits, state

    def _loop_impl(self, params, first_logits, state, active, key, max_steps: int):
        cfg = self.cfg
        batch = first_logits.shape[0]
        eos = -1 if cfg.ignore_eos else cfg.eos_token_id
        model = self._model(params)
        first, first_lp = sampling.sample(cfg, first_logits, jax.random.fold_in(key, 0))
        out = jnp.full((batch, max_steps), cfg.pad_token_id, jnp.int32).at[:, 0].set(first)
        logprobs = jnp.zeros((batch, max_steps), jnp.float32).at[:, 0].set(first_lp)
        produced = active.astype(jnp.int32)
        done = ~active | (first == eos)

        def cond(carry):
            step, _, _, _, _, done, _ = carry
            return (step < max_steps) & ~jnp.all(done)

        def body(carry):
            step, last, out, logprobs, produced, done, state = carry
            logits, state = model.decode(last, state)
            tokens, lp = sampling.sample(cfg, logits, jax.random.fold_in(key, step))
            tokens = jnp.where(done, cfg.pad_token_id, tokens)
            out = out.at[:, step].set(tokens)
            logprobs = logprobs.at[:, step].set(jnp.where(done, 0.0, lp))
            produced = produced + (~done).astype(jnp.int32)
            done = done | (tokens == eos)
            return step + 1, tokens, out, logprobs, produced, done, state

        unrolled = not cfg.scan_layers  # carry each layer's state as its own array
        carry = (jnp.int32(1), first, out, logprobs, produced, done,
                 per_layer_state(state) if unrolled else state)
        step, _, out, logprobs, produced, done, state = jax.lax.while_loop(cond, body, carry)
        return out, logprobs, produced, step, stacked_state(state) if unrolled else state

    # ---- public API -----------------------------------------------------------------------

    def check_prompts(self, prompts: Sequence[Sequence[int]], steps: int) -> None:
        cfg = self.cfg
        for i, p in enumerate(prompts):
            if not p:
                raise ConfigError(f"prompt {i} is empty")
            if len(p) > cfg.max_prefill_predict_length:
                raise ConfigError(f"prompt {i} has {len(p)} tokens, more than "
                                  f"max_prefill_predict_length={cfg.max_prefill_predict_length}")
            if len(p) + steps > cfg.max_target_length:
                raise ConfigError(f"prompt {i} ({len(p)} tokens) + max_decode_steps={steps} "
                                  f"exceeds max_target_length={cfg.max_target_length}")
            bad = [t for t in p if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ConfigError(f"prompt {i} has token ids outside [0, vocab_size="
                                  f"{cfg.vocab_size}): {bad[:5]}")

    def prefill(self, prompts: Sequence[Sequence[int]], batch: int | None = None,
                ) -> tuple[jax.Array, DecodeState]:
        """Prefill `prompts` into `batch` slots (default: one per prompt; extra slots stay
        empty). Returns (logits [batch, vocab] at each prompt's last token, state)."""
        cfg = self.cfg
        batch = batch or len(prompts)
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
        state = self.new_state(batch)
        logits = self._global(np.zeros((batch, cfg.vocab_size), np.float32), ("batch", None))
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            for start in range(0, padded, chunk):
                part = slice(start, start + chunk)
                logits, state = self._prefill_chunk(
                    self.params, self._global(tokens[:, part], ("batch", None)),
                    self._global(valid[:, part], ("batch", None)), state, jnp.int32(start),
                    logits)
        return logits, state

    def step(self, tokens: jax.Array, state: DecodeState, key: jax.Array,
             ) -> tuple[jax.Array, jax.Array, jax.Array, DecodeState]:
        """One decode step for tokens [B]: (sampled next tokens [B], their log-probabilities
        [B], the logits [B, vocab], new state)."""
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            return self._step(self.params, tokens, state, key)

    def warm_up(self, batch: int, max_steps: int | None = None) -> float:
        """Compile (or load from the compilation cache) the programs `generate` runs for
        `batch` slots, by running them on an empty batch: one chunk of padding and a decode
        loop with no active slot, which stops before its first step. Returns the seconds it
        took, so callers can report compile time apart from throughput."""
        cfg = self.cfg
        max_steps = cfg.max_decode_steps if max_steps is None else max_steps
        t0 = time.perf_counter()
        chunk = np.full((batch, cfg.prefill_chunk_size), cfg.pad_token_id, np.int32)
        state = self.new_state(batch)
        logits = self._global(np.zeros((batch, cfg.vocab_size), np.float32), ("batch", None))
        idle = self._global(np.zeros(batch, bool), ("batch",))
        key = jax.random.key(0)  # made as `generate` makes it (outside the mesh context)
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            logits, state = self._prefill_chunk(
                self.params, self._global(chunk, ("batch", None)),
                self._global(np.zeros(chunk.shape, bool), ("batch", None)), state,
                jnp.int32(0), logits)
            jax.block_until_ready(self._loop(self.params, logits, state, idle, key,
                                             max_steps=max_steps))
        return time.perf_counter() - t0

    def generate(self, prompts: Sequence[Sequence[int]], batch: int | None = None,
                 max_steps: int | None = None, seed: int | None = None) -> Generation:
        cfg = self.cfg
        max_steps = cfg.max_decode_steps if max_steps is None else max_steps
        self.check_prompts(prompts, max_steps)
        batch = batch or len(prompts)
        t0 = time.perf_counter()
        logits, state = self.prefill(prompts, batch)
        logits.block_until_ready()
        t1 = time.perf_counter()
        active = self._global(np.arange(batch) < len(prompts), ("batch",))
        key = jax.random.key(cfg.seed if seed is None else seed)
        with sharding.use_mesh(self.ctx.mesh, self.ctx.rules):
            out, logprobs, produced, steps, _ = self._loop(self.params, logits, state, active,
                                                           key, max_steps=max_steps)
            out, logprobs, produced, steps = _to_host((out, logprobs, produced, steps))
        t2 = time.perf_counter()
        eos = None if cfg.ignore_eos else cfg.eos_token_id
        outputs, lps, reasons = [], [], []
        for i in range(len(prompts)):
            n = int(produced[i])
            ids = [int(t) for t in out[i, :n]]
            outputs.append(ids)
            lps.append([float(x) for x in logprobs[i, :n]])
            reasons.append("eos" if eos is not None and ids and ids[-1] == eos else "length")
        return Generation([list(p) for p in prompts], outputs, lps, reasons, t1 - t0, t2 - t1,
                          int(steps))


def _to_host(tree: Any) -> Any:
    """Fetch results to every host (all-gathering across processes when there are several)."""
    if jax.process_count() > 1:
        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


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
