"""The decoder: embedding -> layers (leading, scanned groups, trailing) -> final norm -> logits.

The layer pattern comes from the config (`full_attn_layers`, `first_k_dense_replace`); the
repeating group (K3: KDA, KDA, KDA, MLA) is found by `config.find_scan_plan`, its repeats hold
stacked parameters and run as one `lax.scan`, so compile time and XLA temporaries stay flat in
depth. `scan_layers: false` unrolls the same stacked groups at trace time (same parameter tree,
same checkpoints), which is how the scan is tested. The residual stream (plain, or AttnRes
blocks) and the decode state ride in the scan carry; per-layer indices (AttnRes block
boundaries, KDA/MLA state slots) are computed from the scan index, never from the position
inside a group.

Its modes share all of it:
- `forward(tokens)`: full sequence, no cache (reference and training);
- `prefill(tokens, valid, state, start)`: one chunk, reading and writing the decode state;
- `decode(tokens, state)`: one token per sequence;
- `decode_and_prefill`: the two at once;
- `paged_step(short, long, state)`: rows of decode windows and prefill slices of many
  sequences in one pass over KDA state slots and a paged MLA cache (the form that replaces the
  three before it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3text import sharding
from k3text.config import Config, LayerSpec, ModelStructure
from k3text.layers import attn_res
from k3text.layers.attention_kda import KDAAttention, KDAState
from k3text.layers.attention_mla import MLAAttention
from k3text.layers.embeddings import Embed, LMHead
from k3text.layers.initializers import Init, weight_dtype
from k3text.layers.mlp import MLP
from k3text.layers.moe import MoE
from k3text.layers.normalizations import RMSNorm
from k3text.models.state import DecodeState, StepRows

# (mixer, spec, kda slot, mla slot, normed input, state) -> (mixer output, state)
MixerRun = Callable[[nnx.Module, LayerSpec, Any, Any, jax.Array, Any], tuple[jax.Array, Any]]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Config, spec: LayerSpec, init: Init):
        self.cfg = cfg
        self.spec = spec
        wdt = weight_dtype(cfg)
        self.input_layernorm = RMSNorm(init, cfg.hidden_size, cfg.rms_norm_eps, wdt)
        self.post_attention_layernorm = RMSNorm(init, cfg.hidden_size, cfg.rms_norm_eps, wdt)
        self.mixer = KDAAttention(cfg, init) if spec.mixer == "kda" else MLAAttention(cfg, init)
        if spec.mlp == "moe":
            self.mlp = MoE(cfg, init)
        else:
            self.mlp = MLP(cfg, cfg.hidden_size, cfg.intermediate_size, init)
        if cfg.attn_res_block_size:
            hidden = cfg.hidden_size
            for name in ("self_attention_res", "mlp_res"):
                setattr(self, f"{name}_proj",
                        init.fan_in((hidden,), ("embed",), wdt, fan_in=hidden))
                setattr(self, f"{name}_norm", init.constant((hidden,), ("embed",), wdt))

    def __call__(self, stream: Any, layer_index: Any, kda_slot: Any, mla_slot: Any,
                 state: Any, run: MixerRun, stack_index: Any = None) -> tuple[Any, Any]:
        """`stack_index`: this layer's position in its scanned group's stack, given when the
        routed experts were handed over as that whole stack (see `ops.experts.LayerExperts`)."""
        cfg = self.cfg

        # Sublayer inputs and outputs are pinned whole on every tensor-parallel device
        # (`activation_embed`): a projection then only ever splits its own output (heads,
        # experts, latent) or reduces its partial sums, and norms and AttnRes mixes run locally.
        # Left to itself the partitioner splits the stream and gathers weights instead.
        def mixer(h):
            h = _residual(self.input_layernorm(_residual(h)))
            a, state_out = run(self.mixer, self.spec, kda_slot, mla_slot, h, state)
            return _residual(a), state_out

        def mlp(h):
            h = _residual(self.post_attention_layernorm(_residual(h)))
            return _residual(self.mlp(h, stack_index) if self.spec.mlp == "moe" else self.mlp(h))

        if not cfg.attn_res_block_size:
            a, state_out = mixer(stream)
            x = stream + a
            return x + mlp(x), state_out
        eps = cfg.rms_norm_eps
        h = attn_res.mix(stream.prefix_sum, stream.blocks, stream.count,
                         self.self_attention_res_proj[...], self.self_attention_res_norm[...], eps)
        stream = attn_res.maybe_open_block(stream, layer_index, cfg.attn_res_block_size)
        a, state_out = mixer(h)
        prefix = stream.prefix_sum + a
        h = attn_res.mix(prefix, stream.blocks, stream.count, self.mlp_res_proj[...],
                         self.mlp_res_norm[...], eps)
        prefix = prefix + mlp(h)
        return stream._replace(prefix_sum=prefix), state_out


def _residual(x: jax.Array) -> jax.Array:
    return sharding.constrain_features(x, "activation_embed")


class LayerGroup(nnx.Module):
    """One repeat of the scanned layer pattern."""

    def __init__(self, cfg: Config, specs: tuple[LayerSpec, ...], init: Init):
        self.layers = nnx.List([DecoderLayer(cfg, spec, init) for spec in specs])


class Decoder(nnx.Module):
    def __init__(self, cfg: Config, init: Init):
        self.cfg = cfg
        st: ModelStructure = cfg.structure
        plan = st.scan
        wdt = weight_dtype(cfg)
        self.embed = Embed(cfg, init)
        self.lead = nnx.List([DecoderLayer(cfg, st.layers[i], init) for i in range(plan.lead)])
        if plan.num_groups:
            specs = st.layers[plan.lead : plan.lead + plan.period]
            with init.stacked(plan.num_groups):
                self.groups = LayerGroup(cfg, specs, init)
        first_trail = plan.lead + plan.period * plan.num_groups
        self.trail = nnx.List([DecoderLayer(cfg, st.layers[i], init)
                               for i in range(first_trail, len(st.layers))])
        self.norm = RMSNorm(init, cfg.hidden_size, cfg.rms_norm_eps, wdt)
        if not cfg.tie_word_embeddings:
            self.lm_head = LMHead(cfg, init)
        if cfg.attn_res_block_size:
            self.output_attn_res_proj = init.fan_in((cfg.hidden_size,), ("embed",), wdt,
                                                     fan_in=cfg.hidden_size)
            self.output_attn_res_norm = init.constant((cfg.hidden_size,), ("embed",), wdt)

    # ---- the layer stack ------------------------------------------------------------------

    def _layers(self, stream: Any, state: Any, run: MixerRun) -> tuple[Any, Any]:
        st: ModelStructure = self.cfg.structure
        plan = st.scan

        def fixed(layer, i, stream, state):
            return layer(stream, i, st.kda_index[i], st.mla_index[i], state, run)

        for i, layer in enumerate(self.lead):
            stream, state = fixed(layer, i, stream, state)
        if plan.num_groups:
            stream, state = self._scan_groups(stream, state, run)
        first_trail = plan.lead + plan.period * plan.num_groups
        for j, layer in enumerate(self.trail):
            stream, state = fixed(layer, first_trail + j, stream, state)
        return stream, state

    def _scan_groups(self, stream: Any, state: Any, run: MixerRun) -> tuple[Any, Any]:
        st: ModelStructure = self.cfg.structure
        plan = st.scan
        specs = st.layers[plan.lead : plan.lead + plan.period]
        # Slot offsets of the first scanned group and per-group increments.
        kda0 = sum(s.mixer == "kda" for s in st.layers[: plan.lead])
        mla0 = plan.lead - kda0
        kda_per = sum(s.mixer == "kda" for s in specs)
        mla_per = plan.period - kda_per
        graphdef, experts, params = nnx.split(self.groups, nnx.PathContains("experts"), ...)

        def body(carry, g, group_params, stack_index):
            stream, state = carry
            group = nnx.merge(graphdef, *group_params)
            kda, mla = kda0 + g * kda_per, mla0 + g * mla_per
            for j, layer in enumerate(group.layers):
                spec = specs[j]
                stream, state = layer(stream, plan.lead + g * plan.period + j,
                                      kda if spec.mixer == "kda" else -1,
                                      mla if spec.mixer == "mla" else -1, state, run,
                                      stack_index)
                kda = kda + (spec.mixer == "kda")
                mla = mla + (spec.mixer == "mla")
            return stream, state

        carry = (stream, state)
        if self.cfg.scan_layers:
            # Routed experts stay whole (closed over, not scanned): the MoE indexes (layer,
            # expert) itself, so a step reads only the experts it hits
            # (`ops.experts.LayerExperts`).
            def scanned(carry, xs):
                g, group_params = xs
                return body(carry, g, (experts, group_params), g), None

            carry, _ = jax.lax.scan(scanned, carry, (jnp.arange(plan.num_groups), params))
        else:
            for g in range(plan.num_groups):
                carry = body(carry, g, (group_slice(experts, g), group_slice(params, g)), None)
        return carry

    def _logits(self, stream: Any) -> jax.Array:
        cfg = self.cfg
        if cfg.attn_res_block_size:
            x = attn_res.mix(stream.prefix_sum, stream.blocks, stream.count,
                             self.output_attn_res_proj[...], self.output_attn_res_norm[...],
                             cfg.rms_norm_eps)
        else:
            x = stream
        x = self.norm(x)
        logits = self.embed.attend(cfg, x) if cfg.tie_word_embeddings else self.lm_head(x)
        return logits.astype(jnp.float32)

    def _logits_at(self, stream: Any, picked: jax.Array) -> jax.Array:
        """Logits of the flat stream's tokens at `picked` only: the LM head runs on those."""
        if self.cfg.attn_res_block_size:
            stream = stream._replace(prefix_sum=stream.prefix_sum[picked],
                                     blocks=stream.blocks[:, picked])
        else:
            stream = stream[picked]
        return self._logits(stream)

    def _stream(self, tokens: jax.Array) -> Any:
        x = self.embed(tokens)
        if self.cfg.attn_res_block_size:
            return attn_res.start(x, self.cfg.structure.attn_res_blocks)
        return x

    # ---- modes ----------------------------------------------------------------------------

    def forward(self, tokens: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """Full-sequence logits [B, T, vocab] (fp32) for tokens [B, T], no cache."""

        def run(mixer, spec, kda_slot, mla_slot, h, state):
            return mixer(h, valid=valid)[0], state

        stream, _ = self._layers(self._stream(tokens), None, run)
        return self._logits(stream)

    def prefill(self, tokens: jax.Array, valid: jax.Array, state: DecodeState,
                start: jax.Array, slices: bool = False, every_position: bool = False,
                ) -> tuple[jax.Array, DecodeState]:
        """One prefill chunk: tokens [B, C] at absolute positions [start, start + C); rows may
        end early (`valid` [B, C], padding after the real tokens). Returns the logits [B, vocab]
        at each row's last real token of the chunk (garbage for rows with none) and the state
        with the chunk absorbed. Only those B positions go through the LM head, unless
        `every_position` (not with `slices`): then every position's logits, [B, C, vocab].

        `slices`: context-parallel prefill of one sequence, its state the same in every row:
        row r holds the tokens at [start + r C, start + (r + 1) C) (padding only after the
        sequence's last token). The mixers carry the sequence across the rows (KDA's conv and
        state, MLA's keys); every row returns the sequence's logits at its last token and its
        state."""

        def run(mixer, spec, kda_slot, mla_slot, h, state):
            if spec.mixer == "kda":
                a, new = mixer(h, kda_state(state, kda_slot), valid, slices=slices)
                return a, with_kda_state(state, kda_slot, new)
            a, cache = mixer(h, state.mla_cache[mla_slot], start, valid, slices=slices)
            return a, state._replace(mla_cache=_set(state.mla_cache, mla_slot, cache))

        stream, state = self._layers(self._stream(tokens), state, run)
        batch, length = tokens.shape
        count = jnp.sum(valid, axis=1, dtype=jnp.int32)
        rows = jnp.arange(batch)
        last = jnp.maximum(count - 1, 0)
        if slices:  # the sequence's last token, in whichever row holds it, for every row
            total = jnp.sum(count)
            end = jnp.maximum(total - 1, 0)
            rows, last = jnp.full((batch,), end // length), jnp.full((batch,), end % length)
            lengths = jnp.where(total > 0, start + total, state.lengths)
        else:
            lengths = jnp.where(count > 0, start + count, state.lengths)
        if every_position:
            assert not slices, "every_position logits of a context-parallel chunk"
            return self._logits(stream), state._replace(lengths=lengths)
        if self.cfg.attn_res_block_size:
            stream = stream._replace(prefix_sum=stream.prefix_sum[rows, last],
                                     blocks=stream.blocks[:, rows, last])
        else:
            stream = stream[rows, last]
        return self._logits(stream), state._replace(lengths=lengths)

    def decode(self, tokens: jax.Array, state: DecodeState, absorbed: bool = True,
               ) -> tuple[jax.Array, DecodeState]:
        """One token per slot: tokens [B] -> (logits [B, vocab], state advanced by one)."""
        positions = state.lengths

        def run(mixer, spec, kda_slot, mla_slot, h, state):
            if spec.mixer == "kda":
                a, new = mixer.step(h, kda_state(state, kda_slot))
                return a, with_kda_state(state, kda_slot, new)
            step = mixer.step if absorbed else mixer.step_materialised
            a, cache = step(h, state.mla_cache[mla_slot], positions)
            return a, state._replace(mla_cache=_set(state.mla_cache, mla_slot, cache))

        # Unrolled layers work on per-layer state; it goes back in the form it came in.
        unrolled, came_stacked = not self.cfg.scan_layers, not is_per_layer(state)
        if unrolled:
            state = per_layer_state(state)
        stream, state = self._layers(self._stream(tokens), state, run)
        if unrolled and came_stacked:
            state = stacked_state(state)
        return self._logits(stream), state._replace(lengths=positions + 1)


    def decode_and_prefill(self, tokens: jax.Array, state: DecodeState, chunk: jax.Array,
                           valid: jax.Array, prefix: DecodeState, start: jax.Array,
                           ) -> tuple[jax.Array, DecodeState, jax.Array, DecodeState]:
        """One decode step for the slots (`decode`: tokens [S], `state`) and one prefill chunk
        for other sequences (`prefill`: chunk and valid [P, C] from `start`, state `prefix`)
        in one pass: every token-wise sublayer (projections, MoE, norms, AttnRes mixes) runs
        once over the S + P x C tokens; only the mixers run apart, each mode on its own state.
        Returns (the slots' logits [S, vocab], their state, the chunk's logits [P, vocab] at
        each row's last real token, the prefix state), each as `decode` and `prefill` give
        it."""
        slots = tokens.shape[0]
        rows, width = chunk.shape
        positions = state.lengths

        def run(mixer, spec, kda_slot, mla_slot, h, both):
            state, prefix = both
            h_step, h_chunk = h[:slots], h[slots:].reshape(rows, width, -1)
            if spec.mixer == "kda":
                a_step, new = mixer.step(h_step, kda_state(state, kda_slot))
                a_chunk, new_p = mixer(h_chunk, kda_state(prefix, kda_slot), valid)
                state = with_kda_state(state, kda_slot, new)
                prefix = with_kda_state(prefix, kda_slot, new_p)
            else:
                a_step, cache = mixer.step(h_step, state.mla_cache[mla_slot], positions)
                a_chunk, cache_p = mixer(h_chunk, prefix.mla_cache[mla_slot], start, valid)
                state = state._replace(mla_cache=_set(state.mla_cache, mla_slot, cache))
                prefix = prefix._replace(mla_cache=_set(prefix.mla_cache, mla_slot, cache_p))
            a = jnp.concatenate([a_step, a_chunk.reshape(rows * width, -1)])
            return a, (state, prefix)

        came_stacked = not is_per_layer(state)
        if not self.cfg.scan_layers:
            state = per_layer_state(state)
        flat = jnp.concatenate([tokens, chunk.reshape(-1)])
        stream, (state, prefix) = self._layers(self._stream(flat), (state, prefix), run)
        if not self.cfg.scan_layers and came_stacked:
            state = stacked_state(state)
        count = jnp.sum(valid, axis=1, dtype=jnp.int32)
        # The slots' rows, then each chunk row's last real token.
        picked = jnp.concatenate([jnp.arange(slots),
                                  slots + jnp.arange(rows) * width + jnp.maximum(count - 1, 0)])
        logits = self._logits_at(stream, picked)
        return (logits[:slots], state._replace(lengths=positions + 1), logits[slots:],
                prefix._replace(lengths=jnp.where(count > 0, start + count, prefix.lengths)))

    def paged_step(self, short: StepRows, long: StepRows | None, state: DecodeState,
                   every_long_position: bool = False,
                   ) -> tuple[jax.Array, jax.Array | None, DecodeState]:
        """One step over the paged state (`models.state.paged_state_shapes`): every row of
        `short` (decode windows: [R, W] tokens, W = 1 for one token per sequence) and of `long`
        (prefill slices: [P, C] tokens; None for a decode-only step) in one pass. Every
        token-wise sublayer runs once over the R x W + P x C tokens; the mixers run per kind of
        row, each row from and into its sequence's KDA state slot and pages (rows with count 0
        leave every state as it was). Returns the logits at each row's last real token,
        [R, vocab] and [P, vocab] (garbage for count-0 rows), and the state; with
        `every_long_position` the long rows' logits at every position, [P, C, vocab] (prompts
        whose positions are scored)."""
        rows, width = short.tokens.shape
        kinds = [short] if long is None else [short, long]
        sizes = [k.tokens.size for k in kinds]

        def split(h):
            parts = jnp.split(h, np.cumsum(sizes)[:-1].tolist())
            return [p.reshape(*k.tokens.shape, -1) for p, k in zip(parts, kinds, strict=True)]

        def run(mixer, spec, kda_slot, mla_slot, h, state):
            outs = []
            if spec.mixer == "kda":
                for kind, (h_kind, rows_of) in enumerate(zip(split(h), kinds, strict=True)):
                    layer = kda_rows(state, kda_slot, rows_of)
                    if kind == 0 and width == 1:
                        a, new = mixer.step(h_kind[:, 0], layer, valid=rows_of.count > 0)
                        a = a[:, None]
                    else:
                        valid = jnp.arange(h_kind.shape[1])[None, :] < rows_of.count[:, None]
                        a, new = mixer(h_kind, layer, valid)
                    state = with_kda_rows(state, kda_slot, rows_of, new)
                    outs.append(a.reshape(-1, a.shape[-1]))
            else:
                pages = state.mla_cache[mla_slot]
                for kind, (h_kind, rows_of) in enumerate(zip(split(h), kinds, strict=True)):
                    attend = mixer.paged_step if kind == 0 else mixer.paged_chunk
                    a, pages = attend(h_kind, pages, rows_of.pages, rows_of.start,
                                      rows_of.count)
                    outs.append(a.reshape(-1, a.shape[-1]))
                state = state._replace(mla_cache=_set(state.mla_cache, mla_slot, pages))
            return jnp.concatenate(outs), state

        came_stacked = not is_per_layer(state)
        if not self.cfg.scan_layers:
            state = per_layer_state(state)
        flat = jnp.concatenate([k.tokens.reshape(-1) for k in kinds])
        stream, state = self._layers(self._stream(flat), state, run)
        if not self.cfg.scan_layers and came_stacked:
            state = stacked_state(state)
        picked, offset = [], 0
        for i, kind in enumerate(kinds):
            n, w = kind.tokens.shape
            if i == 1 and every_long_position:
                picked.append(offset + jnp.arange(n * w))
            else:
                picked.append(offset + jnp.arange(n) * w + jnp.maximum(kind.count - 1, 0))
            offset += n * w
        logits = self._logits_at(stream, jnp.concatenate(picked))
        lengths = state.lengths
        for kind in kinds:
            slots = jnp.arange(kind.count.shape[0]) if kind.slot is None else kind.slot
            lengths = lengths.at[jnp.where(kind.count > 0, slots, lengths.shape[0])].set(
                kind.start + kind.count, mode="drop")
        state = state._replace(lengths=lengths)
        long_logits = None if long is None else logits[rows:]
        if long is not None and every_long_position:
            long_logits = long_logits.reshape(*long.tokens.shape, -1)
        return logits[:rows], long_logits, state


def kda_rows(state: DecodeState, slot: Any, rows: StepRows) -> KDAState:
    """One KDA layer's state of each row's slot (`rows.slot`), float32 (as `kda_state`). A row
    naming its slot at position 0 begins a sequence, from zeros, whatever the slot held before;
    rows in slot order (`slot` None) continue theirs."""
    if rows.slot is None:
        return KDAState(state.kda_recurrent[slot].astype(jnp.float32), state.kda_conv[slot])
    fresh = rows.start == 0

    def read(stacked):
        held = stacked[slot][jnp.maximum(rows.slot, 0)]
        return jnp.where(fresh.reshape(-1, *[1] * (held.ndim - 1)), 0, held)

    return KDAState(read(state.kda_recurrent).astype(jnp.float32), read(state.kda_conv))


def with_kda_rows(state: DecodeState, slot: Any, rows: StepRows, new: KDAState) -> DecodeState:
    """`state` with each row's new KDA state in its slot, rows with count 0 written nowhere."""
    recurrent, conv = state.kda_recurrent[slot], state.kda_conv[slot]
    if rows.slot is None:  # the slots in order, count-0 rows already kept by the mixer
        def put(old, value):
            return value.astype(old.dtype)
    else:
        at = jnp.where(rows.count > 0, rows.slot, recurrent.shape[0])  # past the end: dropped

        def put(old, value):
            return old.at[at].set(value.astype(old.dtype), mode="drop")
    recurrent, conv = put(recurrent, new.recurrent), put(conv, new.conv)
    return state._replace(kda_recurrent=_set(state.kda_recurrent, slot, recurrent),
                          kda_conv=_set(state.kda_conv, slot, conv))


def group_slice(tree: Any, g: int) -> Any:
    """Group g's parameters: a slice of each stacked array, or the g-th piece of a stack that
    `split_for_unrolled` already split."""
    return jax.tree.map(lambda v: v[g], tree, is_leaf=lambda v: isinstance(v, tuple))


def split_for_unrolled(params: nnx.State, split_experts: bool) -> nnx.State:
    """`params` made ready for unrolled execution (`scan_layers: false`): every stacked array of
    the scanned groups becomes a tuple of per-group arrays and, when `split_experts`, every
    routed-expert array a tuple of per-expert arrays (inside the per-group tuple); each piece
    keeps its slice's sharding, so experts may be split only where no mesh axis splits them.

    A compiled program that slices a weight out of a larger array copies it (XLA:CPU
    materialises every slice that feeds a dot), so an unrolled decode step over stacked weights
    writes and rereads them all, and each hit expert is copied before its matmul. Split once
    here, every weight is read in place (`ops.experts.LayerExperts`). A scanned program (TPU)
    fuses its slices into their consumers and keeps the stacks."""
    flat = nnx.to_flat_state(params)
    levels = {}
    for path, var in flat:
        n = (path[0] == "groups") + (split_experts and "experts" in path)
        if n and not isinstance(var.get_value(), tuple):
            levels["/".join(map(str, path))] = n
    stacked = {"/".join(map(str, path)): var.get_value() for path, var in flat}
    stacked = {k: stacked[k] for k in levels}

    def split(a: Any, n: int) -> Any:
        return a if n == 0 else tuple(split(a[i], n - 1) for i in range(a.shape[0]))

    def pieces_sharding(a: jax.Array, n: int) -> Any:
        s = a.sharding
        if isinstance(s, jax.sharding.NamedSharding):
            s = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[n:]))
        return _nest(s, a.shape[:n])

    # One program splits everything (a program per array would cost a compile each).
    pieces = jax.jit(
        lambda tree: {k: split(a, levels[k]) for k, a in tree.items()},
        out_shardings={k: pieces_sharding(stacked[k], n) for k, n in levels.items()},
    )(stacked)
    keys = ["/".join(map(str, path)) for path, _ in flat]
    return nnx.from_flat_state([(path, var.replace(pieces[k]) if k in pieces else var)
                                for k, (path, var) in zip(keys, flat, strict=True)])


