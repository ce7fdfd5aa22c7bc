"""Per-device memory: `python -m k3text.tools.memory CONFIG [key=value ...] [batch=N] [context=N]
[page=N] [--hardware v7x|v6e] [--hbm-gib G] [--reserve-gib G]`.

Weights (by component) and decode state per device, from the shardings the stack really places
them with (`sharding.state_shardings` on the parameters' logical axes, `STATE_AXES` for the
decode state, the config's `logical_axis_rules`) on an abstract mesh of the config's shape, so
any mesh size runs on one CPU. Then the capacity trade-off for a per-device HBM budget: the
largest batch at a context, the longest context at a batch, where the constant KDA state
and the growing MLA latent cache cross over, how many sequences fit with the MLA cache given
out by the page instead of reserved per slot (`page=` tokens per page), what a prefix-cache
block (its MLA rows and a KDA checkpoint) costs at each block size and how many fit beside the
decode slots, and when a context-parallel prefill pays on the mesh and what one call moves.

Not included: XLA temporaries and activations, which depend on the compiled graph (measure them
with `compiled.memory_analysis()`; set them aside with --reserve-gib).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence

import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from k3text import sharding
from k3text.config import Config, ConfigError
from k3text.inference import prefix_cache
from k3text.models.state import STATE_AXES, DecodeState, bytes_per_sequence, state_shapes
from k3text.tools import cli, inventory
from k3text.tools.hardware import HARDWARE, HARDWARE_HEADERS, hardware_rows
from k3text.tools.inventory import COMPONENTS, Tensor
from k3text.tools.tables import GiB, exact_bytes, gib, nbytes, table, tokens

MLA_CACHE_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
CONTEXTS = (4096, 32768, 131072, 524288, 1048576)


def mesh_context(cfg: Config) -> sharding.MeshContext:
    """The config's mesh and axis rules on an AbstractMesh: shard shapes without devices."""
    shape = cfg.mesh_shape
    return sharding.MeshContext(AbstractMesh(tuple(shape.values()), tuple(shape)),
                                cfg.logical_axis_rules)


# --------------------------------------------------------------------------------------------
# Weights.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WeightShard:
    tensor: Tensor
    per_device: int  # bytes each device holds

    @property
    def replicated(self) -> bool:
        """No dimension is split: every device holds the whole tensor."""
        return self.per_device == self.tensor.nbytes


def weight_shards(cfg: Config, ctx: sharding.MeshContext) -> list[WeightShard]:
    state = inventory.abstract_state(cfg)
    shardings = dict(nnx.to_flat_state(sharding.state_shardings(state, ctx)))
    return [WeightShard(t, sharding.shard_bytes(shardings[t.path], t.shape, t.dtype))
            for t in inventory.inventory(cfg, state)]


def replicated_floor(shards: Sequence[WeightShard]) -> dict[str, int]:
    """{name inside the layer: bytes} of the tensors every device holds whole, largest first:
    the per-device weight bytes no mesh size removes."""
    floor = inventory.sum_by((s for s in shards if s.replicated),
                             lambda s: s.tensor.local_name, lambda s: s.per_device)
    return dict(sorted(floor.items(), key=lambda kv: -kv[1]))


# --------------------------------------------------------------------------------------------
# Decode state.
# --------------------------------------------------------------------------------------------


def state_bytes_per_device(cfg: Config, ctx: sharding.MeshContext, batch: int,
                           cache_len: int) -> dict[str, int]:
    """{DecodeState field: bytes one device holds} for `batch` slots of `cache_len` positions."""
    shapes = state_shapes(cfg, batch, cache_len)
    shardings = sharding.tree_shardings(STATE_AXES, shapes, ctx)
    return {name: sharding.shard_bytes(sh, s.shape, s.dtype)
            for name, s, sh in zip(DecodeState._fields, shapes, shardings, strict=True)}