def _nest(leaf: Any, shape: tuple[int, ...]) -> Any:
    """Nested tuples of `leaf` with the given lengths."""
    return leaf if not shape else tuple(_nest(leaf, shape[1:]) for _ in range(shape[0]))


_LAYER_STATES = ("kda_recurrent", "kda_conv", "mla_cache")


def per_layer_state(state: DecodeState) -> DecodeState:
    """The layer-stacked state fields as lists of per-layer arrays, for unrolled layers (static
    slots); fields already split stay as they are. Updating a stacked array layer by layer made
    XLA copy the whole stack before each layer's update; as lists, each layer's state is read
    and written once. A decode loop over unrolled layers carries the lists from step to step
    (`Engine.generate`), so the stack is not rebuilt and copied every step either."""
    return state._replace(**{name: list(getattr(state, name)) for name in _LAYER_STATES
                             if not isinstance(getattr(state, name), list)
                             and getattr(state, name).shape[0]})


def per_layer_form(shapes: DecodeState, axes: DecodeState) -> tuple[DecodeState, DecodeState]:
    """A stacked state's ShapeDtypeStructs and logical axes in the form `per_layer_state` gives
    the state itself: each layer-stacked field a list of its layers' entries, the leading layer
    dimension dropped (empty stacks stay as they are)."""
    split_shapes, split_axes = {}, {}
    for name in _LAYER_STATES:
        shape, logical = getattr(shapes, name), getattr(axes, name)
        if shape.shape[0]:
            split_shapes[name] = [jax.ShapeDtypeStruct(shape.shape[1:], shape.dtype)] * \
                shape.shape[0]
            split_axes[name] = [logical[1:]] * shape.shape[0]
    return shapes._replace(**split_shapes), axes._replace(**split_axes)


def stacked_state(state: DecodeState) -> DecodeState:
    """The inverse of `per_layer_state`: each per-layer list stacked back into one array."""
    return state._replace(**{name: jnp.stack(getattr(state, name)) for name in _LAYER_STATES
                             if isinstance(getattr(state, name), list)})


def is_per_layer(state: DecodeState) -> bool:
    """Whether `per_layer_state` split this state's fields."""
    return any(isinstance(getattr(state, name), list) for name in _LAYER_STATES)


def kda_state(state: DecodeState, slot: Any) -> KDAState:
    """One KDA layer's state out of the decode state, its recurrent state in float32 whatever
    `kda_state_dtype` stores it in: the delta rule always runs in float32."""
    return KDAState(state.kda_recurrent[slot].astype(jnp.float32), state.kda_conv[slot])


def with_kda_state(state: DecodeState, slot: Any, new: KDAState) -> DecodeState:
    """`state` with one KDA layer's state replaced, rounded to the stored dtypes."""
    return state._replace(kda_recurrent=_set(state.kda_recurrent, slot, new.recurrent),
                          kda_conv=_set(state.kda_conv, slot, new.conv))


def _set(stacked: jax.Array | list[jax.Array], slot: Any, value: jax.Array) -> Any:
    if isinstance(stacked, list):  # per-layer pieces (`per_layer_state`), a Python int slot
        return [value.astype(old.dtype) if i == slot else old for i, old in enumerate(stacked)]
    return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), slot, 0)