@dataclasses.dataclass(frozen=True)
class SequenceCost:
    """Per-device decode-state bytes added by one row of sequences (one per batch shard)."""

    rows: int  # sequences in one row: the number of batch shards
    kda: int  # KDA recurrent + conv state: constant in context
    lengths: int  # the per-slot length counters
    per_position: float  # MLA latent cache per cache position

    @property
    def fixed(self) -> int:
        return self.kda + self.lengths

    def row_bytes(self, positions: int) -> float:
        return self.fixed + self.per_position * positions


def sequence_cost(cfg: Config, ctx: sharding.MeshContext) -> SequenceCost:
    rows = ctx.size("batch")
    granule = ctx.size("cache_seq")  # the fewest positions that split evenly
    empty = state_bytes_per_device(cfg, ctx, rows, 0)
    filled = state_bytes_per_device(cfg, ctx, rows, granule)
    return SequenceCost(rows, empty["kda_recurrent"] + empty["kda_conv"], empty["lengths"],
                        (filled["mla_cache"] - empty["mla_cache"]) / granule)


def cache_positions(cfg: Config, context: int) -> int:
    """MLA cache positions a context needs: whole prefill chunks, as `state.cache_length`."""
    chunk = cfg.prefill_chunk_size
    return -(-context // chunk) * chunk


def max_batch(free: float, cost: SequenceCost, positions: int) -> int:
    """Most sequences of `positions` cache positions whose state fits in `free` bytes."""
    return cost.rows * max(0, math.floor(free / cost.row_bytes(positions)))


def max_context(cfg: Config, free: float, cost: SequenceCost, batch: int) -> int | None:
    """Longest context (whole prefill chunks) for `batch` sequences; None when the state does
    not grow with context (no MLA layers)."""
    if cost.per_position == 0:
        return None
    rows = -(-batch // cost.rows)
    positions = (free / rows - cost.fixed) / cost.per_position
    chunk = cfg.prefill_chunk_size
    return max(0, math.floor(positions / chunk) * chunk)


def kda_state_per_sequence(cfg: Config) -> int:
    """Global bytes of one sequence's whole KDA state: recurrent state plus conv state."""
    b = bytes_per_sequence(cfg)
    return b["kda_recurrent"] + b["kda_conv"]


def crossover_tokens(kda_bytes: float, cache_bytes_per_token: float) -> float:
    """Context at which the MLA latent cache reaches the constant KDA state."""
    return kda_bytes / cache_bytes_per_token if cache_bytes_per_token else math.inf


# --------------------------------------------------------------------------------------------
# Paged capacity: the MLA cache given out by the page instead of reserved per slot.
# --------------------------------------------------------------------------------------------

# A workload: (share of the sequences, tokens each); the shares sum to 1.
Mix = tuple[tuple[float, int], ...]


def capacity_mixes(max_len: int) -> dict[str, Mix]:
    """The workloads the paged capacity is shown for: every sequence at the longest context,
    and a realistic mix of short chats and some long documents."""
    return {f"every sequence at {tokens(max_len)}": ((1.0, max_len),),
            "90% at 4K, 10% at 128K": ((0.9, 4096), (0.1, 131072))}


def paged_positions(mix: Mix, page: int) -> float:
    """Cache positions a sequence of `mix` holds on average: its tokens in whole pages."""
    return sum(share * -(-n // page) * page for share, n in mix)


def paged_capacity(free: float, cost: SequenceCost, mix: Mix, page: int) -> int:
    """Most sequences of `mix` whose state fits in `free` bytes per device when the MLA cache
    is given out in pages of `page` tokens: each sequence holds its own KDA state (one state
    slot) and the pages its tokens fill, nothing for the context it does not use."""
    return cost.rows * max(0, math.floor(free / cost.row_bytes(paged_positions(mix, page))))


def with_recurrent_dtype(cfg: Config, ctx: sharding.MeshContext, cost: SequenceCost,
                         dtype: str) -> SequenceCost:
    """`cost` with the KDA recurrent state stored in `dtype` instead of `kda_state_dtype` (the
    math stays float32 inside a step; the report's 434 -> 217 MB per sequence in bfloat16)."""
    recurrent = state_bytes_per_device(cfg, ctx, cost.rows, 0)["kda_recurrent"]
    stored = state_bytes_per_device(cfg.replace(kda_state_dtype=dtype), ctx, cost.rows,
                                    0)["kda_recurrent"]
    return dataclasses.replace(cost, kda=cost.kda - recurrent + stored)


# --------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------


def _weights_section(cfg: Config, shards: Sequence[WeightShard]) -> str:
    stored = inventory.sum_by(shards, lambda s: s.tensor.component, lambda s: s.tensor.nbytes)
    per_device = inventory.sum_by(shards, lambda s: s.tensor.component, lambda s: s.per_device)
    rows = [[COMPONENTS[c], gib(stored[c]), gib(per_device[c]),
             f"{stored[c] / per_device[c]:.3g}x"] for c, _ in inventory.ordered(stored)]
    total_stored, total_device = sum(stored.values()), sum(per_device.values())
    rows += [("-",), ["total", gib(total_stored), gib(total_device),
                      f"{total_stored / total_device:.3g}x"]]
    floor = replicated_floor(shards)
    largest = ", ".join(f"{name} {nbytes(b)}" for name, b in list(floor.items())[:4])
    return "\n".join([
        table(("component", "stored (all devices)", "per device", "split"), rows,
              title="Weights"),
        f"replicated on every device (no dimension split): {gib(sum(floor.values()))}"
        f"  [{largest}]",
        f"stored / devices (every tensor split): {gib(total_stored / cfg.num_devices)}",
    ])


def _state_section(cfg: Config, ctx: sharding.MeshContext, cost: SequenceCost) -> str:
    per_seq = bytes_per_sequence(cfg)
    shapes = state_shapes(cfg, 1, 1)
    recurrent, conv = shapes.kda_recurrent, shapes.kda_conv
    empty = state_bytes_per_device(cfg, ctx, cost.rows, 0)
    rows = [
        [f"KDA recurrent state ({np.dtype(recurrent.dtype).name})",
         exact_bytes(per_seq["kda_recurrent"]), exact_bytes(empty["kda_recurrent"] / cost.rows)],
        [f"KDA conv state ({np.dtype(conv.dtype).name}, {conv.size:,} elements)",
         exact_bytes(per_seq["kda_conv"]), exact_bytes(empty["kda_conv"] / cost.rows)],
        ["KDA state, recurrent + conv", exact_bytes(kda_state_per_sequence(cfg)),
         exact_bytes(cost.kda / cost.rows)],
        [f"MLA latent cache per token ({cfg.mla_cache_dtype})",
         exact_bytes(per_seq["mla_cache_per_token"]),
         exact_bytes(cost.per_position / cost.rows)],
    ]
    head = table(("decode state", "per sequence", "per device, per sequence"), rows,
                 title="Decode state (STATE_AXES shardings)")
    cross = []
    for dtype in MLA_CACHE_DTYPES:
        c = cfg.replace(mla_cache_dtype=dtype)
        per_token = bytes_per_sequence(c)["mla_cache_per_token"]
        device = sequence_cost(c, mesh_context(c))
        cross.append([dtype + (" *" if dtype == cfg.mla_cache_dtype else ""), f"{per_token:,}",
                      tokens(crossover_tokens(kda_state_per_sequence(c), per_token)),
                      tokens(crossover_tokens(device.kda, device.per_position))])
    crossover = table(("mla_cache_dtype", "cache B/token", "crossover, per sequence",
                       "crossover, per device"), cross,
                      title="KDA state (recurrent + conv) = MLA latent cache at this many tokens "
                            "(* = configured)")
    return head + "\n\n" + crossover


def _capacity_section(cfg: Config, free: float, cost: SequenceCost, batch: int,
                      context: int) -> str:
    rows = []
    for ctx_len in sorted({*CONTEXTS, context}):
        positions = cache_positions(cfg, ctx_len)
        rows.append([tokens(ctx_len) + (" *" if ctx_len == context else ""),
                     nbytes(cost.row_bytes(positions) / cost.rows),
                     tokens(max_batch(free, cost, positions))])
    out = [table(("context", "state per sequence, per device", "largest batch"), rows,
                 title="Largest batch per context (* = context=)")]
    need = -(-batch // cost.rows) * cost.row_bytes(cache_positions(cfg, context))
    verdict = "fits" if need <= free else "does not fit"
    out.append(f"batch={batch} at context={context:,}: {nbytes(need)} of decode state per device, "
               f"{verdict} in {gib(free)}")
    longest = max_context(cfg, free, cost, batch)
    out.append(f"longest context at batch={batch}: "
               + ("unbounded (no MLA cache)" if longest is None else f"{longest:,} tokens"))
    if cfg.axis_size("cache_seq") > 1 and longest is not None:  # what the split buys
        rules = {name: list(axes) for name, axes in cfg.logical_axis_rules.items()}
        whole = cfg.replace(logical_axis_rules={**rules, "cache_seq": []})
        whole_cost = sequence_cost(whole, mesh_context(whole))
        whole_longest = max_context(whole, free, whole_cost, batch)
        out.append(f"with the MLA cache replicated (cache_seq: []) instead of split "
                   f"{cfg.axis_size('cache_seq')} ways: largest batch at context={context:,} "
                   f"{max_batch(free, whole_cost, cache_positions(cfg, context)):,}, longest "
                   f"context at batch={batch} {whole_longest:,} tokens")
    return "\n".join(out)


def _paged_section(cfg: Config, ctx: sharding.MeshContext, free: float, cost: SequenceCost,
                   page: int) -> str:
    """Concurrent sequences with every slot reserving max_target_length against a paged MLA
    cache and a KDA state pool, for each `capacity_mixes` workload."""
    max_len = cfg.max_target_length
    fixed = max_batch(free, cost, cache_positions(cfg, max_len))
    bf16 = with_recurrent_dtype(cfg, ctx, cost, "bfloat16")
    rows = []
    for name, mix in capacity_mixes(max_len).items():
        paged, paged_bf16 = (paged_capacity(free, c, mix, page) for c in (cost, bf16))
        rows.append([name, f"{fixed:,}", f"{paged:,}", f"{paged / max(fixed, 1):.1f}x",
                     f"{paged_bf16:,}", f"{paged_bf16 / max(paged, 1):.2f}x"])
    return table(("workload", "fixed slots", "paged", "paged / fixed",
                  "paged, bf16 KDA state", "bf16 / fp32 state"), rows,
                 title=f"Concurrent sequences at max_target_length={max_len:,}: fixed slots "
                       f"(each reserves max_target_length) vs a paged MLA cache ({page}-token "
                       f"pages, page=) and a KDA state pool (one slot per sequence)")


BLOCK_CHUNKS = (1, 2, 4, 8, 16, 32)  # prefix-cache block sizes shown, in prefill chunks


def _prefix_cache_section(cfg: Config, ctx: sharding.MeshContext, free: float,
                          cost: SequenceCost, batch: int, context: int) -> str:
    """What one cached block costs, how many the budget and the memory beside the decode slots
    hold, and the checkpoint-spacing trade-off: bigger blocks mean fewer KDA checkpoints per
    cached token but coarser matches (a hit is whole blocks only)."""
    slots = -(-batch // cost.rows) * cost.row_bytes(cache_positions(cfg, context))
    beside = max(0.0, free - slots)
    rows = []
    for chunks in sorted({*BLOCK_CHUNKS, prefix_cache.block_size(cfg) // cfg.prefill_chunk_size}):
        c = cfg.replace(prefix_cache_block=chunks * cfg.prefill_chunk_size)
        part = prefix_cache.entry_bytes(c, ctx)
        one = sum(part.values())
        kda = part["kda_recurrent"] + part["kda_conv"]
        block = prefix_cache.block_size(c)
        mark = " *" if block == prefix_cache.block_size(cfg) else ""
        rows.append([f"{block:,}{mark}", nbytes(one), f"{kda / one:.0%}", nbytes(one / block),
                     tokens(cfg.prefix_cache_bytes // one),
                     tokens(beside // one * block)])
    out = [table(("block (tokens)", "one block per device", "KDA checkpoint share",
                  "per cached token", "blocks in prefix_cache_bytes",
                  "cached tokens beside the slots"), rows,
                 title=f"Prefix cache: per block, the MLA rows of its tokens and one KDA "
                       f"checkpoint (* = prefix_cache_block; prefix_cache_bytes = "
                       f"{nbytes(cfg.prefix_cache_bytes)} per device)")]
    checkpoint = prefix_cache.entry_bytes(cfg, ctx)
    out.append(f"one KDA checkpoint (every KDA layer's recurrent + conv state): "
               f"{exact_bytes(kda_state_per_sequence(cfg))} before sharding, "
               f"{nbytes(checkpoint['kda_recurrent'] + checkpoint['kda_conv'])} per device")
    out.append(f"beside batch={batch} decode slots at context={context:,} ({nbytes(slots)} per "
               f"device): {nbytes(beside)} free for the prefix cache")
    return "\n".join(out)


def _context_parallel_section(cfg: Config, ctx: sharding.MeshContext, context: int) -> str:
    """When a context-parallel prefill (`prefill_context_parallelism`) pays on this mesh, and
    what one call of it moves and holds per device for a prompt of `context` tokens."""
    title = ("Context-parallel prefill: one prompt's consecutive chunks as the rows of one call, "
             "the rows split over the batch mesh axes")
    replicas = ctx.size("batch")
    if replicas == 1:
        return (f"{title}\nthis mesh has one batch shard: a context-parallel call's rows would "
                f"run one after another on the same devices, so it cannot shorten a prompt's "
                f"prefill here (the {cfg.num_devices} devices already share every chunk's work "
                f"by heads and experts). It pays with data replicas (ici_data_parallelism > 1) "
                f"while fewer long prompts wait than there are replicas.")
    rows = cfg.prefill_context_parallelism if cfg.prefill_context_parallelism > 1 else replicas
    chunk, lin, st = cfg.prefill_chunk_size, cfg.linear_attn_config, cfg.structure
    heads = lin.num_heads // ctx.size("heads")
    width = heads * lin.head_dim
    act = np.dtype(cfg.dtype).itemsize
    latents = rows * chunk * cfg.mla_latent_dim * act
    maps = rows * heads * lin.head_dim * 2 * lin.head_dim * 4
    tails = 2 * rows * (lin.short_conv_kernel_size - 1) * 3 * width * act
    moved = st.num_mla * latents + st.num_kda * (maps + tails)
    prefix = sum(state_bytes_per_device(cfg, ctx, rows, cache_positions(cfg, context)).values())
    calls = -(-context // chunk)
    return "\n".join([
        title + f" ({rows} rows over {replicas} batch shards"
        + ("" if cfg.prefill_context_parallelism > 1 else "; prefill_context_parallelism=1 now, "
           f"shown at {rows}") + ")",
        f"a {context:,}-token prompt: {calls:,} chunked calls on one batch shard (the other "
        f"{replicas - 1} idle unless prompts wait for them) -> {-(-calls // rows):,} "
        f"context-parallel calls, each running one chunk per row",
        f"per call: the delta rule runs over V + K = {2 * lin.head_dim} value columns instead "
        f"of {lin.head_dim} (2x its work: it carries each slice's state map), and per device "
        f"{nbytes(moved)} cross the rows ({st.num_mla} MLA latent gathers of {nbytes(latents)}, "
        f"{st.num_kda} KDA state-map gathers of {nbytes(maps)} and conv tails of "
        f"{nbytes(tails)})",
        f"the prefix: {rows} rows each holding the sequence, {nbytes(prefix)} per device at "
        f"context={context:,}",
        f"pays while fewer than {replicas} long prompts wait (a prefill batch of {replicas} "
        f"prompts keeps every shard busy without the extra work); chunked prefill stays the "
        f"default"])


def render(cfg: Config, hardware: str, hbm: float, reserve: float, batch: int,
           context: int, page: int = 128) -> str:
    ctx = mesh_context(cfg)
    shards = weight_shards(cfg, ctx)
    cost = sequence_cost(cfg, ctx)
    weights = sum(s.per_device for s in shards)
    mesh = " x ".join(f"{a}={n}" for a, n in cfg.mesh_shape.items())
    free = hbm - weights - reserve
    sections = [
        f"{cfg.model_name or 'model'} on mesh {mesh} ({cfg.num_devices} devices); "
        f"budget {gib(hbm)} per device ({hardware}); reserve {gib(reserve)}",
        table(HARDWARE_HEADERS, hardware_rows(), title="Hardware (per chip)"),
        _weights_section(cfg, shards),
        _state_section(cfg, ctx, cost),
    ]
    if free <= 0:
        stored = sum(s.tensor.nbytes for s in shards)
        sections.append(f"Capacity: weights ({gib(weights)}) + reserve ({gib(reserve)}) exceed "
                        f"the {gib(hbm)} budget: no room for decode state; the weights alone "
                        f"need at least {math.ceil(stored / (hbm - reserve))} devices.")
    else:
        sections.append(f"Capacity: {gib(hbm)} - weights {gib(weights)} - reserve "
                        f"{gib(reserve)} = {gib(free)} free per device for decode state\n"
                        + _capacity_section(cfg, free, cost, batch, context))
        sections.append(_paged_section(cfg, ctx, free, cost, page))
        sections.append(_prefix_cache_section(cfg, ctx, free, cost, batch, context))
    sections.append(_context_parallel_section(cfg, ctx, context))
    sections.append("Not included: XLA temporaries and activations (compiled.memory_analysis(); "
                    "reserve them with --reserve-gib).")
    return "\n\n".join(sections)


TOOL_KEYS = {"batch": "sequences decoded together (default: the config's global batch)",
             "context": "tokens per sequence (default: max_target_length)",
             "page": "MLA cache tokens per page in the paged capacity table (default 128)"}


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("k3text.tools.memory", __doc__, TOOL_KEYS)
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="v7x")
    p.add_argument("--hbm-gib", type=float, help="per-device HBM budget (default: the table's)")
    p.add_argument("--reserve-gib", type=float, default=0.0,
                   help="per-device bytes set aside for temporaries and activations")

    def body(args: argparse.Namespace, cfg: Config, keys: dict[str, int]) -> str:
        for key in TOOL_KEYS:
            if keys.get(key, 1) < 1:
                raise ConfigError(f"{key}={keys[key]}: must be at least 1")
        for flag, value in (("--hbm-gib", args.hbm_gib), ("--reserve-gib", args.reserve_gib)):
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{flag} {value}: must be a finite number")
            if value is not None and value < 0:
                raise ConfigError(f"{flag} {value}: must not be negative")
        if args.hbm_gib == 0:
            raise ConfigError("--hbm-gib 0.0: must be positive")
        hbm = HARDWARE[args.hardware].hbm_per_device if args.hbm_gib is None \
            else args.hbm_gib * GiB
        if args.reserve_gib * GiB >= hbm:
            raise ConfigError(f"--reserve-gib {args.reserve_gib}: leaves nothing of the "
                              f"{gib(hbm)} budget per device")
        return render(cfg, args.hardware, hbm, args.reserve_gib * GiB,
                      keys.get("batch", cfg.global_batch_size),
                      keys.get("context", cfg.max_target_length), keys.get("page", 128))

    return cli.run(p, argv, body, tuple(TOOL_KEYS))


if __name__ == "__main__":
    sys.exit(main())
